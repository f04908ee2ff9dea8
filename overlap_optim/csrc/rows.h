// What the compiled passes over a table's touched rows share: the order that groups a batch's ids
// by row, and the runs of equal ids in it.
//
// Included by row_pass.cpp (Adam on the fallback's rows) and fused_rows.cpp (FBGEMM's fused
// optimizers from a lookup's output gradient).

#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace overlap_optim {

// Positions 0..n-1 ordered by keys[position], stable (equal keys keep their order): an LSD radix
// sort, 8 bits a pass, over as many bits as the largest key (below `limit`) needs.
inline std::vector<int64_t> positions_by_key(const int64_t* keys, int64_t n, int64_t limit, const char* op) {
  std::vector<int64_t> order(n), next(n);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(keys[p] >= 0 && keys[p] < limit, op, ": id ", keys[p], " out of range for ", limit, " rows");
    order[p] = p;
  }
  for (int shift = 0; shift < 64 && (limit - 1) >> shift; shift += 8) {
    int64_t count[257] = {0};
    for (int64_t p = 0; p < n; ++p) ++count[((keys[p] >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (int64_t k = 0; k < n; ++k) next[count[(keys[order[k]] >> shift) & 0xff]++] = order[k];
    order.swap(next);
  }
  return order;
}

// Where each run of equal keys starts in `order`, then n: run u is order[starts[u] .. starts[u+1]).
inline std::vector<int64_t> run_starts(const int64_t* keys, const std::vector<int64_t>& order) {
  const int64_t n = static_cast<int64_t>(order.size());
  std::vector<int64_t> starts;
  starts.reserve(n + 1);
  for (int64_t k = 0; k < n; ++k)
    if (k == 0 || keys[order[k]] != keys[order[k - 1]]) starts.push_back(k);
  starts.push_back(n);
  return starts;
}

// One id of a lookup: its key (the row in the kernel's row space), where its gradient comes from (its
// bag, pooled; its position, unpooled) and its scale (per-sample weight, mean pooling). 16 bytes: the
// sort moves them whole.
struct Entry {
  int64_t key;
  uint32_t origin;
  float scale;
};

// `entries` sorted by key, stable: an LSD radix sort that moves the entries themselves (so that each
// pass reads them in order), in as few passes of at most 11 bits as keys below `limit` need.
inline void sort_entries(std::vector<Entry>& entries, int64_t limit) {
  int bits = 0;
  while (bits < 63 && ((limit - 1) >> bits) != 0) ++bits;
  if (bits == 0) return;
  const int passes = (bits + 10) / 11, digit = (bits + passes - 1) / passes;
  const int64_t n = static_cast<int64_t>(entries.size()), mask = (int64_t{1} << digit) - 1;
  std::vector<Entry> next(n);
  std::vector<int64_t> count((int64_t{1} << digit) + 1);
  for (int shift = 0; shift < bits; shift += digit) {
    std::fill(count.begin(), count.end(), 0);
    for (const Entry& e : entries) ++count[((e.key >> shift) & mask) + 1];
    for (size_t b = 1; b < count.size(); ++b) count[b] += count[b - 1];
    for (const Entry& e : entries) next[count[(e.key >> shift) & mask]++] = e;
    entries.swap(next);
  }
}

}  // namespace overlap_optim
