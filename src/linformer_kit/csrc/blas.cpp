// The switch between the float GEMMs' two libraries (blas.h): `float_gemm("onednn")` sends
// the attention and feed-forward kernels' float GEMMs to oneDNN's brgemm micro-kernel,
// `float_gemm("blas")` back to `sgemm_`; `float_gemm()` only reads it. Set from Python
// (`native.set_kernel_gemm`), process-wide.
#include <torch/library.h>

#include <optional>
#include <string>

#include "blas.h"

namespace {

std::string float_gemm(const std::optional<std::string>& backend) {
  if (backend) {
    TORCH_CHECK(*backend == "blas" || *backend == "onednn",
                "float_gemm: backend must be 'blas' or 'onednn'; got '", *backend, "'");
    linformer_kit::onednn_float_gemm().store(*backend == "onednn");
  }
  return linformer_kit::onednn_float_gemm().load() ? "onednn" : "blas";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linformer_kit, m) {
  m.def("float_gemm(str? backend=None) -> str", &float_gemm);
}
