"""The packed attention pieces against a naive softmax(QK^T)V written out by hand."""

import torch

from minibatch.runner.backends.torch_ref import batched_decode_attention, reference_attention, store_kv
from minibatch.runner.batch import context_slot_table


def naive(q, k, v, scale):
    """q: (q_len, H, D) at the last q_len positions; k, v: (seq_len, H_kv, D). Loops, no SDPA."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.zeros_like(q)
    for h in range(num_heads):
        kv_h = h // (num_heads // num_kv_heads)  # GQA: query head h reads KV head h // group
        for i in range(q_len):
            visible = seq_len - q_len + i + 1  # causal: keys 0 .. own position
            w = torch.softmax((k[:visible, kv_h] @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ v[:visible, kv_h]
    return out


def test_reference_attention_is_causal_gqa_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 6, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    torch.testing.assert_close(reference_attention(q, k, v, 0.3), naive(q, k, v, 0.3))


def test_batched_decode_equals_one_call_per_request():
    g = torch.Generator().manual_seed(1)
    num_slots, seq_lens = 64, [7, 1, 12]
    k_flat, v_flat = torch.randn(num_slots, 2, 8, generator=g), torch.randn(num_slots, 2, 8, generator=g)
    block_tables = [[5, 1], [9], [0, 2, 7]]  # block_size 4
    slots = context_slot_table(block_tables, seq_lens, block_size=4)
    mask = torch.arange(slots.shape[1])[None, :] < torch.tensor(seq_lens)[:, None]
    q = torch.randn(3, 6, 8, generator=g)
    out = batched_decode_attention(q, k_flat, v_flat, slots, mask, 0.35)
    for i, n in enumerate(seq_lens):
        ctx = slots[i, :n]
        torch.testing.assert_close(out[i : i + 1], naive(q[i : i + 1], k_flat[ctx], v_flat[ctx], 0.35))


def test_slot_table_and_store_kv_follow_the_block_table():
    slots = context_slot_table([[3, 0]], [6], block_size=4)
    assert slots.tolist() == [[12, 13, 14, 15, 0, 1]]  # block_table[p // 4] * 4 + p % 4
    cache = torch.zeros(1, 2, 4, 4, 1, 2)  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.arange(6.0).view(3, 1, 2)
    store_kv(cache, 0, key, -key, torch.tensor([13, -1, 2]))  # -1: not written
    flat = cache[0, 0].view(16, 1, 2)
    assert flat[13].tolist() == [[0.0, 1.0]] and flat[2].tolist() == [[4.0, 5.0]]
    assert int((cache[0, 0] != 0).sum()) == 3  # one of token 0's two values is 0.0
