"""The write ops' input contract (docs/design.md, "Input contract of the ops"), one
regression test per rule, for the XLA reference and the Pallas kernels (interpret
mode on the CPU). The Triton-language kernels share the rules by construction: their
targets come from the same ``addressing`` predicates in JAX before the launch, and
their numerics mirror ``numerics`` (tests/test_triton.py runs them on a GPU).

Caches start filled with a random sentinel byte; bytes are compared. Under jit an
invalid slot is ignored like padding, so "ignored" is checked as: the bytes equal
those of the same call with that slot replaced by -1. On concrete input the ops
refuse what the metadata builders never make.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from pallas_kernels.core import addressing as addr

IMPLS = ["xla", "pallas"]
# 32 pools per block (one page), ring 4, two layers: the writes go to layer 1
LAYOUT = CacheLayout(IndexerConfig(block_size=128), num_layers=2, num_blocks=6)
LAYER = 1
CFG = LAYOUT.config
R, RING, PPB = CFG.kpool, CFG.ring, CFG.pools_per_block
T = 16                      # flat batches
B, N = 3, 4                 # decode batches

_STATIC = dict(static_argnums=(1, 2), static_argnames=("implementation",))
_compress = jax.jit(ops.compress_prefill, **_STATIC)
_seed = jax.jit(ops.seed_tail, **_STATIC)
_decode = jax.jit(ops.decode_update, **_STATIC)


def _bytes(cache):
    return np.array(cache).view(np.uint8)


def _rows(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape + (128,)), jnp.bfloat16)


def _i32(x):
    return jnp.asarray(np.asarray(x, np.int32))


def _random_cache(rng):
    """A cache of random bytes whose bf16 half-words are all finite (|x| < 2), so a ring
    row read from the wrong block gives a finite, different pool."""
    raw = rng.integers(0, 256, size=LAYOUT.total_words * 4, dtype=np.uint8)
    raw[1::2] &= 0xBF
    return jnp.asarray(raw.view(np.uint32))


def _block0(layer=LAYER):
    a, e = LAYOUT.block_byte_range(layer, 0)
    return slice(a, e)


# ---------------------------------------------------------------------------------
# 1. block 0 (the null block) is never written
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_null_block_is_never_written(rng, impl):
    """Pool and tail slots inside block 0 are ignored like padding by all three writers
    (compress_prefill, seed_tail, decode_update) under jit: block 0 keeps its bytes and
    the cache equals the one written with those slots at -1. (A validity predicate that
    takes block 0 lets each of them write into it.)"""
    fill = int(rng.integers(0, 256))
    key, gate = _rows(rng, T), _rows(rng, T)
    ape = jnp.asarray(rng.standard_normal((R, 128)), jnp.float32)
    # two requests of 8 rows: request 0's tail in block 2, pools in block 3; request 1's
    # tail slots in block 0 and its pools half in block 0, half in block 4
    tslot = np.concatenate([2 * RING + np.arange(8) % RING, np.arange(8) % RING])
    slot = np.full(T, -1)
    slot[[3, 7]] = 3 * PPB + rng.permutation(PPB)[:2]
    slot[11] = int(rng.integers(0, PPB))                       # block 0
    slot[15] = 4 * PPB + int(rng.integers(0, PPB))
    in_null = (slot >= 0) & (slot < PPB)
    cases = [(_compress, (key, gate, ape), slot, slot.copy(), in_null),
             (_seed, (key, gate), tslot, tslot.copy(), tslot < RING)]
    for op, args, x, _, null in cases:
        x_clean = np.where(null, -1, x)
        got = _bytes(op(LAYOUT.allocate(fill), LAYOUT, LAYER, *args, _i32(x), implementation=impl))
        want = _bytes(op(LAYOUT.allocate(fill), LAYOUT, LAYER, *args, _i32(x_clean), implementation=impl))
        assert (got[_block0()] == fill).all(), f"{op.__name__}: block 0 written"
        assert (got != fill).any()
        np.testing.assert_array_equal(got, want)

    # decode: request 0 well formed (tail block 2, completes into block 3), request 1 with
    # tail slots in block 0 (completes into block 4), request 2 completes into block 0
    pos = np.array([[8, 9, 10, 11], [4, 5, 6, 7], [12, 13, 14, 15]])
    dts = np.stack([2 * RING + pos[0] % RING, pos[1] % RING, 5 * RING + pos[2] % RING])
    dsl = np.full((B, N), -1)
    dsl[:, 3] = [3 * PPB + 5, 4 * PPB + 6, int(rng.integers(0, PPB))]
    dk, dg = _rows(rng, B, N), _rows(rng, B, N)
    start = _random_cache(rng)
    null_t, null_s = dts < RING, (dsl >= 0) & (dsl < PPB)
    got = _bytes(_decode(start, LAYOUT, LAYER, dk, dg, ape, _i32(dsl), _i32(dts), _i32(pos), implementation=impl))
    want = _bytes(_decode(start, LAYOUT, LAYER, dk, dg, ape, _i32(np.where(null_s | null_t, -1, dsl)),
                          _i32(np.where(null_t, -1, dts)), _i32(pos), implementation=impl))
    np.testing.assert_array_equal(got[_block0()], _bytes(start)[_block0()])
    np.testing.assert_array_equal(got, want)
    assert (got != _bytes(start)).any()


def test_null_block_slots_are_refused_on_concrete_input(rng):
    """On concrete input every writer refuses a slot inside block 0 with an error naming
    it (the metadata builders never make one), and leaves the cache alone."""
    cache = LAYOUT.allocate(0x5A)
    key, gate = _rows(rng, T), _rows(rng, T)
    ape = jnp.zeros((R, 128), jnp.float32)
    slot = np.full(T, -1)
    slot[7] = int(rng.integers(0, PPB))
    with pytest.raises(ValueError, match=rf"compress_prefill: slot_mapping\[7\] = {slot[7]} is a pool slot of "
                                         r"the null block 0"):
        ops.compress_prefill(cache, LAYOUT, LAYER, key, gate, ape, _i32(slot), implementation="xla")
    tslot = np.full(T, -1)
    tslot[2] = int(rng.integers(0, RING))
    with pytest.raises(ValueError, match=rf"seed_tail: tslot\[2\] = {tslot[2]} is a tail slot of the null block 0"):
        ops.seed_tail(cache, LAYOUT, LAYER, key, gate, _i32(tslot), implementation="pallas")
    pos = np.array([[0, 1, 2, 3]] * B)
    dts = np.stack([(1 + b) * RING + pos[b] for b in range(B)])
    dsl = np.full((B, N), -1)
    dk = _rows(rng, B, N)
    bad = dts.copy()
    bad[1, 2] = 2
    with pytest.raises(ValueError, match=r"decode_update: tslot\[1, 2\] = 2 is a tail slot of the null block 0"):
        ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(dsl), _i32(bad), _i32(pos), implementation="xla")
    bad = dsl.copy()
    bad[2, 3] = PPB - 1
    with pytest.raises(ValueError, match=rf"decode_update: slot_mapping\[2, 3\] = {PPB - 1} is a pool slot of the "
                                         r"null block 0"):
        ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(bad), _i32(dts), _i32(pos), implementation="xla")
    # padding tokens (position < 0) write nothing: their slots are not looked at
    pad = np.where(np.arange(N) == 3, -1, pos)
    ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(bad), _i32(dts), _i32(pad), implementation="xla")
    assert (_bytes(cache) == 0x5A).all()


# ---------------------------------------------------------------------------------
# 2. a decode token without a valid tail slot writes nothing, not even its pool
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_completion_without_tail_slot_writes_nothing(rng, impl):
    """A pool-completing decode token with a valid pool slot but an invalid tail slot
    (-1, negative, past the last block) writes nothing: its pool's earlier members are
    in its own tail ring, which it has none of. (Gated on the pool slot alone it writes
    the pool, pooled from block 0's ring bytes: the address an invalid tail slot is
    clamped to.)"""
    start = _random_cache(rng)
    ape = jnp.asarray(rng.standard_normal((R, 128)), jnp.float32)
    dk, dg = _rows(rng, B, N), _rows(rng, B, N)
    p0 = R * rng.integers(1, 9, size=B)
    pos = p0[:, None] + np.arange(N)                       # every request completes at token 3
    dts = np.stack([(1 + b) * RING + pos[b] % RING for b in range(B)])
    dsl = np.full((B, N), -1)
    dsl[:, 3] = 4 * PPB + rng.permutation(PPB)[:B]
    bad = rng.choice([-1, -7, LAYOUT.num_blocks * RING, LAYOUT.num_blocks * RING + 5], size=B)
    dts[:, 3] = bad
    dts[0, 1] = -1                                           # and a stash-only token without one
    got = _bytes(_decode(start, LAYOUT, LAYER, dk, dg, ape, _i32(dsl), _i32(dts), _i32(pos), implementation=impl))
    want = _bytes(_decode(start, LAYOUT, LAYER, dk, dg, ape, _i32(np.full((B, N), -1)), _i32(dts), _i32(pos),
                          implementation=impl))
    np.testing.assert_array_equal(got, want)
    # the other tokens did stash
    assert (got != _bytes(start)).any()
    # on concrete input such a completion is refused
    with pytest.raises(ValueError, match=rf"decode_update: token \[0, 3\] completes pool slot {dsl[0, 3]} but "
                                         rf"its tail slot {bad[0]} is invalid"):
        ops.decode_update(start, LAYOUT, LAYER, dk, dg, ape, _i32(dsl), _i32(dts), _i32(pos), implementation=impl)


# ---------------------------------------------------------------------------------
# 3. non-finite input: one answer, whatever the implementation or the batch
# ---------------------------------------------------------------------------------
FLOOR_SCALE_BITS = 0x34800000               # 2**-22


def _pool_cases(rng):
    """(name, key [R, 128], gate [R, 128], non_finite) pools: NaN / +-inf keys and gates,
    keys whose pooled rotation overflows (1e37), finite but huge gates (the softmax's
    differences overflow to -inf, which the exp's clamp takes: a finite pool), and a
    plain one."""
    def base():
        return (rng.standard_normal((R, 128)) * 3).astype(np.float32), rng.standard_normal((R, 128)).astype(np.float32)
    out = []
    for name, where, v, bad in [("nan key", "key", np.nan, True), ("inf key", "key", np.inf, True),
                                ("-inf key", "key", -np.inf, True), ("nan gate", "gate", np.nan, True),
                                ("inf gate", "gate", np.inf, True), ("-inf gate", "gate", -np.inf, True)]:
        k, g = base()
        (k if where == "key" else g)[int(rng.integers(0, R)), int(rng.integers(0, 128))] = v
        out.append((name, k, g, bad))
    k, g = base()
    out.append(("1e37 keys", np.full_like(k, 1e37), g, True))          # rotation: 128e37 / sqrt(128)
    k, g = base()
    out.append(("+-1e36 keys", np.full_like(k, 1e36) * np.sign(rng.standard_normal((1, 128))), g, False))   # <= 128e36
    k, g = base()
    out.append(("3e38 gates", k, np.where(g < 0, -3e38, 3e38).astype(np.float32), False))
    k, g = base()
    out.append(("1e37 gates", k, (g * 1e37).astype(np.float32), False))
    k, g = base()
    out.append(("plain", k, g, False))
    return out


def _pool_record(cache, slot):
    keys, scales = LAYOUT.pool_keys(cache, LAYER)
    return keys.view(np.uint8)[slot].copy(), int(scales.view(np.uint32)[slot])


def _records_alone_and_in_batches(rng, impl, cases, ape, fill):
    """Each pool written by compress_prefill alone (T = R), in a batch of T rows beside
    random pools, and by decode_update (three members seeded into a ring, the fourth
    completing): {(case index, how): (codes, scale bits)}."""
    out = {}
    slot0 = 3 * PPB
    for i, (_, k, g, _) in enumerate(cases):
        loc = slot0 + i
        c = _compress(LAYOUT.allocate(fill), LAYOUT, LAYER, jnp.asarray(k, jnp.bfloat16),
                      jnp.asarray(g, jnp.bfloat16), ape, _i32(np.r_[-1, -1, -1, loc]), implementation=impl)
        out[i, "alone"] = _pool_record(c, loc)
        # in a batch: the pool at a random pool position among random ones
        at = int(rng.integers(0, T // R))
        kb = (rng.standard_normal((T, 128)) * 3).astype(np.float32)
        gb = rng.standard_normal((T, 128)).astype(np.float32)
        kb[at * R:(at + 1) * R], gb[at * R:(at + 1) * R] = k, g
        sm = np.full(T, -1)
        sm[R - 1::R] = 4 * PPB + rng.permutation(PPB)[:T // R]
        sm[at * R + R - 1] = loc
        c = _compress(LAYOUT.allocate(fill), LAYOUT, LAYER, jnp.asarray(kb, jnp.bfloat16),
                      jnp.asarray(gb, jnp.bfloat16), ape, _i32(sm), implementation=impl)
        out[i, "batch"] = _pool_record(c, loc)
        # decode: members 0..R-2 seeded into tail block 1 (positions 0..R-2), member R-1 completes
        ks, gs = np.zeros((T, 128), np.float32), np.zeros((T, 128), np.float32)
        ks[:R - 1], gs[:R - 1] = k[:R - 1], g[:R - 1]
        ts = np.full(T, -1)
        ts[:R - 1] = RING + np.arange(R - 1)
        c = _seed(LAYOUT.allocate(fill), LAYOUT, LAYER, jnp.asarray(ks, jnp.bfloat16), jnp.asarray(gs, jnp.bfloat16),
                  _i32(ts), implementation=impl)
        pos, dts, dsl = np.full((B, N), -1), np.full((B, N), -1), np.full((B, N), -1)
        pos[0, 0], dts[0, 0], dsl[0, 0] = R - 1, RING + R - 1, loc
        dk, dg = np.zeros((B, N, 128), np.float32), np.zeros((B, N, 128), np.float32)
        dk[0, 0], dg[0, 0] = k[R - 1], g[R - 1]
        c = _decode(c, LAYOUT, LAYER, jnp.asarray(dk, jnp.bfloat16), jnp.asarray(dg, jnp.bfloat16), ape, _i32(dsl),
                    _i32(dts), _i32(pos), implementation=impl)
        out[i, "decode"] = _pool_record(c, loc)
    return out


def test_non_finite_pools_have_one_answer(rng):
    """A pool with a NaN or +-inf key or score, or whose rotation overflows (1e37 keys),
    is written as all-zero fp8 codes with the floor scale 2**-22, by the reference and
    the Pallas kernels, by the prefill writer and the decode writer, alone or beside
    other pools. Finite pools, huge gates included, agree the same way. (Left to NaN
    arithmetic, the bytes of such a pool depend on the implementation and on the batch
    around it: scale -0.0 alone, 2**-22 in a batch, NaN codes.)"""
    cases = _pool_cases(rng)
    ape = jnp.asarray(rng.standard_normal((R, 128)) * 0.5, jnp.float32)
    fill = int(rng.integers(0, 256))
    got = {impl: _records_alone_and_in_batches(rng, impl, cases, ape, fill) for impl in IMPLS}
    for i, (name, _, _, bad) in enumerate(cases):
        want_codes, want_scale = got["xla"][i, "alone"]
        for impl in IMPLS:
            for how in ("alone", "batch", "decode"):
                codes, scale = got[impl][i, how]
                assert scale == want_scale and (codes == want_codes).all(), f"{name}: {impl} {how} differs"
        if bad:
            assert want_scale == FLOOR_SCALE_BITS and (want_codes == 0).all(), f"{name}: not the zero record"
        else:
            assert want_scale != FLOOR_SCALE_BITS and np.isfinite(np.uint32(want_scale).view(np.float32)), name


# ---------------------------------------------------------------------------------
# 4. seed_tail's request_ends_tokens: refused when it disagrees, one meaning under jit
# ---------------------------------------------------------------------------------
def _seed_batch(rng):
    """A flat prefill of three requests (9, 2 and 4 rows; tail blocks 1, 2, 3) and one
    padding row, and its request_ends_tokens."""
    lengths, blocks = [9, 2, 4], [1, 2, 3]
    ts = np.concatenate([b * RING + np.arange(n) % RING for n, b in zip(lengths, blocks)] + [[-1]])
    return ts, np.cumsum(lengths)


@pytest.mark.parametrize("impl", IMPLS)
def test_request_ends_have_one_meaning_under_jit(rng, impl):
    """Under jit a row is seeded only inside the window [e - kpool, e) of an entry e > 0,
    by the reference as by the kernels: entries that miss a request leave its tail
    alone, a wrong end seeds only the rows of its window that the rule seeds anyway,
    negative entries count as padding. With agreeing entries the bytes are those without
    them. (A reference that ignores the entries disagrees with the kernels, which
    visit only the windows.)"""
    ts, ends = _seed_batch(rng)
    key, gate = _rows(rng, T), _rows(rng, T)
    fill = int(rng.integers(0, 256))
    tsp = _i32(np.r_[ts, np.full(T - ts.size, -1)])

    def seed(ends_, tslot=tsp):
        e = None if ends_ is None else _i32(ends_)
        return _bytes(_seed(LAYOUT.allocate(fill), LAYOUT, LAYER, key, gate, tslot, request_ends_tokens=e,
                            implementation=impl))

    plain = seed(None)
    np.testing.assert_array_equal(seed(np.r_[ends, 0, 0]), plain)
    # request 1 (rows 9, 10) missing: as if its rows had no tail slot
    without = np.asarray(tsp).copy()
    without[9:11] = -1
    np.testing.assert_array_equal(seed(np.r_[ends[[0, 2]], -3, 0]), seed(None, _i32(without)))
    # a wrong end: 6 instead of 9 visits rows 2 .. 5, of which the rule seeds row 5 (it looks
    # 4 rows ahead at row 9: another block); request 1's entry 11 visits rows 7 .. 10; so row
    # 6 (position 6: ring slot 2 of tail block 1) is not seeded and keeps the fill
    want = plain.copy()
    s = LAYOUT.strides(LAYER)
    for half in (0, 1):
        w = addr.global_word(s, addr.tail_row_words(s, 1, 6 % RING, half))
        want[4 * w:4 * w + 256] = fill
    np.testing.assert_array_equal(seed(np.r_[6, ends[1:], 0]), want)
    if impl == "pallas":                      # and the implementations agree on every one of these
        for e in (np.r_[ends[[0, 2]], -3, 0], np.r_[6, ends[1:], 0], np.r_[3, 3, 16, -1]):
            want = _bytes(_seed(LAYOUT.allocate(fill), LAYOUT, LAYER, key, gate, tsp, request_ends_tokens=_i32(e),
                                implementation="xla"))
            np.testing.assert_array_equal(seed(e), want)


def test_request_ends_that_disagree_are_refused(rng):
    """On concrete input seed_tail refuses entries that disagree with the tail slots: a
    negative entry, an entry that ends no request (mid-request, or one past a padding
    row), a request without an entry; and rows that would seed one tail slot twice."""
    ts, ends = _seed_batch(rng)
    tsp = _i32(np.r_[ts, np.full(T - ts.size, -1)])
    key = _rows(rng, T)
    cache = LAYOUT.allocate(0x3C)

    def call(e, tslot=tsp):
        return ops.seed_tail(cache, LAYOUT, LAYER, key, key, tslot, request_ends_tokens=None if e is None else _i32(e),
                             implementation="xla")

    ok = call(np.r_[ends, 0])                                   # agreeing entries and padding are fine
    assert (_bytes(ok) != 0x3C).any()
    for e, msg in [(np.r_[ends, -1], r"request_ends_tokens\[3\] = -1 is negative"),
                   (np.r_[7, ends[1:]], r"request_ends_tokens\[0\] = 7 ends no request: row 6 is followed by row 7 "
                                        r"of the same tail block 1"),
                   (np.r_[ends, 16], r"request_ends_tokens\[3\] = 16 ends no request: row 15 has no valid tail slot"),
                   (ends[[0, 2]], r"request_ends_tokens has no entry for the request of row 9 \(tail block 2\)")]:
        with pytest.raises(ValueError, match=msg):
            call(e)
    twice = np.asarray(tsp).copy()
    twice[12] = twice[14]                                       # request 2 (rows 11 .. 14) repeats a tail slot
    with pytest.raises(ValueError, match=r"seed_tail: rows 12 and 14 both seed tail slot"):
        call(None, _i32(twice))
    assert (_bytes(cache) == 0x3C).all()


# ---------------------------------------------------------------------------------
# one owner per block within a decode call
# ---------------------------------------------------------------------------------
def test_decode_block_owners_are_refused(rng):
    """On concrete input decode_update refuses a tail block used by two requests of the
    batch (their programs run in parallel) and a pool slot inside a tail block of the
    call (the pool record would overlap ring rows the launch reads)."""
    cache = LAYOUT.allocate(0x77)
    ape = jnp.zeros((R, 128), jnp.float32)
    dk = _rows(rng, B, N)
    pos = np.array([[0, 1, 2, 3]] * B)
    dts = np.stack([(1 + b) * RING + pos[b] for b in range(B)])
    dsl = np.full((B, N), -1)
    dsl[:, 3] = 4 * PPB + np.arange(B)
    ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(dsl), _i32(dts), _i32(pos), implementation="xla")
    shared = dts.copy()
    shared[2, 1] = RING + 1                                    # row 2's token 1 stashes into row 0's block 1
    with pytest.raises(ValueError, match=r"decode_update: tail block 1 is used by rows 0 and 2"):
        ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(dsl), _i32(shared), _i32(pos), implementation="xla")
    in_tail = dsl.copy()
    in_tail[1, 3] = 3 * PPB + 7                                # block 3: row 2's tail block
    with pytest.raises(ValueError, match=rf"decode_update: token \[1, 3\] writes pool slot {3 * PPB + 7} in block 3, "
                                         r"a tail block of this call"):
        ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(in_tail), _i32(dts), _i32(pos), implementation="xla")
    # padding tokens own nothing
    pad = pos.copy()
    pad[2, 1] = -1
    ops.decode_update(cache, LAYOUT, LAYER, dk, dk, ape, _i32(dsl), _i32(shared), _i32(pad), implementation="xla")
    assert (_bytes(cache) == 0x77).all()
