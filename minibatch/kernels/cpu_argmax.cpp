// The greedy token of every row of a step's logits on a CPU: torch.argmax(logits, -1)'s indices (the first of tied
// maxima; a NaN counts as the largest, the first NaN wins) in one pass over each row, rows split over the threads.
//
// Why: torch's CPU argmax over a row is a scalar loop, and its max over bf16 runs through float conversions one
// vector at a time; the sampler's two passes of torch reductions (runner/sampler.py's two_pass_argmax) took 0.53 ms
// at 32 rows of a 49152-entry bf16 vocabulary on a 2-core Xeon with AMX, about 1.5% of a 32-request decode step,
// and this kernel 0.10 ms (data/cpu/greedy_argmax_bfloat16.json, benchmarks/greedy_argmax.py).
// Here every lane keeps its running maximum and the index where it first reached it (a strictly greater value
// replaces both, so ties keep the earlier index), and its first NaN; at the row's end the lanes are merged by the
// same rules. Built into the fused decode layer's extension (cpu_decode_layer.cpp exports it), which the `cpp`
// attention backend builds anyway.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_simd.h"

namespace {

float value(const float* row, int64_t j) { return row[j]; }
float value(const at::BFloat16* row, int64_t j) { return static_cast<float>(row[j]); }

// The scalar rule from position `from` on, given the best (value, index) so far and the first NaN so far (or -1).
template <typename T>
int64_t finish(const T* row, int64_t from, int64_t n, float best, int64_t at, int64_t first_nan) {
  for (int64_t j = from; j < n && first_nan < 0; ++j) {
    const float v = value(row, j);
    if (std::isnan(v)) first_nan = j;
    else if (v > best) best = v, at = j;
  }
  return first_nan >= 0 ? first_nan : at;
}

#if defined(__AVX512F__)  // cpu_simd.h's Simd is AVX-512's 16 lanes here; its masks are used directly
using minibatch::Simd;
constexpr int64_t W = Simd::W;

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  if (n < W) return finish(row, 0, n, -std::numeric_limits<float>::infinity(), 0, -1);
  const int64_t full = n / W * W;
  const __m512i step = _mm512_set1_epi32(W);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = idx, nan_at = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
  for (int64_t j = 0; j < full; j += W, idx = _mm512_add_epi32(idx, step)) {
    const __m512 v = Simd::load(row + j);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ), nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, greater, v);
    at = _mm512_mask_mov_epi32(at, greater, idx);
    nan_at = _mm512_mask_min_epi32(nan_at, nan, nan_at, idx);
  }
  const int32_t first_nan = _mm512_reduce_min_epi32(nan_at);
  if (first_nan != std::numeric_limits<int32_t>::max()) return first_nan;
  const float m = _mm512_reduce_max_ps(best);  // no lane holds a NaN: only greater values were taken
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  const int32_t lane_at = _mm512_mask_reduce_min_epi32(top, at);
  return finish(row, full, n, m, lane_at, -1);
}
#else
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  return finish(row, 0, n, -std::numeric_limits<float>::infinity(), 0, -1);
}
#endif

}  // namespace

// logits: (rows, vocab) float32 or bf16 on the CPU, each row contiguous (vocab >= 1, < 2^31). Returns (rows,) int64:
// torch.argmax(logits, -1).
torch::Tensor greedy_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) >= 1 &&
                  logits.size(1) < std::numeric_limits<int32_t>::max() && logits.stride(1) == 1 &&
                  (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16),
              "greedy_argmax: logits must be (rows, vocab) float32 or bf16 on the CPU with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  // rows over the threads, at least 64K entries of them per task (a short vocabulary's rows stay together)
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      o[r] = logits.scalar_type() == torch::kFloat32 ? row_argmax(logits.data_ptr<float>() + r * stride, n)
                                                     : row_argmax(logits.data_ptr<at::BFloat16>() + r * stride, n);
  });
  return out;
}

bool greedy_argmax_vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
