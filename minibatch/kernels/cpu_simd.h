// Vector lanes shared by the C++ CPU kernels (cpu_paged_decode.cpp, cpu_decode_layer.cpp, cpu_paged_prefill.cpp's
// float32 path): the Simd operations over the machine's width and e^x on lanes. MINIBATCH_SIMD is defined where
// they exist (AVX-512, or AVX2 with FMA); elsewhere the kernels run their plain C++ loops.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minibatch {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MINIBATCH_SIMD 1
// W fp32 lanes (AVX-512: 16; AVX2 with FMA: 8, which most laptop CPUs without AVX-512 have), the operations the
// kernels use, written once over the width.
#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // W values of a row as fp32 lanes (bf16: zero-extend and shift into the top half; fp16: the hardware conversion)
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  // for the softmax: lane-wise max (b when either is NaN), sum, round to nearest, 2^k of integer-valued k,
  // zero where x < limit (NaN kept)
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float limit, V value) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_NLT_UQ), value);
  }
  // lanes where a <= b: x, else y (a mask's blend)
  static V select_le(V a, V b, V x, V y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static V load(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // the lanes rounded to bf16 as at::BFloat16(float) rounds (to nearest, ties to even; any NaN -> 0x7FC0), as float32
  // lanes; store: lanes that are already bf16 values (round_bf16's) as W bf16
  static V round_bf16(V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm512_castsi512_ps(
        _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
  }
  static void store(at::BFloat16* p, V v) {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  // W dot products' partial sums in, their W totals out: lane j of the result is the sum of v[j]'s lanes. A
  // transposing tree (pairs within 128-bit lanes, then across them): 45 shuffles and adds for 16 sums instead of a
  // full horizontal reduction per sum.
  static V sum(const V* v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; ++k)
      t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {
      const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
      u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
  }
};
#else
struct Simd {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V floor(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float limit, V value) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_NLT_UQ), value);
  }
  static V select_le(V a, V b, V x, V y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
  static float reduce_max(V v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return *std::max_element(lanes, lanes + 8);
  }
  static float reduce_add(V v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
  static V load(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static V round_bf16(V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7FFF));
    const __m256 r = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_add_epi32(u, bias), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  static void store(at::BFloat16* p, V v) {
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
  }
  static V load(const at::Half* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float narrow[8];
    for (int j = 0; j < 8; ++j) narrow[j] = static_cast<float>(p[j]);
    return _mm256_loadu_ps(narrow);
#endif
  }
  // lane j of the result is the sum of v[j]'s 8 lanes: horizontal adds pair the lanes within 128-bit halves, then
  // the two halves are added (14 instructions for 8 sums)
  static V sum(const V* v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#endif
template <typename T>
inline Simd::V load_lanes(const T* p) { return Simd::load(p); }
inline Simd::V load_lanes(const double* p) {
  float narrow[Simd::W];
  for (int j = 0; j < Simd::W; ++j) narrow[j] = static_cast<float>(p[j]);
  return Simd::load(narrow);
}

// e^x on W lanes, in the steps of the scalar exp_nonpositive (cpu_paged_decode.cpp; scalar compilers do not
// vectorize its rounding): x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
// below 3e-7), times 2^k built in the exponent bits as two factors 2^floor(k/2) 2^(k - floor(k/2)), each a normal
// float for every k the clamp allows (so e^88.5 is finite and e^x, x > 88.73, is inf). Below -87: 0 (e^x would be
// below float32's smallest normal). A NaN stays NaN.
inline Simd::V exp_lanes(Simd::V x) {
  const Simd::V clamped = Simd::min(Simd::set1(89.0f), Simd::max(Simd::set1(-87.0f), x));  // NaN: x
  const Simd::V k = Simd::round(Simd::mul(clamped, Simd::set1(1.44269504088896341f)));
  const Simd::V r = Simd::fmadd(k, Simd::set1(2.12194440e-4f), Simd::fmadd(k, Simd::set1(-0.693359375f), clamped));
  Simd::V p = Simd::set1(1.0f / 720.0f);
  for (float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = Simd::fmadd(p, r, Simd::set1(c));
  const Simd::V half = Simd::floor(Simd::mul(k, Simd::set1(0.5f)));
  const Simd::V scaled = Simd::mul(Simd::mul(p, Simd::pow2(half)), Simd::pow2(Simd::sub(k, half)));
  return Simd::zero_below(x, -87.0f, scaled);
}
#endif

// Ask for the cache line at p into L2 (prefetcht1 on x86), as an asm statement the compiler has to keep: GCC 12
// deleted loops of __builtin_prefetch once they sat in a small function it judged free of side effects (a whole
// pass's prefetches vanished from the binary without a warning, and the decode attention ran 0.6x as fast from
// memory).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  asm volatile("prefetcht1 %0" : : "m"(*p));
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#endif
}

// Where a request's context position `pos` lies in a paged cache, read through its block table: block
// table[pos / block_size], slot pos % block_size (strides in elements), plus `lo`, the first value the caller reads
// in that token's row (its first KV head's). One definition for every kernel that walks a block table.
template <typename T>
struct PagedRows {
  const T* cache;
  const int64_t* table;
  int64_t block_size, block_stride, token_stride, lo;
  const T* operator()(int64_t pos) const {
    return cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + lo;
  }
};

// Ask for the rows of context positions [from, to) (`bytes` each; row_of(pos) points at the first) before they are
// read: a block table scatters them, so the hardware prefetcher cannot guess the next one. Into L2 (prefetcht1,
// locality 2), not L1: a chunk's rows are ~100 lines, likely more than L1 tracks in flight. On an AMD EPYC (Zen 4,
// AVX512-BF16, no AMX) one layer's decode attention at batch 32, context 256, K/V from memory, took 0.35 instead of
// 0.52 ms in bf16 and 0.79 instead of 0.89 ms in fp32, no slower with K/V warm (scratch A/B in one process).
template <typename RowOf>
inline void prefetch_positions(RowOf row_of, int64_t from, int64_t to, int64_t bytes) {
  for (int64_t pos = from; pos < to; ++pos) {
    const char* next = reinterpret_cast<const char*>(row_of(pos));
    for (int64_t e = 0; e < bytes; e += 64) prefetch_l2(next + e);
  }
}

}  // namespace minibatch
