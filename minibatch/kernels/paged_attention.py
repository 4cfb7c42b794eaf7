"""Paged attention: queries attend to K/V read block by block through a block table.

vLLM PagedAttention (Kwon et al., SOSP'23 §4.1): a request's KV cache lives in fixed-size blocks
scattered over the cache; its block table maps logical block i (positions i*block_size ..) to a
physical block. The kernel never sees a contiguous context, it translates every position:

    block_tables[r] = [7, 2, 5, <padding>]      block_size = 4, seq_lens[r] = 10
    position:  0  1  2  3 |  4  5  6  7 |  8  9
    block:     7          |  2          |  5
    slot:     28 29 30 31 |  8  9 10 11 | 20 21
    slot = block_tables[r, pos // block_size] * block_size + pos % block_size

The context is consumed in tiles of BLOCK_N positions with the online softmax of FlashAttention
(Dao et al., NeurIPS'22 §3.1, Algorithm 1): keep a running max m, running sum l and unnormalised output acc; for each
tile of scores s,
    m_new = max(m, max(s));  alpha = exp(m - m_new);  p = exp(s - m_new)
    l = l * alpha + sum(p);  acc = acc * alpha + p @ V;  m = m_new
and out = acc / l at the end: exact softmax, one pass, never the whole score row in memory.
Because every position is translated on its own, block_size can be any int >= 1.

Two kernels: decode (one query per sequence) and prefill (packed queries, causal, with earlier
context from the cache, so also chunked prefill and prefix-cache hits; q_len == 1 works too).
GQA: query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minibatch.kernels.triton_probe import HAS_TRITON, IS_INTERPRETED, require_triton
from minibatch.kernels.store_kv import check_kv_cache

# Tile sizes. tl.dot needs every dim >= 16 on NVIDIA GPUs; small tiles also keep the
# interpreter (CPU) fast and make the tests cross several tiles with short contexts.
DECODE_BLOCK_N = 32
PREFILL_BLOCK_M = 16
PREFILL_BLOCK_N = 32
# Triton's interpreter stores bf16 as raw 16-bit integers: loads, stores and `.to(tl.float32)` are exact, but bf16
# arithmetic and tl.dot compute on the integer bit patterns, and its fp32 -> bf16 `.to` truncates instead of
# rounding to nearest even (probed in tests/test_kernels.py). So, interpreted, the prefill kernel upcasts its
# q/k/v tiles to fp32 (the decode kernel always does) and torch rounds bf16 outputs; compiled, tl.dot takes the
# bf16/fp16 tiles as they are, with an fp32 accumulator.
PREFILL_FP32_TILES = IS_INTERPRETED

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, q_ptr,  # (num_seqs, num_heads, head_dim)
        k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer
        block_tables_ptr,  # (num_seqs, max_blocks)
        seq_lens_ptr,  # (num_seqs,)
        scale,
        block_size, num_queries_per_kv, head_dim,
        stride_q_seq, stride_q_head, stride_out_seq, stride_out_head, stride_bt_seq,
        stride_cache_block, stride_cache_offset, stride_cache_head,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per (sequence, query head): a (head_dim,) query against the whole context."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // num_queries_per_kv  # GQA
        seq_len = tl.load(seq_lens_ptr + seq)

        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + offs_d, mask=mask_d, other=0.0)
        q = q.to(tl.float32)  # (BLOCK_D,)

        m_i = -float("inf")  # running max of the scores
        l_i = 0.0  # running sum of exp(score - m_i)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp(score - m_i) * v
        for start_n in range(0, seq_len, BLOCK_N):
            pos = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) context positions of this tile
            mask_n = pos < seq_len
            block_id = tl.load(block_tables_ptr + seq * stride_bt_seq + pos // block_size, mask=mask_n, other=0)
            slot_offs = block_id.to(tl.int64) * stride_cache_block + (pos % block_size) * stride_cache_offset
            kv_offs = slot_offs[:, None] + kv_head * stride_cache_head + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + kv_offs, mask=mask_nd, other=0.0).to(tl.float32)

            # A single query row: a broadcast multiply-and-sum instead of tl.dot (which needs >= 16 rows).
            s = tl.sum(k * q[None, :], axis=1) * scale  # (BLOCK_N,)
            s = tl.where(mask_n, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: position 0 is in the first tile
            alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
            p = tl.exp(s - m_new)  # (BLOCK_N,), 0 where masked
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new

        out = acc / l_i
        tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=mask_d)

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr, q_ptr,  # (num_tokens, num_heads, head_dim), packed over requests
        k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer
        block_tables_ptr,  # (num_reqs, max_blocks)
        seq_lens_ptr,  # (num_reqs,)
        cu_seqlens_q_ptr,  # (num_reqs + 1,)
        scale,
        block_size, num_queries_per_kv, head_dim,
        stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_bt_req,
        stride_cache_block, stride_cache_offset, stride_cache_head,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_TILES: tl.constexpr,
    ):
        """One program per (request, query head, tile of BLOCK_M queries).

        Request r's q_len queries are the last q_len positions of its seq_len-token context:

            positions  0 ........ context_len-1 | context_len ... seq_len-1
                       cached in earlier steps  | this step's queries (K/V already stored)

        Query j sits at position context_len + j and sees keys 0 .. context_len + j.
        FP32_TILES: upcast q/k/v tiles to fp32 before the dots (else tl.dot takes q's dtype, P is rounded to it).
        """
        req = tl.program_id(0)
        head = tl.program_id(1)
        tile_m = tl.program_id(2)
        kv_head = head // num_queries_per_kv  # GQA
        q_start = tl.load(cu_seqlens_q_ptr + req)
        q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
        if tile_m * BLOCK_M >= q_len:  # the grid is sized for the longest request
            return
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len

        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the request
        mask_m = offs_m < q_len
        pos_q = context_len + offs_m  # (BLOCK_M,) query positions
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q_offs = (q_start + offs_m)[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        if FP32_TILES:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max per query row
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator per row
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Causal: this tile's last query sees keys up to position context_len + last offs_m.
        end_n = context_len + tl.minimum((tile_m + 1) * BLOCK_M, q_len)
        for start_n in range(0, end_n, BLOCK_N):
            pos_k = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
            mask_n = pos_k < seq_len
            block_id = tl.load(block_tables_ptr + req * stride_bt_req + pos_k // block_size, mask=mask_n, other=0)
            slot_offs = block_id.to(tl.int64) * stride_cache_block + (pos_k % block_size) * stride_cache_offset
            kv_offs = slot_offs[:, None] + kv_head * stride_cache_head + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=mask_nd, other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=mask_nd, other=0.0)
            if FP32_TILES:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            # "ieee": fp32 inputs are not rounded to tf32 (bf16/fp16 inputs are unaffected).
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_N)
            causal = (pos_k[None, :] <= pos_q[:, None]) & mask_n[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every row
            alpha = tl.exp(m_i - m_new)  # (BLOCK_M,)
            p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N), 0 where masked
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / l_i[:, None]
        out_offs = (q_start + offs_m)[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _check_attention_args(q, kv_cache, layer, block_tables, seq_lens, num_reqs) -> tuple[int, int]:
    """Shared checks; returns (block_size, num_queries_per_kv)."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache, layer)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q must be (num_tokens, num_heads, head_dim={head_dim}) with num_heads a multiple of "
            f"num_kv_heads={num_kv_heads}, got {tuple(q.shape)}"
        )
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match kv_cache dtype {kv_cache.dtype}")
    int_dtypes = (torch.int32, torch.int64)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_reqs or block_tables.dtype not in int_dtypes:
        raise ValueError(
            f"block_tables must be int32/int64 (num_reqs={num_reqs}, max_blocks), "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (num_reqs,) or seq_lens.dtype not in int_dtypes:
        raise ValueError(f"seq_lens must be int32/int64 ({num_reqs},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("q", q), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    return block_size, q.shape[1] // num_kv_heads


def _out_buffer(q: torch.Tensor) -> torch.Tensor:
    """The kernels' output, like q; fp32 for bf16 under the interpreter (its bf16 cast truncates, torch rounds)."""
    return torch.empty_like(q, dtype=torch.float32 if IS_INTERPRETED and q.dtype == torch.bfloat16 else q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention over the paged cache (Triton): one query per sequence.

    q: (num_seqs, num_heads, head_dim), sequence i's query at position seq_lens[i] - 1; its K/V
        are already in the cache. Same dtype as kv_cache.
    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
    block_tables: (num_seqs, max_blocks) int32 or int64; entries past a sequence's last block are ignored.
    seq_lens: (num_seqs,) int32 or int64, each >= 1: sequence i attends to positions 0 .. seq_lens[i] - 1.
    Returns (num_seqs, num_heads, head_dim) in q's dtype (fp32 accumulation).

    Raises:
        ValueError: kv_cache not 6-D with dim 1 == 2, or its last dim not contiguous; layer outside
            [0, num_layers); q not (num_seqs, num_heads, head_dim) with num_heads a multiple of
            num_kv_heads, or q's dtype not kv_cache's; block_tables / seq_lens of the wrong shape or
            not int32/int64; q, block_tables or seq_lens on another device than kv_cache; q's last dim
            not contiguous.
        RuntimeError: from ``require_triton``: triton cannot be imported; the kernels were compiled
            for the GPU but the tensors are not on CUDA; or triton was imported before
            TRITON_INTERPRET=1 was set, so the interpreter cannot run them.

    One program per (sequence, query head), a 2-D grid: the simplest mapping, since a single
    query needs no matmul. With GQA the num_heads // num_kv_heads programs of a group each read
    the same K/V tiles; on a GPU the repeats mostly hit L2. Production kernels (vLLM v1,
    Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023)) give one program the whole group, and split
    long contexts across programs.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_queries_per_kv = _check_attention_args(q, kv_cache, layer, block_tables, seq_lens, num_seqs)
    require_triton(q.device)
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dim (head_dim)")
    out = _out_buffer(q)
    if num_seqs == 0:
        return out.to(q.dtype)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]  # (num_blocks, block_size, num_kv_heads, head_dim)
    _paged_decode_kernel[(num_seqs, num_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, scale,
        block_size, num_queries_per_kv, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache (Triton).

    q: (num_tokens, num_heads, head_dim), same dtype as kv_cache. Request r's queries are rows
        cu_seqlens_q[r] : cu_seqlens_q[r + 1]; with q_len their count, query j sits at position
        seq_lens[r] - q_len + j and attends to keys 0 .. that position. All keys come from the
        cache (the new tokens' K/V must be stored first): earlier chunks or a prefix-cache hit
        are included. q_len == 1 (decode) and q_len == seq_len (fresh prefill) are special cases.
    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).
    block_tables: (num_reqs, max_blocks) int32 or int64; entries past a request's last block are ignored.
    seq_lens: (num_reqs,) int32 or int64, cached + new tokens, >= q_len >= 1.
    cu_seqlens_q: (num_reqs + 1,) int32 or int64 offsets, cu_seqlens_q[0] == 0.
    max_q_len: the longest q_len, if the caller knows it (else read from cu_seqlens_q: a sync).
    Returns (num_tokens, num_heads, head_dim) in q's dtype (fp32 accumulation). Compiled, bf16/fp16
    tiles go to tl.dot as they are and P is rounded to q's dtype for P @ V; interpreted, all math is fp32.

    Grid: (num_reqs, num_heads, cdiv(max_q_len, BLOCK_M)); programs past a request's q_len exit.

    Raises:
        ValueError: as ``paged_decode_attention`` (with num_reqs = len(cu_seqlens_q) - 1 rows in
            block_tables / seq_lens), and cu_seqlens_q not 1-D int32/int64 or not on q's device.
        RuntimeError: from ``require_triton``, as ``paged_decode_attention``.
    """
    num_reqs = cu_seqlens_q.shape[0] - 1
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_queries_per_kv = _check_attention_args(q, kv_cache, layer, block_tables, seq_lens, num_reqs)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_q must be int32/int64 (num_reqs + 1,), got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device} but q is on {q.device}")
    require_triton(q.device)
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dim (head_dim)")
    out = _out_buffer(q)
    if num_reqs == 0 or num_tokens == 0:
        return out.to(q.dtype)
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]  # (num_blocks, block_size, num_kv_heads, head_dim)
    grid = (num_reqs, num_heads, triton.cdiv(max_q_len, PREFILL_BLOCK_M))
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
        block_size, num_queries_per_kv, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        FP32_TILES=PREFILL_FP32_TILES,
    )
    return out.to(q.dtype)


# ---- pure-torch references -------------------------------------------------------------------


def gather_context(
    kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V, (seq_len, num_kv_heads, head_dim) each, in position order."""
    block_size = kv_cache.shape[3]
    pos = torch.arange(seq_len, device=kv_cache.device)  # (seq_len,)
    block_ids = block_table[pos // block_size].long()  # (seq_len,) physical block of each position
    offsets = pos % block_size
    return kv_cache[layer, 0, block_ids, offsets], kv_cache[layer, 1, block_ids, offsets]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len positions of a context, in fp32.

    q: (q_len, num_heads, head_dim); k, v: (seq_len, num_kv_heads, head_dim), seq_len >= q_len.
    Returns (q_len, num_heads, head_dim) in q's dtype.
    """
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_dim): GQA heads share K/V
    v = v.float().repeat_interleave(group, dim=1)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # (q_len, 1)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # (q_len, seq_len), True = visible
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # (num_heads, q_len, head_dim)
    return out.transpose(0, 1).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Pure-torch reference for ``paged_decode_attention`` (same arguments and result).

    Raises:
        ValueError: the argument checks of ``paged_decode_attention`` except q's contiguity.
            No Triton needed, so no RuntimeError.
    """
    _check_attention_args(q, kv_cache, layer, block_tables, seq_lens, q.shape[0])
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, layer, block_tables[i], seq_len)
        out[i] = attention_ref(q[i : i + 1], k, v, scale)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference for ``paged_prefill_attention`` (same arguments and result).

    Raises:
        ValueError: the checks on kv_cache, layer, q, block_tables and seq_lens of
            ``paged_decode_attention``; cu_seqlens_q and q's contiguity are not checked.
            No Triton needed, so no RuntimeError.
    """
    _check_attention_args(q, kv_cache, layer, block_tables, seq_lens, cu_seqlens_q.shape[0] - 1)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, layer, block_tables[r], seq_len)
        out[cu[r] : cu[r + 1]] = attention_ref(q[cu[r] : cu[r + 1]], k, v, scale)
    return out
