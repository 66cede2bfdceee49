// Elementwise math in plain loops g++ vectorizes (`#pragma omp simd`, -fno-trapping-math):
// the exp of attention.cpp's softmax, the activations of feedforward.cpp and
// feedforward_bf16.cpp, and bfloat16's conversions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace linformer_kit {

// std::bit_cast for C++17: torch < 2.13 builds extensions with -std=c++17 (torch 2.11's
// build failed on std::bit_cast). g++ makes the memcpy a register move.
template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// exp(x) for x <= 0 (the callers' range: softmax scores minus their maximum, -x^2): 0 below
// exp(-87) and at -inf, nan stays nan; above about 88 the power of two overflows. Cephes'
// expf: range reduction by ln 2 in two parts, a degree-6 polynomial, relative error about
// 1e-7. Without -fno-trapping-math g++ makes the clamp a branch and leaves the loop scalar.
inline float exp_clamped(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float power = bit_cast<float>((int32_t(n) + 127) << 23);  // 2^n
  const int32_t keep = -int32_t(!(x < -87.0f));  // 0 below exp(-87) and at -inf
  return bit_cast<float>(bit_cast<int32_t>(p * power) & keep);
}

inline double exp_clamped(double x) { return std::exp(x); }  // (double: std::exp itself)

// GELU (exact, erf form) of x, and its derivative into `slope` when asked for. float: erf
// by Abramowitz and Stegun 7.1.26 (absolute error <= 1.5e-7), as ATen's vectorized CPU
// GELU computes it; the derivative 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
// shares its exp.
inline float gelu(float x, float* slope) {
  const float z = std::fabs(x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const float e = exp_clamped(-z * z);
  const float erf_abs = 1.0f - p * t * e;
  const float cdf = 0.5f + 0.5f * (x < 0.0f ? -erf_abs : erf_abs);  // Phi(x)
  if (slope != nullptr) *slope = cdf + x * e * 0.39894228040143268f;
  return x * cdf;
}

// bfloat16 as its 16 bits, to and from float in loops g++ vectorizes (c10::BFloat16's
// conversions are calls it leaves scalar): x rounded to nearest even, NaN to 0x7FC0, as
// c10::BFloat16(x) rounds.
inline uint16_t to_bf16(float x) {
  const uint32_t bits = bit_cast<uint32_t>(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float from_bf16(uint16_t bits) { return bit_cast<float>(uint32_t(bits) << 16); }

inline double gelu(double x, double* slope) {
  const double cdf = 0.5 * std::erfc(-x * 0.70710678118654752);
  if (slope != nullptr) *slope = cdf + x * std::exp(-0.5 * x * x) * 0.39894228040143268;
  return x * cdf;
}

}  // namespace linformer_kit
