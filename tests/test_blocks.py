"""BlockPool: allocation, tails, prefix cache, reference counts, LRU eviction,
admission control. Unit cases plus a hypothesis state machine that checks the
invariants after every operation against an independent shadow model."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.serving.blocks import BlockPool, chain_hashes

BS = 4


def _tokens(rng, n, alphabet=1000):
    return [int(t) for t in rng.integers(0, alphabet, n)]


def test_null_block_never_handed_out_and_everything_returns(rng):
    pool = BlockPool(13, BS)
    ids = []
    for i in range(3):
        rb = pool.admit(i, _tokens(rng, 6), 10)
        ids += rb.index_blocks + [rb.tail_block]
    assert 0 not in ids and len(set(ids)) == len(ids) == 3 * (3 + 1)
    pool.check_invariants()
    for i in range(3):
        pool.release(i)
    pool.check_invariants()
    assert pool.num_free_blocks == 12 and sorted(pool.free_order()) == list(range(1, 13))


def test_from_layout_and_capacity_errors():
    lay = CacheLayout(IndexerConfig(block_size=64, topk=64), num_layers=1, num_blocks=10)
    pool = BlockPool.from_layout(lay)
    assert (pool.num_blocks, pool.block_size_tokens) == (10, 64)
    assert pool.max_request_tokens == 8 * 64
    pool.check_fits(8 * 64)
    with pytest.raises(ValueError, match="can|only 9 usable blocks"):
        pool.check_fits(8 * 64 + 1)
    with pytest.raises(ValueError, match="only 9 usable blocks"):
        pool.admit("x", [1] * 10, 8 * 64 + 1)
    assert pool.requests() == [] and pool.num_free_blocks == 9          # nothing changed
    with pytest.raises(ValueError, match="at least one token"):
        pool.admit("x", [], 4)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(2, 4)


def test_admission_waits_then_fits(rng):
    pool = BlockPool(8, BS)                       # 7 usable
    a = pool.admit("a", _tokens(rng, 8), 16)      # 4 blocks + tail
    assert a is not None
    before = (pool.num_free_blocks, pool.free_order())
    assert pool.admit("b", _tokens(rng, 8), 8) is None                 # needs 3, 2 free: waits
    assert (pool.num_free_blocks, pool.free_order()) == before and not pool.has_request("b")
    with pytest.raises(ValueError, match="already holds"):
        pool.admit("a", _tokens(rng, 4), 4)
    pool.release("a")
    assert pool.admit("b", _tokens(rng, 8), 8) is not None
    pool.check_invariants()


def test_prefix_hit_chain_and_salt(rng):
    pool = BlockPool(32, BS)
    prompt = _tokens(rng, 4 * BS + 2)
    a = pool.admit("a", prompt, len(prompt) + 3)
    assert a.num_cached_tokens == 0
    pool.commit("a", prompt, len(prompt))                 # 4 full blocks become cached
    assert pool.num_cached_blocks == 4
    b = pool.admit("b", prompt, len(prompt) + 3)          # shared while a is still running
    assert b.num_cached_tokens == 4 * BS and b.index_blocks[:4] == a.index_blocks[:4]
    assert all(pool.refcount(x) == 2 for x in a.index_blocks[:4])
    c = pool.admit("c", prompt, len(prompt) + 3, cache_salt="s")       # salt: no hit
    assert c.num_cached_tokens == 0 and not set(c.index_blocks) & set(a.index_blocks)
    # a prompt that diverges inside block 2 hits blocks 0, 1 only (chained hashes)
    other = prompt[:2 * BS + 1] + [(prompt[2 * BS + 1] + 1) % 1000] + prompt[2 * BS + 2:]
    d = pool.admit("d", other, len(other))
    assert d.num_cached_tokens == 2 * BS and d.index_blocks[:2] == a.index_blocks[:2]
    # a whole-block prompt recomputes its last block: hit capped at (len - 1) // BS blocks
    e = pool.admit("e", prompt[:4 * BS], 4 * BS)
    assert e.num_cached_tokens == 3 * BS
    pool.check_invariants()
    assert chain_hashes(prompt, BS, None) != chain_hashes(prompt, BS, "s")
    assert chain_hashes(prompt, BS, None)[:2] == chain_hashes(other, BS, None)[:2]
    assert chain_hashes(prompt, BS, None)[2] != chain_hashes(other, BS, None)[2]


def test_lru_eviction_order_and_reuse_of_uncached_first(rng):
    pool = BlockPool(10, BS)                              # 9 usable
    p1 = _tokens(rng, 2 * BS)
    a = pool.admit("a", p1, 3 * BS)                       # 3 blocks + tail
    pool.commit("a", p1 + [1, 2, 3, 4], 3 * BS)           # 3 full blocks cached
    pool.release("a")
    order = pool.free_order()
    # tail and nothing-cached blocks first, cached chain deepest block first
    assert order[0] == a.tail_block
    cached_part = [b for b in order if pool.is_cached(b)]
    assert cached_part == a.index_blocks[::-1]
    # fill the pool: uncached blocks are taken before any cached block is evicted
    n_uncached = sum(not pool.is_cached(b) for b in order)
    b = pool.admit("b", _tokens(rng, 4), (n_uncached - 1) * BS)
    assert pool.evictions == 0 and pool.num_cached_blocks == 3
    c = pool.admit("c", _tokens(rng, 4), BS)               # must evict the deepest cached block
    assert pool.evictions == 2 and a.index_blocks[2] in c.index_blocks + [c.tail_block]
    assert pool.lookup(p1 + [0] * BS) == a.index_blocks[:1]          # block 1 of the chain is gone
    pool.check_invariants()
    pool.release("b"), pool.release("c")
    pool.check_invariants()


def test_unknown_request(rng):
    pool = BlockPool(6, BS)
    with pytest.raises(ValueError, match="unknown request id"):
        pool.release("nope")
    with pytest.raises(ValueError, match="unknown request id"):
        pool.commit("nope", [1, 2], 2)


class _Audited(BlockPool):
    """Records the state of every block at the moment it is evicted."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.evicted = []

    def _evict(self, block):
        holders = [rid for rid, rb in self._requests.items() if block in rb.index_blocks + [rb.tail_block]]
        self.evicted.append((block, self._ref[block], self._hash[block] is not None, holders))
        super()._evict(block)


class PoolMachine(RuleBasedStateMachine):
    """Random admit / progress / release sequences; tokens from a tiny alphabet and
    shared prefixes so prefix hits, sharing and evictions all happen."""

    def __init__(self):
        super().__init__()
        self.pool = _Audited(14, BS)
        self.live = {}            # rid -> (tokens, reserved tokens, computed tokens, index blocks, tail)
        self.next_id = 0
        self.prefixes = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 5, 5, 5, 6, 6, 6, 6]]

    @rule(prefix=st.integers(0, 2), extra=st.lists(st.integers(0, 3), max_size=9),
          new_tokens=st.integers(1, 8), salt=st.sampled_from([None, None, "s"]))
    def admit(self, prefix, extra, new_tokens, salt):
        toks = (self.prefixes[prefix] if prefix < 2 else []) + extra
        if not toks:
            toks = [7]
        reserve = len(toks) + new_tokens
        rid = self.next_id
        self.next_id += 1
        free_before = self.pool.num_free_blocks
        try:
            rb = self.pool.admit(rid, toks, reserve, salt)
        except ValueError:
            assert self.pool.blocks_for_tokens(reserve) + 1 > self.pool.usable_blocks
            assert self.pool.num_free_blocks == free_before
            return
        if rb is None:
            assert self.pool.num_free_blocks == free_before and not self.pool.has_request(rid)
            return
        assert rb.num_cached_tokens % BS == 0 and rb.num_cached_tokens < len(toks)
        assert len(rb.index_blocks) == self.pool.blocks_for_tokens(reserve)
        # the reused blocks are exactly the blocks cached under this prompt's chain
        for h, b in zip(chain_hashes(toks, BS, salt), rb.index_blocks[:rb.num_cached_tokens // BS]):
            assert self.pool.cached_block_of(h) == b
        self.live[rid] = [toks, reserve, rb.num_cached_tokens, list(rb.index_blocks), rb.tail_block]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def progress(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        toks, reserve, done, blocks, tail = self.live[rid]
        new_done = data.draw(st.integers(done, reserve))
        full = toks + [9] * (reserve - len(toks))          # generated tokens
        self.pool.commit(rid, full, new_done)
        self.live[rid][2] = new_done

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        _, _, _, blocks, tail = self.live.pop(rid)
        self.pool.release(rid)
        for b in blocks + [tail]:
            if not any(b in v[3] for v in self.live.values()):
                assert b in self.pool.free_order(), f"freed block {b} did not return"

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        owned = {}
        for rid, (_, _, _, blocks, tail) in self.live.items():
            assert self.pool.request(rid).index_blocks == blocks
            for b in blocks:
                owned.setdefault(b, set()).add(("index", rid))
            assert tail not in owned, f"tail {tail} also owned by {owned.get(tail)}"
            owned[tail] = {("tail", rid)}
        for b, holders in owned.items():
            kinds = {k for k, _ in holders}
            assert len(kinds) == 1, f"block {b} owned as {kinds}"
            assert self.pool.refcount(b) == len(holders)
        for b in range(1, self.pool.num_blocks):
            if b not in owned:
                assert self.pool.refcount(b) == 0
        for block, ref, was_cached, holders in self.pool.evicted:
            assert ref == 0 and was_cached and not holders, \
                f"evicted block {block} with refcount {ref}, cached={was_cached}, held by {holders}"


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_pool_state_machine = PoolMachine.TestCase


def test_state_machine_reaches_evictions_and_hits():
    """Self-check of the property test's workload: the same kind of sequence does evict and hit."""
    rng = np.random.default_rng(0)
    pool = _Audited(14, BS)
    live = []
    for i in range(200):
        if live and (len(live) > 3 or rng.random() < 0.4):
            rid, toks = live.pop(0)
            pool.commit(rid, toks, len(toks))
            pool.release(rid)
        toks = [0, 1, 2, 3, 4, 5, 6, 7] + [int(x) for x in rng.integers(0, 3, rng.integers(0, 9))]
        if pool.admit(i, toks, len(toks) + 2) is not None:
            live.append((i, toks))
        pool.check_invariants()
    assert pool.evictions > 0 and pool.hit_tokens > 0
