// The feed-forward kernel in bfloat16 (feedforward.cpp's ops given bf16 rows with float32
// weights and biases: `encoder.FeedForward` under CPU bf16 autocast), its GEMMs on AVX-512
// BF16's dot products (bf16_gemm.h) with the weights rounded to bf16 and packed once a call.
//
// It rounds where autocast's three modules round, so that it computes what they compute to
// float rounding: the weights and biases are rounded to bf16 (autocast's casts for addmm),
// the pre-activation H = X W1^T + b1 is kept in bf16 (addmm's bf16 output), the activation
// A = act(H) and the output Y = A W2^T + b2 are bf16; in backward dH = (dY W2) * act'(H) is
// rounded to bf16 before dX = dH W1 and the weight gradients dW2 = dY^T A, dW1 = dH^T X
// (summed as X^T dH), whose sums run in float (each thread's own, added in the order of
// their rows: `sum_partials`) and come back in float32 for the float32 weights. Per block of
// rows, as the float path: the hidden activations stay in the thread's cache; only H is kept.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "blas.h"
#include "feedforward.h"
#include "vmath.h"

namespace linformer_kit::feedforward {
namespace {

using at::BFloat16;

void check_bf16_dot() {
  TORCH_CHECK(bf16_dot_products(),
              "fused feed-forward: bfloat16 needs AVX-512 BF16's dot products (this build has "
              "none, or LINFORMER_KIT_BF16_GEMM=widen); run the modules instead");
}

// bf16 tensors' memory as the 16 bits vmath.h's conversions take.
uint16_t* bits(BFloat16* x) { return reinterpret_cast<uint16_t*>(x); }
const uint16_t* bits(const BFloat16* x) { return reinterpret_cast<const uint16_t*>(x); }

// a = bf16(act(v)) of v = bf16(h + bias) over a row, v kept in `kept` when given.
void activate_row(const float* h, const float* bias, uint16_t* kept, uint16_t* a, int64_t cols,
                  int64_t activation) {
  if (activation == kRelu) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t v = to_bf16(h[c] + bias[c]);
      if (kept != nullptr) kept[c] = v;
      const float x = from_bf16(v);
      a[c] = to_bf16(x <= 0.0f ? 0.0f : x);  // (NaN stays NaN, as in torch.relu)
    }
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    const uint16_t v = to_bf16(h[c] + bias[c]);
    if (kept != nullptr) kept[c] = v;
    a[c] = to_bf16(gelu(from_bf16(v), static_cast<float*>(nullptr)));
  }
}

// a = bf16(act(h)) and dh = bf16(da * act'(h)) over a row of kept pre-activations h.
void activate_backward(const uint16_t* h, const float* da, uint16_t* a, uint16_t* dh,
                       int64_t cols, int64_t activation) {
  if (activation == kRelu) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      const float x = from_bf16(h[c]);
      a[c] = to_bf16(x <= 0.0f ? 0.0f : x);
      dh[c] = to_bf16(x <= 0.0f ? 0.0f : da[c]);  // (NaN passes the gradient, as ATen's)
    }
    return;
  }
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c) {
    float slope;
    a[c] = to_bf16(gelu(from_bf16(h[c]), &slope));
    dh[c] = to_bf16(da[c] * slope);
  }
}

// sums[c] += column sums of the rows x cols bf16 matrix x.
void add_column_sums(const uint16_t* x, int64_t rows, int64_t cols, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) sums[c] += from_bf16(x[r * cols + c]);
  }
}

// out = bf16(sums + bias) over rows x cols (bias per column, or none).
void round_rows(const float* sums, const float* bias, int64_t rows, int64_t cols, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = to_bf16(sums[r * cols + c] + (bias != nullptr ? bias[c] : 0.0f));
    }
  }
}

// op(B) = w (rows, cols) or its transpose, rounded to bf16 and packed for the dot products.
PackedB packed_weight(const at::Tensor& w, bool transposed) {
  const at::Tensor rounded = w.to(at::kBFloat16);
  const int64_t rows = w.size(0), cols = w.size(1);
  PackedB out;
  pack_b_once(transposed, transposed ? cols : rows, transposed ? rows : cols,
              rounded.data_ptr<BFloat16>(), cols, out);
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_bf16(const at::Tensor& x, const at::Tensor& w1,
                                                const at::Tensor& b1, const at::Tensor& w2,
                                                const at::Tensor& b2, int64_t activation,
                                                bool keep_hidden) {
  check_bf16_dot();
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0);
  at::Tensor out = at::empty({rows, dim}, x.options());
  at::Tensor kept = at::empty({keep_hidden ? rows : 0, hidden}, x.options());
  const PackedB up = packed_weight(w1, true), down = packed_weight(w2, true);  // W1^T, W2^T
  // the biases rounded to bf16 too, as autocast casts them for addmm
  const at::Tensor b1_rounded = b1.to(at::kBFloat16).to(at::kFloat);
  const at::Tensor b2_rounded = b2.to(at::kBFloat16).to(at::kFloat);
  const BFloat16* in = x.data_ptr<BFloat16>();
  const float *bias1 = b1_rounded.data_ptr<float>(), *bias2 = b2_rounded.data_ptr<float>();
  BFloat16* y = out.data_ptr<BFloat16>();
  BFloat16* h_all = keep_hidden ? kept.data_ptr<BFloat16>() : nullptr;
  const int64_t step = block_rows(rows, kRows), blocks = (rows + step - 1) / step;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(step * hidden), sums(step * dim);
    std::vector<BFloat16> a(step * hidden);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * step, count = std::min(step, rows - first);
      bf16_dot_gemm(false, count, 1.0f, in + first * dim, dim, up, 0.0f, h.data(), hidden);
      for (int64_t r = 0; r < count; ++r) {
        activate_row(h.data() + r * hidden, bias1,
                     keep_hidden ? bits(h_all + (first + r) * hidden) : nullptr,
                     bits(a.data() + r * hidden), hidden, activation);
      }
      bf16_dot_gemm(false, count, 1.0f, a.data(), hidden, down, 0.0f, sums.data(), dim);
      round_rows(sums.data(), bias2, count, dim, bits(y + first * dim));
    }
  });
  return {out, kept};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_bf16(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& hidden_in, int64_t activation, std::array<bool, 2> needs) {
  check_bf16_dot();
  const int64_t rows = x.size(0), dim = x.size(1), hidden = w1.size(0);
  const auto [need_x, need_weights] = needs;
  const auto none = [](const at::Tensor& like) { return at::empty({0}, like.options()); };
  at::Tensor grad_x = need_x ? at::empty_like(x) : none(x);
  at::Tensor grad_w1 = none(w1), grad_b1 = none(w1), grad_w2 = none(w1), grad_b2 = none(w1);
  if (!need_x && !need_weights) return {grad_x, grad_w1, grad_b1, grad_w2, grad_b2};
  if (need_weights) {
    grad_w1 = at::empty_like(w1), grad_w2 = at::empty_like(w2);
    grad_b1 = at::empty({hidden}, w1.options()), grad_b2 = at::empty({dim}, w1.options());
  }
  const PackedB down = packed_weight(w2, false);  // W2 (dim, hidden), for dA = dY W2
  const PackedB up = need_x ? packed_weight(w1, false) : PackedB();  // W1, for dX = dH W1
  const BFloat16 *g_all = grad.data_ptr<BFloat16>(), *in = x.data_ptr<BFloat16>();
  const BFloat16* h_all = hidden_in.data_ptr<BFloat16>();
  BFloat16* dx = need_x ? grad_x.data_ptr<BFloat16>() : nullptr;
  const int64_t step = block_rows(rows, kBackRows), blocks = (rows + step - 1) / step;
  std::mutex lock;
  std::vector<Partial<float>> partials;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> da(step * hidden), sums(need_x ? step * dim : 0);
    std::vector<BFloat16> a(step * hidden), dh(step * hidden);
    Partial<float> part(begin, need_weights ? hidden : 0, need_weights ? dim : 0);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * step, count = std::min(step, rows - first);
      const BFloat16 *g = g_all + first * dim, *h = h_all + first * hidden;
      bf16_dot_gemm(false, count, 1.0f, g, dim, down, 0.0f, da.data(), hidden);  // dA = dY W2
      for (int64_t r = 0; r < count; ++r) {  // A and dH = dA * act'(H)
        activate_backward(bits(h + r * hidden), da.data() + r * hidden,
                          bits(a.data() + r * hidden), bits(dh.data() + r * hidden), hidden,
                          activation);
      }
      if (need_weights) {
        bf16_dot_gemm(true, false, dim, hidden, count, 1.0f, g, dim, a.data(), hidden, 1.0f,
                      part.w2.data(), hidden);  // dW2 += dY^T A
        add_column_sums(bits(g), count, dim, part.b2.data());
      }
      if (need_x) {
        bf16_dot_gemm(false, count, 1.0f, dh.data(), hidden, up, 0.0f, sums.data(), dim);
        round_rows(sums.data(), nullptr, count, dim, bits(dx + first * dim));  // dX = dH W1
      }
      if (need_weights) {
        add_column_sums(bits(dh.data()), count, hidden, part.b1.data());
        bf16_dot_gemm(true, false, dim, hidden, count, 1.0f, in + first * dim, dim, dh.data(),
                      hidden, 1.0f, part.w1.data(), hidden);  // dW1^T += X^T dH
      }
    }
    if (!need_weights) return;
    std::lock_guard<std::mutex> guard(lock);
    partials.push_back(std::move(part));
  });
  if (need_weights) {  // (dW1 summed as dW1^T: X^T dH ran 1.1-1.2x dH^T X's speed, one thread)
    at::Tensor grad_w1_t = at::empty({dim, hidden}, w1.options());
    sum_partials(partials, {&grad_w1_t, &grad_b1, &grad_w2, &grad_b2});
    grad_w1.copy_(grad_w1_t.t());
  }
  return {grad_x, grad_w1, grad_b1, grad_w2, grad_b2};
}

}  // namespace linformer_kit::feedforward
