// Dropout on CPU, fused: `dropout_forward` makes the mask's random bits, compares and
// multiplies (by the rescaling) in one pass over rows of activations, in both passes of
// `dropout.Dropout` (backward: the same mask on the gradient, made again from the seed).
// The attention weights' dropout is in attention.cpp.
//
// The bits: `bits.h`, row r of the input (seen as rows of its last dimension) owning
// words r * ceil(cols / 4) + 1 onwards. Built on first use by `linformer_kit.native`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "bits.h"

at::Tensor dropout_forward(const at::Tensor& x, const at::Tensor& seed, int64_t threshold,
                           double scale) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu(),
              "dropout kernel: x must be a contiguous CPU tensor of at least one dimension; got ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(threshold >= -32768 && threshold <= 32768, "dropout kernel: threshold ",
              threshold, " outside [-32768, 32768]");
  const uint64_t seed_bits = linformer_kit::seed_value(seed);
  const int64_t cols = x.size(-1), words_per_row = (cols + 3) / 4;
  const int64_t rows = cols ? x.numel() / cols : 0;
  at::Tensor kept = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "dropout_forward", [&] {
    using T = linformer_kit::Opmath<scalar_t>;  // bfloat16: scaled in float, rounded once
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* out = kept.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> words;
      for (int64_t r = begin; r < end; ++r) {
        const int16_t* bits = linformer_kit::row_bits(seed_bits, r, words_per_row, cols, words);
        linformer_kit::keep(bits, int32_t(threshold), in + r * cols, out + r * cols, cols,
                            T(scale));
      }
    });
  });
  return kept;
}

TORCH_LIBRARY(linformer_kit, m) {
  m.def("dropout_forward(Tensor x, Tensor seed, int threshold, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("dropout_forward", &dropout_forward);
}
