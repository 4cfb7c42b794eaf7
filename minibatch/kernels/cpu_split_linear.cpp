// A linear layer on a CPU with its output features split across threads: out = x w^T (+ bias), each thread running
// ATen's matrix product (MKL's GEMM or GEMV) on its own slice of w's rows and writing its own columns of out.
//
// Tensor parallelism's column-parallel linear (Megatron-LM, Shoeybi et al. 2019, section 3: A split along its
// output columns, each worker computing its own part of the output), across the cores of one CPU. Why: for the few
// rows of a decode step, MKL's float32 product runs on one core (a GEMV at one row) or splits its work poorly,
// while each core reading half of the weight streams it from memory at about twice the rate. The result is not
// always bit-identical to the whole product's (MKL picks its code path by shape and thread count: on a 2-core AMD
// EPYC, 2 threads and 5 rows differ in the last bit), so minibatch/runner/prepack.py compares the two on the first
// call of each shape, row count and thread count, and uses this only where they matched. Built on first use by
// minibatch/kernels/cpp_build.py.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

// x: (m, k), w: (n, k), bias: (n,) or none, all on the CPU in one dtype; returns (m, n). One slice per thread
// (torch's thread count), each at least `min_cols` columns.
torch::Tensor split_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t min_cols) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "split_linear: x must be (m, k), w (n, k)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device().is_cpu() && w.device().is_cpu(),
              "split_linear: x and w must be CPU tensors of one dtype");
  const int64_t n = w.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "split_linear: bias must be (n,)");
  // the threads run no autograd and share the caller's inference mode (thread-local state that the pool does not
  // carry over: an inference-mode `out` written outside it is refused)
  x = x.detach();
  w = w.detach();
  if (bias.has_value()) bias = bias->detach();
  const bool inference = c10::InferenceMode::is_enabled();
  auto out = torch::empty({x.size(0), n}, x.options());
  const int64_t slices =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, min_cols)));
  const int64_t width = (n + slices - 1) / slices;
  at::parallel_for(0, slices, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode mode(inference);
    at::NoGradGuard no_grad;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t lo = s * width, len = std::min(n, lo + width) - lo;
      if (len <= 0) continue;
      auto cols = out.narrow(1, lo, len);
      auto rows = w.narrow(0, lo, len).t();
      if (bias.has_value())
        at::addmm_out(cols, bias->narrow(0, lo, len), x, rows);
      else
        at::mm_out(cols, x, rows);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_linear", &split_linear, "a linear layer with its output features split across threads");
}
