// Paged prefill attention on a CPU in bf16 with AVX512-BF16: the causal attention of every prefill (or prefill
// chunk) in a step, reading its whole context, cached and new, through its block table.
//
// Why: torch's CPU flash attention ran SmolLM2-135M's prefill attention at 46-114 GFLOP/s on a 2-core AVX512-BF16
// CPU, a quarter or less of what its bf16 matrix products reach there (benchmarks/prefill_attention.py,
// data/cpu/prefill_attention.json), and a chunk that extends a cached context first copies the context out of the
// cache and builds a mask. This kernel is
// FlashAttention's tiling (Dao et al., NeurIPS'22, section 3.1, Algorithm 1: per block of query rows, the keys in
// chunks with a running max and sum) with both products on VDPBF16PS (bf16 pairs multiplied into float32 sums), on
// vLLM's paged cache (Kwon et al., SOSP'23, section 4.1).
//
// For each (request, KV head) the keys and values are first packed from the cache into VNNI pairs: keys as
// [chunk of 64 keys][pair of dims][64 keys] and values as [pair of keys][head_dim], zeros past the context. Then
// each task takes ROWS query rows of one (request, KV head) (rows are (token, query head of the group), token-major:
// the `group` heads sharing the KV head share every key read) and walks the keys their causal (and sliding-window)
// mask lets them see, 64 at a time: scores S = q k^T (ROWS x 4 vectors of 16 keys, float32), scaled and masked; the
// running max m and sum l; P = e^(S - m) rounded to bf16 for the product with V, as torch's CPU flash attention does
// for bf16 inputs (l sums the float32 P); O = O e^(m_old - m) + P V (float32). Out: O / l rounded to bf16. Tasks are
// handed out longest first from a shared counter, so the causal mask's uneven rows do not leave a thread idle.
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", VDPBF16PS. Built with -march=native
// (kernels/cpp_build.py); without AVX512-BF16 `available()` is false and the callers keep torch's attention.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "cpu_simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(MINIBATCH_SIMD)
#define MINIBATCH_PREFILL_BF16 1
#include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 6;    // query rows per task: 6 x 4 score accumulators + 4 key vectors + 1 broadcast <= 32
constexpr int CHUNK = 64;  // keys per step of the running softmax: 4 vectors of 16
#define MINIBATCH_UNROLL _Pragma("GCC unroll 8")

#if defined(MINIBATCH_PREFILL_BF16)
// One (request, KV head)'s keys and values in VNNI pairs (see the top), and where its query rows are.
struct Head {
  const uint32_t* k;   // [chunks][pairs][CHUNK]
  const uint32_t* v;   // [keys / 2][head_dim]
  int64_t ctx;  // the first new token's position (seq_len - q_len)
  int64_t q_start, q_len, kv_head;
};

// e^x on 16 lanes for x <= 0 (the softmax's x - max): cpu_simd.h's exp_lanes (x = k ln2 + r, e^r by its degree-6
// Taylor polynomial) with 2^k applied by VSCALEFPS, which stays exact for every k the clamp at -87 allows, so none of
// exp_lanes' guards for large x are needed: about half its instructions, on the kernel's hottest elementwise step.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // -inf (a masked key) too: e^-87 is below every bf16 weight's ulp
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  for (float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

// Pack one head's keys and values (positions [0, seq_len) through `table`) from the cache into kd and vd (sized
// for the context padded to a whole chunk; zeros there).
void pack_head(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t block_size,
               int64_t h_kv, int64_t hd, int64_t kv_head, int64_t seq_len, uint32_t* kd, uint32_t* vd) {
  const int64_t pairs = hd / 2, chunks = (seq_len + CHUNK - 1) / CHUNK, padded = chunks * CHUNK;
  const int64_t token_stride = h_kv * hd, block_stride = block_size * token_stride;
  std::memset(kd, 0, padded * pairs * sizeof(uint32_t));
  std::memset(vd, 0, padded / 2 * hd * sizeof(uint32_t));
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    const int64_t at = table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kv_head * hd;
    const uint32_t* krow = reinterpret_cast<const uint32_t*>(k_cache + at);  // the key's dims as pairs
    uint32_t* kc = kd + (pos / CHUNK) * pairs * CHUNK + pos % CHUNK;
    for (int64_t p = 0; p < pairs; ++p) kc[p * CHUNK] = krow[p];
    const uint16_t* vrow = v_cache + at;
    uint16_t* vp = reinterpret_cast<uint16_t*>(vd + (pos / 2) * hd) + pos % 2;  // the key pair's dims, 2 x 16 bits
    for (int64_t d = 0; d < hd; ++d) vp[2 * d] = vrow[d];
  }
}

// S (R rows x NV vectors of 16 keys; the chunk's other vectors -inf) = the rows' queries (pairs of dims, q[r]) times
// one chunk of keys (kc: [pairs][CHUNK]). NV < 4 on the diagonal: no products for keys past every row's position.
template <int R, int NV>
inline void scores(const uint32_t* const* q, const uint32_t* kc, int64_t pairs, __m512* s) {
  __m512 acc[R][NV];
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh kv[NV];
    MINIBATCH_UNROLL for (int c = 0; c < NV; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kc + p * CHUNK + c * 16);
    MINIBATCH_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
      MINIBATCH_UNROLL for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, kv[c]);
    }
  }
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < 4; ++c)
      s[r * 4 + c] = c < NV ? acc[r][c < NV ? c : 0] : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
}

template <int R>
inline void scores_nv(int nv, const uint32_t* const* q, const uint32_t* kc, int64_t pairs, __m512* s) {
  switch (nv) {
    case 1: return scores<R, 1>(q, kc, pairs, s);
    case 2: return scores<R, 2>(q, kc, pairs, s);
    case 3: return scores<R, 3>(q, kc, pairs, s);
    default: return scores<R, 4>(q, kc, pairs, s);
  }
}

// O (R rows of hd float32, row stride hd) += P (R rows of `key_pairs` bf16 pairs, row stride CHUNK / 2) times the
// chunk's values (vc: [key pairs][hd]), 64 dims (V vectors of 16) at a time.
template <int R, int V>
inline void weighted_sum(const uint32_t* pb, const uint32_t* vc, int64_t key_pairs, int64_t hd, int64_t d0,
                         float* o) {
  __m512 acc[R][V];
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) acc[r][c] = _mm512_loadu_ps(o + r * hd + d0 + c * 16);
  for (int64_t j = 0; j < key_pairs; ++j) {
    __m512bh vv[V];
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vc + j * hd + d0 + c * 16);
    MINIBATCH_UNROLL for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r * (CHUNK / 2) + j]));
      MINIBATCH_UNROLL for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, vv[c]);
    }
  }
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + r * hd + d0 + c * 16, acc[r][c]);
}

template <int R>
void weighted_sum_all(const uint32_t* pb, const uint32_t* vc, int64_t key_pairs, int64_t hd, float* o) {
  int64_t d0 = 0;
  for (; d0 + 64 <= hd; d0 += 64) weighted_sum<R, 4>(pb, vc, key_pairs, hd, d0, o);
  switch ((hd - d0) / 16) {
    case 3: weighted_sum<R, 3>(pb, vc, key_pairs, hd, d0, o); break;
    case 2: weighted_sum<R, 2>(pb, vc, key_pairs, hd, d0, o); break;
    case 1: weighted_sum<R, 1>(pb, vc, key_pairs, hd, d0, o); break;
    default: break;
  }
}

// The R query rows from flattened row `row0` of head h: rows are (token t, query head g of the group), t-major.
template <int R>
void task(const Head& h, int64_t row0, const uint16_t* q, uint16_t* out, int64_t heads, int64_t group, int64_t hd,
          float scale, int64_t window) {
  const int64_t pairs = hd / 2;
  const uint32_t* qr[R];
  int64_t pos[R], offset[R];
  for (int r = 0; r < R; ++r) {
    const int64_t t = (row0 + r) / group, g = (row0 + r) % group;
    offset[r] = ((h.q_start + t) * heads + h.kv_head * group + g) * hd;
    qr[r] = reinterpret_cast<const uint32_t*>(q + offset[r]);
    pos[r] = h.ctx + t;
  }
  const int64_t lo_pos = pos[0], hi_pos = pos[R - 1];  // rows are in token order
  const int64_t first = window > 0 ? std::max<int64_t>(0, lo_pos - window + 1) / CHUNK : 0;
  const int64_t last = hi_pos / CHUNK;  // the chunk of the last row's own key
  alignas(64) float o[R * 256];
  alignas(64) uint32_t pb[R * CHUNK / 2];
  std::fill(o, o + R * hd, 0.0f);
  float m[R], l[R];
  for (int r = 0; r < R; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.0f;
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t c = first; c <= last; ++c) {
    const int64_t base = c * CHUNK;
    __m512 s[R * 4];
    const int64_t keys = std::min<int64_t>(CHUNK, hi_pos + 1 - base);  // the rest are masked for every row
    scores_nv<R>(static_cast<int>((keys + 15) / 16), qr, h.k + c * pairs * CHUNK, pairs, s);
    // every row sees every key of the chunk unless the chunk reaches past the first row's position or (window)
    // below the last row's window
    const bool masked = base + CHUNK - 1 > lo_pos || (window > 0 && hi_pos - base >= window);
    for (int r = 0; r < R; ++r) {
      __m512 x[4];
      __mmask16 seen[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
      for (int v = 0; v < 4; ++v) {
        x[v] = _mm512_mul_ps(s[r * 4 + v], _mm512_set1_ps(scale));
        if (masked) {
          const __m512 key = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(base + v * 16)));
          seen[v] = _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(pos[r])), _CMP_LE_OQ);
          if (window > 0)
            seen[v] &= _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(pos[r] - window)), _CMP_GT_OQ);
          x[v] = _mm512_mask_blend_ps(seen[v], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x[v]);
        }
      }
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
      const float m_new = std::max(m[r], top);
      uint32_t* prow = pb + r * (CHUNK / 2);
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible yet (a window's first chunks)
        std::memset(prow, 0, CHUNK * 2);
        continue;
      }
      const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible chunk (m = -inf)
      __m512 sum = _mm512_setzero_ps();
      for (int v = 0; v < 4; ++v) {
        __m512 p = exp_nonpositive(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new)));
        if (masked) p = _mm512_maskz_mov_ps(seen[v], p);  // exactly 0 for a key the row does not see
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + v * 8), (__m256i)_mm512_cvtneps_pbh(p));
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      if (alpha != 1.0f) {
        float* orow = o + r * hd;
        for (int64_t d = 0; d < hd; d += 16)
          _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), _mm512_set1_ps(alpha)));
      }
      m[r] = m_new;
    }
    weighted_sum_all<R>(pb, h.v + base / 2 * hd, (keys + 1) / 2, hd, o);
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t d = 0; d < hd; d += 16) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * hd + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + offset[r] + d), b);
    }
  }
}

void run_task(int rows, const Head& h, int64_t row0, const uint16_t* q, uint16_t* out, int64_t heads,
              int64_t group, int64_t hd, float scale, int64_t window) {
  switch (rows) {
    case 6: return task<6>(h, row0, q, out, heads, group, hd, scale, window);
    case 5: return task<5>(h, row0, q, out, heads, group, hd, scale, window);
    case 4: return task<4>(h, row0, q, out, heads, group, hd, scale, window);
    case 3: return task<3>(h, row0, q, out, heads, group, hd, scale, window);
    case 2: return task<2>(h, row0, q, out, heads, group, hd, scale, window);
    default: return task<1>(h, row0, q, out, heads, group, hd, scale, window);
  }
}
#endif

}  // namespace

bool prefill_available() {
#if defined(MINIBATCH_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

// Causal attention for the prefills described by spans (P, 4) int64 rows [q_start, q_len, seq_len, table_row]: the
// q_len query rows from q_start in q (T, num_heads, head_dim) bf16 are the context's last q_len positions, and see
// its keys [0, position] (and, window > 0, only the last `window` of those) in k_cache, v_cache (num_blocks,
// block_size, num_kv_heads, head_dim) bf16 through tables[table_row] (N, max_blocks) int64. The K/V of every
// position, the new ones too, must already be in the cache. Writes those rows of out (T, num_heads, head_dim) bf16;
// other rows are left as they are.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                   torch::Tensor spans, double scale, int64_t window, torch::Tensor out) {
  RECORD_FUNCTION("minibatch::paged_prefill", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kBFloat16 && q.is_contiguous() && q.device().is_cpu(),
              "paged_prefill: q must be (T, num_heads, head_dim) bf16, contiguous, on the CPU");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "paged_prefill: out must be q's shape and dtype, contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "paged_prefill: the caches must be (num_blocks, block_size, num_kv_heads, head_dim) in q's dtype, "
              "contiguous");
  const int64_t heads = q.size(1), hd = q.size(2), block_size = k_cache.size(1), h_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && h_kv > 0 && heads % h_kv == 0, "paged_prefill: head geometry");
  TORCH_CHECK(hd % 16 == 0 && hd <= 256, "paged_prefill: head_dim must be a multiple of 16 up to 256, not ", hd);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kLong && tables.is_contiguous() &&
                  spans.dim() == 2 && spans.size(1) == 4 && spans.scalar_type() == torch::kLong &&
                  spans.is_contiguous(),
              "paged_prefill: tables (N, max_blocks) and spans (P, 4) int64, contiguous");
  const int64_t n_spans = spans.size(0), max_blocks = tables.size(1), group = heads / h_kv;
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_spans; ++i) {
    const int64_t q_start = sp[4 * i], q_len = sp[4 * i + 1], seq_len = sp[4 * i + 2], row = sp[4 * i + 3];
    TORCH_CHECK(q_len >= 1 && q_start >= 0 && q_start + q_len <= q.size(0) && seq_len >= q_len &&
                    seq_len <= max_blocks * block_size && row >= 0 && row < tables.size(0),
                "paged_prefill: span ", i, " [", q_start, ", ", q_len, ", ", seq_len, ", ", row, "] outside q, its "
                "table or the cache");
    for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tb[row * max_blocks + b] >= 0 && tb[row * max_blocks + b] < k_cache.size(0),
                  "paged_prefill: block id ", tb[row * max_blocks + b], " outside the cache");
  }
#if !defined(MINIBATCH_PREFILL_BF16)
  (void)scale;
  (void)window;
  TORCH_CHECK(false, "paged_prefill: this CPU or build has no AVX512-BF16 (check prefill_available first)");
#else
  // the packed K/V of every (span, KV head), one buffer
  std::vector<int64_t> offsets(n_spans * h_kv + 1, 0);
  for (int64_t i = 0; i < n_spans; ++i) {
    const int64_t padded = (sp[4 * i + 2] + CHUNK - 1) / CHUNK * CHUNK;  // K and V: padded x hd / 2 pairs each
    for (int64_t g = 0; g < h_kv; ++g) offsets[i * h_kv + g + 1] = offsets[i * h_kv + g] + padded * hd;
  }
  std::unique_ptr<uint32_t[]> packed(new uint32_t[offsets.back()]);  // pack_head writes every element
  std::vector<Head> head(n_spans * h_kv);
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  at::parallel_for(0, n_spans * h_kv, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const int64_t i = j / h_kv, g = j % h_kv, seq_len = sp[4 * i + 2];
      uint32_t* kd = packed.get() + offsets[j];
      uint32_t* vd = kd + (offsets[j + 1] - offsets[j]) / 2;  // K's pairs, then V's
      pack_head(kc, vc, tb + sp[4 * i + 3] * max_blocks, block_size, h_kv, hd, g, seq_len, kd, vd);
      head[j] = Head{kd, vd, seq_len - sp[4 * i + 1], sp[4 * i], sp[4 * i + 1], g};
    }
  });
  // the tasks, longest first (the last rows of the longest contexts), handed out from a shared counter
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (head index, first row)
  for (int64_t j = 0; j < n_spans * h_kv; ++j)
    for (int64_t r = 0; r < head[j].q_len * group; r += ROWS) tasks.emplace_back(j, r);
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) {
    return head[a.first].ctx + a.second / group > head[b.first].ctx + b.second / group;
  });
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1)) < n_tasks;) {
      const Head& h = head[tasks[t].first];
      const int64_t row0 = tasks[t].second, rows = std::min<int64_t>(ROWS, h.q_len * group - row0);
      run_task(static_cast<int>(rows), h, row0, qs, os, heads, group, hd, static_cast<float>(scale), window);
    }
  });
#endif
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // also linked into the fused layer's extension: no module of its own there
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_available", &prefill_available, "whether this build runs paged_prefill (AVX512-BF16)");
  m.def("paged_prefill", &paged_prefill, "causal bf16 attention of prefills over the paged cache, into out");
}
#endif
