// The ops' backward formulas as C++ autograd kernels (the Autograd dispatch key), so that a
// training call does not go through Python. torch.library's Python autograd, used before,
// made a tiny call's forward + backward take 142-154 us against 74-91 us through these
// (attention; dropout 95-104 against 50-63 us): about 65 us per attention layer and step,
// some 0.5 % of one at n = 1024. Each kernel calls its op again below autograd, saves what
// backward needs and, in backward, calls the backward op through the dispatcher, so
// torch.compile (fake kernels, `python_side.register`) traces the same nodes.
//
// dropout_forward: backward is the same mask from the seed, times the same scale (the op
// itself, so it is differentiable again). attention_forward and feedforward_forward: backward
// is attention_backward / feedforward_backward, whose own autograd kernels (Python, `native`)
// refuse a double backward with a clear error.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Grad = std::optional<at::Tensor>;

at::Tensor call_dropout(const at::Tensor& x, const at::Tensor& seed, int64_t threshold,
                        double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("linformer_kit::dropout_forward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                               double)>();
  return op.call(x, seed, threshold, scale);
}

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& seed,
                            int64_t threshold, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({seed});
    ctx->saved_data["threshold"] = threshold;
    ctx->saved_data["scale"] = scale;
    return call_dropout(x, seed, threshold, scale);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor seed = ctx->get_saved_variables()[0];
    const at::Tensor grad = call_dropout(grads[0].contiguous(), seed,
                                         ctx->saved_data["threshold"].toInt(),
                                         ctx->saved_data["scale"].toDouble());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dropout_autograd(const at::Tensor& x, const at::Tensor& seed, int64_t threshold,
                            double scale) {
  return DropoutFunction::apply(x, seed, threshold, scale);
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& mask,
                               bool causal, double scale, const at::Tensor& seed,
                               int64_t threshold, double factor, int64_t block_rows,
                               bool keep_weights) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("linformer_kit::attention_forward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const std::optional<at::Tensor>&, bool, double, const at::Tensor&, int64_t,
                double, int64_t, bool)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, stats] = op.call(q, k, v, mask, causal, scale, seed, threshold, factor,
                                block_rows, keep_weights);
    ctx->save_for_backward({q, k, v, mask.value_or(at::Tensor()), seed, stats});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["threshold"] = threshold;
    ctx->saved_data["factor"] = factor;
    ctx->saved_data["block_rows"] = block_rows;
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);  // no zeros made for the stats' gradient
    return {out, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("linformer_kit::attention_backward", "")
            .typed<std::tuple<Grad, Grad, Grad>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const std::optional<at::Tensor>&, const at::Tensor&, bool, double,
                const at::Tensor&, int64_t, double, int64_t, std::array<bool, 3>)>();
    if (!grads[0].defined()) return variable_list(11);  // (grads not materialized: none)
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& mask = saved[3];
    // Read in place with unit stride and rows at least a row apart (`check_matrices`): the
    // gradient of a sum over the query axis is expanded, row stride 0. (sym_stride: under
    // torch.compile a plain stride() would fix every size of a dynamic shape, one
    // recompile per sequence length.)
    const at::Tensor& given = grads[0];
    const bool in_place = given.sym_stride(-1) == 1 &&
                          (given.sym_size(-2) <= 1 || given.sym_stride(-2) >= given.sym_size(-1));
    at::Tensor grad = in_place ? given : given.contiguous();
    const std::array<bool, 3> needs = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                       ctx->needs_input_grad(2)};
    auto [grad_q, grad_k, grad_v] = op.call(
        grad, saved[0], saved[1], saved[2],
        mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, saved[5],
        ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(), saved[4],
        ctx->saved_data["threshold"].toInt(), ctx->saved_data["factor"].toDouble(),
        ctx->saved_data["block_rows"].toInt(), needs);
    const at::Tensor none;
    return {grad_q.value_or(none), grad_k.value_or(none), grad_v.value_or(none),
            none, none, none, none, none, none, none, none};  // mask and the non-tensors
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, bool causal, double scale, const at::Tensor& seed,
    int64_t threshold, double factor, int64_t block_rows, bool keep_weights) {
  const variable_list outputs = AttentionFunction::apply(q, k, v, mask, causal, scale, seed,
                                                         threshold, factor, block_rows,
                                                         keep_weights);
  return {outputs[0], outputs[1]};
}

std::tuple<at::Tensor, at::Tensor> call_feedforward(const at::Tensor& x, const at::Tensor& w1,
                                                    const at::Tensor& b1, const at::Tensor& w2,
                                                    const at::Tensor& b2, int64_t activation,
                                                    bool keep_hidden) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("linformer_kit::feedforward_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, int64_t, bool)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(x, w1, b1, w2, b2, activation, keep_hidden);
}

class FeedForwardFunction : public torch::autograd::Function<FeedForwardFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                               int64_t activation) {
    auto [out, hidden] = call_feedforward(x, w1, b1, w2, b2, activation, true);
    ctx->save_for_backward({x, w1, w2, hidden});
    ctx->saved_data["activation"] = activation;
    ctx->mark_non_differentiable({hidden});
    ctx->set_materialize_grads(false);  // no zeros made for the (rows, hidden) one's gradient
    return {out, hidden};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("linformer_kit::feedforward_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                const at::Tensor&, int64_t, std::array<bool, 2>, int64_t)>();
    if (!grads[0].defined()) return variable_list(6);  // (grads not materialized: none)
    const variable_list saved = ctx->get_saved_variables();
    const bool weights = ctx->needs_input_grad(1) || ctx->needs_input_grad(2) ||
                         ctx->needs_input_grad(3) || ctx->needs_input_grad(4);
    const bool input = ctx->needs_input_grad(0);
    auto [grad_x, grad_w1, grad_b1, grad_w2, grad_b2] =
        op.call(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3],
                ctx->saved_data["activation"].toInt(), {input, weights}, -1);
    const at::Tensor none;  // (the op's empty placeholders for the gradients not asked for)
    return {input ? grad_x : none, weights ? grad_w1 : none, weights ? grad_b1 : none,
            weights ? grad_w2 : none, weights ? grad_b2 : none, none};
  }
};

// Records a backward (keeping the hidden activations for it, whatever `keep_hidden` says)
// where grad mode is on and an input needs its gradient; else the plain kernel.
std::tuple<at::Tensor, at::Tensor> feedforward_autograd(
    const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
    const at::Tensor& b2, int64_t activation, bool keep_hidden) {
  const bool record = at::GradMode::is_enabled() &&
                      (x.requires_grad() || w1.requires_grad() || b1.requires_grad() ||
                       w2.requires_grad() || b2.requires_grad());
  if (!record) return call_feedforward(x, w1, b1, w2, b2, activation, keep_hidden);
  const variable_list outputs = FeedForwardFunction::apply(x, w1, b1, w2, b2, activation);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(linformer_kit, Autograd, m) {
  m.impl("dropout_forward", &dropout_autograd);
  m.impl("attention_forward", &attention_autograd);
  m.impl("feedforward_forward", &feedforward_autograd);
}
