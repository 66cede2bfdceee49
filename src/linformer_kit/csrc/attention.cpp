// Softmax attention with dropout on CPU, fused: the explicit kernel's forward and backward
// (`kernels._fused_attention`) as one parallel loop over blocks of query rows, each block's
// scores, weights, dropped weights and gradients made and consumed in the thread's cache.
//
// Forward, per (batch x head, block of rows): S = Q K^T * scale (one GEMM), exp(S - max) in
// place (a vectorized exp), the dropout mask (`bits.h`), O = kept V (one GEMM, written
// straight into the (B, N, H, Dv) layout the head merge reads), each row of O then divided
// by (1 - p) and its sum of exps (Dv values, not M). What backward gets (`stats`): each
// row's logsumexp, as flash attention saves, from which it makes the weights again (one
// more GEMM and exp pass), or, where the caller asks (`keep_weights`; `kernels` asks in
// training with dropout, up to `_KEEP_WEIGHTS` weights), the (G, N, M) weights themselves,
// zeros on the keys a causal block skips. Backward, per block: the
// weights (kept, or again from Q K^T and the logsumexp), the mask again from the seed,
// dP = dO V^T, the scores' gradient (times the scale) in place, dQ = dS K, and
// dK^T += Q^T dS, dV^T += dO^T kept into thread-local sums added once per matrix under a
// lock. The dropout's 1 / (1 - p) goes into the kept weights and the scale into K^T, not
// into the GEMMs' alpha, for which oneDNN's micro-kernel would copy Q's and dO's blocks
// (docs/performance.md). The GEMMs are single-threaded BLAS calls (`blas.h`) inside
// at::parallel_for. Every GEMM reads its right operand as laid out
// (K^T and V^T made once per call; the sums transposed, so that the per-block operands Q
// and dO are the transposed ones): oneDNN's micro-kernel, which `blas.h` may call, takes no
// transposed operand, and copying one costs least where it is the block's few rows.
//
// Inputs float, double or bfloat16. Bfloat16 q, k, v and gradient go into the GEMMs as they
// are (MKL's bf16 GEMM, AMX where the CPU has it; where the float GEMMs are oneDNN's, AVX-512
// BF16's dot products, `bf16_gemm.h`, or widened to float without them);
// scores, softmax, logsumexp and dK, dV sums are float, and the weights and the scores'
// gradient are rounded to bfloat16 for the GEMMs that read them.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bits.h"
#include "blas.h"
#include "matrices.h"
#include "softmax_rows.h"
#include "vmath.h"

namespace {

using linformer_kit::Allowed;
using linformer_kit::gemm;
using linformer_kit::keep;
using linformer_kit::Matrices;
using linformer_kit::Opmath;
using linformer_kit::row_bits;
using linformer_kit::transposed;
using linformer_kit::transposed_scaled;
using linformer_kit::rows::as_input;
using linformer_kit::rows::exp_sum;
using linformer_kit::rows::gemm_into;
using linformer_kit::rows::mask_row;
using linformer_kit::rows::scores_grad;
using linformer_kit::rows::softmax_row;

// The call's shape and dropout: G = B x H matrices of N query rows and M keys, blocks of
// `rows` query rows; under `causal` a block computes only the keys its last row sees.
struct Plan {
  int64_t groups, seq_len, keys, rows, blocks, words_per_row;
  bool causal, dropout;
  uint64_t seed;
  int32_t threshold;

  // Block `task` of the parallel loop (blocks of each matrix in turn): its matrix g, its
  // first query row, its rows and the keys it computes.
  struct Block {
    int64_t g, first, rows, keys;
  };
  Block block(int64_t task) const {
    const int64_t first = (task % blocks) * rows, count = std::min(rows, seq_len - first);
    return {task / blocks, first, count, causal ? std::min(keys, first + count) : keys};
  }
  int64_t valid_keys(int64_t row, int64_t block_keys) const {
    return causal ? std::min(block_keys, row + 1) : block_keys;
  }
};

// The dropped weights of row `row` of matrix g (its first `keys`), times `factor`.
template <typename T>
void keep_row(const Plan& plan, int64_t g, int64_t row, int64_t keys, const T* weights, T* kept,
              T factor, std::vector<uint64_t>& words) {
  const int16_t* bits =
      row_bits(plan.seed, g * plan.seq_len + row, plan.words_per_row, keys, words);
  keep(bits, plan.threshold, weights, kept, keys, factor);
}

// The GEMMs read each (rows, cols) matrix with leading dimension stride(2), which a BLAS
// raises to at least cols: an expanded row (stride 0) would be read past its end.
void check_matrices(const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.scalar_type() == q.scalar_type() &&
                  (t.numel() == 0 || ((t.stride(3) == 1 || t.size(3) <= 1) &&
                                      (t.stride(2) >= t.size(3) || t.size(2) <= 1))),
              "fused attention: q, k, v and grad must be 4-D CPU tensors of one dtype with "
              "unit stride in the last dimension and rows at least a row apart; got ",
              t.sizes(), " strides ", t.strides(), " ", t.scalar_type());
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask) {
  for (const at::Tensor* t : {&q, &k, &v}) check_matrices(*t, q);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3) &&
                  v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "fused attention: q, k, v shapes ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(),
              " do not match (B, H, N, D), (B, H, M, D), (B, H, M, Dv)");
  TORCH_CHECK(!mask || (mask->scalar_type() == at::kBool &&
                        mask->sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2),
                                                          k.size(2)}) &&
                        (mask->stride(3) == 1 || k.size(2) <= 1)),
              "fused attention: the mask must be bool (B, H, N, M) with unit stride in the "
              "last dimension");
}

Plan plan_of(const at::Tensor& q, const at::Tensor& k, bool causal, const at::Tensor& seed,
             int64_t threshold, int64_t block_rows) {
  TORCH_CHECK(threshold >= -32768 && threshold <= 32768, "fused attention: threshold ",
              threshold, " outside [-32768, 32768]");
  TORCH_CHECK(block_rows >= 1, "fused attention: block_rows must be >= 1; got ", block_rows);
  const int64_t seq_len = q.size(2), keys = k.size(2);
  return Plan{q.size(0) * q.size(1), seq_len, keys, block_rows,
              (seq_len + block_rows - 1) / block_rows, (keys + 3) / 4, causal,
              threshold > -32768, linformer_kit::seed_value(seed), int32_t(threshold)};
}

// The block's scores Q K^T * scale into w, (rows, keys): the forward's, and backward's again
// (Kt and alpha: `transposed_scaled(k, scale)`).
template <typename S>
void block_scores(const Plan::Block& b, const Matrices<const S>& Q, const Matrices<const S>& Kt,
                  int64_t head_dim, Opmath<S> alpha, Opmath<S>* w) {
  gemm<S>(false, false, b.rows, b.keys, head_dim, alpha, Q.row(b.g, b.first), Q.ld,
          Kt.row(b.g, 0), Kt.ld, Opmath<S>(0), w, b.keys);
}

template <typename S>
void forward_blocks(const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const std::optional<at::Tensor>& mask,
                    Opmath<S> scale, Opmath<S> factor, at::Tensor& out, at::Tensor& stats) {
  using T = Opmath<S>;
  const std::pair<at::Tensor, T> k_t = transposed_scaled<S>(k, scale);
  const Matrices<const S> Q(q), Kt(k_t.first), V(v);
  const T alpha = k_t.second;
  const Matrices<S> O(out);
  const Allowed allowed(mask);
  // each row's logsumexp (G, N), or its weights (G, N, M)
  const bool keep_weights = stats.dim() == 3;
  T* lse = keep_weights ? nullptr : stats.data_ptr<T>();
  T* saved = keep_weights ? stats.data_ptr<T>() : nullptr;
  const int64_t head_dim = q.size(3), value_dim = v.size(3), M = plan.keys;
  at::parallel_for(0, plan.groups * plan.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> weights(plan.rows * M), kept(plan.dropout ? plan.rows * M : 0);
    std::vector<T> row_scales(plan.rows);  // factor / each row's sum of weights
    std::vector<T> out_rows;  // bfloat16: the block's output before rounding
    std::vector<S> rounded;   // bfloat16: the weights the output GEMM reads
    std::vector<uint64_t> words;
    for (int64_t task = begin; task < end; ++task) {
      const Plan::Block b = plan.block(task);
      const auto [g, first, rows, keys] = b;
      T* w = weights.data();  // (rows, keys)
      block_scores(b, Q, Kt, head_dim, alpha, w);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = first + i, valid = plan.valid_keys(row, keys);
        mask_row(w + i * keys, valid, keys, allowed.row(g, row));
        const T top = softmax_row(w + i * keys, valid, &row_scales[i]);
        if (keep_weights) {  // the row's weights, zeros on the keys a causal block skips
          T* to = saved + (g * plan.seq_len + row) * M;
          const T* from = w + i * keys;
          const T inverse = row_scales[i];
#pragma omp simd
          for (int64_t c = 0; c < keys; ++c) to[c] = from[c] * inverse;
          std::fill(to + keys, to + M, T(0));
        } else {
          lse[g * plan.seq_len + row] = top;
        }
        row_scales[i] *= factor;
        if (plan.dropout) {
          keep_row(plan, g, row, keys, w + i * keys, kept.data() + i * keys, T(1), words);
        }
      }
      // the exps (dropped) times V, each row then scaled: with the dropout's 1 / (1 - p) as
      // the GEMM's alpha, oneDNN's micro-kernel copied the block of weights (the forward
      // with dropout 0.1 ran 1.03-1.06x faster without, n 4096, alternating processes)
      const S* p = as_input(plan.dropout ? kept.data() : w, rows * keys, rounded);
      gemm_into<S>(rows, value_dim, keys, p, keys, V.row(g, 0), V.ld, O.row(g, first), O.ld,
                   row_scales.data(), out_rows);
    }
  });
}

// dK and dV (grad_k, grad_v) are sums of the compute type, rounded to S by the caller.
// Each thread sums dK^T and dV^T of its current matrix ((D, M), (Dv, M)) and adds them
// into dK and dV when it moves to the next.
template <typename S>
void backward_blocks(const Plan& plan, const at::Tensor& grad, const at::Tensor& q,
                     const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, const at::Tensor& stats,
                     Opmath<S> scale, Opmath<S> factor, at::Tensor& grad_q, at::Tensor& grad_k,
                     at::Tensor& grad_v) {
  using T = Opmath<S>;
  const bool need_q = grad_q.defined(), need_k = grad_k.defined(), need_v = grad_v.defined();
  const std::pair<at::Tensor, T> k_t = transposed_scaled<S>(k, scale);
  const at::Tensor v_t = need_q || need_k ? transposed(v) : at::Tensor();
  const Matrices<const S> dO(grad), Q(q), K(k), Kt(k_t.first), Vt(v_t);
  const T alpha = k_t.second;
  // The rescaling dP's and dV's GEMMs apply: `kept` carries it where there is dropout.
  const T rescale = plan.dropout ? T(1) : factor;
  const Matrices<S> dQ(grad_q);
  const Matrices<T> dK(grad_k), dV(grad_v);
  const Allowed allowed(mask);
  const bool kept_weights = stats.dim() == 3;  // the forward's weights, else logsumexps
  const T* lse = kept_weights ? nullptr : stats.data_ptr<T>();
  const T* saved = kept_weights ? stats.data_ptr<T>() : nullptr;
  const int64_t head_dim = q.size(3), value_dim = v.size(3), M = plan.keys;
  std::unique_ptr<std::mutex[]> locks(new std::mutex[plan.groups]);
  at::parallel_for(0, plan.groups * plan.blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> weights(plan.rows * M), grad_scores(plan.rows * M);
    std::vector<T> kept(plan.dropout ? plan.rows * M : 0);
    std::vector<T> sum_k(head_dim * M), sum_v(value_dim * M);  // this thread's dK^T, dV^T
    std::vector<T> grad_rows;                  // bfloat16: dQ's block before rounding
    std::vector<S> rounded_ds, rounded_kept;  // bfloat16: the GEMMs' inputs
    std::vector<uint64_t> words;
    int64_t summed = -1, summed_keys = 0;  // the matrix the sums belong to, keys touched
    auto add_sums = [&] {  // into dK, dV of matrix `summed`, which other threads may share
      if (summed < 0) return;
      std::lock_guard<std::mutex> lock(locks[summed]);
      for (int64_t m = 0; m < summed_keys; ++m) {
        T* gk = need_k ? dK.row(summed, m) : nullptr;
        T* gv = need_v ? dV.row(summed, m) : nullptr;
        for (int64_t c = 0; gk && c < head_dim; ++c) gk[c] += sum_k[c * M + m];
        for (int64_t c = 0; gv && c < value_dim; ++c) gv[c] += sum_v[c * M + m];
      }
      std::fill(sum_k.begin(), sum_k.end(), T(0));
      std::fill(sum_v.begin(), sum_v.end(), T(0));
    };
    for (int64_t task = begin; task < end; ++task) {
      const Plan::Block b = plan.block(task);
      const auto [g, first, rows, keys] = b;
      if (g != summed) {
        add_sums();
        summed = g;
        summed_keys = 0;
      }
      summed_keys = std::max(summed_keys, keys);
      // w: (rows, keys), the forward's weights: the kept ones in place where a block's rows
      // are whole rows of them, else copied; or made again (scores here, exps below)
      const T* w = weights.data();
      T* ds = grad_scores.data();
      if (kept_weights) {
        const T* from = saved + (g * plan.seq_len + first) * M;
        if (keys == M) {
          w = from;
        } else {
          for (int64_t i = 0; i < rows; ++i) {
            std::copy_n(from + i * M, keys, weights.data() + i * keys);
          }
        }
      } else {
        block_scores(b, Q, Kt, head_dim, alpha, weights.data());
      }
      if (need_q || need_k) {  // dP = dO V^T, times `rescale`
        gemm<S>(false, false, rows, keys, value_dim, rescale, dO.row(g, first), dO.ld,
                Vt.row(g, 0), Vt.ld, T(0), ds, keys);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = first + i, valid = plan.valid_keys(row, keys);
        if (!kept_weights) {
          T* made = weights.data() + i * keys;
          mask_row(made, valid, keys, allowed.row(g, row));
          exp_sum(made, valid, lse[g * plan.seq_len + row]);
        }
        const T* wi = w + i * keys;
        const T* ki = plan.dropout ? kept.data() + i * keys : wi;
        if (plan.dropout) keep_row(plan, g, row, keys, wi, kept.data() + i * keys, factor, words);
        if (need_q || need_k) scores_grad(wi, ki, ds + i * keys, keys, scale);
      }
      const S* ds_in = need_q || need_k ? as_input(ds, rows * keys, rounded_ds) : nullptr;
      if (need_q) {
        gemm_into<S>(rows, head_dim, keys, ds_in, keys, K.row(g, 0), K.ld, dQ.row(g, first),
                     dQ.ld, nullptr, grad_rows);
      }
      if (need_k) {  // dK^T += Q^T dS
        gemm<S>(true, false, head_dim, keys, rows, T(1), Q.row(g, first), Q.ld, ds_in, keys,
                T(1), sum_k.data(), M);
      }
      if (need_v) {  // dV^T += dO^T kept / (1 - p)
        const S* p = as_input(plan.dropout ? kept.data() : w, rows * keys, rounded_kept);
        gemm<S>(true, false, value_dim, keys, rows, rescale, dO.row(g, first), dO.ld, p, keys,
                T(1), sum_v.data(), M);
      }
    }
    add_sums();
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, bool causal, double scale, const at::Tensor& seed,
    int64_t threshold, double factor, int64_t block_rows, bool keep_weights) {
  check_inputs(q, k, v, mask);
  const Plan plan = plan_of(q, k, causal, seed, threshold, block_rows);
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options())
                       .transpose(1, 2);  // (B, H, N, Dv) over (B, N, H, Dv) memory
  std::vector<int64_t> stats_shape = {plan.groups, plan.seq_len};
  if (keep_weights) stats_shape.push_back(plan.keys);
  at::Tensor stats =
      at::empty(stats_shape, q.options().dtype(at::toOpMathType(q.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_forward", [&] {
    using T = Opmath<scalar_t>;
    forward_blocks<scalar_t>(plan, q, k, v, mask, T(scale), T(factor), out, stats);
  });
  return {out, stats};
}

using Grad = std::optional<at::Tensor>;  // None where not asked for

std::tuple<Grad, Grad, Grad> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, const at::Tensor& stats, bool causal,
    double scale, const at::Tensor& seed, int64_t threshold, double factor, int64_t block_rows,
    std::array<bool, 3> needs) {
  check_inputs(q, k, v, mask);
  check_matrices(grad, q);
  const Plan plan = plan_of(q, k, causal, seed, threshold, block_rows);
  const at::ScalarType opmath = at::toOpMathType(q.scalar_type());
  const bool shaped = stats.sizes() == at::IntArrayRef({plan.groups, plan.seq_len}) ||
                      stats.sizes() == at::IntArrayRef({plan.groups, plan.seq_len, plan.keys});
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}) &&
                  stats.is_contiguous() && stats.scalar_type() == opmath && shaped,
              "fused attention: grad ", grad.sizes(), " or the forward's stats ", stats.sizes(),
              " (logsumexps (B x H, N) or weights (B x H, N, M)) do not match the inputs");
  at::Tensor grad_q = needs[0] ? at::empty_like(q) : at::Tensor();  // undefined: None
  at::Tensor grad_k = needs[1] ? at::zeros_like(k, k.options().dtype(opmath)) : at::Tensor();
  at::Tensor grad_v = needs[2] ? at::zeros_like(v, v.options().dtype(opmath)) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_backward", [&] {
    using T = Opmath<scalar_t>;
    backward_blocks<scalar_t>(plan, grad, q, k, v, mask, stats, T(scale), T(factor), grad_q,
                              grad_k, grad_v);
  });
  auto asked = [&](const at::Tensor& t) {  // the sums rounded to the inputs' dtype
    return t.defined() ? Grad(t.to(q.scalar_type())) : std::nullopt;
  };
  return {asked(grad_q), asked(grad_k), asked(grad_v)};
}

TORCH_LIBRARY_FRAGMENT(linformer_kit, m) {
  // The second output, `stats`: each row's logsumexp (B x H, N), or with keep_weights the
  // weights (B x H, N, M); attention_backward takes either.
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, "
        "float scale, Tensor seed, int threshold, float factor, int block_rows, "
        "bool keep_weights=False) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, "
        "Tensor stats, bool causal, float scale, Tensor seed, int threshold, float factor, "
        "int block_rows, bool[3] needs) -> (Tensor?, Tensor?, Tensor?)");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}
