// Paged prefill attention on a CPU, bf16 with AVX512-BF16 or float32 with AVX2 and FMA (or AVX-512): the causal
// attention of every prefill (or prefill chunk) in a step, reading its whole context, cached and new, through its
// block table.
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
// On CPUs with AMX (Intel's bf16 matrix tiles) and head_dim a multiple of 32, a task takes 16 query rows instead and
// runs both products on tiles, transposed (amx_task): S^T = K Q^T and (P V)^T = V^T P^T, so that one vector holds a
// key's (or a dim's) 16 rows and the running softmax needs no reduction across lanes; the keys are packed as rows
// and the values transposed per chunk (pack_head_amx). On a 2-core Xeon with AMX the VDPBF16PS path ran the
// benchmark's cases at 0.41-0.94x torch's speed there (its flash attention runs its products on AMX); tiles with
// the row-wise softmax step ran them 1.60-2.67x as fast (data/cpu/prefill_attention_amx.json), the transposed form
// 1.01-1.47x faster again (data/cpu/prefill_attention_amx_transposed.json; benchmarks/prefill_attention.py
// --against-rev).
//
// float32 (below the bf16 path) is the same tiling on cpu_simd.h's lanes with fused multiply-adds: keys packed
// transposed per chunk, values read in place through the table, P kept in float32. On the same 2-core CPU it ran
// the benchmark's float32 cases at 105-154 GFLOP/s against torch's 49-121 (1.27-2.14x), and built at AVX2's width
// at 84-128 (0.97-1.90x; data/cpu/prefill_attention_float32*.json).
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", VDPBF16PS. Built with -march=native
// (kernels/cpp_build.py); prefill_available(dtype) says which paths this build has, and the callers keep torch's
// attention for the others.
#include "cpu_amx.h"
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
#include <string>
#include <utility>
#include <vector>

#include "cpu_simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(MINIBATCH_SIMD)
#define MINIBATCH_PREFILL_BF16 1
#include <immintrin.h>
#endif

namespace {

constexpr int ROWS = 6;    // query rows per task: 6 x 4 score accumulators + 4 key vectors + 1 broadcast <= 32
constexpr int AMX_ROWS = 16;  // query rows per task on AMX tiles (amx_task): one tile's rows
constexpr int CHUNK = 64;  // keys per step of the running softmax: 4 vectors of 16
#define MINIBATCH_UNROLL _Pragma("GCC unroll 8")

// One (request, KV head): its packed keys (and values), its block table, and where its query rows are.
struct Head {
  const uint32_t* k;      // bf16: [chunks][pairs][CHUNK] VNNI pairs (AMX: [keys][head_dim] bf16); float32:
                          // [chunks][head_dim][CHUNK] floats
  const uint32_t* v;      // bf16: [keys / 2][head_dim] VNNI pairs (AMX: [chunks][head_dim][CHUNK] bf16); float32:
                          // unused (read through the table)
  const int64_t* table;   // the request's block table row
  int64_t ctx;  // the first new token's position (seq_len - q_len)
  int64_t q_start, q_len, kv_head;
};

// A task's R query rows from flattened row `row0` of head h (rows are (token t, query head g of the group), t-major,
// so in token order): each row's element offset in q and out and its position, and the chunks of keys the rows see,
// [first, last] (last: the chunk of the last row's own key; first: the first row's window's, else 0).
template <int R>
struct TaskRows {
  int64_t offset[R], pos[R], first, last;
  TaskRows(const Head& h, int64_t row0, int64_t heads, int64_t group, int64_t hd, int64_t window) {
    for (int r = 0; r < R; ++r) {
      const int64_t t = (row0 + r) / group, g = (row0 + r) % group;
      offset[r] = ((h.q_start + t) * heads + h.kv_head * group + g) * hd;
      pos[r] = h.ctx + t;
    }
    first = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) / CHUNK : 0;
    last = pos[R - 1] / CHUNK;
  }
};

#if defined(MINIBATCH_PREFILL_BF16)

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

// One query row's step of the running softmax over a chunk of CHUNK keys from `base`: its scores s[0..3] (16 keys
// each, unscaled) scaled and masked (keys past `pos`, or outside the window), the new max m, P = e^(S - m) rounded
// to bf16 pairs into prow (zeros for keys the row does not see), l = l e^(m_old - m) + the sum of the float32 P, and
// the row's output orow (hd floats) rescaled by e^(m_old - m). `masked`: whether any key of the chunk may be hidden.
inline void softmax_step(const __m512* s, int64_t base, int64_t pos, bool masked, int64_t window, float scale,
                         float& m, float& l, uint32_t* prow, float* orow, int64_t hd) {
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 x[4];
  __mmask16 seen[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  for (int v = 0; v < 4; ++v) {
    x[v] = _mm512_mul_ps(s[v], _mm512_set1_ps(scale));
    if (masked) {
      const __m512 key = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(base + v * 16)));
      seen[v] = _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(pos)), _CMP_LE_OQ);
      if (window > 0)
        seen[v] &= _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(pos - window)), _CMP_GT_OQ);
      x[v] = _mm512_mask_blend_ps(seen[v], _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x[v]);
    }
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
  const float m_new = std::max(m, top);
  if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible yet (a window's first chunks)
    std::memset(prow, 0, CHUNK * 2);
    return;
  }
  const float alpha = std::exp(m - m_new);  // 0 on the first visible chunk (m = -inf)
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < 4; ++v) {
    __m512 p = exp_nonpositive(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new)));
    if (masked) p = _mm512_maskz_mov_ps(seen[v], p);  // exactly 0 for a key the row does not see
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + v * 8), (__m256i)_mm512_cvtneps_pbh(p));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  if (alpha != 1.0f)
    for (int64_t d = 0; d < hd; d += 16)
      _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), _mm512_set1_ps(alpha)));
  m = m_new;
}

// A row's output: its sums o (hd floats) over l, rounded to bf16 into out.
inline void store_row(const float* o, float l, int64_t hd, uint16_t* out) {
  const __m512 inv = _mm512_set1_ps(1.0f / l);
  for (int64_t d = 0; d < hd; d += 16) {
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), b);
  }
}

// The R query rows of a task (TaskRows) over the keys their masks let them see, on VDPBF16PS.
template <int R>
void task(const Head& h, int64_t row0, const uint16_t* q, uint16_t* out, int64_t heads, int64_t group, int64_t hd,
          float scale, int64_t window) {
  const int64_t pairs = hd / 2;
  const TaskRows<R> rows(h, row0, heads, group, hd, window);
  const int64_t *pos = rows.pos, *offset = rows.offset, first = rows.first, last = rows.last;
  const uint32_t* qr[R];
  for (int r = 0; r < R; ++r) qr[r] = reinterpret_cast<const uint32_t*>(q + offset[r]);
  const int64_t lo_pos = pos[0], hi_pos = pos[R - 1];
  alignas(64) float o[R * 256];
  alignas(64) uint32_t pb[R * CHUNK / 2];
  std::fill(o, o + R * hd, 0.0f);
  float m[R], l[R];
  for (int r = 0; r < R; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.0f;
  for (int64_t c = first; c <= last; ++c) {
    const int64_t base = c * CHUNK;
    __m512 s[R * 4];
    const int64_t keys = std::min<int64_t>(CHUNK, hi_pos + 1 - base);  // the rest are masked for every row
    scores_nv<R>(static_cast<int>((keys + 15) / 16), qr, h.k + c * pairs * CHUNK, pairs, s);
    // every row sees every key of the chunk unless the chunk reaches past the first row's position or (window)
    // below the last row's window
    const bool masked = base + CHUNK - 1 > lo_pos || (window > 0 && hi_pos - base >= window);
    for (int r = 0; r < R; ++r)
      softmax_step(s + r * 4, base, pos[r], masked, window, scale, m[r], l[r], pb + r * (CHUNK / 2), o + r * hd, hd);
    weighted_sum_all<R>(pb, h.v + base / 2 * hd, (keys + 1) / 2, hd, o);
  }
  for (int r = 0; r < R; ++r) store_row(o + r * hd, l[r], hd, out + offset[r]);
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

#if defined(MINIBATCH_AMX)
#define MINIBATCH_PREFILL_AMX 1

// Whether the AMX tasks take a step: the tile state granted, and head_dim whole 32-value query tiles.
inline bool amx_prefill_fits(int64_t hd) { return hd % 32 == 0 && minibatch::amx_permitted(); }

// The tiles amx_task uses, in the calling thread: 0-3 float32 sums (16 rows x 16), 4 an A tile (16 rows x 32 bf16:
// queries or P), 5-7 B tiles (16 pairs x 16 columns: keys or values).
inline void amx_prefill_tiles() {
  minibatch::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Pack one head's keys and values for amx_task: keys as rows ([position][hd] bf16, as the cache holds them: an A
// tile's rows), values transposed per chunk ([chunk][hd][CHUNK positions] bf16: an A tile's rows are dims); zeros
// past the context. kd and vd: padded x hd / 2 4-byte words each.
void pack_head_amx(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t block_size,
                   int64_t h_kv, int64_t hd, int64_t kv_head, int64_t seq_len, uint32_t* kd, uint32_t* vd) {
  const int64_t padded = (seq_len + CHUNK - 1) / CHUNK * CHUNK;
  const int64_t token_stride = h_kv * hd, block_stride = block_size * token_stride;
  uint16_t* kr = reinterpret_cast<uint16_t*>(kd);
  uint16_t* vt = reinterpret_cast<uint16_t*>(vd);
  std::memset(kr + seq_len * hd, 0, (padded - seq_len) * hd * 2);
  std::memset(vt, 0, padded * hd * 2);
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    const int64_t at = table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kv_head * hd;
    std::memcpy(kr + pos * hd, k_cache + at, hd * 2);
    uint16_t* vc = vt + (pos / CHUNK) * hd * CHUNK + pos % CHUNK;
    for (int64_t d = 0; d < hd; ++d) vc[d * CHUNK] = v_cache[at + d];
  }
}

// task()'s contract for up to AMX_ROWS query rows (n_rows) on AMX tiles (Intel's Programming Reference, chapter 3:
// TDPBF16PS, bf16 pairs into float32 sums), transposed so that a vector holds one key's (or one dim's) 16 rows: per
// chunk, S^T = K Q^T as four 16 x 16 tiles (the keys' rows times the rows' queries as VNNI pairs, built once), the
// running softmax with every row in its own lane (no reduction across lanes: the max and sum run over the chunk's 64
// vectors), P^T as bf16 pairs of keys, and (P V)^T = V^T P^T 16 dims a tile, added to O^T after the rescale; O is
// transposed back once at the end. The weights are rounded as task()'s are. The tiles must be configured
// (amx_prefill_tiles) in the calling thread; the head packed by pack_head_amx.
void amx_task(const Head& h, int64_t row0, int64_t n_rows, const uint16_t* q, uint16_t* out, int64_t heads,
              int64_t group, int64_t hd, float scale, int64_t window) {
  constexpr int R = AMX_ROWS;
  const TaskRows<R> rows(h, row0, heads, group, hd, window);  // rows from n_rows on: not read, not written
  const int64_t lo_pos = rows.pos[0], hi_pos = rows.pos[n_rows - 1], first = rows.first, last = hi_pos / CHUNK;
  alignas(64) uint32_t qb[8 * 16 * R];  // [hd / 32][16 dim pairs][R rows]: Q^T as B tiles
  alignas(64) float st[CHUNK * R];      // S^T: [key][row]
  alignas(64) uint32_t pt[CHUNK / 2 * R];  // P^T: [key pair][row], bf16 pairs
  alignas(64) float pvt[256 * R];       // (P V)^T: [dim][row]
  alignas(64) float ot[256 * R];        // O^T
  for (int64_t d0 = 0; d0 < hd; d0 += 32)
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < R; ++n)
        qb[(d0 / 32 * 16 + k) * R + n] =
            n < n_rows ? reinterpret_cast<const uint32_t*>(q + rows.offset[n] + d0)[k] : 0u;
  std::fill(ot, ot + hd * R, 0.0f);
  alignas(64) float pos_lanes[R];
  for (int n = 0; n < R; ++n) pos_lanes[n] = static_cast<float>(rows.pos[std::min<int64_t>(n, n_rows - 1)]);
  const __m512 pos_v = _mm512_load_ps(pos_lanes);
  const __m512 lo_v = _mm512_sub_ps(pos_v, _mm512_set1_ps(static_cast<float>(window)));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sv = _mm512_set1_ps(scale);
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  const uint16_t* kr = reinterpret_cast<const uint16_t*>(h.k);
  const uint16_t* vt = reinterpret_cast<const uint16_t*>(h.v);
  for (int64_t c = first; c <= last; ++c) {
    const int64_t base = c * CHUNK;
    const uint16_t* kc = kr + base * hd;  // 64 keys' rows
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {
      _tile_loadd(4, qb + d0 / 32 * 16 * R, R * 4);
      _tile_loadd(5, kc + d0, hd * 2);
      _tile_loadd(6, kc + 16 * hd + d0, hd * 2);
      _tile_loadd(7, kc + 32 * hd + d0, hd * 2);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, kc + 48 * hd + d0, hd * 2);
      _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, st, R * 4);
    _tile_stored(1, st + 16 * R, R * 4);
    _tile_stored(2, st + 32 * R, R * 4);
    _tile_stored(3, st + 48 * R, R * 4);
    const bool masked = base + CHUNK - 1 > lo_pos || (window > 0 && hi_pos - base >= window);
    __mmask16 seen[CHUNK];
    __m512 top = neg_inf;
    for (int j = 0; j < CHUNK; ++j) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(st + j * R), sv);
      if (masked) {
        const __m512 key = _mm512_set1_ps(static_cast<float>(base + j));
        seen[j] = _mm512_cmp_ps_mask(key, pos_v, _CMP_LE_OQ);
        if (window > 0) seen[j] &= _mm512_cmp_ps_mask(key, lo_v, _CMP_GT_OQ);
        x = _mm512_mask_blend_ps(seen[j], neg_inf, x);
      }
      _mm512_store_ps(st + j * R, x);
      top = _mm512_max_ps(top, x);
    }
    const __m512 m_new = _mm512_max_ps(m, top);
    // a row that sees nothing yet (a window's first chunks) keeps m = -inf: subtract 0 there, its P is 0 by the mask
    const __m512 m_use = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), m_new,
                                              _mm512_setzero_ps());
    const __m512 alpha = exp_nonpositive(_mm512_sub_ps(m, m_use));  // about 1e-38 while m = -inf (o and l are 0)
    __m512 sum = _mm512_setzero_ps();
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // lane 2i: i, 2i + 1: 16 + i
    for (int j = 0; j < CHUNK; j += 2) {
      __m512 p0 = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(st + j * R), m_use));
      __m512 p1 = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(st + (j + 1) * R), m_use));
      if (masked) p0 = _mm512_maskz_mov_ps(seen[j], p0), p1 = _mm512_maskz_mov_ps(seen[j + 1], p1);
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // lanes 0-15: p0's rows, 16-31: p1's
      _mm512_store_si512(pt + j / 2 * R, _mm512_permutexvar_epi16(pairs, b));
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = m_new;
    const uint16_t* vc = vt + c * hd * CHUNK;  // [dim][64 keys]
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {  // (P V)^T for 64 dims (4 tiles) at a time; hd % 32 == 0
      const bool four = d0 + 64 <= hd;
      _tile_zero(0);
      _tile_zero(1);
      if (four) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t half = 0; half < 2; ++half) {  // keys 0-31 and 32-63: 16 pairs each
        const uint16_t* va = vc + d0 * CHUNK + half * 32;
        _tile_loadd(4, pt + half * 16 * R, R * 4);
        _tile_loadd(5, va, CHUNK * 2);
        _tile_loadd(6, va + 16 * CHUNK, CHUNK * 2);
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 6, 4);
        if (four) {
          _tile_loadd(7, va + 32 * CHUNK, CHUNK * 2);
          _tile_loadd(5, va + 48 * CHUNK, CHUNK * 2);
          _tile_dpbf16ps(2, 7, 4);
          _tile_dpbf16ps(3, 5, 4);
        }
      }
      _tile_stored(0, pvt + d0 * R, R * 4);
      _tile_stored(1, pvt + (d0 + 16) * R, R * 4);
      if (four) {
        _tile_stored(2, pvt + (d0 + 32) * R, R * 4);
        _tile_stored(3, pvt + (d0 + 48) * R, R * 4);
      }
    }
    for (int64_t d = 0; d < hd; ++d)
      _mm512_store_ps(ot + d * R, _mm512_fmadd_ps(_mm512_load_ps(ot + d * R), alpha, _mm512_load_ps(pvt + d * R)));
  }
  alignas(64) float inv[R];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  // row n of O: 16 of its dims at a time gathered from O^T (not 16 single-float stores read back as one vector,
  // which stalls on store forwarding; the same numbers)
  const __m512i dims = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(R));  // 16 consecutive dims' offsets in O^T
  for (int64_t n = 0; n < n_rows; ++n)
    for (int64_t d = 0; d < hd; d += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_i32gather_ps(dims, ot + d * R + n, 4), _mm512_set1_ps(inv[n]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + rows.offset[n] + d), (__m256i)_mm512_cvtneps_pbh(o));
    }
}
#endif
#endif

#if defined(MINIBATCH_SIMD)
// The float32 path: the same tiling on the machine's fp32 lanes (cpu_simd.h: 16 with AVX-512, 8 with AVX2 and FMA,
// what most laptops have), both products on fused multiply-adds. Only the keys are packed, transposed per chunk
// ([chunk][dim][CHUNK keys]: a row's scores for W keys are one multiply-add per dim); the values are read in place
// through the block table. P stays float32.
using minibatch::Simd;
constexpr int W = Simd::W;
constexpr int VG = W == 16 ? 4 : 2;  // vectors per register block: ROWS x VG sums + VG loads + 1 fit 32 zmm / 16 ymm

void pack_keys(const float* k_cache, const int64_t* table, int64_t block_size, int64_t h_kv, int64_t hd,
               int64_t kv_head, int64_t seq_len, float* kd) {
  const int64_t chunks = (seq_len + CHUNK - 1) / CHUNK;
  std::memset(kd, 0, chunks * CHUNK * hd * sizeof(float));
  const minibatch::PagedRows<float> row{k_cache, table, block_size, block_size * h_kv * hd, h_kv * hd, kv_head * hd};
  for (int64_t pos = 0; pos < seq_len; ++pos) {
    const float* k = row(pos);
    float* kc = kd + (pos / CHUNK) * hd * CHUNK + pos % CHUNK;
    for (int64_t d = 0; d < hd; ++d) kc[d * CHUNK] = k[d];
  }
}

// s[r][v0 W .. (v0 + N) W) = the R rows' queries times N vectors of the chunk's keys (kc: [hd][CHUNK]).
template <int R, int N>
inline void scores_f32(const float* const* q, const float* kc, int64_t hd, int v0, float* s) {
  Simd::V acc[R][N];
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) acc[r][c] = Simd::zero();
  for (int64_t d = 0; d < hd; ++d) {
    Simd::V kv[N];
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) kv[c] = Simd::load(kc + d * CHUNK + (v0 + c) * W);
    MINIBATCH_UNROLL for (int r = 0; r < R; ++r) {
      const Simd::V a = Simd::set1(q[r][d]);
      MINIBATCH_UNROLL for (int c = 0; c < N; ++c) acc[r][c] = Simd::fmadd(a, kv[c], acc[r][c]);
    }
  }
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) Simd::store(s + r * CHUNK + (v0 + c) * W, acc[r][c]);
}

// o[r][d0 .. d0 + N W) += sum over the chunk's first `keys` keys j of p[r][j] v_j (vrow[j]: key j's values).
template <int R, int N>
inline void weighted_sum_f32(const float* p, const float* const* vrow, int64_t keys, int64_t hd, int64_t d0,
                             float* o) {
  Simd::V acc[R][N];
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) acc[r][c] = Simd::load(o + r * hd + d0 + c * W);
  for (int64_t j = 0; j < keys; ++j) {
    Simd::V vv[N];
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) vv[c] = Simd::load(vrow[j] + d0 + c * W);
    MINIBATCH_UNROLL for (int r = 0; r < R; ++r) {
      const Simd::V a = Simd::set1(p[r * CHUNK + j]);
      MINIBATCH_UNROLL for (int c = 0; c < N; ++c) acc[r][c] = Simd::fmadd(a, vv[c], acc[r][c]);
    }
  }
  MINIBATCH_UNROLL for (int r = 0; r < R; ++r)
    MINIBATCH_UNROLL for (int c = 0; c < N; ++c) Simd::store(o + r * hd + d0 + c * W, acc[r][c]);
}

// the two products over n (1..N) vectors: the register block's size as a template argument
template <int R, int N>
inline void scores_upto(int n, const float* const* q, const float* kc, int64_t hd, int v0, float* s) {
  if constexpr (N > 1)
    if (n < N) return scores_upto<R, N - 1>(n, q, kc, hd, v0, s);
  scores_f32<R, N>(q, kc, hd, v0, s);
}

template <int R, int N>
inline void weighted_sum_upto(int n, const float* p, const float* const* vrow, int64_t keys, int64_t hd, int64_t d0,
                              float* o) {
  if constexpr (N > 1)
    if (n < N) return weighted_sum_upto<R, N - 1>(n, p, vrow, keys, hd, d0, o);
  weighted_sum_f32<R, N>(p, vrow, keys, hd, d0, o);
}

// task()'s float32 twin: R query rows of one (request, KV head), the keys from h.k, the values through the table
template <int R>
void task_f32(const Head& h, int64_t row0, const float* q, float* out, const minibatch::PagedRows<float>& values,
              int64_t heads, int64_t group, int64_t hd, float scale, int64_t window) {
  const TaskRows<R> rows(h, row0, heads, group, hd, window);
  const int64_t *pos = rows.pos, *offset = rows.offset, first = rows.first, last = rows.last;
  const float* qr[R];
  for (int r = 0; r < R; ++r) qr[r] = q + offset[r];
  const int64_t lo_pos = pos[0], hi_pos = pos[R - 1];
  alignas(64) float o[R * 256];
  alignas(64) float s[R * CHUNK];
  alignas(64) float lanes[W];
  const float* vrow[CHUNK];
  for (int i = 0; i < W; ++i) lanes[i] = static_cast<float>(i);
  const Simd::V lane = Simd::load(lanes), neg_inf = Simd::set1(-std::numeric_limits<float>::infinity());
  std::fill(o, o + R * hd, 0.0f);
  float m[R], l[R];
  for (int r = 0; r < R; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.0f;
  minibatch::PagedRows<float> v = values;
  v.table = h.table;
  v.lo = h.kv_head * hd;
  const float* kd = reinterpret_cast<const float*>(h.k);
  for (int64_t c = first; c <= last; ++c) {
    const int64_t base = c * CHUNK;
    const int64_t keys = std::min<int64_t>(CHUNK, hi_pos + 1 - base);
    const int nv = static_cast<int>((keys + W - 1) / W);
    for (int v0 = 0; v0 < nv; v0 += VG) scores_upto<R, VG>(std::min(VG, nv - v0), qr, kd + c * hd * CHUNK, hd, v0, s);
    const bool masked = base + CHUNK - 1 > lo_pos || (window > 0 && hi_pos - base >= window);
    for (int r = 0; r < R; ++r) {  // s becomes P in place
      Simd::V x[CHUNK / W];
      Simd::V top = neg_inf;
      for (int i = 0; i < nv; ++i) {
        x[i] = Simd::mul(Simd::load(s + r * CHUNK + i * W), Simd::set1(scale));
        if (masked) {
          const Simd::V key = Simd::add(lane, Simd::set1(static_cast<float>(base + i * W)));
          x[i] = Simd::select_le(key, Simd::set1(static_cast<float>(pos[r])), x[i], neg_inf);
          if (window > 0)
            x[i] = Simd::select_le(key, Simd::set1(static_cast<float>(pos[r] - window)), neg_inf, x[i]);
        }
        top = Simd::max(top, x[i]);
      }
      const float m_new = std::max(m[r], Simd::reduce_max(top));
      float* prow = s + r * CHUNK;
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible yet (a window's first chunks)
        std::fill(prow, prow + CHUNK, 0.0f);
        continue;
      }
      const float alpha = std::exp(m[r] - m_new);
      Simd::V sum = Simd::zero();
      for (int i = 0; i < nv; ++i) {  // e^-inf = 0 exactly (exp_lanes: 0 below -87)
        const Simd::V p = minibatch::exp_lanes(Simd::sub(x[i], Simd::set1(m_new)));
        sum = Simd::add(sum, p);
        Simd::store(prow + i * W, p);
      }
      l[r] = l[r] * alpha + Simd::reduce_add(sum);
      if (alpha != 1.0f) {
        float* orow = o + r * hd;
        for (int64_t d = 0; d < hd; d += W) Simd::store(orow + d, Simd::mul(Simd::load(orow + d), Simd::set1(alpha)));
      }
      m[r] = m_new;
    }
    for (int64_t j = 0; j < keys; ++j) vrow[j] = v(base + j);
    for (int64_t d0 = 0; d0 < hd; d0 += VG * W)
      weighted_sum_upto<R, VG>(static_cast<int>(std::min<int64_t>(VG, (hd - d0) / W)), s, vrow, keys, hd, d0, o);
  }
  for (int r = 0; r < R; ++r) {
    const Simd::V inv = Simd::set1(1.0f / l[r]);
    for (int64_t d = 0; d < hd; d += W) Simd::store(out + offset[r] + d, Simd::mul(Simd::load(o + r * hd + d), inv));
  }
}

void run_task_f32(int rows, const Head& h, int64_t row0, const float* q, float* out,
                  const minibatch::PagedRows<float>& values, int64_t heads, int64_t group, int64_t hd, float scale,
                  int64_t window) {
  switch (rows) {
    case 6: return task_f32<6>(h, row0, q, out, values, heads, group, hd, scale, window);
    case 5: return task_f32<5>(h, row0, q, out, values, heads, group, hd, scale, window);
    case 4: return task_f32<4>(h, row0, q, out, values, heads, group, hd, scale, window);
    case 3: return task_f32<3>(h, row0, q, out, values, heads, group, hd, scale, window);
    case 2: return task_f32<2>(h, row0, q, out, values, heads, group, hd, scale, window);
    default: return task_f32<1>(h, row0, q, out, values, heads, group, hd, scale, window);
  }
}
#endif

}  // namespace

bool prefill_available(const std::string& dtype) {
#if defined(MINIBATCH_PREFILL_BF16)
  if (dtype == "bfloat16") return true;
#endif
#if defined(MINIBATCH_SIMD)
  if (dtype == "float32") return true;
#endif
  return false;
}

// Causal attention for the prefills described by spans (P, 4) int64 rows [q_start, q_len, seq_len, table_row]: the
// q_len query rows from q_start in q (T, num_heads, head_dim) bf16 or float32 are the context's last q_len
// positions, and see its keys [0, position] (and, window > 0, only the last `window` of those) in k_cache, v_cache
// (num_blocks, block_size, num_kv_heads, head_dim) in q's dtype through tables[table_row] (N, max_blocks) int64.
// The K/V of every position, the new ones too, must already be in the cache. Writes those rows of out (T,
// num_heads, head_dim), q's dtype; other rows are left as they are.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                   torch::Tensor spans, double scale, int64_t window, torch::Tensor out) {
  RECORD_FUNCTION("minibatch::paged_prefill", std::vector<c10::IValue>());
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q.dim() == 3 && (bf16 || q.scalar_type() == torch::kFloat) && q.is_contiguous() && q.device().is_cpu(),
              "paged_prefill: q must be (T, num_heads, head_dim) bf16 or float32, contiguous, on the CPU");
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
  TORCH_CHECK(prefill_available(bf16 ? "bfloat16" : "float32"), "paged_prefill: this CPU or build has no ",
              bf16 ? "AVX512-BF16" : "AVX2 with FMA or AVX-512", " (check prefill_available first)");
#if defined(MINIBATCH_PREFILL_BF16) || defined(MINIBATCH_SIMD)
  // the packed keys (bf16: and values) of every (span, KV head), one buffer: padded x head_dim 4-byte words each
  std::vector<int64_t> offsets(n_spans * h_kv + 1, 0);
  for (int64_t i = 0; i < n_spans; ++i) {
    const int64_t padded = (sp[4 * i + 2] + CHUNK - 1) / CHUNK * CHUNK;
    for (int64_t g = 0; g < h_kv; ++g) offsets[i * h_kv + g + 1] = offsets[i * h_kv + g] + padded * hd;
  }
  std::unique_ptr<uint32_t[]> packed(new uint32_t[offsets.back()]);  // the packing writes every element
#if defined(MINIBATCH_PREFILL_AMX)
  const bool amx = bf16 && amx_prefill_fits(hd);
#else
  const bool amx = false;
#endif
  std::vector<Head> head(n_spans * h_kv);
  at::parallel_for(0, n_spans * h_kv, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const int64_t i = j / h_kv, g = j % h_kv, seq_len = sp[4 * i + 2];
      const int64_t* table = tb + sp[4 * i + 3] * max_blocks;
      uint32_t* kd = packed.get() + offsets[j];
      uint32_t* vd = kd + (offsets[j + 1] - offsets[j]) / 2;  // bf16: K's pairs, then V's
#if defined(MINIBATCH_PREFILL_BF16)
#if defined(MINIBATCH_PREFILL_AMX)
      if (amx)
        pack_head_amx(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), table, block_size, h_kv,
                      hd, g, seq_len, kd, vd);
      else
#endif
      if (bf16)
        pack_head(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), table, block_size, h_kv, hd, g,
                  seq_len, kd, vd);
#endif
#if defined(MINIBATCH_SIMD)
      if (!bf16)
        pack_keys(k_cache.data_ptr<float>(), table, block_size, h_kv, hd, g, seq_len, reinterpret_cast<float*>(kd));
#endif
      head[j] = Head{kd, vd, table, seq_len - sp[4 * i + 1], sp[4 * i], sp[4 * i + 1], g};
    }
  });
  // the tasks, longest first (the last rows of the longest contexts), handed out from a shared counter
  const int64_t task_rows = amx ? AMX_ROWS : ROWS;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (head index, first row)
  for (int64_t j = 0; j < n_spans * h_kv; ++j)
    for (int64_t r = 0; r < head[j].q_len * group; r += task_rows) tasks.emplace_back(j, r);
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) {
    return head[a.first].ctx + a.second / group > head[b.first].ctx + b.second / group;
  });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const void* qp = q.data_ptr();
  void* op = out.data_ptr();
#if defined(MINIBATCH_SIMD)
  // float32: the values are read in place (each task sets its table and KV head)
  const minibatch::PagedRows<float> values{static_cast<const float*>(v_cache.data_ptr()), nullptr, block_size,
                                           block_size * h_kv * hd, h_kv * hd, 0};
#endif
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#if defined(MINIBATCH_PREFILL_AMX)
    if (amx) amx_prefill_tiles();
#endif
    for (int64_t t; (t = next.fetch_add(1)) < n_tasks;) {
      const Head& h = head[tasks[t].first];
      const int64_t row0 = tasks[t].second, rows = std::min<int64_t>(task_rows, h.q_len * group - row0);
#if defined(MINIBATCH_PREFILL_AMX)
      if (amx) {
        amx_task(h, row0, rows, static_cast<const uint16_t*>(qp), static_cast<uint16_t*>(op), heads, group, hd,
                 static_cast<float>(scale), window);
        continue;
      }
#endif
#if defined(MINIBATCH_PREFILL_BF16)
      if (bf16)
        run_task(static_cast<int>(rows), h, row0, static_cast<const uint16_t*>(qp), static_cast<uint16_t*>(op),
                 heads, group, hd, static_cast<float>(scale), window);
#endif
#if defined(MINIBATCH_SIMD)
      if (!bf16)
        run_task_f32(static_cast<int>(rows), h, row0, static_cast<const float*>(qp), static_cast<float*>(op), values,
                     heads, group, hd, static_cast<float>(scale), window);
#endif
    }
#if defined(MINIBATCH_PREFILL_AMX)
    if (amx) _tile_release();
#endif
  });
#endif
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // also linked into the fused layer's extension: no module of its own there
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_available", &prefill_available,
        "whether this build runs paged_prefill in a dtype ('bfloat16': AVX512-BF16; 'float32': AVX2 with FMA or "
        "AVX-512)");
  m.def("paged_prefill", &paged_prefill, "causal attention of prefills over the paged cache, into out");
}
#endif
