// One pass of torch.optim.Adam (and AdamW) over the rows of a table that a batch touched.
//
// What the fallback kernel otherwise does in five passes (sum the gradients of duplicate ids,
// gather the rows of the weight and of each moment, step them, scatter them back) is done here
// in one: each touched row is read once, updated and written back in place.
//
// The arithmetic is torch.optim's single-tensor Adam, operation for operation and in its order,
// in float32 with its scalars cast to float as ATen casts them. The scalars that torch.optim
// computes in Python (the bias corrections) are computed by the caller, as torch.optim computes
// them. Rounding may differ from torch's in the last bit, where ATen's vectorized lerp fuses a
// multiply-add, as torch's own fused kernel differs from its single-tensor path.
//
// Registered as the torch operator overlap_optim::adam_rows_ (overlap_optim/compiled.py loads the
// library); called by overlap_optim/row_pass.py.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "rows.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

void check_table(const at::Tensor& t, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "adam_rows_: ", name, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.sizes() == weight.sizes(), "adam_rows_: ", name, " must be shaped as the weight");
}

// Scalars of one step, as ATen casts them for a float32 tensor.
struct Scalars {
  float decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps, bias_correction2_sqrt, minus_step_size;
  bool coupled_decay, decoupled_decay, maximize;
};

// g = the sum of the gradients at `positions`, in their order, from zero (as index_add_ sums).
__attribute__((target_clones("avx2", "default")))
void sum_positions(float* g, const float* grads, const int64_t* positions, int64_t count, int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) g[j] = 0.0f;
  for (int64_t k = 0; k < count; ++k) {
    const float* src = grads + positions[k] * dim;
    for (int64_t j = 0; j < dim; ++j) g[j] += src[j];
  }
}

// torch.optim's single-tensor Adam on one row, in its order of operations; one loop per
// operation, so that each vectorizes. `g` is the row's summed gradient (overwritten).
__attribute__((target_clones("avx2", "default")))
void adam_row(float* w, float* m, float* v, float* x, float* g, int64_t dim, const Scalars& s) {
  if (s.maximize)
    for (int64_t j = 0; j < dim; ++j) g[j] = -g[j];
  if (s.decoupled_decay)  // param.mul_(1 - lr * weight_decay)
    for (int64_t j = 0; j < dim; ++j) w[j] = w[j] * s.decay;
  if (s.coupled_decay)  // grad = grad.add(param, alpha=weight_decay)
    for (int64_t j = 0; j < dim; ++j) g[j] = g[j] + s.weight_decay * w[j];
  const float weight = s.one_minus_beta1;  // exp_avg.lerp_(grad, 1 - beta1), ATen's two forms
  if (weight < 0.5f)
    for (int64_t j = 0; j < dim; ++j) m[j] = m[j] + weight * (g[j] - m[j]);
  else
    for (int64_t j = 0; j < dim; ++j) m[j] = g[j] - (g[j] - m[j]) * (1.0f - weight);
  for (int64_t j = 0; j < dim; ++j)  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v[j] = v[j] * s.beta2 + s.one_minus_beta2 * g[j] * g[j];
  const float* second = v;
  if (x != nullptr) {  // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq): NaN wins
    for (int64_t j = 0; j < dim; ++j) x[j] = (x[j] > v[j] || x[j] != x[j]) ? x[j] : v[j];
    second = x;
  }
  // denom = (sqrt / bias_correction2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, value=-step_size)
  for (int64_t j = 0; j < dim; ++j)
    w[j] = w[j] + s.minus_step_size * m[j] / (std::sqrt(second[j]) / s.bias_correction2_sqrt + s.eps);
}

void adam_rows_(const at::Tensor& weight, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& ids, const at::Tensor& grads,
                double lr, double beta1, double beta2, double eps, double weight_decay, double step_size,
                double bias_correction2_sqrt, bool decoupled, bool maximize) {
  TORCH_CHECK(weight.dim() == 2, "adam_rows_: the weight must be 2-D");
  check_table(weight, weight, "weight");
  check_table(exp_avg, weight, "exp_avg");
  check_table(exp_avg_sq, weight, "exp_avg_sq");
  const bool amsgrad = max_exp_avg_sq.has_value();
  if (amsgrad) check_table(*max_exp_avg_sq, weight, "max_exp_avg_sq");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "adam_rows_: ids must be a contiguous 1-D int64 CPU tensor");
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  TORCH_CHECK(grads.device().is_cpu() && grads.scalar_type() == at::kFloat && grads.is_contiguous() &&
                  grads.dim() == 2 && grads.size(0) == n && grads.size(1) == dim,
              "adam_rows_: grads must be a contiguous float32 CPU tensor of (ids, dim)");
  if (n == 0) return;

  const int64_t* id = ids.data_ptr<int64_t>();
  const std::vector<int64_t> order = overlap_optim::positions_by_key(id, n, rows, "adam_rows_");
  const std::vector<int64_t> starts = overlap_optim::run_starts(id, order);  // each distinct id's run
  const int64_t touched = static_cast<int64_t>(starts.size()) - 1;

  float* W = weight.data_ptr<float>();
  float* M = exp_avg.data_ptr<float>();
  float* V = exp_avg_sq.data_ptr<float>();
  float* X = amsgrad ? max_exp_avg_sq->data_ptr<float>() : nullptr;
  const float* G = grads.data_ptr<float>();
  const Scalars s{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(weight_decay),
                  static_cast<float>(1.0 - beta1), static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
                  static_cast<float>(eps), static_cast<float>(bias_correction2_sqrt), static_cast<float>(-step_size),
                  weight_decay != 0 && !decoupled, weight_decay != 0 && decoupled, maximize};

  at::parallel_for(0, touched, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(dim);
    float* g = buffer.data();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t row = id[order[starts[u]]];
      if (u + 2 < end) {  // the rows two ahead: their lines are random in tables larger than cache
        const int64_t ahead = id[order[starts[u + 2]]] * dim;
        __builtin_prefetch(W + ahead, 1);
        __builtin_prefetch(M + ahead, 1);
        __builtin_prefetch(V + ahead, 1);
      }
      sum_positions(g, G, order.data() + starts[u], starts[u + 1] - starts[u], dim);
      float* x = amsgrad ? X + row * dim : nullptr;
      adam_row(W + row * dim, M + row * dim, V + row * dim, x, g, dim, s);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_optim, m) {
  m.def(
      "adam_rows_(Tensor(a!) weight, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? max_exp_avg_sq, "
      "Tensor ids, Tensor grads, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "float step_size, float bias_correction2_sqrt, bool decoupled, bool maximize) -> ()");
}

TORCH_LIBRARY_IMPL(overlap_optim, CPU, m) {
  m.impl("adam_rows_", &adam_rows_);
}
