// The dropout mask's bits, the keep multiply and the bfloat16 <-> float conversions, shared by
// dropout.cpp, attention.cpp and blas.h.
//
// Word w of row r (of all B x H x N rows of a call) is output number i = r * words_per_row +
// w + 1 of SplitMix64 seeded with seed * golden, splitmix64((seed + i) * golden) (the order
// `dropout.dropout_bits` needs under torch.compile), and its four 16-bit lanes, read as int16,
// are the bits of the row's weights 4w .. 4w + 3 (`dropout.dropout_bits`, the PyTorch-ops
// definition the tests hold these files to). A weight is kept where its bits are at least
// `threshold`.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vmath.h"

namespace linformer_kit {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// The call's seed, `dropout.dropout_seed`'s draw: a tensor, not an int, so that
// torch.compile traces the call without reading the value (a graph break).
inline uint64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(),
              "dropout kernels: seed must be one int64 value on the CPU; got ", seed.sizes(),
              " ", seed.scalar_type(), " on ", seed.device());
  return uint64_t(seed.item<int64_t>());
}

inline uint64_t splitmix64(uint64_t state) {
  state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9ull;
  state = (state ^ (state >> 27)) * 0x94D049BB133111EBull;
  return state ^ (state >> 31);
}

// The bits of the first `keys` weights of global row `row` into `words` (resized to
// ceil(keys / 4) 64-bit words), one int16 per weight.
inline const int16_t* row_bits(uint64_t seed, int64_t row, int64_t words_per_row, int64_t keys,
                               std::vector<uint64_t>& words) {
  const uint64_t first = uint64_t(row) * uint64_t(words_per_row) + 1;
  words.resize((keys + 3) / 4);
  for (size_t w = 0; w < words.size(); ++w) words[w] = splitmix64((seed + first + w) * kGolden);
  return reinterpret_cast<const int16_t*>(words.data());  // little-endian: lane j = bits 16j..
}

// The type S values are computed in (a GEMM's products, the dropout's multiply): float for
// bfloat16.
template <typename S>
using Opmath = at::opmath_type<S>;

// bfloat16 <-> float by their bits (vmath.h's `to_bf16` / `from_bf16`), in loops g++
// vectorizes (c10::BFloat16's own conversions, with the same rounding, leave them scalar: a
// 4096 x 256 dropout took 2.5x fp32's time): the float's top 16 bits rounded to nearest
// even, a nan a quiet nan.
template <typename T>
inline T widen(T x) {
  return x;
}
inline float widen(at::BFloat16 x) { return from_bf16(x.x); }

template <typename S, typename T>
inline S narrow(T x) {
  if constexpr (std::is_same_v<S, at::BFloat16>) {
    return at::BFloat16(to_bf16(float(x)), at::BFloat16::from_bits());
  } else {
    return S(x);
  }
}

// kept[c] = weights[c] times `scale` where bits[c] >= threshold, else times 0 (so a
// dropped inf or nan is nan, as in nn.Dropout), computed in T (float for bfloat16 S). The
// factor is scale's bits ANDed with an all-ones or all-zeros word, not `keep ? scale : 0`:
// g++ vectorizes a select here or not depending on whether `scale` is a constant
// (-march=haswell: 3-4x slower per row when it does not); the AND vectorizes with every
// -march and scale (measured with AVX2 and AVX-512 builds).
template <typename S, typename T>
inline void keep(const int16_t* bits, int32_t threshold, const S* weights, S* kept,
                 int64_t keys, T scale) {
  using Word = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  Word scale_word;
  std::memcpy(&scale_word, &scale, sizeof(T));
#pragma omp simd
  for (int64_t c = 0; c < keys; ++c) {
    const Word factor_word = scale_word & -Word(bits[c] >= threshold);  // scale or +0
    T factor;
    std::memcpy(&factor, &factor_word, sizeof(T));
    kept[c] = narrow<S>(widen(weights[c]) * factor);
  }
}

}  // namespace linformer_kit
