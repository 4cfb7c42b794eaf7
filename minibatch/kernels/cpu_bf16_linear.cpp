// A bf16 linear layer for the few rows of a decode step with AVX512-BF16 (VDPBF16PS), on CPUs without AMX, reading
// the weight oneDNN prepacked (runner/prepack.py) where it lies: no second copy.
//
// Why: at 1-64 rows a product is a pass over its weight, memory-bound at a few rows and near the compute roof at 32.
// oneDNN's matmul spends 20-30 microseconds per call before it starts and streams a cold weight at well under the
// memory's speed; SmolLM2-135M's decode step calls it 120 times. This kernel starts in a few microseconds and walks
// the weight once, front to back, with software prefetches of the next output block spread over the current one's
// passes (benchmarks/bf16_linear.py, data/cpu/bf16_linear.json).
//
// The layout. On AVX512-BF16 without AMX, _reorder_linear_weight(w, batch_size_hint >= 16) gives oneDNN's
// AB16b64a2b: w (n, k) zero-padded to a multiple of 64 output features and of 32 input features; for each block of
// 64 output features, the pairs of input features in order, each pair as 64 features x 2 (VNNI: the pair side by
// side), 256 bytes = four 512-bit vectors of 16 features. bf16_layout_ok checks exactly that, byte for byte, before
// a layer uses this kernel. A product is, for each output block and each group of up to 6 rows (groups of equal
// size, give or take one), the rows' input pairs broadcast against the block's four vectors into 6 x 4 float32
// accumulators (VDPBF16PS: per lane, the odd product then the even one added, each rounded), the pairs in order over
// all of k; then the bias in float32 and round-to-nearest-even to bf16. Every row is computed alike, whatever the
// other rows (batch invariance). oneDNN sums k in blocks (of 512 or 1024 input features on the shapes tried, by its
// own heuristics) and adds the blocks' sums: on ~1e-4 of the outputs the two differ in the last bf16 bit, so the
// engine runs this kernel only inside its own steps (runner.prepack.engine_linears; the modules' outputs elsewhere
// stay oneDNN's, bit for bit F.linear's).
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", VDPBF16PS. Built with
// -march=native: on a CPU without AVX512-BF16 the functions report unavailable (bf16_layout_ok is false) and the
// callers keep oneDNN.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MINIBATCH_DPBF16 1
#include <immintrin.h>
#endif

namespace at::native {  // an opaque oneDNN tensor's buffer and its size (libtorch_cpu exports both)
void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t OUT_BLOCK = 64;  // output features per block
constexpr int64_t IN_ALIGN = 32;   // input features are zero-padded to a multiple of this
constexpr int ROWS = 6;            // rows per pass: 6 x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 registers
// the accumulators stay in registers only if the loops over rows and vectors are unrolled completely: GCC gave up on
// its own once the pass had a prefetch (half the speed); clang reads the same pragma
#define MINIBATCH_UNROLL _Pragma("GCC unroll 8")

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// The packed weight's buffer if it is a bf16 oneDNN tensor of exactly an n x k weight's padded blocks, else null.
const uint16_t* blocks_of(const torch::Tensor& packed, int64_t n, int64_t k) {
  if (!packed.is_mkldnn() || packed.scalar_type() != torch::kBFloat16 || packed.dim() != 2 ||
      packed.size(0) != n || packed.size(1) != k ||  // its logical shape: another k can pad to the same size
      at::native::nbytes_from_mkldnn(packed) != round_up(n, OUT_BLOCK) * round_up(k, IN_ALIGN) * 2)
    return nullptr;
  return static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
}

#if defined(MINIBATCH_DPBF16)
// R rows (x: their inputs as bf16 pairs, row stride xs pairs) times V of one output block's four vectors of 16
// features, from vector c0 (w: the block's pairs (kp, 64, 2)), plus bias (the block's 64 features, float32), into out
// (row stride n) at the block's features from f0 (those below n). pf: the next block to prefetch into L2 (or null);
// this pass (g of passes) takes its share of that block's lines, so the prefetches are spread over the whole block's
// time rather than bunched into one pass.
template <int R, int V>
void block_rows(const uint32_t* x, int64_t xs, const uint16_t* w, int64_t kp, int c0, const float* bias,
                uint16_t* out, int64_t n, int64_t f0, const char* pf, int64_t g, int64_t passes) {
  __m512 acc[R][V];
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
  // pair p of pass g prefetches lines [(g kp + p) 4 / passes, (g kp + p + 1) 4 / passes): kept as a quotient and a
  // remainder, not divided at every pair (two 64-bit divisions per pair took a fifth of the pass's time)
  int64_t line = g * kp * 4 / passes, rest = g * kp * 4 % passes;
  for (int64_t p = 0; p < kp; ++p) {
    if (pf != nullptr)
      for (rest += 4; rest >= passes; rest -= passes, ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T1);
    const uint16_t* wp = w + p * 2 * OUT_BLOCK + c0 * 32;
    __m512bh wv[V];
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp + c * 32);
    MINIBATCH_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + p]));
      MINIBATCH_UNROLL for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
    }
  }
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) {
      const int64_t f = f0 + (c0 + c) * 16;
      if (f >= n) continue;
      const __m512 sum = _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + (c0 + c) * 16));
      alignas(32) uint16_t v[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(v), (__m256i)_mm512_cvtneps_pbh(sum));
      std::memcpy(out + r * n + f, v, std::min<int64_t>(16, n - f) * 2);
    }
}

// block_rows for a run-time rows (1..ROWS) and V (1..4).
template <int V>
void block_rows_v(int64_t rows, const uint32_t* x, int64_t xs, const uint16_t* w, int64_t kp, int c0,
                  const float* bias, uint16_t* out, int64_t n, int64_t f0, const char* pf, int64_t g, int64_t passes) {
  switch (rows) {
    case 6: return block_rows<6, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
    case 5: return block_rows<5, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
    case 4: return block_rows<4, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
    case 3: return block_rows<3, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
    case 2: return block_rows<2, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
    default: return block_rows<1, V>(x, xs, w, kp, c0, bias, out, n, f0, pf, g, passes);
  }
}
#endif

}  // namespace

// Whether `packed` (from mkldnn::_reorder_linear_weight) holds `weight` ((n, k) bf16) as AB16b64a2b, zeros in the
// padding, and this build runs VDPBF16PS: then bf16_linear may take it.
bool bf16_layout_ok(torch::Tensor packed, torch::Tensor weight) {
#if defined(MINIBATCH_DPBF16)
  if (weight.dim() != 2 || weight.scalar_type() != torch::kBFloat16) return false;
  const int64_t n = weight.size(0), k = weight.size(1), kp = round_up(k, IN_ALIGN) / 2;
  const uint16_t* bits = blocks_of(packed, n, k);
  if (bits == nullptr) return false;
  auto w = weight.detach().contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  std::atomic<bool> same{true};
  at::parallel_for(0, round_up(n, OUT_BLOCK) / OUT_BLOCK, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1 && same; ++nb) {
      const uint16_t* p = bits + nb * kp * 2 * OUT_BLOCK;  // the output block's pairs, in order
      for (int64_t pair = 0; pair < kp; ++pair)
        for (int64_t c = 0; c < OUT_BLOCK; ++c)
          for (int64_t e = 0; e < 2; ++e, ++p) {
            const int64_t row = nb * OUT_BLOCK + c, col = 2 * pair + e;
            if (*p != (row < n && col < k ? src[row * k + col] : 0)) same = false;
          }
    }
  });
  return same;
#else
  (void)packed;
  (void)weight;
  return false;
#endif
}

// x (m, k) bf16 times the weight of bf16_layout_ok's `packed` ((n, k)), plus bias ((n,) bf16 or None): (m, n) bf16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("minibatch::bf16_linear", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
              "bf16_linear: x must be (m, k) bf16 on the CPU");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kBFloat16),
              "bf16_linear: bias must be (n,) bf16");
  const int64_t m = x.size(0), k = x.size(1), kp = round_up(k, IN_ALIGN) / 2;
  const int64_t blocks = round_up(n, OUT_BLOCK) / OUT_BLOCK;
  const uint16_t* w = blocks_of(packed, n, k);
  TORCH_CHECK(w != nullptr, "bf16_linear: packed is not an (", n, ", ", k, ") bf16 weight prepacked by "
              "mkldnn::_reorder_linear_weight in blocks of 64 output features");
#if !defined(MINIBATCH_DPBF16)
  TORCH_CHECK(false, "bf16_linear: this CPU or build has no AVX512-BF16 (check bf16_layout_ok first)");
#endif
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
#if defined(MINIBATCH_DPBF16)
  x = (k == 2 * kp) ? x.contiguous() : torch::constant_pad_nd(x, {0, 2 * kp - k});  // zeros past k, as the weight
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x.data_ptr());
  std::vector<float> b(blocks * OUT_BLOCK, 0.0f);
  if (bias.has_value()) {
    auto bc = bias->contiguous();
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<float>(bc.data_ptr<at::BFloat16>()[i]);
  }
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_elems = kp * 2 * OUT_BLOCK, passes = (m + ROWS - 1) / ROWS;
  // The threads split the blocks' vectors of 16 features, not whole blocks: 9 blocks (o_proj's, down_proj's 576
  // features) on 2 threads would be 5 against 4. A block split between two threads runs as two narrower blocks.
  at::parallel_for(0, blocks * 4, 4, [&](int64_t v0, int64_t v1) {
    for (int64_t nb = v0 / 4; nb * 4 < v1; ++nb) {
      const int c0 = static_cast<int>(std::max(v0, nb * 4) - nb * 4);
      const int width = static_cast<int>(std::min(v1, nb * 4 + 4) - nb * 4) - c0;
      const uint16_t* wb = w + nb * block_elems;
      const char* pf = (nb + 1) * 4 < v1 ? reinterpret_cast<const char*>(wb + block_elems) : nullptr;
      int64_t r = 0;
      for (int64_t g = 0; g < passes; ++g) {  // passes of equal rows, give or take one (a pass of 2 rows is slow)
        const int64_t rows = (m - r + passes - g - 1) / (passes - g);
        auto* pass = width == 4 ? block_rows_v<4> : width == 3 ? block_rows_v<3> : width == 2 ? block_rows_v<2>
                                                                                              : block_rows_v<1>;
        pass(rows, xs + r * kp, kp, wb, kp, c0, b.data() + nb * OUT_BLOCK, os + r * n, n, nb * OUT_BLOCK, pf, g,
             passes);
        r += rows;
      }
    }
  });
#endif
  return out;
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // built into the fused decode layer's extension: no module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_layout_ok", &bf16_layout_ok, "whether a oneDNN-prepacked bf16 weight can run bf16_linear here");
  m.def("bf16_linear", &bf16_linear, "x w^T (+ bias) with AVX512-BF16 from w prepacked by oneDNN, bf16");
}
#endif
