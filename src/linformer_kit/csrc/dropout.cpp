// Dropout on CPU, fused. `dropout_forward`: the mask's random bits, the comparison, the
// multiply (and a scale) in one pass over rows of weights or activations: the explicit
// attention kernel's forward (scale 1, the rescaling goes to its next GEMM), and both
// passes of `dropout.Dropout`. `dropout_backward`: the attention kernel's backward, the
// mask, the kept weights and the softmax-with-dropout gradient in one pass per row.
//
// The bits are those of `dropout.dropout_bits`, the PyTorch-ops definition the tests hold
// this file to: word w of row r (of all B x H x N rows) is SplitMix64's output number
// r * words_per_row + w + 1 for the call's seed, and its four 16-bit lanes, read as int16,
// are the bits of the row's weights 4w .. 4w + 3. A weight is kept where its bits are at
// least `threshold`. Built on first use by `linformer_kit.native` (torch's cpp_extension).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t state) {
  state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9ull;
  state = (state ^ (state >> 27)) * 0x94D049BB133111EBull;
  return state ^ (state >> 31);
}

// Where a block of weights (G, rows, keys) sits among the call's (G, seq_len, keys) rows.
struct Layout {
  uint64_t seed;
  int64_t rows, keys, row_first, seq_len, words_per_row;
  int32_t threshold;

  // The bits of flat block row r into `words` (ceil(keys / 4) 64-bit words).
  const int16_t* bits(int64_t r, std::vector<uint64_t>& words) const {
    const int64_t row = (r / rows) * seq_len + row_first + r % rows;
    const uint64_t first = uint64_t(row) * uint64_t(words_per_row) + 1;
    words.resize((keys + 3) / 4);
    for (size_t w = 0; w < words.size(); ++w) words[w] = splitmix64(seed + (first + w) * kGolden);
    return reinterpret_cast<const int16_t*>(words.data());  // little-endian: lane j = bits 16j..
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

// Row r of the kept weights: row r of the weights times `scale` where its bits keep them,
// else times 0 (so a dropped inf or nan is nan, as in nn.Dropout). The factor is scale's
// bits ANDed with an all-ones or all-zeros word, not `keep ? scale : 0`: g++ vectorizes
// a select here or not depending on whether `scale` is a constant (-march=haswell: 3-4x
// slower per row when it does not); the AND vectorizes with every -march and scale
// (measured with AVX2 and AVX-512 builds).
template <typename T>
void keep_row(const Layout& layout, int64_t r, std::vector<uint64_t>& words, const T* weights,
              T* kept, T scale) {
  using Word = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  const int16_t* bits = layout.bits(r, words);
  const int64_t keys = layout.keys;
  const int32_t threshold = layout.threshold;
  const T* wr = weights + r * keys;
  T* kr = kept + r * keys;
  Word scale_word;
  std::memcpy(&scale_word, &scale, sizeof(T));
#pragma omp simd
  for (int64_t c = 0; c < keys; ++c) {
    const Word factor_word = scale_word & -Word(bits[c] >= threshold);  // scale or +0
    T factor;
    std::memcpy(&factor, &factor_word, sizeof(T));
    kr[c] = wr[c] * factor;  // a dropped inf or nan gives nan, as in nn.Dropout
  }
}

template <typename T>
void forward_rows(const Layout& layout, const at::Tensor& weights, at::Tensor& kept, T scale) {
  const T* w = weights.data_ptr<T>();
  T* out = kept.data_ptr<T>();
  for_rows(weights, layout.keys, [&](int64_t r, std::vector<uint64_t>& words) {
    keep_row(layout, r, words, w, out, scale);
  });
}

// kept = weights * mask; grad <- kept * grad - weights * sum(kept * grad) over the row
// (the scores' gradient, as the dropout path's three in-place passes computed it).
template <typename T>
void backward_rows(const Layout& layout, const at::Tensor& weights, at::Tensor& grad,
                   at::Tensor& kept) {
  const T* w = weights.data_ptr<T>();
  T* g = grad.data_ptr<T>();
  T* out = kept.data_ptr<T>();
  const int64_t keys = layout.keys;
  for_rows(weights, keys, [&](int64_t r, std::vector<uint64_t>& words) {
    keep_row(layout, r, words, w, out, T(1));
    const T* wr = w + r * keys;
    const T* kr = out + r * keys;
    T* gr = g + r * keys;
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < keys; ++c) {
      const T product = gr[c] * kr[c];
      gr[c] = product;
      sum += product;
    }
#pragma omp simd
    for (int64_t c = 0; c < keys; ++c) gr[c] -= wr[c] * sum;
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

at::Tensor dropout_backward(const at::Tensor& weights, at::Tensor grad, int64_t seed,
                            int64_t row_first, int64_t seq_len, int64_t words_per_row,
                            int64_t threshold) {
  const Layout layout = layout_of(weights, seed, row_first, seq_len, words_per_row, threshold);
  TORCH_CHECK(grad.sizes() == weights.sizes() && grad.is_contiguous() &&
                  grad.scalar_type() == weights.scalar_type(),
              "dropout kernel: grad must be contiguous and match weights ", weights.sizes(),
              "; got ", grad.sizes());
  at::Tensor kept = at::empty_like(weights);
  AT_DISPATCH_FLOATING_TYPES(weights.scalar_type(), "dropout_backward",
                             [&] { backward_rows<scalar_t>(layout, weights, grad, kept); });
  return kept;
}

TORCH_LIBRARY(linformer_kit, m) {
  m.def("dropout_forward(Tensor weights, int seed, int row_first, int seq_len, "
        "int words_per_row, int threshold, float scale) -> Tensor");
  m.def("dropout_backward(Tensor weights, Tensor(a!) grad, int seed, int row_first, "
        "int seq_len, int words_per_row, int threshold) -> Tensor");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("dropout_forward", &dropout_forward);
  m.impl("dropout_backward", &dropout_backward);
}
