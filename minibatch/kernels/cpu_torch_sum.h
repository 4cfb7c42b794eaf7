// torch's float32 sum of a contiguous row, in the order its CPU kernel adds the numbers, so that a kernel can compute
// at::mean's result bit for bit without calling it (the fused decode layer's RMSNorm: inside a decode step the
// call's dispatch and TensorIterator set-up cost ~30 us of cold caches, 60 times a step).
//
// The order is ATen's cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp): a row of d >= W numbers is read as
// d / W vectors of W lanes (its Vectorized<float>; torch 2.13's sum on an AVX-512 Xeon matches W = 8), summed by
// row_sum (four interleaved partial sums, each a multi_row_sum cascade of up to four levels of 2^p
// vectors, p = max(4, ceil(log2(count)) / 4)), then the last d % W numbers and the W lanes are added to 0 one by one;
// a row of d < W numbers is the same row_sum on single numbers. torch's CPU mean is that sum divided by d
// (ReduceOps.cpp, mean_out). Which W torch uses is not visible from here, and a future torch may change the
// order: row_sum_mode() tries 16 and 8 against torch's own mean once per row width and answers 0 (keep at::mean)
// unless one of them gives its bits exactly.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

// No fused multiply-adds here: a square added into a sum must round twice, as torch's separate kernels do.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace minibatch {

// row_sum over `size` items (load(i): item i; add: their sum): ATen's row_sum and multi_row_sum.
template <typename T, typename Load, typename Add>
T aten_row_sum(Load load, int64_t size, Add add, T zero) {
  const int64_t count = size / 4;  // rows of four: four interleaved partial sums
  const int64_t log2 = count <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(count - 1));  // CeilLog2
  const int64_t power = std::max<int64_t>(4, log2 / 4), step = int64_t{1} << power, mask = step - 1;
  T acc[4][4];
  for (auto& level : acc)
    for (auto& a : level) a = zero;
  int64_t i = 0;
  while (i + step <= count) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], load(i * 4 + k));
    for (int j = 1; j < 4; ++j) {  // a full level carries into the next one up
      for (int k = 0; k < 4; ++k) acc[j][k] = add(acc[j][k], acc[j - 1][k]), acc[j - 1][k] = zero;
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < count; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], load(i * 4 + k));
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], acc[j][k]);
  for (int64_t r = count * 4; r < size; ++r) acc[0][0] = add(acc[0][0], load(r));
  for (int k = 1; k < 4; ++k) acc[0][0] = add(acc[0][0], acc[0][k]);
  return acc[0][0];
}

// torch's float32 sum of item(0) .. item(d - 1) with W-lane vectors (see the top of this file).
template <int W, typename Item>
float aten_sum(Item item, int64_t d) {
  const auto scalar_add = [](float a, float b) { return a + b; };
  if (d < W) return 0.0f + aten_row_sum<float>(item, d, scalar_add, 0.0f);
  using Lanes = std::array<float, W>;
  const auto load = [&](int64_t v) {
    Lanes l;
    for (int k = 0; k < W; ++k) l[k] = item(v * W + k);
    return l;
  };
  const auto add = [](Lanes a, const Lanes& b) {
    for (int k = 0; k < W; ++k) a[k] += b[k];
    return a;
  };
  const int64_t vectors = d / W;
  const Lanes lanes = aten_row_sum<Lanes>(load, vectors, add, Lanes{});
  float total = 0.0f;
  for (int64_t k = vectors * W; k < d; ++k) total += item(k);
  for (int k = 0; k < W; ++k) total += lanes[k];
  return 0.0f + total;  // the output starts at 0 and the sum is added to it
}

// torch's x.float().pow(2).mean() of one bf16 row of d numbers, its sum in the order of W-lane vectors.
template <int W>
float aten_mean_of_squares(const at::BFloat16* row, int64_t d) {
  const auto square = [row](int64_t i) {
    const float v = static_cast<float>(row[i]);
    return v * v;
  };
  return aten_sum<W>(square, d) / static_cast<float>(d);
}

// Which lane count reproduces torch's mean of the squares of rows of d bf16 numbers here: 16 or 8, or 0 (neither:
// keep at::mean; also for d >= 32768, where torch may split one row's sum between threads). Tried once per d on
// fixed rows of numbers from 1e-3 to 1e3, then remembered.
inline int row_sum_mode(int64_t d) {
  if (d <= 0 || d >= 32768) return 0;
  static std::mutex lock;
  static std::map<int64_t, int> known;
  std::lock_guard<std::mutex> guard(lock);
  const auto found = known.find(d);
  if (found != known.end()) return found->second;
  constexpr int64_t rows = 8;
  auto probe = torch::empty({rows, d}, torch::kFloat32);
  float* p = probe.data_ptr<float>();
  uint32_t state = 12345u;
  for (int64_t i = 0; i < rows * d; ++i) {
    state = state * 1664525u + 1013904223u;
    p[i] = std::ldexp(static_cast<float>(state >> 8) / 16777216.0f + 0.5f, static_cast<int>(state % 21) - 10);
  }
  const auto x = probe.to(torch::kBFloat16);
  const auto mean = x.to(torch::kFloat32).pow(2).mean(-1, true);
  const float* want = mean.data_ptr<float>();
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  int mode = 0;
  for (const int w : {16, 8}) {
    bool same = true;
    for (int64_t r = 0; r < rows && same; ++r) {
      const float got = w == 16 ? aten_mean_of_squares<16>(xs + r * d, d) : aten_mean_of_squares<8>(xs + r * d, d);
      same = std::memcmp(&got, &want[r], sizeof(float)) == 0;
    }
    if (same) {
      mode = w;
      break;
    }
  }
  known[d] = mode;
  return mode;
}

}  // namespace minibatch

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
