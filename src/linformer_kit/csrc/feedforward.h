// What the feed-forward kernel's float / double path (feedforward.cpp) and its bfloat16 path
// (feedforward_bf16.cpp) share: blocks of rows, the checks, each thread's gradient sums.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <utility>
#include <vector>

namespace linformer_kit::feedforward {

// Rows per block, forward and backward: a block's hidden activations (128 x 1024 floats,
// 512 KiB) stay in L2. Measured at 4096 rows of width 256 / 1024, 2 threads (AVX-512 Xeon):
// forward, the GEMMs alone, 32 / 64 / 128 rows took 26 / 21 / 18 ms; backward (three such
// buffers a block, and the weight gradients' GEMMs summing over the block's rows) 128 / 256
// / 512 rows 39-40 / 34-37 / 36-37 ms; in an encoder layer (n 1024 / 4096) 128 to 512 rows
// within 3 % of each other. Fewer rows where that leaves a thread without a block (at least
// `kFewestRows`): every thread busy matters more than the GEMMs' best shape.
constexpr int64_t kRows = 128;
constexpr int64_t kBackRows = 256;
constexpr int64_t kFewestRows = 32;

inline int64_t threads() { return std::max<int64_t>(1, at::get_num_threads()); }

// Rows per block for `rows` rows: `most`, or fewer so that each thread gets a block.
inline int64_t block_rows(int64_t rows, int64_t most) {
  return std::clamp<int64_t>((rows + threads() - 1) / threads(), kFewestRows, most);
}

enum Activation : int64_t { kGelu = 0, kRelu = 1 };

// x (rows, dim), w1 (hidden, dim) and w2 (dim, hidden); all contiguous CPU tensors, the
// `rows_like` ones (x, its gradient, the kept pre-activation) of x's dtype, the `weights`
// (weights and biases) of x's dtype too, or float32 for bfloat16 x.
inline void check_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                         std::initializer_list<const at::Tensor*> rows_like,
                         std::initializer_list<const at::Tensor*> weights) {
  const at::ScalarType weight_type =
      x.scalar_type() == at::kBFloat16 ? at::kFloat : x.scalar_type();
  for (const auto& [group, type] : {std::pair{rows_like, x.scalar_type()},
                                    std::pair{weights, weight_type}}) {
    for (const at::Tensor* t : group) {
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == type,
                  "fused feed-forward: inputs, weights, biases and gradients must be "
                  "contiguous CPU tensors of one dtype (or bfloat16 inputs with float32 "
                  "weights); got ", t->sizes(), " ", t->scalar_type(), " on ", t->device(),
                  " where ", type, " was due");
    }
  }
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 2 && w1.size(1) == x.size(1) &&
                  w2.sizes() == at::IntArrayRef({w1.size(1), w1.size(0)}),
              "fused feed-forward: shapes x ", x.sizes(), ", w1 ", w1.sizes(), ", w2 ",
              w2.sizes(), " do not match (rows, dim), (hidden, dim), (dim, hidden)");
}

inline void check_activation(int64_t activation) {
  TORCH_CHECK(activation == kGelu || activation == kRelu,
              "fused feed-forward: activation must be 0 (gelu) or 1 (relu); got ", activation);
}

// A thread's share of the weight and bias gradients, from the blocks begin .. end.
template <typename T>
struct Partial {
  Partial(int64_t begin, int64_t hidden, int64_t dim)
      : begin(begin), w1(hidden * dim), b1(hidden), w2(dim * hidden), b2(dim) {}  // zeros

  int64_t begin;
  std::vector<T> w1, b1, w2, b2;
};

// The weight and bias gradients (w1, b1, w2, b2) as the sums of the threads' partial sums
// in the order of their rows (the same result whichever thread ended first), in parallel
// over their elements (no partials: zeros).
template <typename T>
void sum_partials(std::vector<Partial<T>>& partials, std::array<at::Tensor*, 4> grads) {
  std::sort(partials.begin(), partials.end(),
            [](const Partial<T>& p, const Partial<T>& q) { return p.begin < q.begin; });
  constexpr std::array<std::vector<T> Partial<T>::*, 4> members = {
      &Partial<T>::w1, &Partial<T>::b1, &Partial<T>::w2, &Partial<T>::b2};
  for (size_t g = 0; g < grads.size(); ++g) {
    T* out = grads[g]->data_ptr<T>();
    at::parallel_for(0, grads[g]->numel(), 1 << 14, [&](int64_t begin, int64_t end) {
      std::fill(out + begin, out + end, T(0));
      for (const Partial<T>& part : partials) {
        const T* sums = (part.*members[g]).data();
#pragma omp simd
        for (int64_t i = begin; i < end; ++i) out[i] += sums[i];
      }
    });
  }
}

// The bfloat16 path (feedforward_bf16.cpp): bf16 x with float32 weights and biases.
std::tuple<at::Tensor, at::Tensor> forward_bf16(const at::Tensor& x, const at::Tensor& w1,
                                                const at::Tensor& b1, const at::Tensor& w2,
                                                const at::Tensor& b2, int64_t activation,
                                                bool keep_hidden);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_bf16(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& hidden, int64_t activation, std::array<bool, 2> needs);

}  // namespace linformer_kit::feedforward
