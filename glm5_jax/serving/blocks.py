"""Host-side block allocation for one device shard: BlockPool.

One pool of ``num_blocks`` block ids serves every group (docs/semantics.md 3.5):

* block 0 is the null block: never handed out (padded tables point at it);
* a running request holds its **indexer/attention blocks** (manager blocks of
  ``block_size_tokens`` tokens: the indexer pages and the attention K/V of those
  tokens, in every layer) and exactly **one tail block** (its bf16 tail ring
  aliases the start of that block's indexer bytes, docs/semantics.md 3.4);
* every block id is owned by the indexer group or by one tail, never both;
  indexer blocks may be shared by several requests through the prefix cache
  (reference counted), tail blocks never are.

Prefix caching: a full block (all ``block_size_tokens`` tokens computed) is
registered under a chained hash ``H(parent hash, its token ids, cache_salt)``
(sha256, so stable across processes). A new request reuses the longest run of
leading cached blocks of its prompt, capped so at least one prompt token is
recomputed; the hit always ends on a block boundary, hence on a pool boundary,
and the recomputed suffix re-seeds the request's fresh tail ring (docs/semantics.md 5.3). Tail
blocks never take part in prefix caching.

Freed blocks go to one free queue ordered for reuse: blocks with nothing cached
(tails, partial blocks) first, then cached blocks least recently freed first (a
request's chain deepest block first). Reusing a cached block evicts it; only a
block with reference count 0 is ever in the queue, so only unreferenced cached
blocks are evicted.

Admission control reserves a request's whole footprint up front (its blocks
for prompt + max_new_tokens, and its tail block), so a running request never
runs out of blocks and no preemption is needed. A request that can never fit
(more blocks than the pool has) is a ValueError; one that cannot fit now waits
(``admit`` returns None and changes nothing).

All state of one device shard lives in one BlockPool; a multi-device engine holds
one BlockPool per shard.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct

FREE, INDEX, TAIL = 0, 1, 2
_OWNER_NAMES = {FREE: "free", INDEX: "indexer", TAIL: "tail"}


def block_hash(parent: bytes | None, token_ids, cache_salt: str | None = None) -> bytes:
    """Chained hash of one full block: sha256(parent || salt || token ids). No salt
    (None) and every salt, "" included, hash apart: a salt is an isolation boundary."""
    h = hashlib.sha256()
    h.update(b"\x01" + parent if parent is not None else b"\x00")
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = str(cache_salt).encode("utf-8")
        h.update(b"\x01" + struct.pack("<I", len(salt)) + salt)
    toks = [int(t) for t in token_ids]
    h.update(struct.pack(f"<{len(toks)}q", *toks))
    return h.digest()


def chain_hashes(token_ids, block_size_tokens: int, cache_salt: str | None = None,
                 num_blocks: int | None = None) -> list[bytes]:
    """Hashes of the leading full blocks of token_ids (at most num_blocks of them)."""
    toks = list(token_ids)
    n = len(toks) // block_size_tokens
    if num_blocks is not None:
        n = min(n, num_blocks)
    out, parent = [], None
    for i in range(n):
        parent = block_hash(parent, toks[i * block_size_tokens:(i + 1) * block_size_tokens], cache_salt)
        out.append(parent)
    return out


@dataclasses.dataclass
class RequestBlocks:
    """What one admitted request holds."""
    request_id: object
    index_blocks: list            # manager block ids in token order (block i = tokens [i*bs, (i+1)*bs))
    tail_block: int
    cache_salt: str | None
    num_cached_tokens: int        # prefix-cache hit at admission (a multiple of block_size_tokens)
    block_hashes: list            # chained hashes of the leading full blocks seen so far


class BlockPool:
    """Block ids of one device shard: allocation, prefix cache, LRU eviction, tails."""

    def __init__(self, num_blocks: int, block_size_tokens: int, *, shard: int = 0):
        if not isinstance(num_blocks, int) or num_blocks < 3:
            raise ValueError(f"num_blocks must be an int >= 3 (null block + one indexer block + one tail), "
                             f"got {num_blocks!r}")
        if not isinstance(block_size_tokens, int) or block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be a positive int, got {block_size_tokens!r}")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.shard = shard
        self._ref = [0] * num_blocks
        self._owner = [FREE] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(1, num_blocks))
        self._requests: dict[object, RequestBlocks] = {}
        self.evictions = 0
        self.hit_tokens = 0
        self.admitted = 0

    @classmethod
    def from_layout(cls, layout, shard: int = 0) -> "BlockPool":
        return cls(layout.num_blocks, layout.config.block_size, shard=shard)

    # ---- sizes ---------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free, including evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def max_request_tokens(self) -> int:
        """Longest request (prompt + new tokens) that could ever be admitted: all
        blocks but the null block and one tail block."""
        return (self.num_blocks - 2) * self.block_size_tokens

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return max(1, -(-int(num_tokens) // self.block_size_tokens))

    def check_fits(self, num_tokens: int) -> None:
        """ValueError if a request of num_tokens tokens could never be admitted."""
        need = self.blocks_for_tokens(num_tokens) + 1
        if need > self.usable_blocks:
            raise ValueError(
                f"a request of {num_tokens} tokens needs {need - 1} blocks of {self.block_size_tokens} "
                f"tokens plus a tail block, but the pool has only {self.usable_blocks} usable blocks "
                f"(at most {self.max_request_tokens} tokens per request)")

    # ---- requests ------------------------------------------------------------------
    def request(self, request_id) -> RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request id {request_id!r} in block pool (shard {self.shard})") from None

    def has_request(self, request_id) -> bool:
        return request_id in self._requests

    def lookup(self, prompt_tokens, cache_salt: str | None = None) -> list[int]:
        """Cached blocks of the longest reusable prefix of prompt_tokens (no state change).

        Capped at (len(prompt) - 1) // block_size blocks: at least one prompt token
        is recomputed, and the recomputed suffix starts on a block boundary.
        """
        cap = (len(prompt_tokens) - 1) // self.block_size_tokens
        out = []
        for h in chain_hashes(prompt_tokens, self.block_size_tokens, cache_salt, cap):
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def admit(self, request_id, prompt_tokens, reserve_tokens: int, cache_salt: str | None = None):
        """Reserve blocks for a request of up to reserve_tokens tokens, reusing cached prefix blocks.

        Returns the RequestBlocks, or None if it does not fit now (nothing changes).
        Raises ValueError for a duplicate id or a request that can never fit.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} already holds blocks")
        if len(prompt_tokens) < 1:
            raise ValueError("prompt must hold at least one token")
        reserve_tokens = max(int(reserve_tokens), len(prompt_tokens))
        self.check_fits(reserve_tokens)
        hits = self.lookup(prompt_tokens, cache_salt)
        n_blocks = self.blocks_for_tokens(reserve_tokens)
        need_new = n_blocks - len(hits) + 1                       # + the tail block
        hits_in_free = sum(1 for b in hits if self._ref[b] == 0)
        if need_new > len(self._free) - hits_in_free:
            return None
        for b in hits:                                            # take the hits first: never evicted below
            if self._ref[b] == 0:
                del self._free[b]
                self._owner[b] = INDEX
            self._ref[b] += 1
        tail = self._take(TAIL)
        new = [self._take(INDEX) for _ in range(n_blocks - len(hits))]
        hashes = [self._hash[b] for b in hits]
        rb = RequestBlocks(request_id, hits + new, tail, cache_salt,
                           len(hits) * self.block_size_tokens, hashes)
        self._requests[request_id] = rb
        self.hit_tokens += rb.num_cached_tokens
        self.admitted += 1
        return rb

    def commit(self, request_id, token_ids, num_computed_tokens: int) -> int:
        """Register the request's blocks that became full (all tokens computed) in the
        prefix cache. Returns how many blocks were newly registered."""
        rb = self.request(request_id)
        bs = self.block_size_tokens
        n_full = min(int(num_computed_tokens) // bs, len(rb.index_blocks), len(token_ids) // bs)
        added = 0
        parent = rb.block_hashes[-1] if rb.block_hashes else None
        for i in range(len(rb.block_hashes), n_full):
            h = block_hash(parent, token_ids[i * bs:(i + 1) * bs], rb.cache_salt)
            b = rb.index_blocks[i]
            if h not in self._cached and self._hash[b] is None:
                self._cached[h] = b
                self._hash[b] = h
                added += 1
            rb.block_hashes.append(h)
            parent = h
        return added

    def release(self, request_id) -> None:
        """Return a request's blocks: the tail and uncached blocks are reused first,
        cached blocks go to the back of the LRU queue (deepest block of the chain first)."""
        rb = self.request(request_id)
        del self._requests[request_id]
        self._ref[rb.tail_block] -= 1
        self._owner[rb.tail_block] = FREE
        self._free[rb.tail_block] = None
        self._free.move_to_end(rb.tail_block, last=False)
        for b in reversed(rb.index_blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._owner[b] = FREE
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)

    def drop_cached(self) -> int:
        """Forget every cached block (the engine lost the cache bytes they named): the
        prefix cache becomes empty, the free queue keeps its order. Every request must
        have been released first (ValueError otherwise). Returns the blocks forgotten."""
        if self._requests:
            raise ValueError(f"drop_cached with {len(self._requests)} requests holding blocks")
        for b in self._cached.values():
            self._hash[b] = None
        n = len(self._cached)
        self._cached.clear()
        return n

    # ---- allocation ----------------------------------------------------------------
    def _take(self, owner: int) -> int:
        b, _ = self._free.popitem(last=False)
        if self._hash[b] is not None:
            self._evict(b)
        self._owner[b] = owner
        self._ref[b] = 1
        return b

    def _evict(self, block: int) -> None:
        """Drop a free cached block from the prefix cache (its bytes will be reused)."""
        h = self._hash[block]
        del self._cached[h]
        self._hash[block] = None
        self.evictions += 1

    # ---- introspection -------------------------------------------------------------
    def owner(self, block: int) -> str:
        return _OWNER_NAMES[self._owner[block]]

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def cached_block_of(self, h: bytes):
        return self._cached.get(h)

    def free_order(self) -> list[int]:
        """Free block ids in the order they will be reused."""
        return list(self._free)

    def requests(self) -> list:
        return list(self._requests)

    def stats(self) -> dict:
        return dict(shard=self.shard, num_blocks=self.num_blocks, free_blocks=self.num_free_blocks,
                    cached_blocks=self.num_cached_blocks, running_requests=len(self._requests),
                    evictions=self.evictions, hit_tokens=self.hit_tokens, admitted=self.admitted)

    def check_invariants(self) -> None:
        """AssertionError naming the first broken invariant."""
        refs = [0] * self.num_blocks
        index_ids, tail_ids = set(), set()
        for rid, rb in self._requests.items():
            assert len(set(rb.index_blocks)) == len(rb.index_blocks), f"{rid!r} lists a block twice"
            for b in rb.index_blocks:
                assert 1 <= b < self.num_blocks, f"{rid!r} holds invalid block {b}"
                assert self._owner[b] == INDEX, f"block {b} of {rid!r} is not owned by the indexer group"
                refs[b] += 1
                index_ids.add(b)
            t = rb.tail_block
            assert 1 <= t < self.num_blocks, f"{rid!r} holds invalid tail block {t}"
            assert self._owner[t] == TAIL, f"tail block {t} of {rid!r} is not owned as a tail"
            assert t not in tail_ids, f"tail block {t} held by two requests"
            tail_ids.add(t)
            refs[t] += 1
        assert not (index_ids & tail_ids), f"blocks {sorted(index_ids & tail_ids)} are tail and indexer at once"
        assert self._ref[0] == 0 and self._owner[0] == FREE and 0 not in self._free, "null block handed out"
        for b in range(1, self.num_blocks):
            assert self._ref[b] == refs[b], f"block {b}: refcount {self._ref[b]} but {refs[b]} holders"
            in_free = b in self._free
            assert in_free == (refs[b] == 0), f"block {b}: free={in_free} with {refs[b]} holders"
            if in_free:
                assert self._owner[b] == FREE, f"free block {b} still has an owner"
            if self._hash[b] is not None:
                assert self._cached.get(self._hash[b]) == b, f"block {b} hash not in the cache map"
                assert self._owner[b] in (FREE, INDEX), f"tail block {b} is prefix cached"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"cache map points at block {b} with another hash"
        assert len(self._free) + len(index_ids) + len(tail_ids) == self.usable_blocks, "blocks lost"
