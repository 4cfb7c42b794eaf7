// Paged decode attention on a CPU: every one-token query reads its K/V through its block table, in place.
//
// vLLM's PagedAttention decode (Kwon et al., SOSP'23, section 4.1) as a plain C++ loop nest, built at first use by
// torch.utils.cpp_extension (minibatch/kernels/cpu_decode.py). One task per request (or per (request, KV head)
// when there are few requests): the `group` query heads that share a KV head read each key and value once. Scores,
// softmax and the weighted sum are fp32 whatever the cache dtype; with a bf16 cache on a CPU with AVX512-BF16 the
// scores and the weighted sum multiply bf16 pairs exactly into fp32 sums instead (cpu_paged_bf16.h: the rows are read
// as stored, and the softmax's weights are rounded to bf16 for the sum, as torch's CPU flash attention does), and
// with AMX the scores are tile products (a block's 16 keys times the query heads sharing them). The output is in
// the query's dtype. Parallel over tasks with ATen's thread pool (torch's thread count).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_paged_bf16.h"
#include "cpu_simd.h"

namespace {

// One row of head_dim values as fp32. bf16 is the top half of an fp32: a shift, which the compiler vectorizes.
template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n, uint32_t*) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n, uint32_t* bits) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < n; ++d) bits[d] = static_cast<uint32_t>(raw[d]) << 16;
  std::memcpy(dst, bits, n * sizeof(float));
}

// A dot product of fp32 rows. With AVX-512: 16 lanes of fused multiply-adds and one horizontal sum. Elsewhere,
// 16 partial sums added up as a tree, which compilers vectorize for the machine's own width (a plain
// `s += a[d] * b[d]` loop is either not vectorized or ends in 16 dependent scalar adds).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  s = _mm512_reduce_add_ps(acc);
#else
  float part[16] = {};
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[d + j] * b[d + j];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  s = part[0];
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// exp(x) for x <= 0 (a softmax's scores minus their max), in a form compilers vectorize (libm's expf is a call
// per element): x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error
// below 3e-7 there), times 2^k built in the exponent bits. Below -87, exp underflows fp32: 0.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float k = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = (clamped - k * 0.693359375f) + k * 2.12194440e-4f;  // ln2 split in two for precision
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Softmax in place along each of `rows` rows of `n` scores (row r at scores + r x stride), fp32.
inline void softmax_rows(float* scores, int64_t rows, int64_t n, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) m = std::max(m, s[p]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < n; ++p) {
      s[p] = exp_nonpositive(s[p] - m);
      total += s[p];
    }
    const float inv = 1.0f / total;
    for (int64_t p = 0; p < n; ++p) s[p] *= inv;
  }
}

// Ask for a block's rows [h0 x head_dim, h1 x head_dim) of every token before they are read (the blocks of a
// table are scattered, so the hardware prefetcher cannot guess the next one).
template <typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t block_size, int64_t token_stride, int64_t lo, int64_t hi) {
#if defined(__GNUC__) || defined(__clang__)
  const int64_t step = 64 / static_cast<int64_t>(sizeof(scalar_t));  // one cache line
  for (int64_t t = 0; t < block_size; ++t)
    for (int64_t e = lo; e < hi; e += step) __builtin_prefetch(block + t * token_stride + e);
#endif
}

// acc[0 .. D) += sum over t < nt of w[t] x v[t x stride .. + D). With D known at compile time (HD > 0) the sums stay
// in registers across the tokens; otherwise in memory.
template <int HD>
inline void weighted_sum(float* acc, const float* w, const float* v, int64_t nt, int64_t stride, int64_t head_dim) {
  if constexpr (HD > 0) {
    float r[HD];
    for (int d = 0; d < HD; ++d) r[d] = acc[d];
    for (int64_t t = 0; t < nt; ++t) {
      const float wt = w[t];
      const float* vt = v + t * stride;
      for (int d = 0; d < HD; ++d) r[d] += wt * vt[d];
    }
    for (int d = 0; d < HD; ++d) acc[d] = r[d];
  } else {
    for (int64_t t = 0; t < nt; ++t) {
      const float wt = w[t];
      const float* vt = v + t * stride;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += wt * vt[d];
    }
  }
}

// One request's KV heads [h0, h1): q and out point at its (num_heads, head_dim) rows. HD: head_dim when it is
// known at compile time (64, 128), else 0.
template <typename scalar_t, int HD>
void decode_task(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 int64_t seq_len, int64_t start, int64_t h0, int64_t h1, int64_t group, int64_t head_dim,
                 int64_t block_size, int64_t token_stride, float scale, scalar_t* out, std::vector<float>& buf,
                 std::vector<uint32_t>& bits) {
  if constexpr (HD > 0) head_dim = HD;
  const int64_t n_pos = seq_len - start, heads = (h1 - h0) * group, width = (h1 - h0) * head_dim;
  const int64_t lo = h0 * head_dim, block_stride = block_size * token_stride;
  // buf: the heads' queries, a block's rows of these KV heads, heads x n_pos scores, heads x head_dim sums
  const int64_t size = heads * head_dim + block_size * width + heads * n_pos + heads * head_dim;
  if (static_cast<int64_t>(buf.size()) < size) buf.resize(size);
  if (static_cast<int64_t>(bits.size()) < width) bits.resize(width);
  float* qf = buf.data();
  float* row = qf + heads * head_dim;
  float* scores = row + block_size * width;
  float* acc = scores + heads * n_pos;
  std::fill(acc, acc + heads * head_dim, 0.0f);
  for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = static_cast<float>(q[h0 * group * head_dim + i]) * scale;
  const int64_t first = start / block_size, last = (seq_len - 1) / block_size;
  // scores: block by block through the table; each key converted once, dotted with every query head sharing it
  for (int64_t b = first, p = 0; b <= last; ++b) {
    const scalar_t* block = k_cache + table[b] * block_stride;
    if (b < last) prefetch_block(k_cache + table[b + 1] * block_stride, block_size, token_stride, lo, lo + width);
    const int64_t t_end = std::min(block_size, seq_len - b * block_size);
    for (int64_t t = std::max<int64_t>(0, start - b * block_size); t < t_end; ++t, ++p) {
      load_row(block + t * token_stride + lo, row, width, bits.data());
      for (int64_t hq = 0; hq < heads; ++hq)
        scores[hq * n_pos + p] = dot(qf + hq * head_dim, row + (hq / group) * head_dim, head_dim);
    }
  }
  softmax_rows(scores, heads, n_pos, n_pos);  // along the context, fp32
  for (int64_t b = first, p = 0; b <= last; ++b) {  // weighted sum: a block's values converted, then summed per head
    const scalar_t* block = v_cache + table[b] * block_stride;
    if (b < last) prefetch_block(v_cache + table[b + 1] * block_stride, block_size, token_stride, lo, lo + width);
    const int64_t t0 = std::max<int64_t>(0, start - b * block_size), t_end = std::min(block_size, seq_len - b * block_size);
    for (int64_t t = t0; t < t_end; ++t) load_row(block + t * token_stride + lo, row + (t - t0) * width, width, bits.data());
    for (int64_t hq = 0; hq < heads; ++hq)
      weighted_sum<HD>(acc + hq * head_dim, scores + hq * n_pos + p, row + (hq / group) * head_dim, t_end - t0, width,
                       head_dim);
    p += t_end - t0;
  }
  for (int64_t i = 0; i < heads * head_dim; ++i) out[h0 * group * head_dim + i] = static_cast<scalar_t>(acc[i]);
}

#if defined(MINIBATCH_SIMD)
// The vector path for head_dim 64 and 128 (HD), written once over `Simd` (cpu_simd.h). Tokens in chunks of W, each
// chunk's rows of one KV head converted to fp32 once and shared by the `group` query heads that read them.
using minibatch::Simd;
using minibatch::exp_lanes;
using minibatch::load_lanes;

// softmax_rows with W lanes at a time (the scalar exp_nonpositive for a row's last n % W scores)
inline void softmax_rows_simd(float* scores, int64_t rows, int64_t n, int64_t stride) {
  constexpr int W = Simd::W;
  const int64_t full = n / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    Simd::V mv = Simd::set1(-std::numeric_limits<float>::infinity());
    for (int64_t p = 0; p < full; p += W) mv = Simd::max(mv, Simd::load(s + p));
    float m = Simd::reduce_max(mv);
    for (int64_t p = full; p < n; ++p) m = std::max(m, s[p]);
    const Simd::V mb = Simd::set1(m);
    Simd::V tv = Simd::zero();
    for (int64_t p = 0; p < full; p += W) {
      const Simd::V e = exp_lanes(Simd::fmadd(mb, Simd::set1(-1.0f), Simd::load(s + p)));
      Simd::store(s + p, e);
      tv = Simd::add(tv, e);
    }
    float total = Simd::reduce_add(tv);
    for (int64_t p = full; p < n; ++p) {
      s[p] = exp_nonpositive(s[p] - m);
      total += s[p];
    }
    const Simd::V inv = Simd::set1(1.0f / total);
    for (int64_t p = 0; p < full; p += W) Simd::store(s + p, Simd::mul(Simd::load(s + p), inv));
    for (int64_t p = full; p < n; ++p) s[p] *= 1.0f / total;
  }
}

constexpr int64_t PREFETCH_AHEAD = 32;  // positions (a multiple of 16: amx_scores prefetches whole chunks)

// The cache rows of context positions [c, c + m) (m <= W), KV heads [h0, h0 + width / HD): each position's
// `width` values are contiguous in its token row; converted to fp32 into rows[W][width] (positions past m are
// zero). The next chunks' rows are prefetched. (Reading a float32 cache's rows in place instead, without the copy,
// was faster with the cache in L3 but slower from memory, as a decode step reads it, in a scratch A/B.)
template <typename scalar_t, int HD>
inline void load_chunk(const scalar_t* cache, const int64_t* table, int64_t c, int64_t m, int64_t end, bool first,
                       int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t lo, int64_t width,
                       float* rows) {
  constexpr int W = Simd::W;
  const minibatch::PagedRows<scalar_t> row_of{cache, table, block_size, block_stride, token_stride, lo};
  for (int64_t j = 0; j < m; ++j) {
    const scalar_t* src = row_of(c + j);
    for (int64_t e = 0; e < width; e += W) Simd::store(rows + j * width + e, load_lanes(src + e));
  }
  for (int64_t j = m; j < W; ++j)
    for (int64_t e = 0; e < width; e += W) Simd::store(rows + j * width + e, Simd::zero());
  // the positions PREFETCH_AHEAD on (at the first chunk, all of those up to there), below `end`
  minibatch::prefetch_positions(row_of, first ? c + W : c + PREFETCH_AHEAD, std::min(end, c + PREFETCH_AHEAD + W),
                                width * static_cast<int64_t>(sizeof(scalar_t)));
}

// The task a thread runs after this one (its keys are asked for while this one's values are summed): its block
// table, first position, number of positions and first value in a token row; n = 0: none.
struct NextTask {
  const int64_t* table = nullptr;
  int64_t start = 0, n = 0, lo = 0;
};

// decode_task's contract (below), for head_dim == HD in {64, 128}. Two passes over the context, W positions at a
// time, each reading the positions' rows of all the task's KV heads as one contiguous run: scores, softmax, then
// the weighted sum of the values.
template <typename scalar_t, int HD>
void decode_task_simd(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                      int64_t seq_len, int64_t start, int64_t h0, int64_t h1, int64_t group, int64_t block_size,
                      int64_t token_stride, float scale, scalar_t* out, std::vector<float>& buf, const NextTask& next) {
  constexpr int W = Simd::W, NV = HD / W;
  using V = Simd::V;
  const int64_t n_pos = seq_len - start, n_pad = (n_pos + W - 1) / W * W, block_stride = block_size * token_stride;
  const int64_t heads = (h1 - h0) * group, width = (h1 - h0) * HD, lo = h0 * HD;
  // buf: heads x n_pad scores, heads x HD sums, W positions' rows, heads x HD queries
  const int64_t size = heads * n_pad + heads * HD + W * width + heads * HD;
  if (static_cast<int64_t>(buf.size()) < size) buf.resize(size);
  float* scores = buf.data();
  float* acc = scores + heads * n_pad;
  float* rows = acc + heads * HD;
  float* qf = rows + W * width;
#if defined(__AVX512BF16__)
  constexpr bool bf16_pairs = std::is_same_v<scalar_t, at::BFloat16> && HD % 32 == 0;  // cpu_paged_bf16.h's paths
#else
  constexpr bool bf16_pairs = false;
#endif
  if constexpr (!bf16_pairs)  // those read q as it is
    for (int64_t i = 0; i < heads * HD; ++i) qf[i] = static_cast<float>(q[h0 * group * HD + i]);
  auto chunk = [&](const scalar_t* cache, int64_t c) {  // loads the chunk at c; returns how many positions it holds
    const int64_t m = std::min<int64_t>(W, n_pos - c);
    load_chunk<scalar_t, HD>(cache, table, start + c, m, seq_len, c == 0, block_size, block_stride, token_stride, lo,
                             width, rows);
    return m;
  };
#if defined(__AVX512BF16__)
  if constexpr (bf16_pairs) {  // the keys read as bf16, no conversion: on AMX tiles where they fit, else vdpbf16ps
#if defined(MINIBATCH_AMX)
    // `rows` (W x width floats, free until the weighted sum) is amx_scores' buffer: with group <= 16 and HD >= 64
    // it holds the query tiles and a chunk's scores
    if (minibatch::amx_scores_fit(block_size, HD, group))
      minibatch::amx_scores<HD>(q + h0 * group * HD, k_cache, table, start, n_pos, n_pad, heads, group, block_size,
                                block_stride, token_stride, lo, width, scale, scores, rows, PREFETCH_AHEAD);
    else
#endif
      minibatch::bf16_scores<HD>(q + h0 * group * HD, k_cache, table, start, n_pos, n_pad, heads, group, block_size,
                                 block_stride, token_stride, lo, width, scale, scores, PREFETCH_AHEAD,
                                 {reinterpret_cast<const uint16_t*>(v_cache), table, block_size, block_stride,
                                  token_stride, lo}, start, n_pos);
  } else
#endif
  for (int64_t c = 0; c < n_pos; c += W) {  // scores: q . k of W positions at a time, scaled
    chunk(k_cache, c);
    for (int64_t hq = 0; hq < heads; ++hq) {
      const float* kh = rows + (hq / group) * HD;
      V qv[NV], part[W];
      for (int v = 0; v < NV; ++v) qv[v] = Simd::load(qf + hq * HD + v * W);
      for (int j = 0; j < W; ++j) {
        V a = Simd::mul(qv[0], Simd::load(kh + j * width));
        for (int v = 1; v < NV; ++v) a = Simd::fmadd(qv[v], Simd::load(kh + j * width + v * W), a);
        part[j] = a;
      }
      Simd::store(scores + hq * n_pad + c, Simd::mul(Simd::sum(part), Simd::set1(scale)));
    }
  }
  softmax_rows_simd(scores, heads, n_pos, n_pad);  // along the context, fp32
#if defined(__AVX512BF16__)
  if constexpr (bf16_pairs) {
    minibatch::bf16_weighted_sum<HD>(v_cache, table, start, n_pos, n_pad, heads, group, block_size, block_stride,
                                     token_stride, lo, width, scores, acc, rows, PREFETCH_AHEAD,
                                     {reinterpret_cast<const uint16_t*>(k_cache), next.table, block_size,
                                      block_stride, token_stride, next.lo}, next.start, next.n);
  } else
#endif
  {
    std::fill(acc, acc + heads * HD, 0.0f);
    for (int64_t c = 0; c < n_pos; c += W) {  // weighted sum of the values; a head's sums in registers per chunk
      const int64_t m = chunk(v_cache, c);
      for (int64_t hq = 0; hq < heads; ++hq) {
        const float* vh = rows + (hq / group) * HD;
        const float* w = scores + hq * n_pad + c;
        V r[NV];
        for (int v = 0; v < NV; ++v) r[v] = Simd::load(acc + hq * HD + v * W);
        for (int64_t j = 0; j < m; ++j) {
          const V wj = Simd::set1(w[j]);
          for (int v = 0; v < NV; ++v) r[v] = Simd::fmadd(wj, Simd::load(vh + j * width + v * W), r[v]);
        }
        for (int v = 0; v < NV; ++v) Simd::store(acc + hq * HD + v * W, r[v]);
      }
    }
  }
  for (int64_t i = 0; i < heads * HD; ++i) out[h0 * group * HD + i] = static_cast<scalar_t>(acc[i]);
}
#endif

}  // namespace

// q: (n, num_heads, head_dim); k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous;
// tables: (n, max_blocks) int64; seq_lens: (n,) int64, each >= 1; window: 0 = none, else each query sees the last
// `window` keys of its context. Returns (n, num_heads, head_dim) in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale, int64_t window) {
  // a named range for torch's profiler (free when it is off): `python -m minibatch profile` credits it to attention
  RECORD_FUNCTION("minibatch::paged_decode", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: q must be (n, num_heads, head_dim) and k_cache, v_cache "
              "(num_blocks, block_size, num_kv_heads, head_dim) of one shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_decode: q and the cache differ in dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "paged_decode: int64 tables");
  q = q.contiguous();
  tables = tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), max_blocks = tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "paged_decode: head geometry");
  TORCH_CHECK(tables.size(0) == n && seq_lens.size(0) == n, "paged_decode: one table and length per query");
  const int64_t group = num_heads / num_kv_heads;
  auto out = torch::empty_like(q);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // every block a query reads must exist: never read outside the cache
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "paged_decode: seq_len out of its table");
    for (int64_t b = 0; b * block_size < lens[i]; ++b) {
      const int64_t block = table_data[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "paged_decode: block id ", block, " outside the cache");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t token_stride = num_kv_heads * head_dim;
    // a task is one request's KV heads: all of them (each block read as one contiguous run) when there are enough
    // requests to keep every thread busy, else one KV head per task
    const int64_t per_task = n >= 2 * at::get_num_threads() ? num_kv_heads : 1;
    const int64_t splits = num_kv_heads / per_task;
    at::parallel_for(0, n * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      std::vector<uint32_t> bits;
      const auto first_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, lens[i] - window) : 0; };
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / splits, h0 = (task % splits) * per_task;
        const int64_t start = first_of(i);
#if defined(MINIBATCH_SIMD)
        if (head_dim == 64 || head_dim == 128) {
          NextTask next;
          if (task + 1 < end) {
            const int64_t i2 = (task + 1) / splits;
            next = {tp + i2 * max_blocks, first_of(i2), lens[i2] - first_of(i2),
                    ((task + 1) % splits) * per_task * head_dim};
          }
          auto fast = head_dim == 64 ? decode_task_simd<scalar_t, 64> : decode_task_simd<scalar_t, 128>;
          fast(qp + i * num_heads * head_dim, kp, vp, tp + i * max_blocks, lens[i], start, h0, h0 + per_task, group,
               block_size, token_stride, static_cast<float>(scale), op + i * num_heads * head_dim, buf, next);
          continue;
        }
#endif
        auto task_fn = head_dim == 64 ? decode_task<scalar_t, 64>
                       : head_dim == 128 ? decode_task<scalar_t, 128> : decode_task<scalar_t, 0>;
        task_fn(qp + i * num_heads * head_dim, kp, vp, tp + i * max_blocks, lens[i], start, h0, h0 + per_task, group,
                head_dim, block_size, token_stride, static_cast<float>(scale), op + i * num_heads * head_dim, buf, bits);
      }
    });
  });
  return out;
}

#ifndef MINIBATCH_KERNEL_LIBRARY  // built into the fused decode layer's extension: no module of its own
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (one-token queries) reading K/V by block table");
}
#endif
