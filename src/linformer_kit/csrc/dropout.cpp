// Dropout on CPU, fused: `dropout_forward` makes the mask's random bits, compares and
// multiplies (by the rescaling) in one pass over rows of activations, in both passes of
// `dropout.Dropout` (backward: the same mask on the gradient, made again from the seed).
// The attention weights' dropout is in attention.cpp.
//
// The bits: `bits.h`. Built on first use by `linformer_kit.native` (torch's cpp_extension).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "bits.h"

namespace {

using linformer_kit::keep;
using linformer_kit::row_bits;

// Where a block of weights (G, rows, keys) sits among the call's (G, seq_len, keys) rows.
struct Layout {
  uint64_t seed;
  int64_t rows, keys, row_first, seq_len, words_per_row;
  int32_t threshold;

  // The bits of flat block row r into `words` (ceil(keys / 4) 64-bit words).
  const int16_t* bits(int64_t r, std::vector<uint64_t>& words) const {
    return row_bits(seed, (r / rows) * seq_len + row_first + r % rows, words_per_row, keys, words);
  }
};

// Over the block's G * rows rows, in parallel on torch's threads (its OpenMP pool).
template <typename Body>
void for_rows(const at::Tensor& weights, int64_t keys, const Body& body) {
  const int64_t count = keys ? weights.numel() / keys : 0;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> words;
    for (int64_t r = begin; r < end; ++r) body(r, words);
  });
}

// Row r of the kept weights: row r of the weights times `scale` where its bits keep them.
template <typename T>
void keep_row(const Layout& layout, int64_t r, std::vector<uint64_t>& words, const T* weights,
              T* kept, T scale) {
  const int64_t keys = layout.keys;
  keep(layout.bits(r, words), layout.threshold, weights + r * keys, kept + r * keys, keys, scale);
}

template <typename T>
void forward_rows(const Layout& layout, const at::Tensor& weights, at::Tensor& kept, T scale) {
  const T* w = weights.data_ptr<T>();
  T* out = kept.data_ptr<T>();
  for_rows(weights, layout.keys, [&](int64_t r, std::vector<uint64_t>& words) {
    keep_row(layout, r, words, w, out, scale);
  });
}

Layout layout_of(const at::Tensor& weights, int64_t seed, int64_t row_first, int64_t seq_len,
                 int64_t words_per_row, int64_t threshold) {
  TORCH_CHECK(weights.dim() >= 2 && weights.is_contiguous() && weights.device().is_cpu(),
              "dropout kernel: weights must be contiguous CPU (..., rows, keys); got ",
              weights.sizes(), " on ", weights.device());
  const int64_t keys = weights.size(-1);
  TORCH_CHECK(4 * words_per_row >= keys, "dropout kernel: words_per_row ", words_per_row,
              " is fewer than keys / 4 = ", (keys + 3) / 4);
  TORCH_CHECK(threshold >= -32768 && threshold <= 32768, "dropout kernel: threshold ",
              threshold, " outside [-32768, 32768]");
  return Layout{uint64_t(seed), weights.size(-2), keys, row_first, seq_len, words_per_row,
                int32_t(threshold)};
}

}  // namespace

at::Tensor dropout_forward(const at::Tensor& weights, int64_t seed, int64_t row_first,
                           int64_t seq_len, int64_t words_per_row, int64_t threshold,
                           double scale) {
  const Layout layout = layout_of(weights, seed, row_first, seq_len, words_per_row, threshold);
  at::Tensor kept = at::empty_like(weights);
  AT_DISPATCH_FLOATING_TYPES(weights.scalar_type(), "dropout_forward",
                             [&] { forward_rows<scalar_t>(layout, weights, kept, scalar_t(scale)); });
  return kept;
}

TORCH_LIBRARY(linformer_kit, m) {
  m.def("dropout_forward(Tensor weights, int seed, int row_first, int seq_len, "
        "int words_per_row, int threshold, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("dropout_forward", &dropout_forward);
}
