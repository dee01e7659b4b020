"""KVCacheManager: which blocks each request owns, prefix-cache lookups, and slot allocation for a step."""

from __future__ import annotations

from pagedllm.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.engine.request import Request
from pagedllm.prompt_embeds import block_keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are in the hash map
        self.num_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_hits = 0  # of which found there

    def update_block_hashes(self, request: Request) -> None:
        """Extends request.block_hashes to cover every full block of its tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        # the first block's extra keys (the rest chain from it): the cache salt and the LoRA adapter, whose KV differs
        first = tuple(
            k for k in (request.cache_salt, ("lora", request.lora_int_id) if request.lora_int_id else None) if k
        )
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            extra = first if i == 0 else ()
            if request.mm_features:  # the items whose placeholders the block holds: other images, other keys
                extra += tuple(f.identifier for f in request.mm_features if f.offset < (i + 1) * bs and f.end > i * bs)
            if request.prompt_embeds is not None and i * bs < len(request.prompt_embeds):  # never a token block's
                extra += block_keys(request.prompt_embeds, i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], extra))

    def _looks_up(self, request: Request) -> bool:
        """Whether the request may start from cached blocks (one asking prompt logprobs computes its prompt)."""
        return self.enable_caching and not request.needs_prompt_logprobs

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, never covering its last token."""
        if not self._looks_up(request):
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts an admitted request's lookup (a request retried at the head of the queue counts once)."""
        if self._looks_up(request):
            self.num_queries += request.num_tokens
            self.num_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Gives the request room for num_new_tokens more tokens after its computed (and newly cached) ones.

        Returns the newly allocated blocks, or None (nothing changed) when the pool cannot supply them."""
        new_computed_blocks = new_computed_blocks or []
        owned = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(owned) - len(new_computed_blocks)
        # Cached blocks with no other user sit in the free queue: touching them takes them out of it.
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable:
            return None
        self.pool.touch(new_computed_blocks)
        owned.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        owned.extend(new_blocks)
        if self.enable_caching:  # the blocks full of known tokens after this step (never drafts: not among them)
            self._cache_full_blocks(request, owned, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the hashes of the request's blocks that its first num_tokens tokens fill."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks.get(request.request_id, []), num_tokens)

    def _cache_full_blocks(self, request: Request, owned: list[KVCacheBlock], num_tokens: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_tokens // self.block_size <= start:  # no block newly full (most decode steps): no hashing
            return
        self.update_block_hashes(request)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(owned[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so that a prefix's last blocks are evicted before its first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def uncache(self, request: Request) -> None:
        """Forgets the hashes of the request's blocks (their contents cannot be trusted)."""
        for block in self.req_to_blocks.get(request.request_id, []):
            self.pool.uncache(block)
        self.num_cached_blocks.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
