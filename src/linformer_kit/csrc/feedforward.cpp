// The feed-forward block on CPU, fused: Linear -> GELU or ReLU -> Linear (`encoder.FeedForward`)
// as one parallel loop over blocks of rows, each block's hidden activations made and consumed
// in the thread's cache.
//
// PyTorch runs the block as whole-tensor ops: the rows x hidden pre-activation, activation,
// its gradient and the pre-activation's gradient are each a fresh tensor written to memory and
// read back by the next op (16 MiB each at 4096 rows of 1024; in a profile at that size its
// GEMMs took 8-9 ms each against 6.4 ms alone). Here, per block of `kRows` rows: H = X W1^T + b1
// (one GEMM, kept for backward when asked), A = act(H) in the thread's buffer, Y = A W2^T + b2
// (one GEMM into the output). Backward, per block: A and act'(H) again from the kept H,
// dA = dY W2, dH = dA * act'(H), dX = dH W1, and the weight gradients dW2 += dY^T A,
// dW1 += dH^T X, db1 += sum dH, db2 += sum dY into each thread's own sums, added in the
// order of their rows once the loop is done (the same result whichever thread ends first);
// or, where those copies would cost more (few rows for the threads and width, `all_rows`),
// A and dH kept for every row and the weight gradients as two GEMMs over all rows after the
// loop. Only the gradients asked for are computed. Float and double; the GEMMs in the loop
// are single-threaded BLAS calls (`blas.h`). bf16 rows with float weights: feedforward_bf16.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "blas.h"
#include "feedforward.h"
#include "vmath.h"

namespace {

using namespace linformer_kit::feedforward;
using linformer_kit::gemm;
using linformer_kit::Opmath;

// a[c] = act(h[c] + bias[c]) over a row, and h <- h + bias when `keep_sum`.
template <typename T>
void activate_row(T* h, const T* bias, T* a, int64_t cols, int64_t activation, bool keep_sum) {
  if (activation == kRelu) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      const T x = h[c] + bias[c];
      if (keep_sum) h[c] = x;
      a[c] = x <= T(0) ? T(0) : x;  // (NaN stays NaN, as in torch.relu)
    }
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    const T x = h[c] + bias[c];
    if (keep_sum) h[c] = x;
    a[c] = linformer_kit::gelu(x, static_cast<T*>(nullptr));
  }
}

// a[c] = act(h[c]) and slope[c] = act'(h[c]) over a row of kept pre-activations.
template <typename T>
void activate_with_slope(const T* h, T* a, T* slope, int64_t cols, int64_t activation) {
  if (activation == kRelu) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      a[c] = h[c] <= T(0) ? T(0) : h[c];
      slope[c] = h[c] <= T(0) ? T(0) : T(1);  // (NaN passes the gradient, as ATen's)
    }
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    T s;
    a[c] = linformer_kit::gelu(h[c], &s);
    slope[c] = s;
  }
}

// sums[c] += column sums of the rows x cols matrix x.
template <typename T>
void add_column_sums(const T* x, int64_t rows, int64_t cols, T* sums) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) sums[c] += x[r * cols + c];
  }
}

// A (rows, cols) weight W for the forward's GEMMs, which read it in every block: W^T laid out
// in `copy` (`packed`, rows copy_stride(rows) apart) where they would copy it each time (float
// on oneDNN's micro-kernel, `plain`), else W itself, which they read transposed. `ld`: the
// row stride of what is returned.
template <typename T>
const T* weight_t(const at::Tensor& w, bool plain, std::vector<T>& copy, int64_t& ld) {
  const int64_t rows = w.size(0), cols = w.size(1);
  ld = cols;
  if constexpr (std::is_same_v<T, float>) {
    if (plain) {
      ld = linformer_kit::copy_stride(rows);
      return linformer_kit::packed(true, cols, rows, 1.0f, w.data_ptr<float>(), cols, copy);
    }
  }
  return w.data_ptr<T>();
}

// How backward sums the weight gradients over the rows (`weight_sums`): each thread into its
// own copies of dW1 and dW2 (2 x dim x hidden), added once the loop is done (kThreadSums), or
// from A and dH kept for every row (2 x rows x hidden), by two GEMMs over all rows that the
// BLAS threads (kAllRows). The copies cost the same however few the rows (zeroed, summed into,
// read back). Timed by `benchmarks/kernels_feedforward_sums.py`
// (`benchmarks/kernels/feedforward/sums/`: fwd+bwd, hidden 4 dim, dims 256-1024, 512-4096
// rows, 2 threads, AVX-512 Xeon): all rows took 0.71-0.99x the thread sums' time below
// rows = 2 x threads x dim and 1.03-1.20x from there, but for the two cells at dim 1024 nearest
// the line (1.02x, 0.98x); the rule picked the faster way in 14 of 16 cells, 2 % slower in the
// other two. With 1 thread (`sums/threads1/`) in 11 of 12. The noise is as large: the same
// way timed twice in a cell differed by up to 11 %. With 16 threads (the GPU machine's
// Xeon, `cuda/feedforward-sums/`, dims 256 / 768, 2048-32768 rows) within 3.2 % of the
// faster way in 5 of 6 cells, 1.17x at dim 256, 2048 rows (all rows, where the thread sums
// won). With 16 threads, dim 768 and 2048 rows, backward's extra peak memory went 411 ->
// 97 MiB. Between threads x dim and 2 x threads x dim rows all rows holds more memory than
// the copies (up to about twice): speed decides.
enum WeightSums : int64_t { kRule = -1, kThreadSums = 0, kAllRows = 1 };

bool all_rows(int64_t weight_sums, int64_t rows, int64_t dim, int64_t blocks) {
  if (weight_sums != kRule) return weight_sums == kAllRows;
  if (blocks == 0) return false;
  // The copies: one per call of at::parallel_for's function, each call given
  // ceil(blocks / threads) blocks.
  const int64_t per_call = (blocks + threads() - 1) / threads();
  const int64_t copies = (blocks + per_call - 1) / per_call;
  return rows < 2 * copies * dim;
}

}  // namespace

// (rows, dim) -> (rows, dim), and the (rows, hidden) pre-activation H for backward when
// `keep_hidden` (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> feedforward_forward(
    const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
    const at::Tensor& b2, int64_t activation, bool keep_hidden) {
  check_inputs(x, w1, w2, {&x}, {&w1, &b1, &w2, &b2});
  check_activation(activation);
  TORCH_CHECK(b1.sizes() == at::IntArrayRef({w1.size(0)}) &&
                  b2.sizes() == at::IntArrayRef({w1.size(1)}),
              "fused feed-forward: biases ", b1.sizes(), ", ", b2.sizes(),
              " do not match (hidden), (dim) of w1 ", w1.sizes());
  if (x.scalar_type() == at::kBFloat16) {
    return forward_bf16(x, w1, b1, w2, b2, activation, keep_hidden);
  }
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0);
  at::Tensor out = at::empty({rows, dim}, x.options());
  at::Tensor kept = at::empty({keep_hidden ? rows : 0, hidden}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "feedforward_forward", [&] {
    using T = scalar_t;
    const T *in = x.data_ptr<T>(), *bias1 = b1.data_ptr<T>(), *bias2 = b2.data_ptr<T>();
    T* y = out.data_ptr<T>();
    T* h_all = keep_hidden ? kept.data_ptr<T>() : nullptr;
    const bool plain = linformer_kit::plain_operands<T>();
    std::vector<T> w1_t, w2_t;
    int64_t ld1 = 0, ld2 = 0;
    const T *right1 = weight_t(w1, plain, w1_t, ld1), *right2 = weight_t(w2, plain, w2_t, ld2);
    const int64_t step = block_rows(rows, kRows), blocks = (rows + step - 1) / step;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> h_buffer(keep_hidden ? 0 : step * hidden), a(step * hidden);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t first = b * step, count = std::min(step, rows - first);
        T* h = keep_hidden ? h_all + first * hidden : h_buffer.data();
        gemm<T>(false, !plain, count, hidden, dim, T(1), in + first * dim, dim, right1, ld1,
                T(0), h, hidden);  // X W1^T
        for (int64_t r = 0; r < count; ++r) {
          activate_row(h + r * hidden, bias1, a.data() + r * hidden, hidden, activation,
                       keep_hidden);
          std::copy(bias2, bias2 + dim, y + (first + r) * dim);
        }
        gemm<T>(false, !plain, count, dim, hidden, T(1), a.data(), hidden, right2, ld2, T(1),
                y + first * dim, dim);  // + A W2^T
      }
    });
  });
  return {out, kept};
}

// The gradients of x and of w1, b1, w2, b2 from the output's gradient (rows, dim) and the
// kept H: those `needs` asks for (x's; the weights and biases'), the others empty tensors
// (not None: vmap, as in `jacobian(vectorize=True)`, has a fallback for ops returning
// tensors, none for optional ones).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feedforward_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& hidden_in, int64_t activation, std::array<bool, 2> needs,
    int64_t weight_sums) {
  check_inputs(x, w1, w2, {&x, &grad, &hidden_in}, {&w1, &w2});
  check_activation(activation);
  TORCH_CHECK(weight_sums >= kRule && weight_sums <= kAllRows,
              "fused feed-forward backward: weight_sums must be -1 (the rule), 0 (each "
              "thread's sums) or 1 (over all rows); got ", weight_sums);
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0);
  TORCH_CHECK(grad.sizes() == x.sizes() && hidden_in.sizes() == at::IntArrayRef({rows, hidden}),
              "fused feed-forward backward: grad ", grad.sizes(), " and hidden ",
              hidden_in.sizes(), " do not match (rows, dim) and (rows, hidden)");
  if (x.scalar_type() == at::kBFloat16) {  // (each thread's sums, whatever weight_sums says)
    return backward_bf16(grad, x, w1, w2, hidden_in, activation, needs);
  }
  const auto [need_x, need_weights] = needs;
  const auto none = [&] { return at::empty({0}, x.options()); };  // (one each: no aliases)
  at::Tensor grad_x = need_x ? at::empty_like(x) : none();
  at::Tensor grad_w1 = none(), grad_b1 = none(), grad_w2 = none(), grad_b2 = none();
  if (!need_x && !need_weights) return {grad_x, grad_w1, grad_b1, grad_w2, grad_b2};
  if (need_weights) {
    grad_w1 = at::empty_like(w1), grad_w2 = at::empty_like(w2);
    grad_b1 = at::empty({hidden}, x.options()), grad_b2 = at::empty({dim}, x.options());
  }
  const int64_t step = block_rows(rows, kBackRows), blocks = (rows + step - 1) / step;
  const bool over_all_rows = need_weights && all_rows(weight_sums, rows, dim, blocks);
  // A and dH of every row, for the weight gradients' GEMMs over all rows after the loop
  at::Tensor a_all = over_all_rows ? at::empty({rows, hidden}, x.options()) : at::Tensor();
  at::Tensor dh_all = over_all_rows ? at::empty({rows, hidden}, x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "feedforward_backward", [&] {
    using T = scalar_t;
    const T *g_all = grad.data_ptr<T>(), *in = x.data_ptr<T>(), *h_all = hidden_in.data_ptr<T>();
    const T *weight1 = w1.data_ptr<T>(), *weight2 = w2.data_ptr<T>();
    T* dx = need_x ? grad_x.data_ptr<T>() : nullptr;
    T* a_rows = over_all_rows ? a_all.data_ptr<T>() : nullptr;
    T* dh_rows = over_all_rows ? dh_all.data_ptr<T>() : nullptr;
    const bool thread_sums = need_weights && !over_all_rows;
    std::mutex lock;
    std::vector<Partial<T>> partials;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> slope(step * hidden), a(over_all_rows ? 0 : step * hidden);
      std::vector<T> dh(over_all_rows ? 0 : step * hidden);
      Partial<T> part(begin, thread_sums ? hidden : 0, thread_sums ? dim : 0);
      std::vector<T>&dw1 = part.w1, &db1 = part.b1, &dw2 = part.w2, &db2 = part.b2;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t first = b * step, count = std::min(step, rows - first);
        const T *g = g_all + first * dim, *h = h_all + first * hidden;
        T* ab = over_all_rows ? a_rows + first * hidden : a.data();
        T* dhb = over_all_rows ? dh_rows + first * hidden : dh.data();
        for (int64_t r = 0; r < count; ++r) {
          activate_with_slope(h + r * hidden, ab + r * hidden, slope.data() + r * hidden,
                              hidden, activation);
        }
        if (thread_sums) {
          gemm<T>(true, false, dim, hidden, count, T(1), g, dim, ab, hidden, T(1),
                  dw2.data(), hidden);  // dW2 += dY^T A
          add_column_sums(g, count, dim, db2.data());
        }
        gemm<T>(false, false, count, hidden, dim, T(1), g, dim, weight2, hidden, T(0), dhb,
                hidden);  // dA = dY W2
        for (int64_t c = 0; c < count * hidden; ++c) dhb[c] *= slope[c];  // dH
        if (need_x) {
          gemm<T>(false, false, count, dim, hidden, T(1), dhb, hidden, weight1, dim, T(0),
                  dx + first * dim, dim);  // dX = dH W1
        }
        if (thread_sums) {
          add_column_sums(dhb, count, hidden, db1.data());
          gemm<T>(true, false, hidden, dim, count, T(1), dhb, hidden, in + first * dim,
                  dim, T(1), dw1.data(), dim);  // dW1 += dH^T X
        }
      }
      if (!thread_sums) return;
      std::lock_guard<std::mutex> guard(lock);
      partials.push_back(std::move(part));
    });
    if (over_all_rows) {  // the weight gradients as GEMMs over all rows, threaded by the BLAS
      // (blas.h, as in the loop: not at::mm, whose fp32 precision
      // torch.set_float32_matmul_precision may lower)
      gemm<T>(true, false, dim, hidden, rows, T(1), g_all, dim, a_rows, hidden, T(0),
              grad_w2.data_ptr<T>(), hidden);  // dY^T A
      gemm<T>(true, false, hidden, dim, rows, T(1), dh_rows, hidden, in, dim, T(0),
              grad_w1.data_ptr<T>(), dim);  // dH^T X
      at::sum_out(grad_b1, dh_all, 0);
      at::sum_out(grad_b2, grad, 0);
    }
    if (thread_sums) sum_partials(partials, {&grad_w1, &grad_b1, &grad_w2, &grad_b2});
  });
  return {grad_x, grad_w1, grad_b1, grad_w2, grad_b2};
}

TORCH_LIBRARY_FRAGMENT(linformer_kit, m) {
  m.def("feedforward_forward(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, "
        "int activation, bool keep_hidden) -> (Tensor, Tensor)");
  m.def("feedforward_backward(Tensor grad, Tensor x, Tensor w1, Tensor w2, Tensor hidden, "
        "int activation, bool[2] needs, int weight_sums=-1) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("feedforward_forward", &feedforward_forward);
  m.impl("feedforward_backward", &feedforward_backward);
}
