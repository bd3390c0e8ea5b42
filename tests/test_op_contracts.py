"""Property test of the write ops' input contract (docs/design.md, "Input contract of
the ops"): glm5_jax.ops seed_tail / compress_prefill / decode_update driven with
arbitrary slot and tail-slot arrays, with the XLA reference and the Pallas kernels
(interpret mode on the CPU).

The generated inputs hold, beside valid slots, every kind of invalid one: -1 and other
negatives, slots inside the null block 0, slots past the last block, huge values; and
keys / gates holding NaN, +-inf and huge finite values. Duplicates are generated only
where the contract defines them: invalid slots may repeat; valid pool slots are unique
in a call (a duplicate is refused on concrete input, its last writer undefined), a
tail block belongs to one decode request and holds no pool of the call, and no two
seeded rows write one tail slot. For every input:

* under jit, no byte outside the valid targets changes (a sentinel-filled cache, or
  random ring bytes for decode), and the two implementations write identical bytes;
* on concrete input, a call with a slot inside block 0 is refused, and a call that is
  not refused writes the bytes of the jitted one.

Shapes are fixed (one compile per op and implementation), the layout small.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from glm5_jax import ops
from pallas_kernels.core import addressing as addr
from test_write_contract import LAYOUT, LAYER, PPB, RING, R, T, B, N, _compress, _decode, _seed

IMPLS = ("xla", "pallas")
S = LAYOUT.strides(LAYER)
NB = LAYOUT.num_blocks
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPECIALS = np.array([np.nan, np.inf, -np.inf, 1e37, -1e37, 3e38, -3e38, 0.0, -0.0], np.float32)


# The contract's predicates, written here from docs/design.md rather than taken from
# pallas_kernels.core.addressing, so the test holds the implementation to the document.
def _pool_ok(x):
    return (x >= PPB) & (x < NB * PPB)                 # blocks 1 .. NB - 1


def _tail_ok(x):
    return (x >= RING) & (x < NB * RING)


def _tail_block(x):
    return np.where(_tail_ok(x), x // RING, 0)


def _invalid_pool_slot(data):
    return data.draw(st.one_of(st.just(-1), st.integers(-2**31, -2), st.integers(0, PPB - 1),
                               st.integers(NB * PPB, NB * PPB + 3 * PPB), st.just(2**31 - 1)), label="bad slot")


def _invalid_tail_slot(data):
    return data.draw(st.one_of(st.just(-1), st.integers(-2**31, -2), st.integers(0, RING - 1),
                               st.integers(NB * RING, NB * RING + 3 * RING), st.just(2**31 - 1)), label="bad tslot")


def _rows(data, rng, shape):
    """bf16 rows [*shape, 128]: random, some rows holding special values (NaN, inf, huge)."""
    x = (rng.standard_normal(shape + (128,)) * 2).astype(np.float32)
    special = data.draw(st.lists(st.integers(0, int(np.prod(shape)) - 1), max_size=3), label="special rows")
    flat = x.reshape(-1, 128)
    for i in special:
        cols = rng.integers(0, 128, size=int(rng.integers(1, 129)))
        flat[i, cols] = SPECIALS[rng.integers(0, SPECIALS.size, size=cols.size)]
    return jnp.asarray(x, jnp.bfloat16)


def _jit_bytes(fn, cache, *args, impl, **kw):
    return np.array(fn(cache, LAYOUT, LAYER, *args, implementation=impl, **kw)).view(np.uint8)


def _check(fn, start, args, targets, has_null, impl_kw=None):
    """The contract's checks for one input: jit bytes of both implementations equal and
    inside `targets` (a byte mask), and the concrete call refused (block 0) or equal."""
    impl_kw = impl_kw or {}
    before = np.array(start).view(np.uint8)
    got = {impl: _jit_bytes(fn, start, *args, impl=impl, **impl_kw) for impl in IMPLS}
    diff = np.nonzero(got["xla"] != got["pallas"])[0]
    assert diff.size == 0, f"{diff.size} bytes differ between xla and pallas, first at {diff[0]}"
    stray = np.nonzero((got["xla"] != before) & ~targets)[0]
    assert stray.size == 0, f"{stray.size} bytes changed outside the valid targets, first at {stray[0]}"
    op = {id(_compress): ops.compress_prefill, id(_seed): ops.seed_tail, id(_decode): ops.decode_update}[id(fn)]
    if has_null:
        with pytest.raises(ValueError, match="null block 0"):
            op(start, LAYOUT, LAYER, *args, implementation="xla", **impl_kw)
    else:
        out = np.array(op(start, LAYOUT, LAYER, *args, implementation="xla", **impl_kw)).view(np.uint8)
        np.testing.assert_array_equal(out, got["xla"])


def _pool_mask(slots):
    m = np.zeros(LAYOUT.total_bytes, bool)
    for loc in slots:
        k = addr.global_word(S, addr.pool_key_words(S, int(loc))) * 4
        m[k:k + 128] = True
        sc = addr.global_word(S, addr.pool_scale_words(S, int(loc))) * 4
        m[sc:sc + 4] = True
    return m


def _ring_mask(m, blocks_slots):
    for blk, rs in blocks_slots:
        for half in (0, 1):
            w = addr.global_word(S, addr.tail_row_words(S, int(blk), int(rs), half)) * 4
            m[w:w + 256] = True
    return m


# ---------------------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_compress_prefill_contract(data):
    """Completing rows at least kpool apart (closer ones are refused: each pool owns its
    kpool rows), unique valid pool slots, invalid slots anywhere, special keys and gates."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    slot = np.full(T, -1, np.int64)
    valid = rng.permutation(np.arange(PPB, NB * PPB))
    used, k = [], 0
    row = data.draw(st.integers(0, R - 1), label="first completing row")
    while row < T:
        if data.draw(st.booleans(), label="valid here"):
            slot[row] = valid[k]
            used.append(row)
            k += 1
            row += data.draw(st.integers(R, 2 * R), label="gap")
        else:
            row += 1
    for i in data.draw(st.lists(st.integers(0, T - 1), max_size=T), label="invalid rows"):
        if i not in used:
            slot[i] = _invalid_pool_slot(data)
    key, gate = _rows(data, rng, (T,)), _rows(data, rng, (T,))
    ape = jnp.asarray(rng.standard_normal((R, 128)) * 0.5, jnp.float32)
    fill = int(rng.integers(0, 256))
    writes = [slot[i] for i in used if i >= R - 1]
    has_null = bool(((slot >= 0) & (slot < PPB)).any())
    _check(_compress, LAYOUT.allocate(fill), (key, gate, ape, jnp.asarray(slot.astype(np.int32))),
           _pool_mask(writes), has_null)


@SETTINGS
@given(data=st.data())
def test_seed_tail_contract(data):
    """Requests as contiguous runs of rows with their own tail block and consecutive
    positions, rows knocked out with invalid tail slots, optional request_ends_tokens
    (the right ones or arbitrary integers), special rows. An input whose seeded rows
    would write one tail slot twice is refused on concrete input (checked) and has no
    jit answer to compare."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    tslot = np.full(T, -1, np.int64)
    blocks = list(rng.permutation(np.arange(1, NB)))
    row = 0
    while row < T and blocks:
        n = data.draw(st.integers(1, T - row), label="run length")
        p0 = data.draw(st.integers(0, 50), label="first position")
        tslot[row:row + n] = blocks.pop() * RING + (p0 + np.arange(n)) % RING
        row += n
        if data.draw(st.booleans(), label="padding after"):
            row += data.draw(st.integers(1, 3), label="padding rows")
    for i in data.draw(st.lists(st.integers(0, T - 1), max_size=6), label="invalid rows"):
        tslot[i] = _invalid_tail_slot(data)
    mode = data.draw(st.sampled_from(["none", "right", "arbitrary"]), label="request ends")
    kw = {}
    valid = _tail_ok(tslot)
    if mode == "right":                      # one past each run of one tail block (after the knock-outs)
        blk = _tail_block(tslot)
        last = valid & ~(np.r_[valid[1:], False] & (np.r_[blk[1:], -1] == blk))
        kw["request_ends_tokens"] = jnp.asarray(np.r_[np.nonzero(last)[0] + 1, 0].astype(np.int32))
    elif mode == "arbitrary":
        kw["request_ends_tokens"] = jnp.asarray(np.array(
            data.draw(st.lists(st.integers(-5, T), min_size=1, max_size=5), label="ends"), np.int32))
    key, gate = _rows(data, rng, (T,)), _rows(data, rng, (T,))
    fill = int(rng.integers(0, 256))
    ahead = np.concatenate([tslot[R:], np.full(R, -1)])
    seeded = valid & ((ahead < 0) | (_tail_block(ahead) != _tail_block(tslot)))
    args = (key, gate, jnp.asarray(tslot.astype(np.int32)))
    has_null = bool(((tslot >= 0) & (tslot < RING)).any())
    if np.unique(tslot[seeded]).size != seeded.sum():               # one ring row written twice: refused
        with pytest.raises(ValueError, match="null block 0" if has_null else "both seed tail slot"):
            ops.seed_tail(LAYOUT.allocate(fill), LAYOUT, LAYER, *args, implementation="xla", **kw)
        return
    targets = _ring_mask(np.zeros(LAYOUT.total_bytes, bool),
                         [(t // RING, t % RING) for t in tslot[seeded]])
    if mode == "arbitrary" and not has_null:
        # entries that disagree with the tail slots are refused; those that agree give jit's bytes
        try:
            ops.seed_tail(LAYOUT.allocate(fill), LAYOUT, LAYER, *args, implementation="xla", **kw)
        except ValueError as e:
            assert "request_ends_tokens" in str(e)
            got = {impl: _jit_bytes(_seed, LAYOUT.allocate(fill), *args, impl=impl, **kw) for impl in IMPLS}
            np.testing.assert_array_equal(got["xla"], got["pallas"])
            assert ((got["xla"] != fill) <= targets).all()
            return
    _check(_seed, LAYOUT.allocate(fill), args, targets, has_null, kw)


@SETTINGS
@given(data=st.data())
def test_decode_update_contract(data):
    """Three requests, each with its own tail block (1 .. 3) and its pools in blocks 4 and
    up; positions anywhere (repeated, out of order, padding); per token a valid tail slot
    of its request's block or an invalid one, a unique valid pool slot or an invalid one;
    special rows; the ring starts as random finite bytes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    own = 1 + np.arange(B)
    pos = np.array(data.draw(st.lists(st.integers(-3, 40), min_size=B * N, max_size=B * N), label="positions"),
                   np.int64).reshape(B, N)
    if data.draw(st.booleans(), label="in order"):
        pos = np.where(pos >= 0, (pos[:, :1] % 20) + np.arange(N), pos)
    tslot = np.zeros((B, N), np.int64)
    slot = np.full((B, N), -1, np.int64)
    valid_pools = rng.permutation(np.arange((B + 1) * PPB, NB * PPB))
    k = 0
    for b in range(B):
        for j in range(N):
            if data.draw(st.integers(0, 4), label="tslot kind") > 0:
                tslot[b, j] = own[b] * RING + int(rng.integers(0, RING))
            else:
                tslot[b, j] = _invalid_tail_slot(data)
            kind = data.draw(st.integers(0, 2), label="slot kind")
            if kind == 1:
                slot[b, j] = valid_pools[k]
                k += 1
            elif kind == 2:
                slot[b, j] = _invalid_pool_slot(data)
    key, gate = _rows(data, rng, (B, N)), _rows(data, rng, (B, N))
    ape = jnp.asarray(rng.standard_normal((R, 128)) * 0.5, jnp.float32)
    raw = rng.integers(0, 256, size=LAYOUT.total_words * 4, dtype=np.uint8)
    raw[1::2] &= 0xBF                                             # finite bf16 ring rows
    start = jnp.asarray(raw.view(np.uint32))
    live = pos >= 0
    stash = live & _tail_ok(tslot)
    complete = stash & (pos % R == R - 1) & _pool_ok(slot)
    targets = _pool_mask(slot[complete])
    targets = _ring_mask(targets, [(t // RING, p % RING) for t, p in zip(tslot[stash], pos[stash])])
    has_null = bool((live & (((slot >= 0) & (slot < PPB)) | ((tslot >= 0) & (tslot < RING)))).any())
    orphan = live & (pos % R == R - 1) & _pool_ok(slot) & ~_tail_ok(tslot)
    args = (key, gate, ape, *(jnp.asarray(x.astype(np.int32)) for x in (slot, tslot, pos)))
    if orphan.any() and not has_null:
        # a completion without a tail slot: refused on concrete input, nothing written under jit
        with pytest.raises(ValueError, match="is invalid"):
            ops.decode_update(start, LAYOUT, LAYER, *args, implementation="xla")
        got = {impl: _jit_bytes(_decode, start, *args, impl=impl) for impl in IMPLS}
        np.testing.assert_array_equal(got["xla"], got["pallas"])
        assert ((got["xla"] != raw) <= targets).all()
        return
    _check(_decode, start, args, targets, has_null)
