// The attention kernel's view of its (B, H, rows, cols) tensors as G = B x H row-major
// matrices (attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <type_traits>

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

// (B, H, M, D) -> (B, H, D, M), contiguous: K^T and V^T, the right operands of Q K^T and
// dO V^T.
inline at::Tensor transposed(const at::Tensor& t) { return t.transpose(2, 3).contiguous(); }

}  // namespace linformer_kit
