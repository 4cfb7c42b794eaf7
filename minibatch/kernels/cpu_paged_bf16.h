// The paged decode kernel's bf16 paths on CPUs with AVX512-BF16 (cpu_paged_decode.cpp's decode_task_simd calls
// them for a bf16 cache and head_dim a multiple of 32): q . k and the weighted sum of the values by `vdpbf16ps`,
// which multiplies bf16 pairs exactly and adds them into fp32 lanes, so the cache's rows are read as they are
// stored, never converted to fp32 first; on CPUs with AMX, q . k on tiles instead (amx_scores, at the end).
// `ahead`: how many positions ahead the next rows are prefetched. Both passes ask for the rows of the chunk `ahead`
// positions on a share at a time, one share per query head of the loop, not all ~100 lines at once: a core keeps
// only a few dozen lines in flight, so a burst stalls it until most have left, and the arithmetic between the
// prefetches waited on memory instead of overlapping it. On the Zen 4 EPYC, 32 requests of 256 tokens, K/V from
// memory, one layer took 0.30 instead of 0.37 ms (benchmarks/cpu_decode_memory.py, data/cpu/cpu_decode_memory.json).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_amx.h"
#include "cpu_simd.h"

#if defined(__AVX512BF16__)
namespace minibatch {

// The rows a pass asks for ahead of itself: its own, positions [start, start + n), and past them the first rows of
// the pass that follows it (`then`, positions [then_start, then_start + then_n)): the values after the keys, the next
// task's keys after the values. So no pass starts on rows nobody asked for (a pass's first chunks waited on memory
// with nothing else running beside them). On the Zen 5 EPYC, 32 requests of 256 tokens, K/V from memory: one layer
// 1.07-1.12x as fast, 0.92-0.95x with one layer's K/V warm in the caches (data/cpu/cpu_decode_memory_zen5_stream.json);
// whole bf16 decode steps of 8/32/64 requests 1.03-1.06x, 1.01-1.03x, 1.02x in two A/B runs
// (data/cpu/fused_layers_bfloat16_stream.json).
struct RowStream {
  PagedRows<uint16_t> rows;
  int64_t start, n;
  PagedRows<uint16_t> then;
  int64_t then_start, then_n;
  // ask for the rows of stream positions [from, to), `bytes` each, those past the stream's end left out
  void prefetch(int64_t from, int64_t to, int64_t bytes) const {
    if (from < n) prefetch_positions(rows, start + from, start + std::min(to, n), bytes);
    if (to > n)
      prefetch_positions(then, then_start + std::max<int64_t>(from - n, 0), then_start + std::min(to - n, then_n),
                         bytes);
  }
};

// The scores of a bf16 cache on CPUs with AVX512-BF16: q . k for W = 16 positions at a time straight from the cache
// rows, by `vdpbf16ps` (each fp32 lane adds two exact bf16 products), so the keys are never converted to fp32. The
// sums round in another order than the fp32 path's (pairs first), within its bf16 tolerance. q and the rows stay bf16
// bits; `scale` is applied to the sums, as on the fp32 path.
template <int HD>
inline void bf16_scores(const at::BFloat16* q_rows, const at::BFloat16* k_cache, const int64_t* table, int64_t start,
                        int64_t n_pos, int64_t n_pad, int64_t heads, int64_t group, int64_t block_size,
                        int64_t block_stride, int64_t token_stride, int64_t lo, int64_t width, float scale,
                        float* scores, int64_t ahead, const PagedRows<uint16_t>& then, int64_t then_start,
                        int64_t then_n) {
  constexpr int W = 16, NV = HD / 32;  // 32 bf16 values per register
  const uint16_t* q = reinterpret_cast<const uint16_t*>(q_rows);
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(k_cache);
  const RowStream stream{{cache, table, block_size, block_stride, token_stride, lo}, start, n_pos, then, then_start,
                         then_n};
  const __m512 sv = _mm512_set1_ps(scale);
  if (n_pos > W) stream.prefetch(W, std::min(n_pos, ahead), width * 2);
  for (int64_t c = 0; c < n_pos; c += W) {
    const int64_t m = std::min<int64_t>(W, n_pos - c);
    const uint16_t* rows[W];
    for (int64_t j = 0; j < m; ++j) rows[j] = stream.rows(start + c + j);
    const int64_t pf_from = c + ahead, pf_to = c + ahead + W;
    for (int64_t hq = 0; hq < heads; ++hq) {
      const int64_t a = pf_from + (pf_to - pf_from) * hq / heads, b = pf_from + (pf_to - pf_from) * (hq + 1) / heads;
      stream.prefetch(a, b, width * 2);
      const int64_t kh = (hq / group) * HD;
      __m512bh qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(q + hq * HD + v * 32);
      __m512 part[W];
      for (int j = 0; j < W; ++j) {
        __m512 a = _mm512_setzero_ps();
        if (j < m)  // the chunk's positions past the context score 0 (their weights are never used)
          for (int v = 0; v < NV; ++v)
            a = _mm512_dpbf16_ps(a, qv[v], (__m512bh)_mm512_loadu_si512(rows[j] + kh + v * 32));
        part[j] = a;
      }
      _mm512_storeu_ps(scores + hq * n_pad + c, _mm512_mul_ps(Simd::sum(part), sv));
    }
  }
}

// The weighted sum of a bf16 cache's values on CPUs with AVX512-BF16, by `vdpbf16ps` on pairs of positions: the
// weights (fp32 probabilities) are rounded to bf16 once, as torch's CPU flash attention does before its P x V
// product, and each fp32 lane adds w[j] v[j][d] + w[j+1] v[j+1][d], exact products. Two positions' rows are
// interleaved once per chunk (into `buffer`, at least 8 x width floats) and shared by the `group` query heads of
// their KV head. acc (heads x HD) ends in head-dim order.
template <int HD>
inline void bf16_weighted_sum(const at::BFloat16* v_cache, const int64_t* table, int64_t start, int64_t n_pos,
                              int64_t n_pad, int64_t heads, int64_t group, int64_t block_size, int64_t block_stride,
                              int64_t token_stride, int64_t lo, int64_t width, float* scores, float* acc, float* buffer,
                              int64_t ahead, const PagedRows<uint16_t>& then, int64_t then_start, int64_t then_n) {
  constexpr int W = 16, NH = HD / 32, NR = 2 * NH;  // a head's row in NH registers of 32 values; NR sums
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(v_cache);
  uint16_t* pairs = reinterpret_cast<uint16_t*>(buffer);
  const RowStream stream{{cache, table, block_size, block_stride, token_stride, lo}, start, n_pos, then, then_start,
                         then_n};
  for (int64_t hq = 0; hq < heads; ++hq) {  // each row's weights to bf16, in place at the start of its fp32 row
    float* s = scores + hq * n_pad;
    for (int64_t p = 0; p < n_pad; p += W) {
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + p));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(s) + p), b);
    }
  }
  std::fill(acc, acc + heads * HD, 0.0f);
  const int64_t kv_heads = width / HD;
  if (n_pos > W) stream.prefetch(W, std::min(n_pos, ahead), width * 2);
  for (int64_t c = 0; c < n_pos; c += W) {
    const int64_t m = std::min<int64_t>(W, n_pos - c);
    const int64_t pf_from = c + ahead, pf_to = c + ahead + W;
    for (int64_t jp = 0; jp < (m + 1) / 2; ++jp) {  // positions c + 2jp and c + 2jp + 1 interleaved value by value
      const uint16_t* a = stream.rows(start + c + 2 * jp);
      const uint16_t* b = 2 * jp + 1 < m ? stream.rows(start + c + 2 * jp + 1) : nullptr;
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        for (int h = 0; h < NH; ++h) {
          const __m512i ra = _mm512_loadu_si512(a + kv * HD + h * 32);
          const __m512i rb = b ? _mm512_loadu_si512(b + kv * HD + h * 32) : _mm512_setzero_si512();
          uint16_t* dst = pairs + ((kv * (W / 2) + jp) * NH + h) * 64;
          _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(ra, rb));
          _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi16(ra, rb));
        }
    }
    for (int64_t hq = 0; hq < heads; ++hq) {
      const int64_t pa = pf_from + (pf_to - pf_from) * hq / heads, pb = pf_from + (pf_to - pf_from) * (hq + 1) / heads;
      stream.prefetch(pa, pb, width * 2);
      const uint16_t* pk = pairs + (hq / group) * (W / 2) * NH * 64;
      const uint16_t* wb = reinterpret_cast<const uint16_t*>(scores + hq * n_pad) + c;
      __m512 r[NR];
      for (int k = 0; k < NR; ++k) r[k] = _mm512_loadu_ps(acc + hq * HD + k * 16);
      for (int64_t jp = 0; jp < (m + 1) / 2; ++jp) {
        uint32_t wpair;
        std::memcpy(&wpair, wb + 2 * jp, sizeof(wpair));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wpair));
        for (int k = 0; k < NR; ++k)
          r[k] = _mm512_dpbf16_ps(r[k], (__m512bh)_mm512_loadu_si512(pk + (jp * NH) * 64 + k * 32), w);
      }
      for (int k = 0; k < NR; ++k) _mm512_storeu_ps(acc + hq * HD + k * 16, r[k]);
    }
  }
  // unpacklo/hi work within 128-bit lanes: a half's low sums hold dims 8L..8L+3 of lane L, its high sums 8L+4..8L+7
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t hq = 0; hq < heads; ++hq)
    for (int h = 0; h < NH; ++h) {
      float* a = acc + hq * HD + h * 32;
      const __m512 low = _mm512_loadu_ps(a), high = _mm512_loadu_ps(a + 16);
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(low, first, high));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(low, second, high));
    }
}

}  // namespace minibatch
#endif

#if defined(MINIBATCH_AMX)
namespace minibatch {

// Whether amx_scores takes a task: AMX granted, chunks of 16 positions lie inside one block, a head is whole 64-value
// tile pairs, and a KV head's query heads fit one tile's 16 columns.
inline bool amx_scores_fit(int64_t block_size, int64_t head_dim, int64_t group) {
  return block_size % 16 == 0 && head_dim % 64 == 0 && group <= 16 && amx_permitted();
}

// bf16_scores' contract on AMX (cpu_amx.h), where amx_scores_fit: the keys of 16 positions of one block (one KV
// head's 32 values of each) are an A tile loaded straight from the cache (rows a token_stride apart), the query
// heads sharing that KV head a B tile (their 32 values as VNNI pairs, arranged once per task in `buffer`), and
// TDPBF16PS sums the 16 x group scores in fp32 (bf16 products exact; the sums in another order than bf16_scores',
// within its bf16 tolerance; AMX reads bf16 subnormals as zero). A chunk starts at a multiple of 16, so a sliding
// window's first chunk and the context's last one hold rows outside [start, start + n_pos): their scores are never
// stored (and a row past the context may be anything, even NaN, without reaching the output); the padding up to
// n_pad is set to 0, as bf16_scores leaves it. buffer: at least width / 2 * group + 16 * heads_pad floats,
// heads_pad = heads rounded up to 16. Tiles 0-4 are configured here and released at the end.
template <int HD>
inline void amx_scores(const at::BFloat16* q_rows, const at::BFloat16* k_cache, const int64_t* table, int64_t start,
                       int64_t n_pos, int64_t n_pad, int64_t heads, int64_t group, int64_t block_size,
                       int64_t block_stride, int64_t token_stride, int64_t lo, int64_t width, float scale,
                       float* scores, float* buffer, int64_t ahead) {
  constexpr int NH = HD / 32;  // tile-wide slices of a head (even: HD % 64 == 0)
  const int64_t kv_heads = width / HD, heads_pad = (heads + 15) / 16 * 16;
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q_rows);
  uint32_t* qb = reinterpret_cast<uint32_t*>(buffer);  // [kv head][slice][pair r][query head j]
  for (int64_t kh = 0; kh < kv_heads; ++kh)
    for (int s = 0; s < NH; ++s)
      for (int r = 0; r < 16; ++r)
        for (int64_t j = 0; j < group; ++j)
          qb[((kh * NH + s) * 16 + r) * group + j] = q_pairs[(kh * group + j) * (HD / 2) + s * 16 + r];
  float* sums = buffer + width / 2 * group;  // 16 positions x heads_pad: one chunk's scores, position-major
  TileConfig cfg{};
  cfg.palette = 1;
  const int64_t colsb[5] = {group * 4, 64, 64, group * 4, group * 4};  // tile 0: sums, 1-2: keys, 3-4: queries
  for (int t = 0; t < 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(colsb[t]);
  _tile_loadconfig(&cfg);
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(k_cache);
  const PagedRows<uint16_t> row_of{cache, table, block_size, block_stride, token_stride, lo};
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(heads_pad)));
  const int64_t end = start + n_pos, row_bytes = token_stride * 2;
  auto prefetch_chunk = [&](int64_t c) {  // a chunk's 16 rows are consecutive in its block
    if (c >= end) return;
    const char* p = reinterpret_cast<const char*>(row_of(c));
    for (int64_t e = 0; e < 15 * row_bytes + width * 2; e += 64) _mm_prefetch(p + e, _MM_HINT_T0);
  };
  const int64_t first = start - start % 16;
  for (int64_t c = first; c < first + ahead; c += 16) prefetch_chunk(c + 16);
  for (int64_t c = first; c < end; c += 16) {
    const uint16_t* rows = row_of(c);
    prefetch_chunk(c + ahead);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      _tile_zero(0);
      for (int s = 0; s < NH; s += 2) {
        _tile_loadd(1, rows + kh * HD + s * 32, row_bytes);
        _tile_loadd(2, rows + kh * HD + (s + 1) * 32, row_bytes);
        _tile_loadd(3, qb + (kh * NH + s) * 16 * group, group * 4);
        _tile_loadd(4, qb + (kh * NH + s + 1) * 16 * group, group * 4);
        _tile_dpbf16ps(0, 1, 3);
        _tile_dpbf16ps(0, 2, 4);
      }
      _tile_stored(0, sums + kh * group, heads_pad * 4);
    }
    // lane j: position c + j, scores index c + j - start (masked-off lanes are not touched, so the row's base may
    // lie before `scores` at a window's first chunk); stored where that index is in [0, n_pad), 0 from n_pos on
    const int64_t from = std::max<int64_t>(0, start - c), valid = std::min<int64_t>(16, end - c);
    const int64_t stored = std::min<int64_t>(16, start + n_pad - c);
    const auto bits = [](int64_t k) { return static_cast<uint32_t>((uint64_t{1} << k) - 1); };
    const __mmask16 keep = static_cast<__mmask16>(bits(valid) & ~bits(from));
    const __mmask16 write = static_cast<__mmask16>(bits(stored) & ~bits(from));
    for (int64_t hq = 0; hq < heads; ++hq) {
      const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(hq))), sums, 4);
      _mm512_mask_storeu_ps(scores + hq * n_pad + (c - start), write, _mm512_maskz_mul_ps(keep, v, sv));
    }
  }
  _tile_release();
}

}  // namespace minibatch
#endif
