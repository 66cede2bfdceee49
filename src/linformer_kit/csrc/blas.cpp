// The switch between the float GEMMs' two libraries (blas.h): `float_gemm("onednn")` sends
// the kernels' float GEMMs (attention.cpp, feedforward.cpp, `matmul`) to oneDNN's brgemm
// micro-kernel, `float_gemm("blas")` back to `sgemm_`; `float_gemm()` only reads. Set from
// Python (`native.set_kernel_gemm`), process-wide; `split_reduction`, whether the threaded
// ones may split their reduction. And `matmul` / `matmul_add_`, a batched product on those
// GEMMs (`linear_backend.matmul`, `add_matmul_`: the sequence projection and the language
// models' loss where they are oneDNN's).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "blas.h"

namespace {

std::string float_gemm(const std::optional<std::string>& backend) {
  auto& on = linformer_kit::onednn_float_gemm();
  if (backend) {
    TORCH_CHECK(*backend == "blas" || *backend == "onednn",
                "float_gemm: backend must be 'blas' or 'onednn'; got '", *backend, "'");
    // (a libtorch without the float brgemm keeps the BLAS, and says so)
    on.store(*backend == "onednn" && linformer_kit::kFloatBrgemm);
  }
  return on.load() ? "onednn" : "blas";
}

// A matrix (the last two dims of t) as gemm reads it: transposed where its columns, not
// its rows, have unit stride (a transposed view), with the other stride as the row stride.
struct Operand {
  at::Tensor t;
  bool trans;
  int64_t ld;
};

// `operand` laid out untransposed once (`packed`) where every batch entry shares it (batch
// stride 0, as the shared sequence projection's E^T) and the GEMMs would otherwise copy it
// per entry (float on oneDNN's micro-kernel): E^T X at batch 8, n 4096, k 256, width 256,
// min 12.0 / 10.9 -> 10.6 / 10.1 ms (alternating processes). `copy` holds the layout.
template <typename T>
const T* shared_plain(Operand& x, int64_t batch, std::vector<float>& copy) {
  const T* data = x.t.template data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (x.trans && batch > 1 && x.t.stride(0) == 0 && linformer_kit::plain_operands<float>()) {
      const int64_t rows = x.t.size(1), cols = x.t.size(2);
      data = linformer_kit::packed(true, rows, cols, 1.0f, data, x.ld, copy);
      x.trans = false, x.ld = linformer_kit::copy_stride(cols);
    }
  }
  return data;
}

Operand operand(const at::Tensor& t) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  if (t.stride(-1) == 1 && t.stride(-2) >= std::max<int64_t>(cols, 1)) {
    return {t, false, t.stride(-2)};
  }
  if (t.stride(-2) == 1 && t.stride(-1) >= std::max<int64_t>(rows, 1)) {
    return {t, true, t.stride(-1)};
  }
  return {t.contiguous(), false, std::max<int64_t>(cols, 1)};  // (rows of one: any stride)
}

void check_operands(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                  a.size(2) == b.size(1) && a.device().is_cpu() && b.device().is_cpu() &&
                  a.scalar_type() == b.scalar_type(),
              "matmul: a and b must be CPU tensors (B, M, K) and (B, K, N) of one dtype; got ",
              a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
}

// out (B, M, N) = a (B, M, K) @ b (B, K, N), or out += a @ b where `add`, float or double,
// either matrix of each pair read in place when one of its last two dims has unit stride
// (views, expanded batches with stride 0 included); one gemm per batch entry, each
// threaded (blas.h). The operands checked by the caller; out's rows of unit stride.
void product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, bool add) {
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  Operand left = operand(a), right = operand(b);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "matmul", [&] {
    using T = scalar_t;
    std::vector<float> left_copy, right_copy;
    const T* left_data = shared_plain<T>(left, batch, left_copy);
    const T* right_data = shared_plain<T>(right, batch, right_copy);
    for (int64_t i = 0; i < batch; ++i) {
      linformer_kit::gemm<T>(left.trans, right.trans, m, n, k, T(1),
                             left_data + i * left.t.stride(0), left.ld,
                             right_data + i * right.t.stride(0), right.ld, T(add ? 1 : 0),
                             out.data_ptr<T>() + i * out.stride(0), out.stride(1));
    }
  });
}

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  check_operands(a, b);
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  product(a, b, out, false);
  return out;
}

void matmul_add_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  check_operands(a, b);
  const int64_t n = b.size(2);
  TORCH_CHECK(out.sizes() == at::IntArrayRef({a.size(0), a.size(1), n}) &&
                  out.device().is_cpu() && out.scalar_type() == a.scalar_type() &&
                  out.stride(2) == 1 && out.stride(1) >= n,
              "matmul_add_: out must be ", a.scalar_type(), " (", a.size(0), ", ", a.size(1),
              ", ", n, ") on the CPU with unit stride in its rows; got ", out.sizes(), " ",
              out.scalar_type(), " strides ", out.strides());
  product(a, b, out, true);
}

// Whether threaded float products on oneDNN's micro-kernel may split their reduction
// between the threads (blas.h `split_reduction`; on by default); sets it first if given.
// Process-wide, for A/B timings (`benchmarks/gemm_split.py`) and tests.
bool split_reduction(std::optional<bool> enabled) {
  if (enabled) linformer_kit::split_reduction_on().store(*enabled);
  return linformer_kit::split_reduction_on().load();
}

// `bf16_dot_products()` for Python: where the feed-forward kernel's bf16 form can run
// (`native.bf16_feedforward`, with the float GEMMs on oneDNN).
bool bf16_dot() { return linformer_kit::bf16_dot_products(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(linformer_kit, m) {
  m.def("float_gemm(str? backend=None) -> str", &float_gemm);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("split_reduction(bool? enabled=None) -> bool", &split_reduction);
  m.def("matmul(Tensor a, Tensor b) -> Tensor");
  m.def("matmul_add_(Tensor(a!) out, Tensor a, Tensor b) -> ()");
}

TORCH_LIBRARY_IMPL(linformer_kit, CPU, m) {
  m.impl("matmul", &matmul);
  m.impl("matmul_add_", &matmul_add_);
}
