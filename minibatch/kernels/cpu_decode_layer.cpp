// One decoder layer of a Llama-family model for a decode step on a CPU, in one call: float32 (decode_layer), or bf16
// on oneDNN's prepacked products (decode_layer_prepacked, at the end).
//
// A decode step of a small model runs ~40 small operators per layer (two RMSNorms, rotary embedding, residual adds,
// SiLU, views), each a few microseconds of dispatch and Python on a few thousand numbers: at 32 requests of
// SmolLM2-135M that is about a quarter of the step. vLLM and SGLang write their own model code for this reason (one
// CUDA graph, or fused kernels per layer); here the layer's whole decode path is one C++ function that calls the
// packed matrix product (cpu_linear.cpp) and the paged decode attention (cpu_paged_decode.cpp) directly and does the
// small operators itself:
//
//   h = RMSNorm(x) ; q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv) ; rotary on q, k ; k, v -> cache slots
//   x = x + (PagedAttention(q; cache) Wo^T (+bo)) ; h = RMSNorm(x) ; x = x + (SiLU(h Wg^T) * (h Wu^T)) Wd^T
//
// transformers' LlamaDecoderLayer (also Mistral's and Qwen2's) with our packed attention, operation by operation in
// the same float32 order where it is elementwise (RMSNorm: x * rsqrt(mean(x^2) + eps), then weight times that;
// rotary: q cos + rotate_half(q) sin; SiLU: g / (1 + exp(-g))), with no fused multiply-add contraction. The mean of
// squares is summed in double (torch sums float32 in another order), and SiLU's e^-g comes from cpu_simd.h's
// exp_lanes where there are vector lanes: outputs differ from the modules' in the last bits, as the packed matrix
// product's do. Built by minibatch/kernels/cpu_decode_layer.py with the two kernels' sources.
#include "cpu_kernels.h"
#include "cpu_simd.h"
#include "cpu_torch_sum.h"

#include <ATen/Parallel.h>

#include <ATen/record_function.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(MINIBATCH_SIMD)
using minibatch::Simd;
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#define MINIBATCH_NO_CONTRACT
#elif defined(__GNUC__)
#define MINIBATCH_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define MINIBATCH_NO_CONTRACT
#endif

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for the n rows of width d.
MINIBATCH_NO_CONTRACT void rms_norm(const float* x, const float* weight, double eps, int64_t n, int64_t d, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    double part[8] = {};  // 8 partial sums, added up as a tree: compilers vectorize it (one running sum they cannot)
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(xr[i + j]) * xr[i + j];
    for (; i < d; ++i) part[0] += static_cast<double>(xr[i]) * xr[i];
    for (int w = 4; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) part[j] += part[j + w];
    const double sq = part[0];
    const float var = static_cast<float>(sq / static_cast<double>(d));
    const float inv = 1.0f / std::sqrt(var + static_cast<float>(eps));
    float* o = out + r * d;
    for (int64_t c = 0; c < d; ++c) o[c] = weight[c] * (xr[c] * inv);
  }
}

// Rotary embedding in place on rows (n, heads, hd) with the token's cos, sin (n, hd): transformers'
// x cos + rotate_half(x) sin, rotate_half(x) = (-x[hd/2:], x[:hd/2]).
MINIBATCH_NO_CONTRACT void rotary(float* x, const float* cos, const float* sin, int64_t n, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// g = SiLU(g) * u, elementwise (torch's silu: g / (1 + exp(-g))), over the thread pool. With vector lanes, e^-g
// comes from exp_lanes (cpu_simd.h, relative error below 3e-7; torch's own vectorized silu is not libm's expf bit
// for bit either), every element alike (a slice's last count % W through a padded copy): the same numbers at any
// batch, thread count or position. Without lanes, libm's expf.
MINIBATCH_NO_CONTRACT void silu_mul(float* g, const float* u, int64_t count) {
  at::parallel_for(0, count, 4096, [&](int64_t begin, int64_t end) {
#if defined(MINIBATCH_SIMD)
    constexpr int W = Simd::W;
    auto lanes = [](float* gp, const float* up) {
      const Simd::V gv = Simd::load(gp);
      const Simd::V e = minibatch::exp_lanes(Simd::sub(Simd::zero(), gv));
      Simd::store(gp, Simd::mul(Simd::div(gv, Simd::add(Simd::set1(1.0f), e)), Simd::load(up)));
    };
    int64_t i = begin;
    for (; i + W <= end; i += W) lanes(g + i, u + i);
    if (i < end) {
      float gt[W] = {}, ut[W] = {};
      std::memcpy(gt, g + i, (end - i) * sizeof(float));
      std::memcpy(ut, u + i, (end - i) * sizeof(float));
      lanes(gt, ut);
      std::memcpy(g + i, gt, (end - i) * sizeof(float));
    }
#else
    for (int64_t i = begin; i < end; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
#endif
  });
}

void add_into(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

// Every token's slot (n of them) below the cache's slot count, all checked before anything is written: a refused
// call leaves the cache as is. `who`: the calling function, for the message.
void check_slots(const int64_t* slot, int64_t n, const torch::Tensor& k_cache, const char* who) {
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slot[t] < slots, who, ": slot ", slot[t], " outside the cache");
}

// Token t's K and V rows (k, v: (n, num_kv_heads, head_dim), contiguous, the caches' dtype) copied into the caches
// at slot[t] (-1: not written): the same bits an index_copy_ writes.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const int64_t* slot, int64_t n) {
  const int64_t row = k.numel() / std::max<int64_t>(n, 1) * k.element_size();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kd + slot[t] * row, ks + t * row, row);
    std::memcpy(vd + slot[t] * row, vs + t * row, row);
  }
}

}  // namespace

// x: (n, hidden) float32, the residual stream of n one-token decodes; returns the layer's output (n, hidden).
// norms: {input_layernorm.weight, post_attention_layernorm.weight}, each (hidden,); eps: their epsilons.
// panels: {q, k, v, o, gate, up, down} weights packed by cpu_linear's pack_weight; biases: q, k, v, o (or None).
// dims: {hidden, intermediate, num_heads, num_kv_heads, head_dim}. cos, sin: (n, head_dim) float32, the tokens'
// rotary embedding (the model's own rotary module computes them). k_cache, v_cache: this layer's
// (num_blocks, block_size, num_kv_heads, head_dim) float32 caches, contiguous; slot_mapping: (n,) int64, where each
// token's K/V goes (-1: not written); tables (n, max_blocks) int64, seq_lens (n,) int64: as paged_decode's.
// scale: the attention's softmax scale; window: 0 = none, else the sliding window.
torch::Tensor decode_layer(torch::Tensor x, std::vector<torch::Tensor> norms, std::vector<double> eps,
                           std::vector<torch::Tensor> panels, c10::optional<torch::Tensor> bq,
                           c10::optional<torch::Tensor> bk, c10::optional<torch::Tensor> bv,
                           c10::optional<torch::Tensor> bo, std::vector<int64_t> dims, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor slot_mapping, torch::Tensor tables, torch::Tensor seq_lens, double scale,
                           int64_t window) {
  RECORD_FUNCTION("minibatch::decode_layer", std::vector<c10::IValue>());
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2 && panels.size() == 7 && dims.size() == 5,
              "decode_layer: 2 norms, 2 epsilons, 7 packed weights and 5 dims");
  const int64_t hidden = dims[0], inter = dims[1], heads = dims[2], kv_heads = dims[3], hd = dims[4];
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "decode_layer: x must be (n, hidden) float32 on the CPU");
  x = x.contiguous();
  const int64_t n = x.size(0);
  for (const auto& w : norms)
    TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
                "decode_layer: norm weights must be (hidden,) float32, contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n && cos.size(1) == hd &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "decode_layer: cos and sin must be (n, head_dim) float32");
  TORCH_CHECK(hd % 2 == 0 && k_cache.scalar_type() == torch::kFloat32 && k_cache.dim() == 4 &&
                  k_cache.size(2) == kv_heads && k_cache.size(3) == hd && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "decode_layer: caches must be (num_blocks, block_size, num_kv_heads, head_dim) float32, contiguous");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && tables.device().is_cpu() &&
                  seq_lens.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "decode_layer: every tensor must be on the CPU");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == n && slot_mapping.scalar_type() == torch::kLong &&
                  slot_mapping.device().is_cpu(),
              "decode_layer: slot_mapping must be (n,) int64 on the CPU");
  cos = cos.contiguous();
  sin = sin.contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  check_slots(slot, n, k_cache, "decode_layer");
  // the ranges are named after `python -m minibatch profile`'s components (minibatch/experiments/step_profile.py)
  auto h = torch::empty_like(x);
  {
    RECORD_FUNCTION("minibatch::norms", std::vector<c10::IValue>());
    rms_norm(x.data_ptr<float>(), norms[0].data_ptr<float>(), eps[0], n, hidden, h.data_ptr<float>());
  }
  torch::Tensor q, k, v;
  {
    RECORD_FUNCTION("minibatch::qkv_proj", std::vector<c10::IValue>());
    q = packed_linear(h, panels[0], heads * hd, bq);
    k = packed_linear(h, panels[1], kv_heads * hd, bk);
    v = packed_linear(h, panels[2], kv_heads * hd, bv);
  }
  {
    RECORD_FUNCTION("minibatch::rotary_and_reshapes", std::vector<c10::IValue>());
    rotary(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), n, heads, hd);
    rotary(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), n, kv_heads, hd);
  }
  {
    RECORD_FUNCTION("minibatch::kv_write", std::vector<c10::IValue>());
    write_kv(k, v, k_cache, v_cache, slot, n);
  }
  torch::Tensor attn, o;
  {
    RECORD_FUNCTION("minibatch::attention", std::vector<c10::IValue>());
    attn = paged_decode(q.view({n, heads, hd}), k_cache, v_cache, tables, seq_lens, scale, window);
  }
  {
    RECORD_FUNCTION("minibatch::o_proj", std::vector<c10::IValue>());
    o = packed_linear(attn.view({n, heads * hd}), panels[3], hidden, bo);
  }
  auto out = x.clone();
  add_into(out.data_ptr<float>(), o.data_ptr<float>(), n * hidden);
  {
    RECORD_FUNCTION("minibatch::norms", std::vector<c10::IValue>());
    rms_norm(out.data_ptr<float>(), norms[1].data_ptr<float>(), eps[1], n, hidden, h.data_ptr<float>());
  }
  {
    RECORD_FUNCTION("minibatch::mlp", std::vector<c10::IValue>());
    auto g = packed_linear(h, panels[4], inter, c10::nullopt);
    auto u = packed_linear(h, panels[5], inter, c10::nullopt);
    silu_mul(g.data_ptr<float>(), u.data_ptr<float>(), n * inter);
    auto d = packed_linear(g, panels[6], hidden, c10::nullopt);
    add_into(out.data_ptr<float>(), d.data_ptr<float>(), n * hidden);
  }
  return out;
}

// The same layer in bf16, as ATen operators called from C++: the
// operators transformers' modules run, in their order and dtypes (RMSNorm upcast to float32 and back, rotary and
// residuals in the model's dtype, SiLU then the product), so the outputs are bit for bit the unfused step's; only the
// Python between them is gone. The products run on weights prepacked once (runner/prepack.py), as the modules' do:
// oneDNN's matmul (mkldnn::_linear_pointwise), or our AMX kernel on the same bytes for at most amx_rows rows; q/k/v
// and gate/up each as one product. x: (n, hidden); weights: {qkv, o, gate_up, down}, each prepacked by
// mkldnn::_reorder_linear_weight; biases: qkv's and o's (or None); the rest as decode_layer's, caches in x's dtype.
// A step with prefills (or chunks, or verifications: rows of several tokens) passes spans and prefill_tables, as
// paged_prefill's (cpu_paged_prefill.cpp, the cpp backend's bf16 prefill kernel), and decode_rows ((d,) int64, the
// one-token rows, whose tables and seq_lens are then those d rows'): the same kernels the backend runs for them.
namespace {

// Elements per task of the layer's elementwise loops: a decode step's few rows stay on one thread (a fork costs more
// than their work), a prefill's thousands split over the pool.
constexpr int64_t ELEMENTWISE_GRAIN = 65536;

// x (m, k) times a prepacked weight of n outputs: on AMX from the same bytes (cpu_amx_linear.cpp) for at most
// amx_rows rows, else with AVX512-BF16 from the same bytes (cpu_bf16_linear.cpp) for at most bf16_rows rows, else
// oneDNN's matmul (runner/prepack.py's prepacked_product, which the modules run in the engine's steps: the same rule).
torch::Tensor prepacked_product(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                const c10::optional<torch::Tensor>& bias, int64_t amx_rows, int64_t bf16_rows) {
  if (x.size(0) <= amx_rows) return amx_linear(x, packed, n, bias);
  if (x.size(0) <= bf16_rows) return bf16_linear(x, packed, n, bias);
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// transformers' RMSNorm on x (n, d) bf16 with weight (d,) bf16: h = x.float(); variance = h.pow(2).mean(-1);
// weight * (h * rsqrt(variance + eps)).to(bf16). The mean is torch's: its float32 sum of the squares in its own order
// (cpu_torch_sum.h, checked against at::mean once per width; where no order matches, at::mean itself), divided by
// d; the elementwise steps are loops that round as its float32 and bf16 kernels do (x * x, + eps in float32,
// rsqrt = 1 / sqrt, bf16 round-to-nearest-even): one operator instead of eight, and no call into torch.
MINIBATCH_NO_CONTRACT torch::Tensor rms_norm_like_modules(const torch::Tensor& x, const torch::Tensor& weight,
                                                          double eps) {
  using bf16 = at::BFloat16;
  const auto xc = x.contiguous(), w = weight.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1);
  const bf16* xs = xc.data_ptr<bf16>();
  const bf16* ws = w.data_ptr<bf16>();
  const int mode = minibatch::row_sum_mode(d);
  std::vector<float> var(n);
  const int64_t grain = std::max<int64_t>(1, ELEMENTWISE_GRAIN / std::max<int64_t>(d, 1));  // rows per task
  if (mode == 0) {  // at::mean on the float32 squares
    auto squares = torch::empty({n, d}, xc.options().dtype(torch::kFloat32));
    float* sq = squares.data_ptr<float>();
    at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * d; i < r1 * d; ++i) {
        const float v = static_cast<float>(xs[i]);
        sq[i] = v * v;
      }
    });
    const auto mean = squares.mean(-1, true);
    std::memcpy(var.data(), mean.data_ptr<float>(), n * sizeof(float));
  }
  auto out = torch::empty_like(xc);
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* xr = xs + r * d;
      if (mode == 16) var[r] = minibatch::aten_mean_of_squares<16>(xr, d);
      if (mode == 8) var[r] = minibatch::aten_mean_of_squares<8>(xr, d);
      const float inv = 1.0f / std::sqrt(var[r] + static_cast<float>(eps));
      int64_t c = 0;
#if defined(MINIBATCH_SIMD)
      for (const Simd::V scale = Simd::set1(inv); c + Simd::W <= d; c += Simd::W) {
        const Simd::V h = Simd::round_bf16(Simd::mul(Simd::load(xr + c), scale));
        Simd::store(o + r * d + c, Simd::round_bf16(Simd::mul(Simd::load(ws + c), h)));
      }
#endif
      for (; c < d; ++c) {
        const bf16 h = static_cast<float>(xr[c]) * inv;
        o[r * d + c] = static_cast<float>(ws[c]) * static_cast<float>(h);
      }
    }
  });
  return out;
}

// x + y for bf16 tensors of one shape, as torch's bf16 add rounds it (each sum in float32, then to bf16 by
// round-to-nearest-even): the residual adds without a call into torch (its dispatch runs with cold caches inside a
// step). x is the residual stream, contiguous; y a product's fresh output. On vector lanes where there are some
// (cpu_simd.h's round_bf16 rounds as at::BFloat16 does), over the thread pool for a prefill's many rows.
MINIBATCH_NO_CONTRACT torch::Tensor add_like_modules(const torch::Tensor& x, const torch::Tensor& y) {
  using bf16 = at::BFloat16;
  const auto xc = x.contiguous(), yc = y.contiguous();
  auto out = torch::empty_like(xc);
  const bf16* a = xc.data_ptr<bf16>();
  const bf16* b = yc.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, xc.numel(), ELEMENTWISE_GRAIN, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(MINIBATCH_SIMD)
    for (; i + Simd::W <= i1; i += Simd::W)
      Simd::store(o + i, Simd::round_bf16(Simd::add(Simd::load(a + i), Simd::load(b + i))));
#endif
    for (; i < i1; ++i) o[i] = static_cast<float>(a[i]) + static_cast<float>(b[i]);
  });
  return out;
}

// transformers' q * cos + rotate_half(q) * sin on t (n, heads, hd) with cos, sin (n, hd), all bf16: each operator
// computes in float32 and rounds to bf16 (as torch's bf16 kernels do), so these loops give its numbers exactly, on
// vector lanes where there are some, over the thread pool for a prefill's many rows. t may be a view of the fused
// q/k/v product's rows (its heads contiguous, rows strided): read in place, written to a new contiguous tensor.
MINIBATCH_NO_CONTRACT torch::Tensor rotary_like_modules(const torch::Tensor& t, const torch::Tensor& cos,
                                                        const torch::Tensor& sin) {
  using bf16 = at::BFloat16;
  const int64_t n = t.size(0), heads = t.size(1), hd = t.size(2), half = hd / 2;
  TORCH_CHECK(hd > 0 && hd % 2 == 0, "rotary_like_modules: head_dim must be even and positive (rotate_half splits it "
              "in two)");
  const auto src = (t.stride(2) == 1 && t.stride(1) == hd) ? t : t.contiguous();
  auto out = torch::empty({n, heads, hd}, t.options());
  const int64_t row_stride = src.stride(0);
  const bf16* x = src.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  // one output element: a = x cos, b = rotate_half(x) sin, each rounded to bf16, then a + b rounded
  auto one = [](float v, float rotated, float c, float s) -> bf16 {
    const bf16 a = v * c;
    const bf16 b = static_cast<float>(bf16(rotated)) * s;
    return static_cast<float>(a) + static_cast<float>(b);
  };
  at::parallel_for(0, n * heads, std::max<int64_t>(1, ELEMENTWISE_GRAIN / std::max<int64_t>(hd, 1)),
                   [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = j / heads, h = j % heads;
      const bf16* c = cos.data_ptr<bf16>() + r * hd;
      const bf16* s = sin.data_ptr<bf16>() + r * hd;
      const bf16* v = x + r * row_stride + h * hd;
      bf16* w = o + j * hd;
      for (int64_t lo = 0; lo < hd; lo += half) {  // the first half's partner is -x[i + half], the second's x[i - half]
        const int64_t partner = lo == 0 ? half : -half;
        int64_t i = lo;
#if defined(MINIBATCH_SIMD)
        const Simd::V sign = Simd::set1(lo == 0 ? -1.0f : 1.0f);  // exact: a bf16 value times +-1
        for (; i + Simd::W <= lo + half; i += Simd::W) {
          const Simd::V a = Simd::round_bf16(Simd::mul(Simd::load(v + i), Simd::load(c + i)));
          const Simd::V rotated = Simd::round_bf16(Simd::mul(Simd::load(v + i + partner), sign));
          const Simd::V b = Simd::round_bf16(Simd::mul(rotated, Simd::load(s + i)));
          Simd::store(w + i, Simd::round_bf16(Simd::add(a, b)));
        }
#endif
        for (; i < lo + half; ++i) {
          const float partner_value = static_cast<float>(v[i + partner]);
          w[i] = one(static_cast<float>(v[i]), lo == 0 ? -partner_value : partner_value, static_cast<float>(c[i]),
                     static_cast<float>(s[i]));
        }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor decode_layer_prepacked(torch::Tensor x, std::vector<torch::Tensor> norms, std::vector<double> eps,
                                     std::vector<torch::Tensor> weights, c10::optional<torch::Tensor> b_qkv,
                                     c10::optional<torch::Tensor> b_o, int64_t amx_rows, int64_t bf16_rows,
                                     std::vector<int64_t> dims,
                                     torch::Tensor cos,
                                     torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor slot_mapping, torch::Tensor tables, torch::Tensor seq_lens,
                                     double scale, int64_t window, c10::optional<torch::Tensor> spans,
                                     c10::optional<torch::Tensor> prefill_tables,
                                     c10::optional<torch::Tensor> decode_rows) {
  RECORD_FUNCTION("minibatch::decode_layer", std::vector<c10::IValue>());
  TORCH_CHECK(spans.has_value() == prefill_tables.has_value() && (!decode_rows.has_value() || spans.has_value()),
              "decode_layer_prepacked: spans and prefill_tables come together, decode_rows only with them");
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2 && weights.size() == 4 && dims.size() == 5,
              "decode_layer_prepacked: 2 norms, 2 epsilons, 4 prepacked weights and 5 dims");
  const int64_t hidden = dims[0], inter = dims[1], heads = dims[2], kv_heads = dims[3], hd = dims[4];
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 &&
                  k_cache.scalar_type() == x.scalar_type() &&
                  k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == hd &&
                  v_cache.sizes() == k_cache.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0),
              "decode_layer_prepacked: x (n, hidden) bf16, caches (num_blocks, block_size, num_kv_heads, head_dim) in "
              "x's dtype, cos and sin (n, head_dim)");
  const int64_t n = x.size(0);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == x.scalar_type() && cos.size(1) == hd,
              "decode_layer_prepacked: contiguous caches; cos and sin (n, head_dim) in x's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == n && slot_mapping.scalar_type() == torch::kLong &&
                  slot_mapping.is_contiguous(),
              "decode_layer_prepacked: slot_mapping must be (n,) int64, contiguous");
  for (const auto& w : norms)
    TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden && w.scalar_type() == x.scalar_type(),
                "decode_layer_prepacked: norm weights must be (hidden,) in x's dtype");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  check_slots(slot, n, k_cache, "decode_layer_prepacked");
  cos = cos.contiguous();
  sin = sin.contiguous();
  torch::Tensor h, q, k, v, attn;
  {
    RECORD_FUNCTION("minibatch::norms", std::vector<c10::IValue>());
    h = rms_norm_like_modules(x, norms[0], eps[0]);
  }
  {
    RECORD_FUNCTION("minibatch::qkv_proj", std::vector<c10::IValue>());
    auto qkv = prepacked_product(h, weights[0], (heads + 2 * kv_heads) * hd, b_qkv, amx_rows, bf16_rows)
                   .split({heads * hd, kv_heads * hd, kv_heads * hd}, -1);
    q = qkv[0].view({n, heads, hd});
    k = qkv[1].view({n, kv_heads, hd});
    v = qkv[2].view({n, kv_heads, hd});
  }
  {
    RECORD_FUNCTION("minibatch::rotary_and_reshapes", std::vector<c10::IValue>());
    q = rotary_like_modules(q, cos, sin);
    k = rotary_like_modules(k, cos, sin);
  }
  {
    RECORD_FUNCTION("minibatch::kv_write", std::vector<c10::IValue>());
    write_kv(k, v.contiguous(), k_cache, v_cache, slot, n);  // k: the rotary's new, contiguous tensor
  }
  {
    RECORD_FUNCTION("minibatch::attention", std::vector<c10::IValue>());
    if (!spans.has_value()) {
      attn = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, window);
    } else {  // a step with prefills: theirs on the prefill kernel, the decode rows (if any) on the decode kernel
      attn = torch::empty_like(q);
      paged_prefill(q, k_cache, v_cache, *prefill_tables, *spans, scale, window, attn);
      if (decode_rows.has_value() && decode_rows->numel() > 0)
        attn.index_copy_(0, *decode_rows, paged_decode(q.index_select(0, *decode_rows), k_cache, v_cache, tables,
                                                       seq_lens, scale, window));
    }
  }
  torch::Tensor out;
  {
    RECORD_FUNCTION("minibatch::o_proj", std::vector<c10::IValue>());
    out = add_like_modules(x, prepacked_product(attn.reshape({n, heads * hd}).contiguous(), weights[1], hidden, b_o,
                                                amx_rows, bf16_rows));
  }
  {
    RECORD_FUNCTION("minibatch::norms", std::vector<c10::IValue>());
    h = rms_norm_like_modules(out, norms[1], eps[1]);
  }
  {
    RECORD_FUNCTION("minibatch::mlp", std::vector<c10::IValue>());
    auto gu = prepacked_product(h, weights[2], 2 * inter, c10::nullopt, amx_rows, bf16_rows).chunk(2, -1);
    out = add_like_modules(out, prepacked_product(torch::silu(gu[0]) * gu[1], weights[3], hidden, c10::nullopt,
                                                  amx_rows, bf16_rows));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layer", &decode_layer, "a Llama-family decoder layer's decode path, float32, in one call");
  m.def("decode_layer_prepacked", &decode_layer_prepacked,
        "the same layer as ATen operators on oneDNN-prepacked weights (bf16), bit for bit the modules' outputs");
  m.def("silu_mul", [](torch::Tensor g, torch::Tensor u) {  // the layer's SiLU(g) * u, for tests: g, u float32
    TORCH_CHECK(g.scalar_type() == torch::kFloat32 && u.sizes() == g.sizes() && u.scalar_type() == torch::kFloat32,
                "silu_mul: g and u must be float32 tensors of one shape");
    auto out = g.contiguous().clone();
    auto uc = u.contiguous();
    silu_mul(out.data_ptr<float>(), uc.data_ptr<float>(), out.numel());
    return out;
  }, "SiLU(g) * u as the fused layer computes it");
  m.def("rotary_like_modules", [](torch::Tensor t, torch::Tensor cos, torch::Tensor sin) {  // for tests
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kBFloat16 && t.device().is_cpu() && cos.dim() == 2 &&
                    cos.size(0) == t.size(0) && cos.size(1) == t.size(2) && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16,
                "rotary_like_modules: t (n, heads, head_dim), cos and sin (n, head_dim), all bf16 on the CPU");
    return rotary_like_modules(t, cos.contiguous(), sin.contiguous());
  }, "transformers' rotary embedding in bf16, bit for bit: t (n, heads, head_dim), cos and sin (n, head_dim)");
  m.def("add_like_modules", [](torch::Tensor x, torch::Tensor y) {  // for tests
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && y.scalar_type() == torch::kBFloat16 && x.sizes() == y.sizes() &&
                    x.device().is_cpu() && y.device().is_cpu(),
                "add_like_modules: x and y must be bf16 CPU tensors of one shape");
    return add_like_modules(x, y);
  }, "x + y in bf16 as torch rounds it, bit for bit");
  m.def("greedy_argmax", &greedy_argmax, "torch.argmax(logits, -1) of CPU float32 or bf16 logits, one pass a row");
  m.def("greedy_argmax_vectorized", &greedy_argmax_vectorized, "whether greedy_argmax runs on vector lanes here");
  m.def("row_sum_mode", &minibatch::row_sum_mode, "the lane count whose order gives torch's row mean here (0: none)");
  m.def("rms_norm_like_modules", [](torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu() && weight.dim() == 1 &&
                    weight.size(0) == x.size(1) && weight.scalar_type() == torch::kBFloat16,
                "rms_norm_like_modules: x (n, d) and weight (d,), both bf16 on the CPU");
    return rms_norm_like_modules(x, weight, eps);
  }, "transformers' RMSNorm in bf16, bit for bit: x (n, d), weight (d,)");
}
