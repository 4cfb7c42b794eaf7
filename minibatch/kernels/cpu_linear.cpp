// A float32 linear layer on a CPU: out = x w^T (+ bias), with w laid out once, at load, in panels of 16 output
// features, and a register-tiled micro-kernel.
//
// The layout and loop nest of GotoBLAS / BLIS (Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", ACM TOMS 2008, sections 4-6: pack the operand that is reused into contiguous panels, then compute
// one small block of the output in registers). Here the reused operand is the weight: a decode step multiplies a few
// rows by every weight once, so the weight is packed once per model, not per call. Panel j holds output features
// [16 j, 16 j + 16) as (k, 16): for each input feature, the 16 features' weights side by side (zeros past n). The
// micro-kernel keeps a block of the output in registers (AVX2: 6 rows x 16 features in twelve 8-lane registers;
// AVX-512: 12 x 16 in twelve 16-lane ones) and, for each input feature, loads the panel's 16 weights once and
// multiplies them by each row's input (fused multiply-adds). Threads share the panels
// (ATen's thread pool, torch's thread count); each panel is read from memory once per call, whatever the rows.
//
// Numbers: every output is bias + (x[i, 0] w[j, 0] + x[i, 1] w[j, 1] + ...) summed in that order with fused
// multiply-adds in float32, the same for any row count, thread count or instruction set (an FMA rounds once,
// in hardware or in std::fma): a row's output does not depend on the other rows of its batch. It is not
// bit-identical to torch.nn.functional.linear (MKL sums in another order); both are float32 sums of the same
// products. Built on first use by minibatch/kernels/cpp_build.py.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// MINIBATCH_PORTABLE (a -D flag): the plain C++ lanes even where AVX2 is available (tests compare the two builds)
#if defined(__AVX512F__) && !defined(MINIBATCH_PORTABLE)
#define MINIBATCH_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(MINIBATCH_PORTABLE)
#define MINIBATCH_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 16;  // output features per panel: one 16-lane vector or two 8-lane ones

#if defined(MINIBATCH_AVX512)
constexpr int ROWS = 12;  // rows per micro-kernel call: 12 accumulators + 1 weight of 32 registers
struct Vec {  // 16 float32 lanes in one AVX-512 register
  static constexpr int W = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#elif defined(MINIBATCH_AVX2)
constexpr int ROWS = 6;  // rows per micro-kernel call: 12 accumulators + 2 weights + 1 input in 16 registers
struct Vec {  // 8 float32 lanes in one AVX register
  static constexpr int W = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
#else
constexpr int ROWS = 6;
struct Vec {  // the same operations lane by lane (std::fma: one rounding, so the same numbers), for other CPUs
  static constexpr int W = 8;
  float v[8];
  static Vec zero() { return {}; }
  static Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  static Vec broadcast(const float* p) { Vec r; for (float& x : r.v) x = *p; return r; }
  static Vec fmadd(Vec a, Vec b, Vec c) { for (int l = 0; l < 8; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return c; }
  static Vec add(Vec a, Vec b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
};
#endif

// out[r, c] = bias[c] + sum over d < k of x[r, d] panel[d, c], for r < R rows (x's rows `ldx` apart, out's `ldo`) and
// c < cols (<= PANEL) output features. The accumulators stay in registers across the whole k loop (the unroll
// pragmas make the compiler keep each one in its own register instead of in an array in memory). `next`: the panel
// to ask memory for meanwhile, one cache line (16 floats) per input feature, or null.
template <int R>
inline void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias, float* out,
                         int64_t ldo, int64_t cols, const float* next) {
  constexpr int V = PANEL / Vec::W;  // vectors per panel row
  Vec acc[R][V];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) acc[r][v] = Vec::zero();
  }
  for (int64_t d = 0; d < k; ++d) {
#if defined(__GNUC__) || defined(__clang__)
    if (next != nullptr) __builtin_prefetch(next + d * PANEL);
#endif
    Vec w[V];
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) w[v] = Vec::load(panel + d * PANEL + v * Vec::W);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
      const Vec a = Vec::broadcast(x + r * ldx + d);
      _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) acc[r][v] = Vec::fmadd(a, w[v], acc[r][v]);
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) {
    float tmp[PANEL];
    float* dst = cols == PANEL ? out + r * ldo : tmp;  // tmp: the last panel of a layer whose n is not a multiple of 16
    _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) {
      if (bias != nullptr) acc[r][v] = Vec::add(acc[r][v], Vec::load(bias + v * Vec::W));
      acc[r][v].store(dst + v * Vec::W);
    }
    if (cols < PANEL) std::memcpy(out + r * ldo, tmp, cols * sizeof(float));
  }
}

template <int R>
void tail_rows(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias, float* out, int64_t ldo,
               int64_t cols, int64_t left, const float* next) {
  if constexpr (R > 0) {
    if (left == R)
      micro_kernel<R>(x, ldx, panel, k, bias, out, ldo, cols, next);
    else
      tail_rows<R - 1>(x, ldx, panel, k, bias, out, ldo, cols, left, next);
  }
}

}  // namespace

// w: (n, k) float32 -> its panels, (ceil(n / 16), k, 16) float32, zero past n.
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.device().is_cpu(),
              "pack_weight: w must be a (n, k) float32 CPU tensor");
  w = w.detach().contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + PANEL - 1) / PANEL;
  auto packed = torch::zeros({panels, k, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t c = 0; c < std::min(PANEL, n - j * PANEL); ++c)
        for (int64_t d = 0; d < k; ++d) dst[(j * k + d) * PANEL + c] = src[(j * PANEL + c) * k + d];
  });
  return packed;
}

// x: (..., k) float32; packed: pack_weight's (ceil(n / 16), k, 16); bias: (n,) or none. Returns (..., n) float32.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  // a named range for torch's profiler (free when it is off): the work runs on the pool's threads, which the
  // profiler does not see, so without it `python -m minibatch profile` would count it as Python overhead
  RECORD_FUNCTION("minibatch::packed_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "packed_linear: x must be a (..., k) float32 CPU tensor");
  const int64_t k = x.size(-1), panels = (n + PANEL - 1) / PANEL;
  int64_t m = 1;  // the rows: every size but the last (k may be 0: then each output is its bias, or 0)
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == k && packed.size(2) == PANEL &&
                  packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() && packed.device().is_cpu(),
              "packed_linear: packed must be pack_weight's (ceil(n / 16), k, 16) panels for x's k and this n");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kFloat32 &&
                                     bias->device().is_cpu()),
              "packed_linear: bias must be (n,) float32 on the CPU");
  x = x.detach().contiguous();
  torch::Tensor b = bias.has_value() ? bias->detach().contiguous() : torch::Tensor();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  auto out = torch::empty(out_shape, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* panel = pp + j * k * PANEL;
      const int64_t cols = std::min(PANEL, n - j * PANEL);
      float tail_bias[PANEL] = {};  // the last panel's bias, zero past n (the kernel reads 16)
      const float* pb = bp == nullptr ? nullptr : bp + j * PANEL;
      if (pb != nullptr && cols < PANEL) pb = static_cast<const float*>(std::memcpy(tail_bias, pb, cols * sizeof(float)));
      // the thread's next panel comes from memory while the first rows' pass runs over this one (later passes
      // read this panel from the cache)
      const float* next = j + 1 < end ? panel + k * PANEL : nullptr;
      int64_t i = 0;
      for (; i + ROWS <= m; i += ROWS, next = nullptr)
        micro_kernel<ROWS>(xp + i * k, k, panel, k, pb, op + i * n + j * PANEL, n, cols, next);
      if (i < m) tail_rows<ROWS - 1>(xp + i * k, k, panel, k, pb, op + i * n + j * PANEL, n, cols, m - i, next);
    }
  });
  return out;
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // built into the fused decode layer's extension: no module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a (n, k) float32 weight as panels of 16 output features");
  m.def("packed_linear", &packed_linear, "x w^T (+ bias) with w packed by pack_weight");
}
#endif
