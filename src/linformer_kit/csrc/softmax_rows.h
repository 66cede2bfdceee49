// The row operations of the attention kernel (attention.cpp): a block's GEMM into a row-scaled
// output, and a row's mask, softmax and scores' gradient, in plain loops g++ vectorizes
// (`#pragma omp simd`, -fno-trapping-math). T is the compute type (float or double), S a
// GEMM operand's type (T, or bfloat16 computed in float).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "matrices.h"
#include "vmath.h"

namespace linformer_kit::rows {

// x (count values of the compute type T) as a GEMM input of type S: x itself where S is T,
// else rounded into `buffer` (bfloat16: the dropped weights and the scores' gradient, as
// SDPA's bfloat16 flash kernel rounds its weights).
template <typename S, typename T>
const S* as_input(const T* x, int64_t count, std::vector<S>& buffer) {
  if constexpr (std::is_same_v<S, T>) {
    return x;
  } else {
    buffer.resize(count);
    for (int64_t c = 0; c < count; ++c) buffer[c] = linformer_kit::narrow<S>(x[c]);
    return buffer.data();
  }
}

// C (m x n of type S, row stride ldc) = A B, A m x k, B k x n, each row i of the product
// times row_scale[i] where given: straight into C where S is the compute type, else into
// `buffer` and rounded into C.
template <typename S>
void gemm_into(int64_t m, int64_t n, int64_t k, const S* a, int64_t lda, const S* b, int64_t ldb,
               S* c, int64_t ldc, const Opmath<S>* row_scale, std::vector<Opmath<S>>& buffer) {
  using T = Opmath<S>;
  T* product = nullptr;
  int64_t ld = n;
  if constexpr (std::is_same_v<S, T>) {
    product = c, ld = ldc;
  } else {
    buffer.resize(m * n);
    product = buffer.data();
  }
  gemm<S>(false, false, m, n, k, T(1), a, lda, b, ldb, T(0), product, ld);
  if (std::is_same_v<S, T> && row_scale == nullptr) return;
  for (int64_t i = 0; i < m; ++i) {
    const T factor = row_scale != nullptr ? row_scale[i] : T(1);
    const T* from = product + i * ld;
    S* to = c + i * ldc;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) to[j] = linformer_kit::narrow<S>(from[j] * factor);
  }
}

// exp(s[c] - shift) in place over a row, returning the row's sum; -inf gives 0, nan stays
// nan (`exp_clamped`: results below exp(-87) are 0).
template <typename T>
inline T exp_sum(T* s, int64_t count, T shift) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < count; ++c) {
    const T e = linformer_kit::exp_clamped(s[c] - shift);
    s[c] = e;
    sum += e;
  }
  return sum;
}

// The largest of s[0 .. count), -inf if none (a max reduction g++ vectorizes).
template <typename T>
T row_max(const T* s, int64_t count) {
  T top = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < count; ++c) top = s[c] > top ? s[c] : top;
  return top;
}

// The scores' gradient of one row of softmax weights followed by dropout, times the scores'
// scale, in place of dP = dO V^T: grad <- scale (kept * grad - weights * sum(kept * grad)),
// kept being the dropped weights times 1 / (1 - p) (or the weights, dP then carrying it).
template <typename T>
inline void scores_grad(const T* weights, const T* kept, T* grad, int64_t keys, T scale) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < keys; ++c) {
    const T product = grad[c] * kept[c];
    grad[c] = product;
    sum += product;
  }
#pragma omp simd
  for (int64_t c = 0; c < keys; ++c) grad[c] = scale * (grad[c] - weights[c] * sum);
}

// Row scores ready for the exp: -inf where `allowed` is false (if given) among the first
// `valid`, and 0 in s[valid .. keys), the keys a causal row does not see.
template <typename T>
void mask_row(T* s, int64_t valid, int64_t keys, const bool* allowed) {
  if (allowed != nullptr) {
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    for (int64_t c = 0; c < valid; ++c) s[c] = allowed[c] ? s[c] : kNegInf;
  }
  std::fill(s + valid, s + keys, T(0));
}

// Softmax of a masked row's first `valid` scores in place, but for the division by their
// sum, whose inverse goes to `inverse` (the caller scales the row of the output instead:
// Dv values, not M); returns its logsumexp, from which backward makes the weights again.
template <typename T>
T softmax_row(T* s, int64_t valid, T* inverse) {
  const T top = row_max(s, valid);
  const T sum = exp_sum(s, valid, top);
  *inverse = sum > T(0) ? T(1) / sum : T(0);  // no key (M = 0): a row of 0, as SDPA's
  return top + std::log(sum);
}

}  // namespace linformer_kit::rows
