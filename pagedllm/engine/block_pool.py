"""BlockPool: the KV-cache blocks, their reference counts, the LRU free queue and the prefix-cache hash map."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """hash(parent_hash, block_token_ids, extra_keys): a stable 32-byte digest chaining each block to its prefix."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Hands out blocks. A block with ref_cnt 0 sits in the free queue (least recently freed first); if it holds a
    cached prefix it stays findable by hash until it is taken for new data (lazy eviction)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Drops the block from the prefix-cache map (lazy eviction, or contents that cannot be trusted)."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Takes a reference on cached blocks, pulling the unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drops one reference from each block. Blocks reaching 0 join the free queue: a cached one at the tail, in
        the given order (evicted last), those holding no cached prefix at the head, in the given order, to be taken
        first (taking one evicts nothing, and its memory has been written: on the CPU a block never used costs page
        faults)."""
        uncached = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    self.free_queue[block.block_id] = block
        for block in reversed(uncached):
            self.free_queue[block.block_id] = block
            self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        # none is cached now: the most recently freed first (their memory is written, and may still be in cache)
        self.free_queue = OrderedDict(reversed(self.free_queue.items()))
        return True
