// The attention kernel's view of its (B, H, rows, cols) tensors as G = B x H row-major
// matrices (attention.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "blas.h"

namespace linformer_kit {

// A (B, H, rows, cols) tensor with unit column stride, addressed as matrix g = b * H + h.
template <typename T>
struct Matrices {
  T* data = nullptr;
  int64_t heads = 1, batch_stride = 0, head_stride = 0, ld = 0;

  explicit Matrices(const at::Tensor& t) {  // an undefined t: a gradient not asked for
    if (t.defined()) {
      data = t.data_ptr<std::remove_const_t<T>>();
      heads = t.size(1), batch_stride = t.stride(0), head_stride = t.stride(1), ld = t.stride(2);
    }
  }
  T* row(int64_t g, int64_t r) const {
    return data + (g / heads) * batch_stride + (g % heads) * head_stride + r * ld;
  }
};

// The optional (B, H, N, M) bool mask's rows (nullptr without a mask).
struct Allowed {
  std::optional<Matrices<const bool>> mask;

  explicit Allowed(const std::optional<at::Tensor>& t) {
    if (t) mask.emplace(*t);
  }
  const bool* row(int64_t g, int64_t r) const { return mask ? mask->row(g, r) : nullptr; }
};

// (B, H, M, D) -> alpha * (B, H, D, M), contiguous: K^T and V^T, the right operands of Q K^T
// and dO V^T (alpha: the scores' scale, which the GEMM then need not apply). float: each
// matrix in 16 x 16 tiles (`transposed_rows`), threaded over the matrices; other dtypes:
// ATen's transposing copy. In the causal LM's block attention (256
// matrices of 192 keys x 32, the blocks as batch entries) ATen's copies took 4 % of a
// training step in the profiler; the kernel's forward there went 1.75 / 1.69 -> 1.43 / 1.61
// ms (min, alternating processes, AMD EPYC, 2 threads), fwd+bwd 7.20 / 6.98 -> 6.70 / 6.88.
inline at::Tensor transposed(const at::Tensor& t, double alpha = 1.0) {
  if (t.scalar_type() != at::kFloat || (t.stride(3) != 1 && t.size(3) > 1)) {
    at::Tensor out = t.transpose(2, 3).contiguous();
    return alpha == 1.0 ? out : out.mul_(alpha);
  }
  const int64_t rows = t.size(3), cols = t.size(2);  // of each (D, M) result
  at::Tensor out = at::empty({t.size(0), t.size(1), rows, cols}, t.options());
  const Matrices<const float> from(t);
  float* dest = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(rows * cols, 1));
  at::parallel_for(0, t.size(0) * t.size(1), grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        transposed_rows(r0, std::min(rows, r0 + 16), cols, float(alpha), from.row(g, 0),
                        from.ld, dest + g * rows * cols, cols);
      }
    }
  });
  return out;
}

// alpha * X^T (`transposed`) as a GEMM's right operand, and the alpha left for that GEMM:
// alpha goes into the copy where the GEMM would otherwise copy each block of its left
// operand to apply it (float on oneDNN's micro-kernel, which takes no alpha:
// `plain_operands`), else it stays the GEMM's.
template <typename S>
std::pair<at::Tensor, Opmath<S>> transposed_scaled(const at::Tensor& t, Opmath<S> alpha) {
  if (plain_operands<S>()) return {transposed(t, alpha), Opmath<S>(1)};
  return {transposed(t), alpha};
}

}  // namespace linformer_kit
