// bfloat16 GEMMs on the CPU's bf16 dot-product instruction (AVX-512 BF16's vdpbf16ps: two
// bf16 products a lane added to a float sum), for blas.h's gemm<bfloat16> where neither MKL
// nor oneDNN's micro-kernel multiplies bf16 at the CPU's bf16 rate (AMD CPUs with AVX-512:
// MKL runs generic code there, libtorch's bf16 brgemm packs nothing, blas.h).
//
// C (m x n, float) = alpha op(A) op(B) + beta C, in blocks of kDepth pairs of the inner
// dimension: op(B) is packed per block into panels of 32 columns, each inner pair's 32
// columns as 64 bf16 (pair-interleaved, the instruction's operand layout; zeros past n and
// k), op(A) read in place as pairs of a row (packed first where transposed or where its
// pairs would be split: an odd k or row stride). A micro-kernel of up to 8 rows x 32
// columns keeps its 16 sums in registers over the block (8 rows: 429-503 GFLOP/s on one
// thread of an AMD EPYC at the attention kernel's block shapes; 12 rows, 24 sums: 357-488;
// 6: 395-465; 10: 361-493). Products are exact in float; sums run in float, in a different
// order than a float GEMM's (float rounding), and the instruction treats denormal inputs,
// products and sums as zero whatever MXCSR says (at most ~1e-38 a step: nothing to the
// kernels, whose weights are 0 below exp(-87)).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace linformer_kit {

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;

namespace bf16_dot {

constexpr int64_t kRows = 8;     // micro-kernel rows (header comment)
constexpr int64_t kCols = 32;    // micro-kernel columns (two vectors of 16 floats)
constexpr int64_t kDepth = 128;  // inner pairs per block (256 of k)

// op(M)[r, c] of a bf16 matrix, row-major with row stride ld, as its 16 bits.
inline uint16_t element(const at::BFloat16* x, bool trans, int64_t ld, int64_t r, int64_t c) {
  return (trans ? x[c * ld + r] : x[r * ld + c]).x;
}

// The panels of kCols columns that n columns take.
inline int64_t panel_count(int64_t n) { return (n + kCols - 1) / kCols; }

// The size of op(B) (k x n) packed: every pair of its rows, in panels of kCols columns.
inline int64_t packed_size(int64_t k, int64_t n) {
  return panel_count(n) * ((k + 1) / 2) * 2 * kCols;
}

// Pairs p0 .. p0 + pairs of op(B) (k x n) into panels of kCols columns at `out`: panel j,
// pair q at out[(j * pairs + q) * 2 * kCols], column c's pair at 2c, 2c + 1; zeros past k
// and n. Untransposed, two rows' 16 columns at a time are widened to 32 bits and
// interleaved; transposed, a column's pair is one 32-bit word of B's row.
inline void pack_b(bool trans, int64_t k, int64_t n, const at::BFloat16* b, int64_t ldb,
                   int64_t p0, int64_t pairs, uint16_t* out) {
  const int64_t panels = panel_count(n);
  for (int64_t j = 0; j < panels; ++j) {
    const int64_t c0 = j * kCols, cols = std::min(kCols, n - c0);
    for (int64_t q = 0; q < pairs; ++q) {
      uint16_t* dest = out + (j * pairs + q) * 2 * kCols;
      const int64_t r = 2 * (p0 + q);
      if (!trans && cols == kCols && r + 1 < k) {
        const at::BFloat16* even = b + r * ldb + c0;
        for (int64_t h = 0; h < kCols; h += 16) {
          const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + h)));
          const __m512i high =
              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + ldb + h)));
          _mm512_storeu_si512(dest + 2 * h, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
        continue;
      }
      if (trans && r + 1 < k) {
        for (int64_t c = 0; c < kCols; ++c) {
          uint32_t word = 0;
          if (c < cols) std::memcpy(&word, b + (c0 + c) * ldb + r, sizeof(word));
          std::memcpy(dest + 2 * c, &word, sizeof(word));
        }
        continue;
      }
      for (int64_t c = 0; c < kCols; ++c) {
        const bool inside = c < cols;
        dest[2 * c] = inside && r < k ? element(b, trans, ldb, r, c0 + c) : 0;
        dest[2 * c + 1] = inside && r + 1 < k ? element(b, trans, ldb, r + 1, c0 + c) : 0;
      }
    }
  }
}

// op(A) (m x k) as 32-bit pairs, pair q of row r at out[q * m + r] (pair-major: A^T's rows
// 2q and 2q + 1 interleaved, 16 at a time where A is transposed), zero-padded past k.
inline const uint32_t* pack_a(bool trans, int64_t m, int64_t k, const at::BFloat16* a,
                              int64_t lda, std::vector<uint32_t>& out) {
  const int64_t pairs = (k + 1) / 2;
  out.resize(m * pairs);
  for (int64_t q = 0; q < pairs; ++q) {
    uint32_t* dest = out.data() + q * m;
    int64_t r = 0;
    if (trans && 2 * q + 1 < k) {
      const at::BFloat16* even = a + 2 * q * lda;
      for (; r + 16 <= m; r += 16) {
        const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + r)));
        const __m512i high =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(even + lda + r)));
        _mm512_storeu_si512(dest + r, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
      }
    }
    for (; r < m; ++r) {
      const uint32_t low = element(a, trans, lda, r, 2 * q);
      const uint32_t high = 2 * q + 1 < k ? element(a, trans, lda, r, 2 * q + 1) : 0;
      dest[r] = low | (high << 16);
    }
  }
  return out.data();
}

// rows x up to kCols of C from the sums: alpha * sum + (first block ? beta C : C).
template <int64_t R>
inline void store(const __m512 (&sums)[R][2], int64_t cols, float alpha, float beta,
                  bool first, float* c, int64_t ldc) {
  const __mmask16 low = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
  const __m512 scale = _mm512_set1_ps(alpha);
  const float old = first ? beta : 1.0f;
  for (int64_t r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      const __mmask16 mask = h == 0 ? low : high;
      if (mask == 0) continue;
      float* dest = c + r * ldc + 16 * h;
      __m512 value = _mm512_mul_ps(sums[r][h], scale);
      if (old != 0.0f) {
        const __m512 before = _mm512_maskz_loadu_ps(mask, dest);
        value = _mm512_fmadd_ps(before, _mm512_set1_ps(old), value);
      }
      _mm512_mask_storeu_ps(dest, mask, value);
    }
  }
}

// 32 bits of bf16 memory (two elements): may alias it, and is only 2-byte aligned (a view
// at an odd element offset).
typedef uint32_t PairBits __attribute__((may_alias, aligned(2)));

// A's pairs: row r's pair q at at[r * row + q * pair].
struct Pairs {
  const PairBits* at;
  int64_t row, pair;
};

// R rows x kCols: sums over `pairs` pairs of A's rows times one packed panel of B, then
// stored.
template <int64_t R>
inline void micro(int64_t pairs, Pairs a, const uint16_t* panel,
                  int64_t cols, float alpha, float beta, bool first, float* c, int64_t ldc) {
  __m512 sums[R][2];
  for (int64_t r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + q * 2 * kCols);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + q * 2 * kCols + kCols);
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(int(a.at[r * a.row + q * a.pair]));
      sums[r][0] = _mm512_dpbf16_ps(sums[r][0], pair, b0);
      sums[r][1] = _mm512_dpbf16_ps(sums[r][1], pair, b1);
    }
  }
  store<R>(sums, cols, alpha, beta, first, c, ldc);
}

// micro<R> for R = rows (1 .. kRows).
template <int64_t R = kRows>
inline void micro_rows(int64_t rows, int64_t pairs, Pairs a, const uint16_t* panel,
                       int64_t cols, float alpha, float beta, bool first, float* c, int64_t ldc) {
  if constexpr (R > 1) {
    if (rows < R) {
      micro_rows<R - 1>(rows, pairs, a, panel, cols, alpha, beta, first, c, ldc);
      return;
    }
  }
  micro<R>(pairs, a, panel, cols, alpha, beta, first, c, ldc);
}

// op(A) (m x k) as the micro-kernel reads it: in place, or packed into `copy` where
// transposed or where its pairs would be split (an odd k or row stride).
inline Pairs pairs_of_a(bool trans, int64_t m, int64_t k, const at::BFloat16* a, int64_t lda,
                        std::vector<uint32_t>& copy) {
  if (trans || k % 2 != 0 || lda % 2 != 0) {
    return Pairs{pack_a(trans, m, k, a, lda, copy), 1, m};
  }
  return Pairs{reinterpret_cast<const PairBits*>(a), lda / 2, 1};
}

// C (m x n) = alpha A op(B) + beta C over op(B)'s pairs in blocks of kDepth, each block's
// pairs packed (pack_b) at `block_of_b(p0, pairs)`.
template <typename BlockOfB>
inline void gemm_blocks(int64_t m, int64_t n, int64_t all_pairs, Pairs a, float alpha,
                        float beta, float* c, int64_t ldc, BlockOfB block_of_b) {
  const int64_t panels = panel_count(n);
  for (int64_t p0 = 0; p0 < all_pairs; p0 += kDepth) {
    const int64_t pairs = std::min(kDepth, all_pairs - p0);
    const uint16_t* packed = block_of_b(p0, pairs);
    for (int64_t j = 0; j < panels; ++j) {
      const uint16_t* panel = packed + j * pairs * 2 * kCols;
      const int64_t cols = std::min(kCols, n - j * kCols);
      for (int64_t i = 0; i < m; i += kRows) {
        const Pairs rows{a.at + i * a.row + p0 * a.pair, a.row, a.pair};
        micro_rows(std::min(kRows, m - i), pairs, rows, panel, cols, alpha, beta, p0 == 0,
                   c + i * ldc + j * kCols, ldc);
      }
    }
  }
}

// C = beta C, A and B not read (k or alpha 0, as in BLAS).
inline void scale_only(int64_t m, int64_t n, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
  }
}

}  // namespace bf16_dot

// op(B) (k x n) packed once for several GEMMs with it (the feed-forward kernel's weights,
// read by every block of rows): `pack_b`'s depth blocks one after another.
struct PackedB {
  std::vector<uint16_t> panels;
  int64_t k = 0, n = 0;
};

inline void pack_b_once(bool trans, int64_t k, int64_t n, const at::BFloat16* b, int64_t ldb,
                        PackedB& out) {
  using namespace bf16_dot;
  out.k = k, out.n = n;
  out.panels.resize(packed_size(k, n));
  const int64_t all_pairs = (k + 1) / 2, panels = panel_count(n);
  // (in parallel over the blocks' panels: a 256-deep B is one block)
  const int64_t blocks = (all_pairs + kDepth - 1) / kDepth;
  at::parallel_for(0, blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p0 = task / panels * kDepth, j = task % panels;
      const int64_t pairs = std::min(kDepth, all_pairs - p0);
      pack_b(trans, k, std::min(kCols, n - j * kCols), b + (trans ? j * kCols * ldb : j * kCols),
             ldb, p0, pairs, out.panels.data() + p0 * 2 * kCols * panels + j * pairs * 2 * kCols);
    }
  });
}

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C for bf16 A and B (row strides lda,
// ldb), float C (ldc), on the calling thread (the attention kernel calls it inside its
// parallel loop).
inline void bf16_dot_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const at::BFloat16* a, int64_t lda,
                          const at::BFloat16* b, int64_t ldb, float beta, float* c,
                          int64_t ldc) {
  using namespace bf16_dot;
  thread_local std::vector<uint16_t> b_packed;
  thread_local std::vector<uint32_t> a_packed;
  const int64_t all_pairs = (k + 1) / 2, panels = panel_count(n);
  if (all_pairs == 0 || alpha == 0.0f) return scale_only(m, n, beta, c, ldc);
  gemm_blocks(m, n, all_pairs, pairs_of_a(trans_a, m, k, a, lda, a_packed), alpha, beta, c, ldc,
              [&](int64_t p0, int64_t pairs) {
                b_packed.resize(panels * pairs * 2 * kCols);
                pack_b(trans_b, k, n, b, ldb, p0, pairs, b_packed.data());
                return b_packed.data();
              });
  if (b_packed.capacity() > (size_t(1) << 22)) std::vector<uint16_t>().swap(b_packed);
  if (a_packed.capacity() > (size_t(1) << 22)) std::vector<uint32_t>().swap(a_packed);
}

// The same with op(B) packed once (`pack_b_once`).
inline void bf16_dot_gemm(bool trans_a, int64_t m, float alpha, const at::BFloat16* a,
                          int64_t lda, const PackedB& b, float beta, float* c, int64_t ldc) {
  using namespace bf16_dot;
  thread_local std::vector<uint32_t> a_packed;
  const int64_t all_pairs = (b.k + 1) / 2, panels = panel_count(b.n);
  if (m == 0 || b.n == 0) return;
  if (all_pairs == 0 || alpha == 0.0f) return scale_only(m, b.n, beta, c, ldc);
  const uint16_t* panels_of_b = b.panels.data();
  gemm_blocks(m, b.n, all_pairs, pairs_of_a(trans_a, m, b.k, a, lda, a_packed), alpha, beta,
              c, ldc, [&](int64_t p0, int64_t) { return panels_of_b + p0 * 2 * kCols * panels; });
  if (a_packed.capacity() > (size_t(1) << 22)) std::vector<uint32_t>().swap(a_packed);
}

#else
constexpr bool kBf16Dot = false;

struct PackedB {};

// Never called without AVX-512 BF16 (blas.h checks bf16_dot_products(); the feed-forward
// kernel's bf16 path is refused before).
inline void pack_b_once(bool, int64_t, int64_t, const at::BFloat16*, int64_t, PackedB&) {
  TORCH_CHECK(false, "bf16_dot_gemm: this build has no AVX-512 BF16");
}
inline void bf16_dot_gemm(bool, bool, int64_t, int64_t, int64_t, float, const at::BFloat16*,
                          int64_t, const at::BFloat16*, int64_t, float, float*, int64_t) {
  TORCH_CHECK(false, "bf16_dot_gemm: this build has no AVX-512 BF16");
}
inline void bf16_dot_gemm(bool, int64_t, float, const at::BFloat16*, int64_t, const PackedB&,
                          float, float*, int64_t) {
  TORCH_CHECK(false, "bf16_dot_gemm: this build has no AVX-512 BF16");
}
#endif

}  // namespace linformer_kit
