// Row-major GEMMs for attention.cpp and feedforward.cpp, single-threaded calls into the BLAS
// libtorch_cpu links in (Fortran interface, column-major: C^T = op(B)^T op(A)^T). Inputs of
// type S, products in its compute type `Opmath<S>`: float and double as they are (`sgemm_`,
// `dgemm_`); bfloat16 into float through MKL's `GEMM_BF16BF16F32` (AMX or AVX-512 BF16 where
// the CPU has them), or, in a libtorch without MKL (or with LINFORMER_KIT_BF16_GEMM=widen in
// the environment, read once per process), by widening the inputs to float for `sgemm_`.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bits.h"  // Opmath, widen

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*);
// Weak: null where libtorch_cpu does not export it (builds without MKL).
void GEMM_BF16BF16F32(const char*, const char*, const int*, const int*, const int*,
                      const float*, const uint16_t*, const int*, const uint16_t*, const int*,
                      const float*, float*, const int*) __attribute__((weak));
}

namespace linformer_kit {

// Whether bfloat16 GEMMs widen their inputs to float: no MKL bf16 GEMM in this libtorch, or
// LINFORMER_KIT_BF16_GEMM=widen (the path a libtorch without MKL takes, for tests and as an
// escape hatch).
inline bool widen_bf16() {
  static const bool widen = [] {
    const char* value = std::getenv("LINFORMER_KIT_BF16_GEMM");
    return GEMM_BF16BF16F32 == nullptr || (value != nullptr && std::string_view(value) == "widen");
  }();
  return widen;
}

// The rows x cols matrix at `a` (row stride ld) widened to float, contiguous, into `out`.
inline const float* widened(const at::BFloat16* a, int64_t rows, int64_t cols, int64_t ld,
                            std::vector<float>& out) {
  out.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = widen(a[r * ld + c]);
  }
  return out.data();
}

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, op(A) m x k, op(B) k x n; A, B, C
// row-major with row strides lda, ldb, ldc.
template <typename S>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Opmath<S> alpha,
          const S* a, int64_t lda, const S* b, int64_t ldb, Opmath<S> beta, Opmath<S>* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  // A row stride is free where its rows are single: BLAS wants at least the row's length.
  lda = std::max<int64_t>({lda, trans_a ? m : k, 1});
  ldb = std::max<int64_t>({ldb, trans_b ? k : n, 1});
  if constexpr (std::is_same_v<S, at::BFloat16>) {
    if (widen_bf16()) {
      thread_local std::vector<float> a32, b32;
      const int64_t a_rows = trans_a ? k : m, b_rows = trans_b ? n : k;
      const float* wide_a = widened(a, a_rows, trans_a ? m : k, lda, a32);
      const float* wide_b = widened(b, b_rows, trans_b ? k : n, ldb, b32);
      gemm<float>(trans_a, trans_b, m, n, k, alpha, wide_a, trans_a ? m : k, wide_b,
                  trans_b ? k : n, beta, c, ldc);
      return;
    }
  }
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int M = int(m), N = int(n), K = int(k), LDA = int(lda), LDB = int(ldb);
  const int LDC = int(std::max<int64_t>({ldc, n, 1}));
  if constexpr (std::is_same_v<S, float>) {
    sgemm_(&tb, &ta, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
  } else if constexpr (std::is_same_v<S, double>) {
    dgemm_(&tb, &ta, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
  } else {
    static_assert(std::is_same_v<S, at::BFloat16>, "gemm: float, double or bfloat16 inputs");
    GEMM_BF16BF16F32(&tb, &ta, &N, &M, &K, &alpha, reinterpret_cast<const uint16_t*>(b), &LDB,
                     reinterpret_cast<const uint16_t*>(a), &LDA, &beta, c, &LDC);
  }
}

}  // namespace linformer_kit
