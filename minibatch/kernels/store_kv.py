"""store_kv: scatter the K/V of this step's new tokens into their paged-cache slots.

vLLM PagedAttention (Kwon et al., SOSP'23 §4.1) stores a request's KV cache in fixed-size blocks
that need not be contiguous; vLLM's ``reshape_and_cache`` kernel is this function. The cache
layout, fixed by the project:

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), index 0 = K, 1 = V

A token's *slot* names one (block, offset) pair: slot = block_id * block_size + offset. The
scheduler hands every new token a slot (``slot_mapping``); -1 marks a padding token whose K/V
must not be written.

    slot_mapping = [9, -1, 4]     block_size = 4
    token 0 -> slot 9 = block 2, offset 1
    token 1 -> skipped (padding)
    token 2 -> slot 4 = block 1, offset 0
"""

from __future__ import annotations

import torch

from minibatch.kernels.triton_probe import HAS_TRITON, IS_INTERPRETED, require_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr,  # (num_tokens, num_kv_heads, head_dim)
        k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer
        slot_mapping_ptr,  # (num_tokens,)
        block_size, num_kv_heads, head_dim,
        stride_key_token, stride_key_head,
        stride_value_token, stride_value_head,
        stride_cache_block, stride_cache_offset, stride_cache_head,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per token: copy its (num_kv_heads, head_dim) K and V tiles."""
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block_id * stride can pass 2**31
        if slot < 0:  # padding token
            return
        block_id = slot // block_size
        offset = slot % block_size

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)  # last dims are contiguous (checked by the wrapper)
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]  # (BLOCK_H, BLOCK_D)

        key_offs = token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
        value_offs = token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :]
        key = tl.load(key_ptr + key_offs, mask=mask)
        value = tl.load(value_ptr + value_offs, mask=mask)
        cache_offs = block_id * stride_cache_block + offset * stride_cache_offset  # the slot's start
        cache_offs += offs_h[:, None] * stride_cache_head + offs_d[None, :]  # (BLOCK_H, BLOCK_D)
        tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_cache(kv_cache: torch.Tensor, layer: int) -> tuple[int, int, int, int]:
    """Validate the cache layout; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"layer must be in [0, {kv_cache.shape[0]}), got {layer}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dim (head_dim) must be contiguous")
    _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def _check_store_args(kv_cache, layer, key, value, slot_mapping) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache, layer)
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key and value must be (num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be int32/int64 of shape ({num_tokens},), "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def store_kv(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token i's K/V into ``kv_cache[layer, 0/1]`` at slot ``slot_mapping[i]``, in place (Triton).

    kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), any float dtype.
    key, value: (num_tokens, num_kv_heads, head_dim), cast to the cache dtype; last dim contiguous.
    slot_mapping: (num_tokens,) int32 or int64; slot = block_id * block_size + offset, -1 = skip.
    Slots must be distinct and < num_blocks * block_size (not checked: that would sync with the
    GPU). Returns None. A bf16/fp16 key into a cache of the same dtype is copied bit for bit.

    Raises:
        ValueError: kv_cache not 6-D with dim 1 == 2, or its last dim not contiguous; layer outside
            [0, num_layers); key / value not (num_tokens, num_kv_heads, head_dim) matching the cache;
            slot_mapping not (num_tokens,) int32/int64; key, value or slot_mapping on another device
            than kv_cache; key's or value's last dim not contiguous.
        RuntimeError: from ``require_triton``: triton cannot be imported; the kernels were compiled
            for the GPU but kv_cache is not on CUDA; or triton was imported before TRITON_INTERPRET=1
            was set, so the interpreter cannot run them.
    """
    _check_store_args(kv_cache, layer, key, value, slot_mapping)
    require_triton(kv_cache.device)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last dim (head_dim)")
    if IS_INTERPRETED and kv_cache.dtype == torch.bfloat16:
        # the interpreter's cast to bf16 truncates; torch rounds to nearest even, like the compiled kernel
        key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]  # (num_blocks, block_size, num_kv_heads, head_dim)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], num_kv_heads, head_dim,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_ref(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch reference for ``store_kv``: same arguments, same in-place effect.

    Raises:
        ValueError: the checks of ``store_kv`` except the contiguity of key / value; no RuntimeError.
    """
    _check_store_args(kv_cache, layer, key, value, slot_mapping)
    _, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    keep = slot_mapping >= 0  # (num_tokens,) False on padding
    slots = slot_mapping[keep].long()
    # slot s = block_id * block_size + offset, so (block_id, offset) = divmod(s, block_size)
    kv_cache[layer, 0, slots // block_size, slots % block_size] = key[keep].to(kv_cache.dtype)
    kv_cache[layer, 1, slots // block_size, slots % block_size] = value[keep].to(kv_cache.dtype)
