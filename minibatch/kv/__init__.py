"""KV cache memory: which slots of the KV tensors each request owns."""

from minibatch.kv.allocator import BlockAllocator

__all__ = ["BlockAllocator"]
