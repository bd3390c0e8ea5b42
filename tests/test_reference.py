"""The golden reference (glm5_jax.reference, = ops with implementation="xla"):
padded tail stride (B1), vLLM conformance vectors, decode writer == prefill
writer (B3), rejected-draft redo (B2), a random-workload property test, padding
and out-of-range slots, and the op boundary checks.

Every cache starts filled with a sentinel so a stray byte anywhere shows; bytes
are compared, not values. The reference compiles once per (layout, shape), so
the tests reuse a few layouts and shapes (see refjit.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout, with_fault
from glm5_jax.testing import random_ape, random_rows

import refjit
import vectors as V
from refjit import GoldenScenario as Scenario

SENTINEL = 0xA5
SENT16 = np.uint16(0xA5A5)


def _u16(x):
    return np.asarray(x).view(np.uint16)


def _pool_records(layout, cache, layer, slots):
    keys, scales = layout.pool_keys(cache, layer)
    return keys.view(np.uint8)[slots], scales.view(np.uint32)[slots]


# =================================================================================
# B1: the tail ring aliases its own indexer block through the PADDED stride
# =================================================================================
def _place_seed_rows(raw, base, block_stride, ring, blocks, positions, key, gate):
    """Numpy model of a seed: K row of (block, pos) at base + block*stride + (pos%ring)*256,
    gate row ring*256 further (docs/semantics.md 3.4). Only the rows given are placed."""
    for b, p, k, g in zip(blocks, positions, key, gate):
        o = base + b * block_stride + (p % ring) * 256
        raw[o:o + 256] = k.view(np.uint8)
        raw[o + ring * 256:o + ring * 256 + 256] = g.view(np.uint8)


@pytest.mark.parametrize("n_spec", [0, 3], ids=["ring4", "ring8"])
def test_b1_seed_honours_padded_tail_stride(rng, n_spec):
    cfg = IndexerConfig(block_size=1152, num_spec_tokens=n_spec)
    R, ring = cfg.kpool, cfg.ring
    lay = CacheLayout(cfg, num_layers=2, num_blocks=256, attn_block_bytes=1056)
    layer = 1
    base = lay.index_base_bytes(layer)
    ib, dense = cfg.index_block_bytes, cfg.tail_block_bytes

    def disjoint(blocks):
        own = [(b * ib, b * ib + dense) for b in blocks]
        bad = [(b * dense, b * dense + dense) for b in blocks]
        return all(a1 <= b0 or b1 <= a0 for a0, a1 in own for b0, b1 in bad)

    while True:
        blocks = [18, 200, int(rng.integers(1, 256))]
        if len(set(blocks)) == 3 and disjoint(blocks):
            break
    # three requests of R + 2 tokens each (only the last R are seeded), all ring slots for ring 4
    n_tok = R + 2
    pos = np.tile(np.arange(n_tok), 3)
    blk = np.repeat(blocks, n_tok)
    tslot = (blk * ring + pos % ring).astype(np.int32)
    key, gate = random_rows(rng, 3 * n_tok), random_rows(rng, 3 * n_tok)
    last = np.tile(np.arange(n_tok) >= n_tok - R, 3)

    cache = refjit.seed(lay.allocate(SENTINEL), lay, layer, key, gate, tslot)
    got = refjit.as_bytes(cache)
    want = np.full(lay.total_bytes, SENTINEL, np.uint8)
    _place_seed_rows(want, base, ib, ring, blk[last], pos[last], key[last], gate[last])
    diff = np.nonzero(got != want)[0]
    assert diff.size == 0, f"{diff.size} bytes differ from the padded-stride model, first at {diff[0]}"
    # only the first 2*ring*256 bytes of each own indexer block changed
    changed = np.nonzero(got != SENTINEL)[0]
    for b in blocks:
        a0 = base + b * ib
        assert np.any(got[a0:a0 + dense] != SENTINEL), f"own tail block {b} not seeded"
    own = np.zeros(lay.total_bytes, bool)
    for b in blocks:
        own[base + b * ib: base + b * ib + dense] = True
    assert own[changed].all()
    tk, tg = lay.tail_ring(cache, layer)
    for b in blocks:
        rows = np.nonzero(last & (blk == b))[0]
        np.testing.assert_array_equal(_u16(tk[b, pos[rows] % ring]), _u16(key[rows]))
        np.testing.assert_array_equal(_u16(tg[b, pos[rows] % ring]), _u16(gate[rows]))

    # the probe: with the historical dense stride injected, the own block stays sentinel and
    # the dense location (base + b * 2*ring*256) changes -- the model above would catch it
    bad = with_fault(lay, "dense-tail-stride").strides(layer)
    cache_bad = refjit.seed_tail_strides(lay.allocate(SENTINEL), bad, jnp.asarray(key), jnp.asarray(gate),
                                         jnp.asarray(tslot))
    got_bad = refjit.as_bytes(cache_bad)
    assert np.any(got_bad != want), "the dense-stride fault went unnoticed"
    for b in blocks:
        a0 = base + b * ib
        assert np.all(got_bad[a0:a0 + dense] == SENTINEL), f"block {b}: own tail written under the fault"
        assert np.any(got_bad[base + b * dense: base + (b + 1) * dense] != SENTINEL)
    want_bad = np.full(lay.total_bytes, SENTINEL, np.uint8)
    _place_seed_rows(want_bad, base, dense, ring, blk[last], pos[last], key[last], gate[last])
    np.testing.assert_array_equal(got_bad, want_bad)


# =================================================================================
# vLLM conformance vectors
# =================================================================================
needs_vectors = pytest.mark.skipif(not V.available(), reason="conformance vectors not found")


@needs_vectors
def test_vllm_seed_vector():
    layout, sent, key, gate, tslot, want = V.seed_case()
    cache = refjit.seed(layout.allocate(sent), layout, 0, key, gate, tslot)
    got = refjit.as_bytes(cache)
    np.testing.assert_array_equal(got[:want.size], want)
    assert np.all(got[want.size:] == sent)
    # README: only these two windows differ from the sentinel (blocks 200 and 18, bytes 0..2048)
    changed = np.nonzero(got != sent)[0]
    in_windows = ((changed >= 7603200) & (changed < 7605248)) | ((changed >= 684288) & (changed < 686336))
    assert changed.size > 0 and in_windows.all()


@needs_vectors
def test_vllm_compress_vector():
    layout, key, gate, ape, slot, want = V.compress_case()
    cache = refjit.compress(layout.allocate(0), layout, 0, key, gate, ape, slot)
    got = refjit.as_bytes(cache)
    diff = np.nonzero(got[:want.size] != want)[0]
    assert diff.size == 0, f"{diff.size} bytes differ from vLLM, first at byte {diff[0]}"
    assert np.all(got[want.size:] == 0)


def _pool_byte_mask(layout, layer, slots):
    """Bytes of the pool records of `slots`, from the docs/semantics.md 3.1 formulas (not addressing.py)."""
    c = layout.config
    m = np.zeros(layout.total_bytes, bool)
    base = layout.index_base_bytes(layer)
    for loc in slots:
        page, row = divmod(int(loc), c.page_rows)
        start = base + page * c.page_rows * 132
        m[start + row * 128: start + row * 128 + 128] = True
        m[start + c.page_rows * 128 + row * 4: start + c.page_rows * 128 + row * 4 + 4] = True
    return m


@needs_vectors
def test_vllm_prefill_decode_vector():
    layout, sent, ape, pre, steps, want = V.prefill_decode_case()
    cache = refjit.prefill(layout.allocate(sent), layout, 0, ape, pre)
    for st in steps:
        cache = refjit.decode_step(cache, layout, 0, ape, st)
    got = refjit.as_bytes(cache)
    assert got.size == want.size
    slots = [s for s in pre["slot_mapping"][layout.config.kpool - 1:] if s >= 0]
    slots += [int(s) for st in steps for s in st["slot_mapping"].ravel() if s >= 0]
    pool_mask = _pool_byte_mask(layout, 0, slots)
    tail_mask = np.zeros(want.size, bool)
    for b in np.unique(pre["tslot"][pre["tslot"] >= 0] // layout.config.ring):
        a0 = layout.index_base_bytes(0) + b * layout.config.index_block_bytes
        tail_mask[a0:a0 + layout.config.tail_block_bytes] = True
    assert not (pool_mask & tail_mask).any()
    diff = got != want
    n_written = int((want != sent).sum())
    assert n_written == 45410
    # tail bytes and every unwritten byte agree exactly; pool records may differ at a
    # handful of rounding boundaries (vectors README: an independent port differed in 6)
    assert not diff[tail_mask].any(), "tail ring bytes differ from vLLM"
    assert not diff[~pool_mask & ~tail_mask].any(), "bytes outside pool records and tails differ"
    n_diff = int(diff.sum())
    print(f"\nvllm_prefill_decode: {n_diff} of {n_written} written bytes differ (pool records)")
    assert n_diff <= 6


# =================================================================================
# decode writer == prefill writer, byte for byte (docs/semantics.md 8, invariant 1; B3)
# =================================================================================
# (config, decode width W). W = 1 only for R16-ring16 (n_spec 0: next_n is 1), to spare
# the CPU a compile of the unrolled kpool-16 decode at a second width.
DP_CONFIGS = {
    "R4-ring4-P16": (IndexerConfig(kpool=4, block_size=64), 3),
    "R4-ring8-P32": (IndexerConfig(kpool=4, num_spec_tokens=3, block_size=128), 4),
    "R16-ring16-P64": (IndexerConfig(kpool=16, block_size=1024), 1),
    "R16-ring32-P64x2": (IndexerConfig(kpool=16, num_spec_tokens=4, block_size=2048), 2),
}


@pytest.mark.parametrize("name", list(DP_CONFIGS))
def test_decode_writer_matches_prefill_writer(rng, name):
    """One token stream, processed as: prefill only; prefill of the first k tokens then
    decode one token per step, for every split k; the same with decode windows of random
    width (next_n > 1); and decode alone (k = 0, nothing seeded). All pool records and
    ring contents must be identical. Every variant is one request of the same batch."""
    cfg, W = DP_CONFIGS[name]
    R, ring = cfg.kpool, cfg.ring
    assert ring in (R, 2 * R)
    L = ring + R + 3                                   # wraps the ring, ends mid-pool
    splits = list(range(L + 1))
    # group A: one token per step; group B (when W > 1): windows of 1..W tokens per step
    n = len(splits) * (2 if W > 1 else 1)
    layer = 1
    layout = CacheLayout(cfg, num_layers=2, num_blocks=2 * n + 3, attn_block_bytes=64)
    sc = Scenario.random(rng, layout, [L] * n, layer=layer)
    for r in sc.requests[1:]:
        r.key, r.gate = sc.requests[0].key, sc.requests[0].gate
    done = splits * (n // len(splits))
    cache = refjit.prefill(layout.allocate(SENTINEL), layout, layer, sc.ape, sc.prefill(done))
    while any(d < L for d in done):
        counts = [min(1 if i < len(splits) else int(rng.integers(1, W + 1)), L - d)
                  for i, d in enumerate(done)]
        cache = refjit.decode_step(cache, layout, layer, sc.ape, sc.decode(done, counts, W))
        done = [d + c for d, c in zip(done, counts)]

    def label(i):
        return f"split {splits[i % len(splits)]}, {'one token/step' if i < len(splits) else 'windows'}"

    m = L // R
    ref_i = len(splits) - 1                             # prefill only
    ref_k, ref_s = _pool_records(layout, cache, layer, sc.pool_slots(ref_i, m))
    key = sc.requests[0].key
    tk, tg = layout.tail_ring(cache, layer)
    ref_tb = sc.requests[ref_i].tail_block
    last_r = range(max(0, L - R), L)
    for p in last_r:
        np.testing.assert_array_equal(_u16(tk[ref_tb, p % ring]), _u16(key[p]))
    # the prefill seed wrote only its last R tokens: other ring slots still hold the sentinel
    seeded = {p % ring for p in last_r}
    for s in set(range(ring)) - seeded:
        assert np.all(_u16(tk[ref_tb, s]) == SENT16) and np.all(_u16(tg[ref_tb, s]) == SENT16)
    for i, r in enumerate(sc.requests):
        k_i, s_i = _pool_records(layout, cache, layer, sc.pool_slots(i, m))
        np.testing.assert_array_equal(k_i, ref_k, err_msg=f"pool keys, {label(i)}")
        np.testing.assert_array_equal(s_i, ref_s, err_msg=f"pool scales, {label(i)}")
        for p in last_r:
            np.testing.assert_array_equal(_u16(tk[r.tail_block, p % ring]), _u16(tk[ref_tb, p % ring]),
                                          err_msg=f"ring K of position {p}, {label(i)}")
            np.testing.assert_array_equal(_u16(tg[r.tail_block, p % ring]), _u16(tg[ref_tb, p % ring]),
                                          err_msg=f"ring gate of position {p}, {label(i)}")
        if L - splits[i % len(splits)] >= ring:      # decode stashed the whole ring
            for p in range(L - ring, L):
                np.testing.assert_array_equal(_u16(tk[r.tail_block, p % ring]), _u16(key[p]),
                                              err_msg=f"ring K of position {p}, {label(i)}")
                np.testing.assert_array_equal(_u16(tg[r.tail_block, p % ring]),
                                              _u16(sc.requests[0].gate[p]),
                                              err_msg=f"ring gate of position {p}, {label(i)}")
    # golden model (docs/semantics.md appendix C), tails, and sentinel outside the requests' blocks
    sc.check_cache(cache, [L] * n, SENTINEL)


# =================================================================================
# rejected-draft redo (docs/semantics.md 5.4 example, bug B2)
# =================================================================================
REDO_LAYOUTS = {
    "ring8": refjit.SMALL_LAYOUT,        # kpool 4, num_spec_tokens 3 -> ring 8, block_size 128
    "ring4": CacheLayout(IndexerConfig(kpool=4, num_spec_tokens=0, block_size=128), num_layers=1, num_blocks=4),
}
PREFILL_T = refjit.SMALL_T     # prefill batches of the small layouts are padded to this many rows
DECODE_W = refjit.SMALL_W      # decode batches are [1, 4]


def _redo_run(rng, layout, history: str):
    """R=4, n_spec=3: tokens 0..5 committed (one per step, or by prefill); verify [6,7,8,9] with
    wrong drafts 7..9, all rejected; redo [7,8,9,10] with the true tokens; then decode 11."""
    sc = Scenario.random(rng, layout, [12])
    ape = sc.ape
    cache = layout.allocate(SENTINEL)
    if history == "steps":
        for p in range(6):
            cache = refjit.decode_step(cache, layout, 0, ape, sc.decode([p], [1], DECODE_W))
    else:
        cache = refjit.prefill(cache, layout, 0, ape, sc.prefill([6], pad_to=PREFILL_T))
    verify = sc.decode([6], [4], DECODE_W)
    verify["key"][0, 1:4] = random_rows(rng, 3)
    verify["gate"][0, 1:4] = random_rows(rng, 3)
    cache = refjit.decode_step(cache, layout, 0, ape, verify)
    after_verify = _pool_records(layout, cache, 0, sc.pool_slots(0, 2))
    cache = refjit.decode_step(cache, layout, 0, ape, sc.decode([7], [4], DECODE_W))
    after_redo = _pool_records(layout, cache, 0, sc.pool_slots(0, 2))
    cache = refjit.decode_step(cache, layout, 0, ape, sc.decode([11], [1], DECODE_W))
    # the prefill writer's pools of the true tokens, in a fresh cache
    fresh = refjit.prefill(layout.allocate(SENTINEL), layout, 0, ape, sc.prefill([8], pad_to=PREFILL_T))
    prefill_pools = _pool_records(layout, fresh, 0, sc.pool_slots(0, 2))
    return sc, cache, after_verify, after_redo, prefill_pools


@pytest.mark.parametrize("history", ["steps", "prefill"])
def test_rejected_draft_redo_with_ring8(rng, history):
    layout = REDO_LAYOUTS["ring8"]
    assert layout.config.ring == 8
    sc, cache, after_verify, after_redo, prefill_pools = _redo_run(rng, layout, history)
    gk, gs = sc.golden_pools(0, 12)
    # the verify wrote a wrong pool 1 (draft 7) ...
    assert np.any(after_verify[0][1] != prefill_pools[0][1])
    # ... which the redo overwrote with exactly the prefill writer's bytes
    for j in (0, 1):
        np.testing.assert_array_equal(after_redo[0][j], prefill_pools[0][j], err_msg=f"pool {j} keys")
        np.testing.assert_array_equal(after_redo[1][j], prefill_pools[1][j], err_msg=f"pool {j} scale")
        np.testing.assert_array_equal(after_redo[0][j], gk[j])
    # and the next pool (8..11), built from redone ring slots, is right too
    sc.check_cache(cache, [12], SENTINEL)
    np.testing.assert_array_equal(_pool_records(layout, cache, 0, sc.pool_slots(0, 3))[0], gk)


def test_rejected_draft_redo_fails_with_ring4(rng):
    """Self-check (docs/semantics.md 8, invariant 3): with a one-pool ring the drafts at 8, 9 overwrite the ring slots
    of 4, 5, so the redone pool 1 differs from the prefill writer's."""
    layout = REDO_LAYOUTS["ring4"]
    assert layout.config.ring == 4
    sc, cache, after_verify, after_redo, prefill_pools = _redo_run(rng, layout, "steps")
    np.testing.assert_array_equal(after_redo[0][0], prefill_pools[0][0])       # pool 0 unaffected
    assert np.any(after_redo[0][1] != prefill_pools[0][1]), "ring 4 redo unexpectedly matched"
    with pytest.raises(AssertionError):
        sc.check_cache(cache, [12], SENTINEL)


# =================================================================================
# property test: random configs, layouts, batches and block assignments
# =================================================================================
def _random_config(rng):
    while True:
        kpool = int(rng.choice([4, 4, 16]))
        s_rows = int(rng.choice([16, 32, 48, 64, 96, 128, 160, 288]))
        try:
            return IndexerConfig(kpool=kpool, num_spec_tokens=int(rng.integers(0, 6)),
                                 block_size=kpool * s_rows)
        except ValueError:
            continue


def _random_lengths(rng, cfg, n_req):
    R = cfg.kpool
    out = []
    for _ in range(n_req):
        kind = rng.integers(0, 4)
        if kind == 0:
            out.append(int(rng.integers(1, R)))                          # shorter than a pool
        elif kind == 1:
            out.append(R * int(rng.integers(1, 6)))                       # a multiple of kpool
        elif kind == 2:
            out.append(int(rng.integers(1, 6 * R)))
        else:
            out.append(int(rng.integers(1, min(2 * cfg.block_size + 5, 160))))   # may span blocks
    return out


def test_random_workloads_golden_and_no_stray_bytes(rng):
    """After a padded prefill and decode steps, every owned pool and tail slot holds exactly the
    golden value and every byte outside the requests' blocks (all layers) is the sentinel."""
    n_cases = 5
    for case in range(n_cases):
        cfg = _random_config(rng)
        R = cfg.kpool
        n_req = int(rng.integers(1, 5))
        lengths = _random_lengths(rng, cfg, n_req)
        num_layers = int(rng.integers(1, 4))
        attn = int(rng.choice([0, 4 * int(rng.integers(1, 700))]))
        need = sum(max(1, -(-L // cfg.block_size)) for L in lengths) + n_req
        layout = CacheLayout(cfg, num_layers=num_layers, num_blocks=need + 1 + int(rng.integers(0, 6)),
                             attn_block_bytes=attn)
        layer = int(rng.integers(0, num_layers))
        desc = (f"case {case}: {cfg}, layers={num_layers}, layer={layer}, attn={attn}, "
                f"blocks={layout.num_blocks}, lengths={lengths}")
        sc = Scenario.random(rng, layout, lengths, layer=layer)
        # prefill a prefix of each request (whole request, nothing, or in between)
        upto = [int(rng.choice([0, L, int(rng.integers(0, L + 1))])) for L in lengths]
        pre = sc.prefill(upto, pad_to=sum(upto) + int(rng.integers(0, 2 * R)))
        cache = refjit.prefill(layout.allocate(SENTINEL), layout, layer, sc.ape, pre)
        try:
            sc.check_cache(cache, upto, SENTINEL)
            W = int(rng.integers(1, 3)) if R == 4 else 1
            for _ in range(4):
                counts = [int(rng.integers(0, min(W, L - u) + 1)) for L, u in zip(lengths, upto)]
                cache = refjit.decode_step(cache, layout, layer, sc.ape, sc.decode(upto, counts, W))
                upto = [u + c for u, c in zip(upto, counts)]
            info = sc.check_cache(cache, upto, SENTINEL)
        except AssertionError as e:
            raise AssertionError(f"{desc}, processed={upto}: {e}") from None
        assert info["pools"] == sum(u // R for u in upto)


# =================================================================================
# padding and out-of-range slots write nothing
# =================================================================================
def test_padding_and_out_of_range_write_nothing(rng):
    layout = REDO_LAYOUTS["ring8"]
    c = layout.config
    R, ring = c.kpool, c.ring
    n_pool, n_tail = layout.num_blocks * c.pools_per_block, layout.num_blocks * ring
    ape = random_ape(rng, R)
    key, gate = random_rows(rng, PREFILL_T), random_rows(rng, PREFILL_T)
    clean = layout.allocate(SENTINEL)

    def unchanged(cache, what):
        diff = np.nonzero(refjit.as_bytes(cache) != SENTINEL)[0]
        assert diff.size == 0, f"{what}: {diff.size} bytes written, first at byte {diff[0]}"

    # the null block 0's slots (0 .. ring - 1, 0 .. pools_per_block - 1) are as invalid as padding
    bad_tslots = [-1, -2, -ring, 0, ring - 1, n_tail, n_tail + 3, n_tail + ring + 1, 2**31 - 1, -2**31]
    bad_slots = [-1, -7, 0, c.pools_per_block - 1, n_pool, n_pool + 1, n_pool + c.pools_per_block,
                 2**31 - 1, -2**31]
    # seed: negative tail slots, block 0 and tail block ids >= num_blocks
    ts = np.array(rng.choice(bad_tslots, PREFILL_T), np.int32)
    unchanged(refjit.seed(clean, layout, 0, key, gate, ts), f"seed tslot={ts}")
    # compress: padding (-1), block 0 and pool slots past the last block (never wrap to block 0)
    sm = np.array(rng.choice(bad_slots, PREFILL_T), np.int32)
    unchanged(refjit.compress(clean, layout, 0, key, gate, ape, sm), f"compress slots={sm}")
    # a valid completion next to invalid ones: exactly its 132 record bytes change
    loc = int(rng.integers(c.pools_per_block, n_pool))
    sm = np.array([-1, -1, -1, loc, -1, -1, -1, n_pool + loc % 5], np.int32)
    got = refjit.as_bytes(refjit.compress(clean, layout, 0, key, gate, ape, sm))
    mask = _pool_byte_mask(layout, 0, [loc])
    assert np.all(got[~mask] == SENTINEL)
    assert np.count_nonzero(got[mask] != SENTINEL) > 100

    # decode [1, 4]: pos < 0 with valid slots; pos valid with tslot / slot out of range
    kd = random_rows(rng, DECODE_W)[None]
    gd = random_rows(rng, DECODE_W)[None]
    pos = np.array([[-1, -1, -3, -1]], np.int32)
    valid_t = np.array([[ring + 1, ring + 2, ring + 3, ring]], np.int32)      # block 1
    valid_s = np.array([[5, 6, 7, 8]], np.int32)
    unchanged(refjit.decode(clean, layout, 0, kd, gd, ape, valid_s, valid_t, pos), "decode pos<0")
    pos = np.array([[3, 7, 10, 11]], np.int32)                                # 3, 7, 11 complete pools
    unchanged(refjit.decode(clean, layout, 0, kd, gd, ape,
                            np.array([[-1, n_pool, -1, n_pool + 3]], np.int32),
                            np.array([[-1, n_tail, n_tail + 2, -5]], np.int32), pos),
              "decode invalid tslot/slot")
    # valid pool slots (block 2) with tail slots in block 0, padding or past the last block:
    # no stash, and no pool either (its other members would come from block 0's ring)
    unchanged(refjit.decode(clean, layout, 0, kd, gd, ape,
                            2 * c.pools_per_block + np.array([[1, 2, 3, 4]], np.int32),
                            np.array([[3, -1, n_tail + 2, 7]], np.int32), pos),
              "decode completions without a tail slot")
    # ... and slots in block 0 (pool and tail) write nothing
    unchanged(refjit.decode(clean, layout, 0, kd, gd, ape, np.array([[0, 5, 6, 7]], np.int32),
                            np.array([[3, 7, 2, 3]], np.int32), pos), "decode block 0")


# =================================================================================
# op boundary: clear errors, and a rejected call never touches the caller's cache
# =================================================================================
def _small_inputs(rng, layout):
    T = PREFILL_T
    bf = lambda *s: jnp.asarray(random_rows(rng, int(np.prod(s[:-1]))).reshape(s))
    return dict(
        key=bf(T, 128), gate=bf(T, 128), ape=jnp.asarray(random_ape(rng, layout.config.kpool)),
        slot=jnp.asarray(np.array([-1, -1, -1, 105, -1, -1, -1, 106], np.int32)),     # block 3
        tslot=jnp.asarray((8 + np.arange(T) % 8).astype(np.int32)),
        dkey=bf(2, 3, 128), dgate=bf(2, 3, 128),
        dslot=jnp.asarray(np.array([[-1, -1, 99], [-1, 103, -1]], np.int32)),        # block 3
        dtslot=jnp.asarray(np.array([[9, 10, 11], [16, 17, 18]], np.int32)),
        dpos=jnp.asarray(np.array([[1, 2, 3], [6, 7, 8]], np.int32)),
    )


def _bad_calls(layout, a):
    """(description, call, message regex) of rejected op calls; each call takes the cache."""
    f32 = lambda x: x.astype(jnp.float32)
    i16 = lambda x: x.astype(jnp.int16)
    S, C, D = ops.seed_tail, ops.compress_prefill, ops.decode_update
    dup_flat = jnp.asarray(np.array([-1, -1, -1, 105, -1, -1, -1, 105], np.int32))
    too_many = jnp.asarray(np.array([-1, -1, -1, 105, 106, 107, -1, 108], np.int32))
    too_close = jnp.asarray(np.array([-1, -1, -1, 105, -1, 106, -1, -1], np.int32))
    dup_dec = jnp.asarray(np.array([[-1, -1, 99], [-1, 99, -1]], np.int32))
    null_flat = jnp.asarray(np.array([-1, -1, -1, 31, -1, -1, -1, 106], np.int32))
    null_tail = a["tslot"].at[5].set(7)
    null_dec = a["dslot"].at[0, 2].set(3)
    null_dec_tail = a["dtslot"].at[1, 0].set(0)
    orphan = a["dtslot"].at[0, 2].set(-1)                 # token [0, 2] completes pool 99 (position 3)
    orphan_far = a["dtslot"].at[0, 2].set(4 * 8 + 3)      # ... with a tail slot past the last block
    x = dict(implementation="xla")
    return [
        ("seed key f32", lambda c: S(c, layout, 0, f32(a["key"]), a["gate"], a["tslot"], **x),
         r"seed_tail: key must be bfloat16"),
        ("seed key [T,64]", lambda c: S(c, layout, 0, a["key"][:, :64], a["gate"], a["tslot"], **x),
         r"seed_tail: key must have shape \(8, 128\)"),
        ("seed gate short", lambda c: S(c, layout, 0, a["key"], a["gate"][:5], a["tslot"], **x),
         r"seed_tail: gate must have shape \(8, 128\), got \(5, 128\)"),
        ("seed tslot int16", lambda c: S(c, layout, 0, a["key"], a["gate"], i16(a["tslot"]), **x),
         r"seed_tail: tslot must be int32"),
        ("seed tslot [T,1]", lambda c: S(c, layout, 0, a["key"], a["gate"], a["tslot"][:, None], **x),
         r"seed_tail: tslot must have shape \(8,\)"),
        ("seed cache int32", lambda c: S(c.view(jnp.int32), layout, 0, a["key"], a["gate"], a["tslot"], **x),
         r"seed_tail: cache must be uint32"),
        ("seed cache short", lambda c: S(c[:-1], layout, 0, a["key"], a["gate"], a["tslot"], **x),
         r"seed_tail: cache must have shape"),
        ("seed layout", lambda c: S(c, layout.strides(0), 0, a["key"], a["gate"], a["tslot"], **x),
         r"seed_tail: layout must be a CacheLayout"),
        ("seed layer", lambda c: S(c, layout, 1, a["key"], a["gate"], a["tslot"], **x),
         r"layer must be an int in \[0, 1\)"),
        ("seed impl", lambda c: S(c, layout, 0, a["key"], a["gate"], a["tslot"], implementation="cuda"),
         r"seed_tail: implementation must be one of"),
        ("compress ape shape", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"][:3], a["slot"], **x),
         r"compress_prefill: ape must have shape \(4, 128\)"),
        ("compress ape bf16", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"].astype(jnp.bfloat16),
                                          a["slot"], **x),
         r"compress_prefill: ape must be float32"),
        ("compress slot f32", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], f32(a["slot"]), **x),
         r"compress_prefill: slot_mapping must be int32"),
        ("compress slot shape", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], a["slot"][:7], **x),
         r"compress_prefill: slot_mapping must have shape \(8,\)"),
        ("compress dup", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], dup_flat, **x),
         r"compress_prefill: slot_mapping writes the same pool slot twice"),
        ("compress too many", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], too_many, **x),
         r"compress_prefill: slot_mapping completes 4 pools in 8 rows; at most 2"),
        ("compress too close", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], too_close, **x),
         r"compress_prefill: slot_mapping completes pools at rows 3 and 5, closer than kpool = 4"),
        ("decode key [B,n,64]", lambda c: D(c, layout, 0, a["dkey"][..., :64], a["dgate"], a["ape"],
                                            a["dslot"], a["dtslot"], a["dpos"], **x),
         r"decode_update: key must have shape \(2, 3, 128\)"),
        ("decode gate f32", lambda c: D(c, layout, 0, a["dkey"], f32(a["dgate"]), a["ape"],
                                        a["dslot"], a["dtslot"], a["dpos"], **x),
         r"decode_update: gate must be bfloat16"),
        ("decode slot [B,n+1]", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"],
                                            jnp.pad(a["dslot"], ((0, 0), (0, 1))), a["dtslot"], a["dpos"], **x),
         r"decode_update: slot_mapping must have shape \(2, 3\)"),
        ("decode tslot int16", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"],
                                           i16(a["dtslot"]), a["dpos"], **x),
         r"decode_update: tslot must be int32"),
        ("decode positions f32", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"],
                                             a["dtslot"], f32(a["dpos"]), **x),
         r"decode_update: positions must be int32"),
        ("decode positions 1-D", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"],
                                             a["dtslot"], a["dpos"].ravel(), **x),
         r"decode_update: positions must be"),
        ("decode dup", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], dup_dec, a["dtslot"],
                                   a["dpos"], **x),
         r"decode_update: slot_mapping writes the same pool slot twice"),
        ("compress null block", lambda c: C(c, layout, 0, a["key"], a["gate"], a["ape"], null_flat, **x),
         r"compress_prefill: slot_mapping\[3\] = 31 is a pool slot of the null block 0 \(pool slots 0 \.\. 31\)"),
        ("seed null block", lambda c: S(c, layout, 0, a["key"], a["gate"], null_tail, **x),
         r"seed_tail: tslot\[5\] = 7 is a tail slot of the null block 0 \(tail slots 0 \.\. 7\)"),
        ("decode null block", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], null_dec, a["dtslot"],
                                          a["dpos"], **x),
         r"decode_update: slot_mapping\[0, 2\] = 3 is a pool slot of the null block 0"),
        ("decode null tail", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"],
                                         null_dec_tail, a["dpos"], **x),
         r"decode_update: tslot\[1, 0\] = 0 is a tail slot of the null block 0"),
        ("decode no tail", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"], orphan,
                                       a["dpos"], **x),
         r"decode_update: token \[0, 2\] completes pool slot 99 but its tail slot -1 is invalid"),
        ("decode tail past the end", lambda c: D(c, layout, 0, a["dkey"], a["dgate"], a["ape"], a["dslot"],
                                                 orphan_far, a["dpos"], **x),
         r"decode_update: token \[0, 2\] completes pool slot 99 but its tail slot 35 is invalid"),
    ]


def test_ops_reject_bad_input_and_leave_cache_unchanged(rng):
    layout = REDO_LAYOUTS["ring8"]
    a = _small_inputs(rng, layout)
    cache = layout.allocate(SENTINEL)
    # write something first so "unchanged" is not just "still the sentinel"
    cache = refjit.compress(cache, layout, 0, np.asarray(a["key"]), np.asarray(a["gate"]), np.asarray(a["ape"]),
                            np.asarray(a["slot"]))
    before = refjit.as_bytes(cache)
    for desc, call, msg in _bad_calls(layout, a):
        with pytest.raises(ValueError, match=msg):
            call(cache)
        assert not cache.is_deleted(), desc
        np.testing.assert_array_equal(refjit.as_bytes(cache), before, err_msg=desc)


def test_rejected_call_under_donating_jit_keeps_cache(rng):
    """Shape errors are raised at trace time, before the donated buffer is consumed."""
    layout = REDO_LAYOUTS["ring8"]
    a = _small_inputs(rng, layout)
    seed = jax.jit(ops.seed_tail, static_argnums=(1, 2), static_argnames=("implementation",),
                   donate_argnums=0)
    cache = layout.allocate(SENTINEL)
    before = refjit.as_bytes(cache)
    with pytest.raises(ValueError, match="key must be bfloat16"):
        seed(cache, layout, 0, a["key"].astype(jnp.float32), a["gate"], a["tslot"], implementation="xla")
    with pytest.raises(ValueError, match="tslot must have shape"):
        seed(cache, layout, 0, a["key"], a["gate"], a["tslot"][:4], implementation="xla")
    assert not cache.is_deleted()
    np.testing.assert_array_equal(refjit.as_bytes(cache), before)
    # the same jitted op does consume the donated cache when the input is good, so the
    # checks above are not vacuous
    out = seed(cache, layout, 0, a["key"], a["gate"], a["tslot"], implementation="xla")
    assert np.any(refjit.as_bytes(out) != SENTINEL)
    assert cache.is_deleted()
