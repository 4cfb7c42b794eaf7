"""KV cache memory: which slots of the KV tensors each request owns (block tables, ref_cnt,
prefix caching, copy-on-write, swap)."""

from minibatch.kv.block_manager import BlockManager, KVBlock, hash_block

__all__ = ["BlockManager", "KVBlock", "hash_block"]
