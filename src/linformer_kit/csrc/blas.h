// Row-major GEMMs for attention.cpp and feedforward.cpp, single-threaded calls into the BLAS
// libtorch_cpu links in (Fortran interface, column-major: C^T = op(B)^T op(A)^T). Inputs of
// type S, products in its compute type `Opmath<S>`: float and double as they are (`sgemm_`,
// `dgemm_`); bfloat16 into float through MKL's `GEMM_BF16BF16F32` (AMX or AVX-512 BF16 where
// the CPU has them), or off MKL (`off_mkl_bf16`: a libtorch without it, float GEMMs on
// oneDNN's micro-kernel below, LINFORMER_KIT_BF16_GEMM=widen) on AVX-512 BF16's dot products
// (`bf16_dot_gemm`, bf16_gemm.h) where the CPU has them and the widening is not forced, else
// by widening the inputs to float for the float GEMM.
//
// Float GEMMs go instead to oneDNN's brgemm micro-kernel (`at::native::cpublas::brgemm`)
// while `onednn_float_gemm` is set (`float_gemm` op, blas.cpp; set from Python,
// `native.set_kernel_gemm`), for every kernel alike. On an AMD EPYC (AVX-512, one
// thread) it ran 239-267 GFLOP/s at the kernels' block shapes, (64..256) x (64..1024) x
// (64..1024), against `sgemm_`'s 99-109. It takes row-major A and B as they are laid out, and
// no alpha: a transposed or scaled operand is copied first (`packed`), and the kernels lay
// out the operands they reuse untransposed once per call (`plain_operands`).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bf16_gemm.h"
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

// Whether this libtorch has the float brgemm (its CPUBlas.h says so).
#ifdef CPUBLAS_BRGEMM_F32F32F32
constexpr bool kFloatBrgemm = true;
#else
constexpr bool kFloatBrgemm = false;
#endif

// Whether the float GEMMs call oneDNN's brgemm micro-kernel rather than `sgemm_`
// (process-wide; never set where kFloatBrgemm is false).
inline std::atomic<bool>& onednn_float_gemm() {
  static std::atomic<bool> on;  // (static storage: false)
  return on;
}

// Whether gemm<S> takes the brgemm path (float, the switch set, oneDNN not
// switched off by torch.backends.mkldnn, without which torch's brgemm falls back to its own
// GEMM), where transposed operands are copied: callers that pass the same operand to many
// GEMMs then lay it out untransposed once instead.
template <typename S>
bool plain_operands() {
  return std::is_same_v<S, float> && onednn_float_gemm().load(std::memory_order_relaxed) &&
         at::globalContext().userEnabledMkldnn();
}

// The row stride of a copy of `cols` columns: a multiple of 256. torch compiles a
// micro-kernel per shape and strides and keeps it (a new lda: 37-48 us on its first call,
// 8 after, a (64, 64, 256) product, one thread); strides that followed the operand (the
// projection's E^T: lda = n) would add kernels with every new sequence length.
inline int64_t copy_stride(int64_t cols) { return (std::max<int64_t>(cols, 1) + 255) / 256 * 256; }

#ifdef __AVX512F__
// dest[r * ld_dest + c] = alpha * src[c * ld_src + r] for r, c < 16: sixteen rows loaded,
// transposed in registers (pairs of floats, pairs of doubles, then 128-bit lanes as a 4 x 4
// transpose), sixteen rows stored. The scalar loop g++ makes of it ran about 2.4 cycles an
// element (5 % of an encoder layer's time, AMD EPYC).
inline void transpose_16x16(const float* src, int64_t ld_src, float* dest, int64_t ld_dest,
                            float alpha) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4 g + c], lane j: column 4 j + c of rows 4 g .. 4 g + 3
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int g = 0; g < 4; ++g) {
    const __m512 *lo = t + 4 * g, *hi = t + 4 * g + 2;
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(lo[0]), pd(hi[0])));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(lo[0]), pd(hi[0])));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(lo[1]), pd(hi[1])));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(lo[1]), pd(hi[1])));
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int c = 0; c < 4; ++c) {  // output row 4 j + c: lane j of r[c], r[4 + c], ...
    const __m512 ab01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 ab23 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 cd01 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 cd23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    const __m512 rows[4] = {_mm512_shuffle_f32x4(ab01, cd01, 0x88),
                            _mm512_shuffle_f32x4(ab01, cd01, 0xDD),
                            _mm512_shuffle_f32x4(ab23, cd23, 0x88),
                            _mm512_shuffle_f32x4(ab23, cd23, 0xDD)};
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(dest + (4 * j + c) * ld_dest, _mm512_mul_ps(rows[j], scale));
    }
  }
}
#endif

// Rows r0 .. r1 (at most 16) of alpha * X^T (cols columns; X row-major with row stride ld)
// into dest (row stride ld_dest), in 16 x 16 tiles: `transpose_16x16` where the CPU has
// AVX-512, a scalar loop on the edges.
inline void transposed_rows(int64_t r0, int64_t r1, int64_t cols, float alpha, const float* x,
                            int64_t ld, float* dest, int64_t ld_dest) {
  constexpr int64_t kSide = 16;
  for (int64_t c0 = 0; c0 < cols; c0 += kSide) {
    const int64_t c1 = std::min(cols, c0 + kSide);
#ifdef __AVX512F__
    if (r1 - r0 == kSide && c1 - c0 == kSide) {
      transpose_16x16(x + c0 * ld + r0, ld, dest + r0 * ld_dest + c0, ld_dest, alpha);
      continue;
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) dest[r * ld_dest + c] = alpha * x[c * ld + r];
    }
  }
}

// alpha * op(X) (rows x cols; X row-major with row stride ld, transposed when `trans`) into
// `out`, rows `copy_stride(cols)` apart, threaded over blocks of 16 rows outside a parallel
// region. A transposed read goes in 16 x 16 tiles (`transposed_rows`), one that is not row
// by row.
inline const float* packed(bool trans, int64_t rows, int64_t cols, float alpha, const float* x,
                           int64_t ld, std::vector<float>& out) {
  constexpr int64_t kSide = 16;
  const int64_t stride = copy_stride(cols);
  out.resize(rows * stride);
  float* dest = out.data();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kSide * std::max<int64_t>(cols, 1)));
  at::parallel_for(0, (rows + kSide - 1) / kSide, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin * kSide; r0 < std::min(rows, end * kSide); r0 += kSide) {
      const int64_t r1 = std::min(rows, r0 + kSide);
      if (!trans) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* from = x + r * ld;
          float* to = dest + r * stride;
#pragma omp simd
          for (int64_t c = 0; c < cols; ++c) to[c] = alpha * from[c];
        }
        continue;
      }
      transposed_rows(r0, r1, cols, alpha, x, ld, dest, stride);
    }
  });
  return dest;
}

// The side of brgemm_tiles' tiles, and the depth of each micro-kernel call.
constexpr int64_t kTile = 256;

// Row-major C (m x n) = A B (+ C when `add`), A m x k, B k x n, with oneDNN's brgemm in
// kTile^3 tiles: on whole large operands its speed falls away (a (256, 1024, 8192) product
// in one call ran at 11 GFLOP/s, in 256^3 tiles at 197; (64..2048) x (256..1024) x
// (256..8192) at 197-245 in such tiles, one thread, AMD EPYC). Threaded over C's tiles when
// called outside a parallel region (as `sgemm_` threads itself there), the tiles' sides
// halved (down to 64) until every thread has one.
inline void brgemm_tiles(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, bool add, float* c, int64_t ldc) {
  const bool threaded = !at::in_parallel_region() && at::get_num_threads() > 1;
  int64_t side = kTile;
  auto count = [&](int64_t length) { return (length + side - 1) / side; };
  while (threaded && side > 64 && count(m) * count(n) < at::get_num_threads()) side /= 2;
  const int64_t row_tiles = count(m), col_tiles = count(n);
  auto tiles = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = (t / col_tiles) * side, j = (t % col_tiles) * side;
      const int64_t rows = std::min(side, m - i), cols = std::min(side, n - j);
      float* tile = c + i * ldc + j;
      if (k == 0 && !add) {
        for (int64_t r = 0; r < rows; ++r) std::fill_n(tile + r * ldc, cols, 0.0f);
      }
#ifdef CPUBLAS_BRGEMM_F32F32F32
      for (int64_t p = 0; p < k; p += kTile) {
        at::native::cpublas::brgemm(rows, cols, std::min(kTile, k - p), lda, ldb, ldc,
                                    add || p > 0, a + i * lda + p, b + p * ldb + j, tile,
                                    /*is_vnni=*/false);
      }
#endif
    }
  };
  if (threaded) {
    at::parallel_for(0, row_tiles * col_tiles, 1, tiles);
  } else {
    tiles(0, row_tiles * col_tiles);
  }
}

// The most floats a thread keeps in a GEMM's copy buffers between calls (16 MiB).
constexpr size_t kKeepFloats = size_t(1) << 22;

// Frees the thread's copy buffers that a call grew past kKeepFloats.
inline void trim_copies(std::vector<float>& a, std::vector<float>& b) {
  for (std::vector<float>* copy : {&a, &b}) {
    if (copy->capacity() > kKeepFloats) std::vector<float>().swap(*copy);
  }
}

// Whether threaded products may split their reduction (`split_reduction`; process-wide,
// on unless set off: the `split_reduction` op, blas.cpp, for A/B timings and tests).
inline std::atomic<bool>& split_reduction_on() {
  static std::atomic<bool> on{true};
  return on;
}

// The shortest reduction, and the most outputs, of a product `split_reduction` takes.
constexpr int64_t kSplitMinK = 2048, kSplitMaxOutputs = int64_t(1) << 18;

// Whether brgemm_float splits the reduction of this product between the threads rather
// than its output: op(A) transposed (a weight gradient X^T dY, the projection E^T X), k
// from kSplitMinK and at least 8x the output's longer side, at most kSplitMaxOutputs
// outputs, called outside a parallel region with threads to share. There the output
// tiling halves a 256 x 256 output into four 128 x 128 tiles over a whole transposed copy
// of A; each thread transposing its own k blocks of A as it multiplies them ran (256, 256,
// k) products 1.08 / 1.12 / 1.29x faster at k 2048 / 4096 / 16384, (512, 512, k) 1.12 /
// 1.19x at 4096 / 16384, (64, 256, 16384) 1.14x, (256, 1024, 16384) 1.08x; the attention
// layer 1.01-1.03x (2 threads, caches flushed between calls, AMD EPYC;
// `benchmarks/gemm_split.py`). Forced below 8x, or with A untransposed: 0.82-1.04x.
inline bool split_reduction(bool trans_a, int64_t m, int64_t n, int64_t k) {
  return trans_a && k >= std::max<int64_t>(kSplitMinK, 8 * std::max(m, n)) &&
         m * n <= kSplitMaxOutputs && !at::in_parallel_region() && at::get_num_threads() > 1 &&
         split_reduction_on().load(std::memory_order_relaxed);
}

// C (m x n) = alpha A^T op(B) (+ C when `add`), A k x m, with k split into blocks of kTile
// shared among the threads: each multiplies its blocks into its own m x n sum (the block of
// A^T, and of op(B) where transposed, laid out untransposed in its cache first: `packed`),
// and the sums are added into C in thread order (the same bits at every call with as many
// threads).
inline void brgemm_split_k(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                           const float* a, int64_t lda, const float* b, int64_t ldb, bool add,
                           float* c, int64_t ldc) {
  const int64_t blocks = (k + kTile - 1) / kTile;
  std::vector<std::vector<float>> sums(at::get_num_threads());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> a_copy, b_copy;
    std::vector<float>& sum = sums[at::get_thread_num()];
    sum.assign(m * n, 0.0f);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t p = block * kTile, depth = std::min(kTile, k - p);
      // op(A)[:, p .. p + depth) and op(B)[p .. p + depth, :], untransposed
      const float* a_block = packed(true, m, depth, alpha, a + p * lda, lda, a_copy);
      const float* b_block =
          trans_b ? packed(true, depth, n, 1.0f, b + p, ldb, b_copy) : b + p * ldb;
      brgemm_tiles(m, n, depth, a_block, copy_stride(depth), b_block,
                   trans_b ? copy_stride(n) : ldb, true, sum.data(), n);
    }
    trim_copies(a_copy, b_copy);
  });
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = c + i * ldc;
      if (!add) std::fill_n(row, n, 0.0f);
      for (const std::vector<float>& sum : sums) {
        if (sum.empty()) continue;  // a thread without blocks
        const float* from = sum.data() + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] += from[j];
      }
    }
  });
}

// gemm<float> on brgemm: op(A) and op(B) copied where transposed (A also where alpha != 1:
// the micro-kernel has no alpha), or the reduction split (`split_reduction`); beta 0 or 1,
// all the kernels use. The copies live in the thread's buffers, freed after a call that
// grew them past 16 MiB.
inline void brgemm_float(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                         float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                         float beta, float* c, int64_t ldc) {
  TORCH_CHECK(beta == 0.0f || beta == 1.0f, "gemm on oneDNN: beta must be 0 or 1; got ", beta);
  if (split_reduction(trans_a, m, n, k)) {
    brgemm_split_k(trans_b, m, n, k, alpha, a, lda, b, ldb, beta != 0.0f, c, ldc);
    return;
  }
  thread_local std::vector<float> a_copy, b_copy;
  if (trans_a || alpha != 1.0f) {
    a = packed(trans_a, m, k, alpha, a, lda, a_copy), lda = copy_stride(k);
  }
  if (trans_b) b = packed(true, k, n, 1.0f, b, ldb, b_copy), ldb = copy_stride(n);
  brgemm_tiles(m, n, k, a, lda, b, ldb, beta != 0.0f, c, ldc);
  trim_copies(a_copy, b_copy);
}

// LINFORMER_KIT_BF16_GEMM=widen in the environment (read once per process): bfloat16 GEMMs
// widen their inputs to float (the path a libtorch without MKL takes on a CPU without
// AVX-512 BF16; for tests and as an escape hatch).
inline bool widen_forced() {
  static const bool forced = [] {
    const char* value = std::getenv("LINFORMER_KIT_BF16_GEMM");
    return value != nullptr && std::string_view(value) == "widen";
  }();
  return forced;
}

// Whether bfloat16 GEMMs leave MKL's `GEMM_BF16BF16F32`: none in this libtorch, the widening
// forced, or float GEMMs on oneDNN's micro-kernel (`plain_operands`). There (MKL running its
// generic code on an AMD CPU) MKL's bf16 GEMM made the attention kernel 2.2x slower than in
// float32; widened onto the micro-kernel, 1.1x (fwd+bwd, n 4096, k 256, 4 heads of 64, 2
// threads, AMD EPYC with AVX-512 BF16). libtorch's bf16 brgemm there packs nothing
// (`cpublas::could_pack` false) and ran at less than half the fp32 one's rate. Off MKL they
// run `bf16_dot_gemm` where the CPU has AVX-512 BF16 (bf16_gemm.h), else widen.
inline bool off_mkl_bf16() {
  return GEMM_BF16BF16F32 == nullptr || widen_forced() || plain_operands<float>();
}

// Whether bfloat16 GEMMs off MKL run AVX-512 BF16's dot products (`bf16_dot_gemm`): this
// build has them and the widening is not forced.
inline bool bf16_dot_products() { return kBf16Dot && !widen_forced(); }

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
    if (off_mkl_bf16()) {
      if (bf16_dot_products()) {
        bf16_dot_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                      std::max<int64_t>(ldc, n));
        return;
      }
      thread_local std::vector<float> a32, b32;
      const int64_t a_rows = trans_a ? k : m, b_rows = trans_b ? n : k;
      const float* wide_a = widened(a, a_rows, trans_a ? m : k, lda, a32);
      const float* wide_b = widened(b, b_rows, trans_b ? k : n, ldb, b32);
      gemm<float>(trans_a, trans_b, m, n, k, alpha, wide_a, trans_a ? m : k, wide_b,
                  trans_b ? k : n, beta, c, ldc);
      trim_copies(a32, b32);
      return;
    }
  }
  if constexpr (std::is_same_v<S, float>) {
    if (plain_operands<float>()) {
      brgemm_float(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                   std::max<int64_t>(ldc, n));
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
