
// The backward of an FBGEMM TBE whose optimizer FBGEMM fuses on CPU (EXACT_SGD, EXACT_ADAGRAD,
// EXACT_ROWWISE_ADAGRAD), in one pass over the touched rows, from the lookup's output gradient.
//
// FBGEMM's CPU backward sorts the ids, forms each touched row's gradient and applies the update.
// This does the same work in one pass: the ids of all the kernel's tables are sorted once (one
// radix sort over the kernel's row space), and each touched row's gradient is summed from the
// output gradient's rows (per-sample weights and mean pooling applied), then the row is stepped
// and written back in place. The arithmetic of the update is torch.optim's (torchrec's
// RowWiseAdagrad for the row-wise kind), in float32, operation for operation:
//
//   SGD:              w = w + (-lr) * g
//   Adagrad:          s = s + g * g;            w = w + (-lr) * (g / (sqrt(s) + eps))
//   row-wise Adagrad: s = s + sum(g * g) / D;   w = w + (-lr) * (g / (sqrt(s) + eps))
//
// A table stored in FP16 (FBGEMM's CPU TBE has no BF16 kernels) steps the same arithmetic on its row
// read in float32, and the result is rounded once to FP16, to nearest even (F16C's conversion, or
// c10::Half's, as torch's .to(torch.float16)); its state stays float32. FBGEMM's own CPU backward instead rounds
// the update to FP16 before adding it: two roundings a step.
//
// Clipping by norm splits the pass in two (fused_rows_coalesce, then fused_rows_apply_): the first
// sorts the ids and adds each touched row's |g|^p (max |g| for p = inf) to a float64 partial, keeping
// each touched row's gradient: summed, where several ids touched the row; where one id did, a reference
// to that id's output gradient row and scale (the caller holds the output gradient until the second
// half), and its part of the norm from its bag's, made once per bag. The second multiplies each
// gradient by the clipping coefficient and steps the row. Only the rows several ids touched are summed
// and stored (on rank 0 of benchmarks/clipping.py, 52k of 243k touched rows a step: 13 MB, not 62).
//
// Deterministic for any number of threads: a row's gradients are summed by one thread in the
// order of the ids, and the partial norm is summed over fixed chunks of rows, then over the
// chunks in order.
//
// Registered as torch operators overlap_optim::fused_rows_step_, fused_rows_coalesce and
// fused_rows_apply_ (overlap_optim/compiled.py loads the library); called by
// sharders/fused_rows.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "rows.h"

namespace {

enum Optimizer : int64_t { kSgd = 0, kAdagrad = 1, kRowwiseAdagrad = 2 };
enum Pooling : int64_t { kSum = 0, kMean = 1, kNone = 2 };

constexpr int64_t kChunk = 64;  // rows per task, and per partial of the norm (fixed: determinism)
// Rows stepped together: their gradients made (summed, or scaled) while the next block's rows are
// prefetched (a touched row is rarely in cache), then the block stepped.
constexpr int64_t kBlock = 64;

// One table of the kernel: its weight (rows x dim, float32 or FP16), and its state (float32: rows x dim,
// rows, or none).
struct Table {
  void* weight;
  bool half;  // the weight is FP16
  float* state;
  int64_t rows, dim;
};

std::vector<Table> tables_of(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& states,
                             int64_t optimizer, const char* op) {
  TORCH_CHECK(optimizer == kSgd || optimizer == kAdagrad || optimizer == kRowwiseAdagrad, op, ": optimizer ",
              optimizer, " is not one of SGD (0), Adagrad (1), row-wise Adagrad (2)");
  TORCH_CHECK(optimizer == kSgd ? states.empty() : states.size() == weights.size(), op,
              ": one state tensor per table, none for SGD");
  std::vector<Table> tables;
  for (size_t t = 0; t < weights.size(); ++t) {
    const at::Tensor& w = weights[t];
    const bool half = w.scalar_type() == at::kHalf;
    TORCH_CHECK(w.device().is_cpu() && (half || w.scalar_type() == at::kFloat) && w.is_contiguous() &&
                    w.dim() == 2, op, ": table ", t, "'s weight must be a contiguous 2-D float32 or FP16 CPU tensor");
    float* state = nullptr;
    if (optimizer != kSgd) {
      const at::Tensor& s = states[t];
      const bool shaped = optimizer == kAdagrad ? s.sizes() == w.sizes() : (s.dim() == 1 && s.size(0) == w.size(0));
      TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() && shaped, op,
                  ": table ", t, "'s state must be a contiguous float32 CPU tensor, shaped as the weight (Adagrad) "
                  "or one value per row (row-wise Adagrad)");
      state = s.data_ptr<float>();
    }
    tables.push_back({w.data_ptr(), half, state, w.size(0), w.size(1)});
  }
  return tables;
}

// A lookup's ids grouped by (table, row): its entries sorted by key, the runs of each row, and each
// run's table and row.
struct Lookup {
  std::vector<overlap_optim::Entry> entries;  // sorted by key, stable
  std::vector<int64_t> starts;                // runs of equal keys in `entries`, then n
  std::vector<int32_t> run_table;             // per run
  std::vector<int64_t> run_row;               // per run: the row in its table
  std::vector<int64_t> bag_source;            // pooled: each bag's gradient, as an offset in `grad`
  int64_t stride = 0;                         // unpooled: an id's gradient is row `origin` of `grad`
  bool pooled = true;
  const float* grad = nullptr;
  bool scaled = false;                        // some scale is not 1

  int32_t table(int64_t u) const { return run_table[u]; }
  int64_t row(int64_t u) const { return run_row[u]; }
  const float* source(const overlap_optim::Entry& e) const {
    return grad + (pooled ? bag_source[e.origin] : static_cast<int64_t>(e.origin) * stride);
  }
};

Lookup group_ids(const at::Tensor& grad, const at::Tensor& indices, const at::Tensor& offsets,
                 const std::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                 const std::vector<int64_t>& feature_table, const std::vector<int64_t>& feature_offset,
                 const std::vector<int64_t>& rows, const std::vector<int64_t>& dims, const char* op) {
  TORCH_CHECK(pooling == kSum || pooling == kMean || pooling == kNone, op, ": pooling ", pooling,
              " is not one of SUM (0), MEAN (1), NONE (2)");
  TORCH_CHECK(indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 &&
                  indices.is_contiguous(), op, ": indices must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  offsets.is_contiguous() && offsets.numel() >= 1, op,
              ": offsets must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(grad.device().is_cpu() && grad.scalar_type() == at::kFloat && grad.dim() == 2 &&
                  (grad.size(1) <= 1 || grad.stride(1) == 1) && grad.stride(0) >= grad.size(1), op,
              ": the output gradient must be a 2-D float32 CPU tensor with contiguous rows");
  const int64_t features = static_cast<int64_t>(feature_table.size());
  TORCH_CHECK(features > 0 && feature_offset.size() == feature_table.size(), op,
              ": one table and one column offset per feature");
  const int64_t n = indices.numel(), bags = offsets.numel() - 1;
  TORCH_CHECK(bags % features == 0, op, ": ", bags, " bags are not a whole batch for ", features, " features");
  const int64_t batch = bags / features;
  const int64_t* id = indices.data_ptr<int64_t>();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  TORCH_CHECK(offset[0] == 0 && offset[bags] == n, op, ": offsets must run from 0 to the number of ids");
  const bool weighted = per_sample_weights.has_value();
  if (weighted) {
    TORCH_CHECK(per_sample_weights->device().is_cpu() && per_sample_weights->scalar_type() == at::kFloat &&
                    per_sample_weights->is_contiguous() && per_sample_weights->numel() == n, op,
                ": per-sample weights must be a contiguous float32 CPU tensor, one per id");
  }
  TORCH_CHECK(grad.size(0) == (pooling == kNone ? n : batch), op,
              ": the output gradient must have one row per id (unpooled) or per sample (pooled)");

  TORCH_CHECK(n < (int64_t{1} << 32) && bags < (int64_t{1} << 32), op, ": ", n, " ids in ", bags,
              " bags: at most 2^32 - 1 of each in one lookup");
  Lookup l;
  l.grad = grad.data_ptr<float>();
  l.scaled = weighted || pooling == kMean;
  l.pooled = pooling != kNone;
  const int64_t width = grad.size(1), stride = grad.stride(0);  // a column slice of a wider gradient: rows apart
  l.stride = stride;
  std::vector<int64_t> base(rows.size() + 1, 0);
  for (size_t t = 0; t < rows.size(); ++t) base[t + 1] = base[t] + rows[t];
  l.entries.resize(n);
  if (l.pooled) l.bag_source.resize(bags);
  const float* psw = weighted ? per_sample_weights->data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t f = b / batch, t = feature_table[f];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(rows.size()), op, ": feature ", f, " names no table");
    TORCH_CHECK(pooling == kNone ? dims[t] == width : feature_offset[f] + dims[t] <= width, op,
                ": feature ", f, "'s columns lie outside the output gradient");
    const int64_t begin = offset[b], end = offset[b + 1];
    TORCH_CHECK(begin <= end, op, ": offsets must not decrease");
    const float mean = pooling == kMean && end > begin ? 1.0f / static_cast<float>(end - begin) : 1.0f;
    if (l.pooled) l.bag_source[b] = (b % batch) * stride + feature_offset[f];
    for (int64_t p = begin; p < end; ++p) {
      TORCH_CHECK(id[p] >= 0 && id[p] < rows[t], op, ": id ", id[p], " out of range for table ", t, "'s ",
                  rows[t], " rows");
      l.entries[p] = {base[t] + id[p], static_cast<uint32_t>(l.pooled ? b : p), weighted ? psw[p] * mean : mean};
    }
  }
  overlap_optim::sort_entries(l.entries, std::max<int64_t>(base.back(), 1));
  l.starts.reserve(n + 1);
  int32_t t = 0;  // keys are sorted, so each run's table only moves forward
  for (int64_t k = 0; k < n; ++k) {
    if (k > 0 && l.entries[k].key == l.entries[k - 1].key) continue;
    while (l.entries[k].key >= base[t + 1]) ++t;
    l.starts.push_back(k);
    l.run_table.push_back(t);
    l.run_row.push_back(l.entries[k].key - base[t]);
  }
  l.starts.push_back(n);
  return l;
}

// g = the sum of run u's gradients, in the order of the ids.
__attribute__((target_clones("avx2", "default")))
void sum_run(float* g, const Lookup& l, int64_t u, int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) g[j] = 0.0f;
  for (int64_t k = l.starts[u]; k < l.starts[u + 1]; ++k) {
    const overlap_optim::Entry& e = l.entries[k];
    const float* src = l.source(e);
    if (!l.scaled) {
      for (int64_t j = 0; j < dim; ++j) g[j] += src[j];
    } else {
      const float s = e.scale;
      for (int64_t j = 0; j < dim; ++j) g[j] += s * src[j];
    }
  }
}

// One row's update, torch.optim's arithmetic in its order (see the file's head).
__attribute__((target_clones("avx2", "default")))
void step_row_float(float* w, float* state, int64_t dim, const float* g, int64_t optimizer, float minus_lr,
                    float eps) {
  if (optimizer == kSgd) {
    for (int64_t j = 0; j < dim; ++j) w[j] = w[j] + minus_lr * g[j];
  } else if (optimizer == kAdagrad) {
    float* s = state;
    for (int64_t j = 0; j < dim; ++j) s[j] = s[j] + g[j] * g[j];
    for (int64_t j = 0; j < dim; ++j) w[j] = w[j] + minus_lr * (g[j] / (std::sqrt(s[j]) + eps));
  } else {
    float lanes[8] = {};  // the sum of squares in 8 lanes, so that it vectorizes (as ATen's sum does)
    int64_t j = 0;
    for (; j + 8 <= dim; j += 8)
      for (int k = 0; k < 8; ++k) lanes[k] += g[j + k] * g[j + k];
    float squares = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; j < dim; ++j) squares += g[j] * g[j];
    float& s = *state;
    s = s + squares / static_cast<float>(dim);
    const float denominator = std::sqrt(s) + eps;
    for (int64_t j = 0; j < dim; ++j) w[j] = w[j] + minus_lr * (g[j] / denominator);
  }
}

// FP16 <-> float32, 8 at a time where the CPU converts them (F16C), else one by one (c10::Half); both
// round to nearest even.
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c");
  return yes;
}

__attribute__((target("avx,f16c")))
void widen_f16c(const c10::Half* from, float* to, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(to + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + j))));
  for (; j < n; ++j) to[j] = static_cast<float>(from[j]);
}

__attribute__((target("avx,f16c")))
void narrow_f16c(const float* from, c10::Half* to, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(from + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; j < n; ++j) to[j] = c10::Half(from[j]);
}

void widen(const c10::Half* from, float* to, int64_t n) {
  if (has_f16c()) return widen_f16c(from, to, n);
  for (int64_t j = 0; j < n; ++j) to[j] = static_cast<float>(from[j]);
}

void narrow(const float* from, c10::Half* to, int64_t n) {
  if (has_f16c()) return narrow_f16c(from, to, n);
  for (int64_t j = 0; j < n; ++j) to[j] = c10::Half(from[j]);
}

// Row `row` of table t stepped; an FP16 row is read in float32, stepped, and rounded once on its way back.
void step_row(const Table& t, int64_t row, const float* g, int64_t optimizer, float minus_lr, float eps) {
  float* state = t.state == nullptr ? nullptr : t.state + (optimizer == kAdagrad ? row * t.dim : row);
  if (!t.half) {
    step_row_float(static_cast<float*>(t.weight) + row * t.dim, state, t.dim, g, optimizer, minus_lr, eps);
    return;
  }
  thread_local std::vector<float> wide;
  if (static_cast<int64_t>(wide.size()) < t.dim) wide.resize(t.dim);
  c10::Half* w = static_cast<c10::Half*>(t.weight) + row * t.dim;
  widen(w, wide.data(), t.dim);
  step_row_float(wide.data(), state, t.dim, g, optimizer, minus_lr, eps);
  narrow(wide.data(), w, t.dim);
}

// Every cache line of a row (and of its Adagrad state): a touched row is rarely in cache. Always inlined:
// as a function of its own GCC finds it free of side effects and drops every call (the object file had no
// prefetch instruction, and the pass ran 3x slower).
__attribute__((always_inline)) inline void prefetch_row(const Table& t, int64_t row, int64_t optimizer) {
  const int64_t element = t.half ? 2 : 4, bytes = t.dim * element;
  const char* w = static_cast<const char*>(t.weight) + row * bytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(w + b, 1);
  if (optimizer == kAdagrad) {
    const char* s = reinterpret_cast<const char*>(t.state + row * t.dim);
    for (int64_t b = 0; b < t.dim * 4; b += 64) __builtin_prefetch(s + b, 1);
  } else if (optimizer == kRowwiseAdagrad) {
    __builtin_prefetch(t.state + row, 1);
  }
}

int64_t max_dim(const std::vector<int64_t>& dims) {
  int64_t most = 1;
  for (int64_t d : dims) most = std::max(most, d);
  return most;
}

std::vector<int64_t> table_rows(const std::vector<Table>& tables) {
  std::vector<int64_t> rows;
  for (const Table& t : tables) rows.push_back(t.rows);
  return rows;
}

std::vector<int64_t> table_dims(const std::vector<Table>& tables) {
  std::vector<int64_t> dims;
  for (const Table& t : tables) dims.push_back(t.dim);
  return dims;
}

// The whole backward in one pass: each touched row summed and stepped.
void fused_rows_step_(const at::Tensor& grad, const at::Tensor& indices, const at::Tensor& offsets,
                      const std::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                      std::vector<int64_t> feature_table, std::vector<int64_t> feature_offset,
                      const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& states,
                      int64_t optimizer, double lr, double eps) {
  const char* op = "fused_rows_step_";
  const std::vector<Table> tables = tables_of(weights, states, optimizer, op);
  const std::vector<int64_t> dims = table_dims(tables);
  const Lookup l = group_ids(grad, indices, offsets, per_sample_weights, pooling, feature_table, feature_offset,
                             table_rows(tables), dims, op);
  const int64_t runs = static_cast<int64_t>(l.starts.size()) - 1, width = max_dim(dims);
  const float minus_lr = static_cast<float>(-lr), epsilon = static_cast<float>(eps);
  at::parallel_for(0, runs, kChunk, [&](int64_t begin, int64_t end) {
    // A block of rows at a time (measured with the prefetches issued: as fast as summing and stepping row
    // by row with the rows 4-16 ahead prefetched, or blocks of 8-32, within this machine's noise).
    std::vector<float> buffer(kBlock * width);
    for (int64_t first = begin; first < end; first += kBlock) {
      const int64_t last = std::min(end, first + kBlock);
      for (int64_t u = first; u < last; ++u) {
        if (u + kBlock < end) prefetch_row(tables[l.table(u + kBlock)], l.row(u + kBlock), optimizer);
        sum_run(buffer.data() + (u - first) * width, l, u, tables[l.table(u)].dim);
      }
      for (int64_t u = first; u < last; ++u)
        step_row(tables[l.table(u)], l.row(u), buffer.data() + (u - first) * width, optimizer, minus_lr, epsilon);
    }
  });
}

// |g|^p summed over one row (max |g| for p = inf), in float64; in lanes, so that it vectorizes.
__attribute__((target_clones("avx2", "default")))
double row_partial(const float* g, int64_t dim, double norm_type) {
  double lanes[4] = {};
  int64_t j = 0;
  if (std::isinf(norm_type)) {
    for (; j + 4 <= dim; j += 4)
      for (int k = 0; k < 4; ++k) lanes[k] = std::max(lanes[k], std::fabs(static_cast<double>(g[j + k])));
    double most = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    for (; j < dim; ++j) most = std::max(most, std::fabs(static_cast<double>(g[j])));
    return most;
  }
  if (norm_type == 2.0) {
    for (; j + 4 <= dim; j += 4)
      for (int k = 0; k < 4; ++k) lanes[k] += static_cast<double>(g[j + k]) * static_cast<double>(g[j + k]);
  } else {
    for (; j + 4 <= dim; j += 4)
      for (int k = 0; k < 4; ++k) lanes[k] += std::pow(std::fabs(static_cast<double>(g[j + k])), norm_type);
  }
  double total = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  for (; j < dim; ++j) total += std::pow(std::fabs(static_cast<double>(g[j])), norm_type);
  return total;
}

bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// 8 floats' squares added in float64 to two accumulators of 4 lanes, and the accumulators' total.
__attribute__((target("avx2,fma"), always_inline)) inline void add_squares(__m256 v, __m256d& low, __m256d& high) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  low = _mm256_fmadd_pd(a, a, low);
  high = _mm256_fmadd_pd(b, b, high);
}

__attribute__((target("avx2,fma"), always_inline)) inline double lanes_total(__m256d low, __m256d high) {
  const __m256d both = _mm256_add_pd(low, high);
  const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(both), _mm256_extractf128_pd(both, 1));
  return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

// sum_run and row_partial for p = 2 in one pass, 8 columns at a time (dim a multiple of 8): each column's
// sum made as sum_run makes it (0, then each id's gradient, scaled, added in the order of the ids: the
// same bits), stored, and its squares added in float64 (the order of those adds is this function's own).
// Measured: the pass about a third shorter than with the two calls (whose second re-read the row, bound by
// its adds' latency).
__attribute__((target("avx2,fma")))
double sum_run_squares(float* g, const Lookup& l, int64_t u, int64_t dim) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  const int64_t first = l.starts[u], last = l.starts[u + 1];
  for (int64_t j = 0; j < dim; j += 8) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t k = first; k < last; ++k) {
      const overlap_optim::Entry& e = l.entries[k];
      __m256 v = _mm256_loadu_ps(l.source(e) + j);
      if (l.scaled) v = _mm256_mul_ps(_mm256_set1_ps(e.scale), v);
      sum = _mm256_add_ps(sum, v);
    }
    _mm256_storeu_ps(g + j, sum);
    add_squares(sum, low, high);
  }
  return lanes_total(low, high);
}

// A touched row as the first half under clipping by norm leaves it for the second: its table and row, and
// where its gradient is. A row several ids touched has its gradient summed into the caller's buffer
// (`source` = -1 - its offset there); a row one id touched keeps a reference to that id's output gradient
// row and scale (`source` = the row's offset in the output gradient): its gradient is 0 + scale * that
// row, made in the second half with the same bits. Three int64 a row, in a tensor the caller keeps.
struct Touched {
  int64_t row;
  int64_t source;
  float scale;
  int32_t table;
};
static_assert(sizeof(Touched) == 3 * sizeof(int64_t), "a touched row is three int64 of its tensor");

// sum |g|^p over one row (max |g| for p = inf), in float64: for p = 2 and a width that is a multiple of 8,
// in AVX2 (two accumulators of 4 lanes), else row_partial.
__attribute__((target("avx2,fma")))
double row_squares_avx2(const float* g, int64_t dim) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  for (int64_t j = 0; j < dim; j += 8) {
    add_squares(_mm256_loadu_ps(g + j), low, high);
  }
  return lanes_total(low, high);
}

double source_partial(const float* g, int64_t dim, double norm_type) {
  if (norm_type == 2.0 && dim % 8 == 0 && has_avx2_fma()) return row_squares_avx2(g, dim);
  return row_partial(g, dim, norm_type);
}

// |scale|^p times a source row's partial: the row's part of the norm when one id touched it. The same as
// the partial of its made gradient (0 + scale * row, each element rounded to float32) for scale 1 and for
// p = inf, within that rounding otherwise.
double scaled_partial(double partial, float scale, double norm_type) {
  if (scale == 1.0f) return partial;
  const double s = std::fabs(static_cast<double>(scale));
  if (std::isinf(norm_type))  // max |fl(scale * g)| = fl(|scale| * max |g|): rounding is monotone
    return static_cast<double>(std::fabs(scale) * static_cast<float>(partial));
  return norm_type == 2.0 ? s * s * partial : std::pow(s, norm_type) * partial;
}

// The first half under clipping by norm. Returns this lookup's partial of the norm (float64, one element:
// sum |g|^p over its touched rows' gradients, or max |g| for norm_type = inf), and leaves in `touched`
// ([rows, 3] int64) each touched row as a Touched, and in `summed` (float32) the gradients of the rows
// several ids touched. Both are resized as needed: the caller keeps them from step to step, so that their
// pages stay mapped. A row one id touched reads its output gradient row once, pooled from the partials of
// the lookup's bags (made once per bag).
at::Tensor fused_rows_coalesce(const at::Tensor& grad, const at::Tensor& indices, const at::Tensor& offsets,
                               const std::optional<at::Tensor>& per_sample_weights, int64_t pooling,
                               std::vector<int64_t> feature_table, std::vector<int64_t> feature_offset,
                               std::vector<int64_t> rows, std::vector<int64_t> dims, double norm_type,
                               const at::Tensor& summed, const at::Tensor& touched) {
  const char* op = "fused_rows_coalesce";
  TORCH_CHECK(rows.size() == dims.size() && !rows.empty(), op, ": one row count and one dimension per table");
  TORCH_CHECK(norm_type > 0, op, ": norm_type must be positive, got ", norm_type);
  TORCH_CHECK(summed.device().is_cpu() && summed.scalar_type() == at::kFloat && summed.dim() == 1, op,
              ": summed must be a 1-D float32 CPU tensor");
  TORCH_CHECK(touched.device().is_cpu() && touched.scalar_type() == at::kLong, op,
              ": touched must be an int64 CPU tensor");
  const Lookup l = group_ids(grad, indices, offsets, per_sample_weights, pooling, feature_table, feature_offset,
                             rows, dims, op);
  const int64_t runs = static_cast<int64_t>(l.starts.size()) - 1;
  touched.resize_({runs, 3});
  Touched* out = reinterpret_cast<Touched*>(touched.data_ptr<int64_t>());
  int64_t need = 0;  // each run's source: its offset in `summed` (several ids), or 0 for now (one id)
  for (int64_t u = 0; u < runs; ++u) {
    const bool several = l.starts[u + 1] - l.starts[u] > 1;
    out[u].source = several ? -1 - need : 0;
    if (several) need += dims[l.table(u)];
  }
  summed.resize_({need});
  float* sums = summed.data_ptr<float>();
  // Pooled, each bag's partial once (a bag's row is the gradient of all its ids); unpooled, each id's
  // row is its own, read where its run is.
  std::vector<double> bag_partial;
  if (l.pooled) {
    const int64_t bags = static_cast<int64_t>(l.bag_source.size());
    const int64_t batch = bags / static_cast<int64_t>(feature_table.size());
    bag_partial.resize(bags);
    at::parallel_for(0, bags, 256, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        bag_partial[b] = source_partial(l.grad + l.bag_source[b], dims[feature_table[b / batch]], norm_type);
    });
  }
  const bool inf = std::isinf(norm_type);
  const bool two_norm_avx2 = norm_type == 2.0 && has_avx2_fma();
  const int64_t chunks = (runs + kChunk - 1) / kChunk;
  std::vector<double> partials(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      double total = 0.0;
      for (int64_t u = c * kChunk; u < std::min(runs, (c + 1) * kChunk); ++u) {
        const int64_t t = l.table(u), dim = dims[t];
        Touched& r = out[u];
        r.row = l.row(u);
        r.table = static_cast<int32_t>(t);
        double part;
        if (r.source < 0) {
          float* g = sums + (-1 - r.source);
          r.scale = 1.0f;
          if (two_norm_avx2 && dim % 8 == 0) {
            part = sum_run_squares(g, l, u, dim);
          } else {
            sum_run(g, l, u, dim);
            part = row_partial(g, dim, norm_type);
          }
        } else {
          const overlap_optim::Entry& e = l.entries[l.starts[u]];
          r.source = l.source(e) - l.grad;
          r.scale = e.scale;
          const double row = l.pooled ? bag_partial[e.origin] : source_partial(l.grad + r.source, dim, norm_type);
          part = scaled_partial(row, l.scaled ? e.scale : 1.0f, norm_type);
        }
        total = inf ? std::max(total, part) : total + part;
      }
      partials[c] = total;
    }
  });
  double total = 0.0;
  for (double part : partials) total = inf ? std::max(total, part) : total + part;
  at::Tensor partial = at::empty({1}, at::TensorOptions().dtype(at::kDouble));
  *partial.data_ptr<double>() = total;
  return partial;
}

// The second half: each touched row's gradient (`touched` and `summed` as fused_rows_coalesce left them,
// `grad` the output gradient it read) times `coefficient`, stepped.
void fused_rows_apply_(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& states,
                       const at::Tensor& grad, const at::Tensor& touched, const at::Tensor& summed,
                       int64_t optimizer, double lr, double eps, double coefficient) {
  const char* op = "fused_rows_apply_";
  const std::vector<Table> tables = tables_of(weights, states, optimizer, op);
  TORCH_CHECK(touched.device().is_cpu() && touched.scalar_type() == at::kLong && touched.is_contiguous() &&
                  touched.dim() == 2 && touched.size(1) == 3 && summed.scalar_type() == at::kFloat &&
                  summed.is_contiguous() && grad.scalar_type() == at::kFloat, op,
              ": touched, summed and the output gradient are not as fused_rows_coalesce left them");
  const int64_t runs = touched.size(0), width = max_dim(table_dims(tables));
  const Touched* in = reinterpret_cast<const Touched*>(touched.data_ptr<int64_t>());
  const float* g_out = grad.data_ptr<float>();
  const float* sums = summed.data_ptr<float>();
  const int64_t grad_extent = grad.numel() == 0 ? 0 : (grad.size(0) - 1) * grad.stride(0) + grad.size(1);
  for (int64_t u = 0; u < runs; ++u) {
    const Touched& r = in[u];
    TORCH_CHECK(r.table >= 0 && r.table < static_cast<int64_t>(tables.size()) && r.row >= 0 &&
                    r.row < tables[r.table].rows, op, ": touched row ", u, " names no row of the kernel's tables");
    const int64_t dim = tables[r.table].dim;
    TORCH_CHECK(r.source >= 0 ? r.source + dim <= grad_extent : -1 - r.source + dim <= summed.numel(), op,
                ": touched row ", u, "'s gradient lies outside the output gradient and the summed rows");
  }
  const float minus_lr = static_cast<float>(-lr), epsilon = static_cast<float>(eps);
  const float coef = static_cast<float>(coefficient);
  at::parallel_for(0, runs, kChunk, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kBlock * width);  // as in fused_rows_step_: a block made, then stepped
    for (int64_t first = begin; first < end; first += kBlock) {
      const int64_t last = std::min(end, first + kBlock);
      for (int64_t u = first; u < last; ++u) {
        if (u + kBlock < end) prefetch_row(tables[in[u + kBlock].table], in[u + kBlock].row, optimizer);
        const Touched& r = in[u];
        const int64_t dim = tables[r.table].dim;
        float* g = buffer.data() + (u - first) * width;
        if (r.source < 0) {
          const float* from = sums + (-1 - r.source);
          for (int64_t j = 0; j < dim; ++j) g[j] = from[j] * coef;
        } else {  // 0 + scale * row, as sum_run makes a run of one id
          const float* from = g_out + r.source;
          const float scale = r.scale;
          for (int64_t j = 0; j < dim; ++j) g[j] = (0.0f + scale * from[j]) * coef;
        }
      }
      for (int64_t u = first; u < last; ++u)
        step_row(tables[in[u].table], in[u].row, buffer.data() + (u - first) * width, optimizer, minus_lr, epsilon);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap_optim, m) {
  m.def(
      "fused_rows_step_(Tensor grad, Tensor indices, Tensor offsets, Tensor? per_sample_weights, int pooling, "
      "int[] feature_table, int[] feature_offset, Tensor(a!)[] weights, Tensor(b!)[] states, int optimizer, "
      "float lr, float eps) -> ()");
  m.def(
      "fused_rows_coalesce(Tensor grad, Tensor indices, Tensor offsets, Tensor? per_sample_weights, int pooling, "
      "int[] feature_table, int[] feature_offset, int[] rows, int[] dims, float norm_type, Tensor(a!) summed, "
      "Tensor(b!) touched) -> Tensor");
  m.def(
      "fused_rows_apply_(Tensor(a!)[] weights, Tensor(b!)[] states, Tensor grad, Tensor touched, Tensor summed, "
      "int optimizer, float lr, float eps, float coefficient) -> ()");
}

TORCH_LIBRARY_IMPL(overlap_optim, CPU, m) {
  m.impl("fused_rows_step_", &fused_rows_step_);
  m.impl("fused_rows_coalesce", &fused_rows_coalesce);
  m.impl("fused_rows_apply_", &fused_rows_apply_);
}
