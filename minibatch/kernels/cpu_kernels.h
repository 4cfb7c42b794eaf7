// The C++ CPU kernels that minibatch/kernels/cpu_decode_layer.cpp calls directly (one extension built from the
// seven sources, with -DMINIBATCH_KERNEL_LIBRARY so that only the layer's source defines a Python module).
#pragma once

#include <torch/extension.h>

// cpu_linear.cpp: x (..., k) float32 times a weight packed by pack_weight, (ceil(n / 16), k, 16), plus bias.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);

// cpu_paged_decode.cpp: one-token queries q (n, num_heads, head_dim) against caches (num_blocks, block_size,
// num_kv_heads, head_dim) read through tables (n, max_blocks) int64 up to seq_lens (n,) int64; window 0 = none.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale, int64_t window);

// cpu_amx_linear.cpp: x (m, k) bf16 times a weight oneDNN prepacked (mkldnn::_reorder_linear_weight) on AMX, plus
// bias; amx_layout_ok: whether this process runs AMX and packed holds weight in the layout amx_linear reads.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
bool amx_layout_ok(torch::Tensor packed, torch::Tensor weight);

// cpu_bf16_linear.cpp: the same with AVX512-BF16 (VDPBF16PS) where oneDNN's layout is AB16b64a2b; bf16_layout_ok:
// whether this build runs it and packed holds weight in that layout.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
bool bf16_layout_ok(torch::Tensor packed, torch::Tensor weight);

// cpu_paged_prefill.cpp: causal bf16 or float32 attention of the prefills in spans (P, 4) int64 [q_start, q_len,
// seq_len, table_row] over the caches through tables (N, max_blocks) int64, into those rows of out (q's shape);
// window 0 = none.
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                   torch::Tensor spans, double scale, int64_t window, torch::Tensor out);

// cpu_argmax.cpp: torch.argmax(logits, -1) of (rows, vocab) float32 or bf16 logits with contiguous rows, (rows,) int64;
// greedy_argmax_vectorized: whether this build runs it on vector lanes (else a scalar loop, slower than torch's).
torch::Tensor greedy_argmax(torch::Tensor logits);
bool greedy_argmax_vectorized();
