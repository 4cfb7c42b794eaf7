// A bf16 linear layer for the few rows of a decode step on Intel AMX (Advanced Matrix Extensions), reading the
// weight oneDNN prepacked (runner/prepack.py) where it lies: no second copy.
//
// Why: oneDNN's matmul on AMX streams a decode step's few rows of weights at well under the memory's speed, and
// each call costs tens of microseconds before it starts. This kernel walks the weight once, front to back, with
// software prefetches a block and 16 KiB ahead, and starts in a few microseconds (benchmarks/amx_linear.py,
// data/cpu/amx_linear.json: SmolLM2-135M's linears 1.4x-2x as fast at 1-32 rows on a 2-core Xeon).
//
// The layout. _reorder_linear_weight(w, batch_size_hint >= 16) gives oneDNN's AB16b32a2b: w (n, k) zero-padded to
// multiples of 32, cut into blocks of 32 output features x 32 input features, the blocks of an output block
// consecutive over k; inside a block, 16 rows (pairs of input features) of 32 features x 2 (VNNI: the pair side by
// side). amx_layout_ok checks exactly that, byte for byte, before a layer uses this kernel. Such a block is two AMX
// B tiles (16 rows x 64 bytes, row stride 128: features 0-15 and 16-31), and a product of up to 32 rows is, for
// each output block and each 32-wide slice of k, two A tiles (the rows' inputs) times the two B tiles into four
// float32 accumulator tiles (TDPBF16PS), converted to bf16 by round-to-nearest-even, plus the bias in float32
// (what oneDNN does: on the shapes tests/test_amx_linear.py tries, up to 32 rows, its outputs are bit for bit
// oneDNN's). Every row is computed alike whatever the other rows (batch invariance); oneDNN at more than 32 rows
// blocks k differently, which is why the engine runs oneDNN there (AMX_MAX_ROWS in cpu_amx_linear.py).
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", chapter 3 (AMX: tiles,
// LDTILECFG, TILELOADD, TDPBF16PS); cpu_amx.h asks Linux for the tile state. Built with -march=native: on a CPU
// without AMX the functions report unavailable (amx_layout_ok is false) and the callers keep oneDNN.
#include "cpu_amx.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace at::native {  // an opaque oneDNN tensor's buffer and its size (libtorch_cpu exports both)
void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t BLOCK = 32;               // output and input features per block
constexpr int64_t BLOCK_BYTES = 32 * 32 * 2;  // one block of bf16 weights: two B tiles

int64_t blocks(int64_t size) { return (size + BLOCK - 1) / BLOCK; }

using minibatch::amx_permitted;

// The packed weight's buffer if it is a bf16 oneDNN tensor of exactly an n x k weight's 32 x 32 blocks, else null.
const uint16_t* blocks_of(const torch::Tensor& packed, int64_t n, int64_t k) {
  if (!packed.is_mkldnn() || packed.scalar_type() != torch::kBFloat16 || packed.dim() != 2 ||
      packed.size(0) != n || packed.size(1) != k ||  // its logical shape: another k can pad to the same size
      at::native::nbytes_from_mkldnn(packed) != blocks(n) * blocks(k) * BLOCK_BYTES)
    return nullptr;
  return static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
}

}  // namespace

// Whether `packed` (from mkldnn::_reorder_linear_weight) holds `weight` ((n, k) bf16) as AB16b32a2b, zeros in the
// padding, and this process can run AMX: then amx_linear may take it.
bool amx_layout_ok(torch::Tensor packed, torch::Tensor weight) {
  if (!amx_permitted() || weight.dim() != 2 || weight.scalar_type() != torch::kBFloat16) return false;
  const int64_t n = weight.size(0), k = weight.size(1), kb = blocks(k);
  const uint16_t* packed_bits = blocks_of(packed, n, k);
  if (packed_bits == nullptr) return false;
  auto w = weight.detach().contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  std::atomic<bool> same{true};
  at::parallel_for(0, blocks(n), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1 && same; ++nb) {
      const uint16_t* p = packed_bits + nb * kb * BLOCK_BYTES / 2;  // the output block's k blocks, in order
      for (int64_t j = 0; j < kb; ++j)
        for (int64_t r = 0; r < 16; ++r)  // a block: 16 pairs of input features x 32 output features x the pair
          for (int64_t c = 0; c < BLOCK; ++c)
            for (int64_t e = 0; e < 2; ++e, ++p) {
              const int64_t row = nb * BLOCK + c, col = j * BLOCK + 2 * r + e;
              if (*p != (row < n && col < k ? src[row * k + col] : 0)) same = false;
            }
    }
  });
  return same;
}

// x (m, k) bf16 times the weight of amx_layout_ok's `packed` ((n, k)), plus bias ((n,) bf16 or None): (m, n) bf16.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  RECORD_FUNCTION("minibatch::amx_linear", std::vector<c10::IValue>());
  TORCH_CHECK(amx_permitted(), "amx_linear: this CPU or build has no AMX (check amx_layout_ok first)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
              "amx_linear: x must be (m, k) bf16 on the CPU");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kBFloat16),
              "amx_linear: bias must be (n,) bf16");
  const int64_t m = x.size(0), k = x.size(1), kb = blocks(k), nb_count = blocks(n);
  const uint16_t* w = blocks_of(packed, n, k);
  TORCH_CHECK(w != nullptr, "amx_linear: packed is not an (", n, ", ", k, ") bf16 weight prepacked by "
              "mkldnn::_reorder_linear_weight in 32 x 32 blocks");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  // the rows as the tiles read them: 32-feature slices, zeros past k (the weight's padding is zero too)
  x = (k % BLOCK == 0) ? x.contiguous() : torch::constant_pad_nd(x, {0, kb * BLOCK - k});
  std::vector<float> b(nb_count * BLOCK, 0.0f);
  if (bias.has_value()) {
    auto bc = bias->contiguous();
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<float>(bc.data_ptr<at::BFloat16>()[i]);
  }
#if defined(MINIBATCH_AMX)
  const char* xs = static_cast<const char*>(x.data_ptr());
  const int64_t x_stride = kb * BLOCK * 2;  // bytes per row
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, nb_count, 1, [&](int64_t b0, int64_t b1) {
    minibatch::TileConfig cfg{};
    alignas(64) float acc[2][2][16][16];  // [row tile][feature half][row][feature]
    int64_t configured = -1;
    for (int64_t nb = b0; nb < b1; ++nb) {
      const char* wb = reinterpret_cast<const char*>(w + nb * kb * BLOCK_BYTES / 2);
      for (int64_t m0 = 0; m0 < m; m0 += 32) {
        const int r0 = static_cast<int>(std::min<int64_t>(16, m - m0));
        const int r1 = static_cast<int>(std::clamp<int64_t>(m - m0 - 16, 0, 16));
        if (r0 * 32 + r1 != configured) {  // tiles 0-3: accumulators, 4-5: rows, 6-7: weights
          const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
          cfg.palette = 1;
          for (int t = 0; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(std::max(rows[t], 1)), cfg.colsb[t] = 64;
          _tile_loadconfig(&cfg);
          configured = r0 * 32 + r1;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const char* xa = xs + m0 * x_stride;
        for (int64_t j = 0; j < kb; ++j) {
          const char* blk = wb + j * BLOCK_BYTES;
          for (int line = 0; line < BLOCK_BYTES; line += 64) {  // the next block into L1, one 8 blocks on into L2
            _mm_prefetch(blk + BLOCK_BYTES + line, _MM_HINT_T0);
            _mm_prefetch(blk + 8 * BLOCK_BYTES + line, _MM_HINT_T1);
          }
          _tile_loadd(4, xa + j * 64, x_stride);
          _tile_loadd(6, blk, 128);
          _tile_loadd(7, blk + 64, 128);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (r1 > 0) {
            _tile_loadd(5, xa + 16 * x_stride + j * 64, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, acc[0][0], 64);
        _tile_stored(1, acc[0][1], 64);
        if (r1 > 0) {
          _tile_stored(2, acc[1][0], 64);
          _tile_stored(3, acc[1][1], 64);
        }
        for (int r = 0; r < r0 + r1; ++r)
          for (int half = 0; half < 2; ++half) {
            const int64_t f0 = nb * BLOCK + half * 16;
            if (f0 >= n) continue;
            const __m512 sum = _mm512_add_ps(_mm512_load_ps(acc[r / 16][half][r % 16]), _mm512_loadu_ps(&b[f0]));
            alignas(32) uint16_t v[16];
            _mm256_store_si256(reinterpret_cast<__m256i*>(v), (__m256i)_mm512_cvtneps_pbh(sum));
            std::memcpy(os + (m0 + r) * n + f0, v, std::min<int64_t>(16, n - f0) * 2);
          }
      }
    }
    _tile_release();
  });
#endif
  return out;
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // built into the fused decode layer's extension: no module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_layout_ok", &amx_layout_ok, "whether a oneDNN-prepacked bf16 weight can run amx_linear here");
  m.def("amx_linear", &amx_linear, "x w^T (+ bias) on AMX from w prepacked by oneDNN, bf16");
}
#endif
