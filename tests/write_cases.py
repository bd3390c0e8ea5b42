"""Shared cases of the write-kernel tests: layouts, random workloads, the
prefill-then-decode run and the padded-stride regression.

Used by test_write_kernels.py (Pallas vs XLA), test_triton.py (Triton vs XLA) and
the interpreter dev script tests/scripts/triton_dev_check.py, so every
implementation is held to the same cases.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout, with_fault
from glm5_jax.testing import Scenario

SENTINEL = 0xA5

# Pairwise coverage: every kpool {4, 16}, ring {kpool, 2*kpool}, page_rows {32, 64},
# attention region {absent, present} and 1- / 3-layer layouts appears, in 4 cases
# instead of the 16 of the full product (interpret mode costs ~30 s a case on CI).
CASES = [
    pytest.param(dict(kpool=4, num_spec_tokens=0, block_size=1152), dict(num_layers=1, attn_block_bytes=0, layer=0),
                 id="R4-ring4-P32-1layer"),
    pytest.param(dict(kpool=4, num_spec_tokens=1, block_size=512), dict(num_layers=3, attn_block_bytes=1056, layer=1),
                 id="R4-ring8-P64-3layers-attn"),
    pytest.param(dict(kpool=16, num_spec_tokens=0, block_size=1536), dict(num_layers=3, attn_block_bytes=1056, layer=2),
                 id="R16-ring16-P32-3layers-attn"),
    pytest.param(dict(kpool=16, num_spec_tokens=1, block_size=2048), dict(num_layers=1, attn_block_bytes=0, layer=0),
                 id="R16-ring32-P64-1layer"),
]


def as_bytes(cache) -> np.ndarray:
    return np.asarray(cache).view(np.uint8)


def ops_writers(impl):
    """The three writers of glm5_jax.ops with `implementation=impl`, as run_writes expects."""
    return dict(
        compress=lambda c, lay, l, k, g, a, s: ops.compress_prefill(c, lay, l, k, g, a, s, implementation=impl),
        seed=lambda c, lay, l, k, g, t: ops.seed_tail(c, lay, l, k, g, t, implementation=impl),
        decode=lambda c, lay, l, k, g, a, s, t, p: ops.decode_update(c, lay, l, k, g, a, s, t, p,
                                                                     implementation=impl),
    )


def random_workload(rng, cfg: dict, lay: dict):
    """A layout of the case and a random workload on it.

    Returns (layout, scenario, prefill batch, decode steps, tokens per request after
    the last step): three requests (one of at least 3 pools + 1), a padded flat
    prefill, then two decode steps of up to 2 * kpool tokens each, uneven per request.
    """
    config = IndexerConfig(**cfg)
    layout = CacheLayout(config, num_layers=lay["num_layers"], num_blocks=12,
                         attn_block_bytes=lay["attn_block_bytes"])
    R = config.kpool
    lengths = [int(x) for x in rng.integers(1, 6 * R + 3, size=3)]
    lengths[0] = max(lengths[0], 3 * R + 1)                   # at least one long request
    sc = Scenario.random(rng, layout, [L + 2 * R for L in lengths], layer=lay["layer"])
    pre = sc.prefill(lengths, pad_to=sum(lengths) + int(rng.integers(0, 5)))
    width = 2 * R
    starts, steps = list(lengths), []
    for _ in range(2):
        counts = [int(rng.integers(0, min(width, r.length_tokens - s0) + 1))
                  for r, s0 in zip(sc.requests, starts)]
        steps.append(sc.decode(starts, counts, width))
        starts = [s + n for s, n in zip(starts, counts)]
    return layout, sc, pre, steps, starts


def run_writes(writers, layout, layer, sc, pre, steps):
    """compress_prefill + seed_tail of `pre`, then decode_update of each step, on a
    sentinel-filled cache. Returns (final cache, byte snapshot after each stage)."""
    cache = layout.allocate(SENTINEL)
    ape = jnp.asarray(sc.ape)
    cache = writers["compress"](cache, layout, layer, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                                ape, jnp.asarray(pre["slot_mapping"]))
    cache = writers["seed"](cache, layout, layer, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                            jnp.asarray(pre["tslot"]))
    snaps = [as_bytes(cache).copy()]
    for st in steps:
        cache = writers["decode"](cache, layout, layer, jnp.asarray(st["key"]), jnp.asarray(st["gate"]), ape,
                                  jnp.asarray(st["slot_mapping"]), jnp.asarray(st["tslot"]),
                                  jnp.asarray(st["positions"]))
        snaps.append(as_bytes(cache).copy())
    return cache, snaps


def assert_same_snapshots(want, got):
    for i, (a, b) in enumerate(zip(want, got)):
        diff = np.nonzero(a != b)[0]
        assert diff.size == 0, f"after step {i}: {diff.size} bytes differ, first at byte {diff[0]}"


def check_padded_stride(rng, seed_strides, fault):
    """Bug B1 (docs/semantics.md 6) through a seed kernel taking (cache, strides, key, gate, tslot): with the
    real strides only the own tail blocks (18 and 200) change; with the injected dense
    stride the own blocks stay sentinel and other requests' indexer bytes change."""
    from glm5_jax import reference as ref
    config = IndexerConfig()                                   # 1152-token blocks, ring 4
    layout = CacheLayout(config, num_layers=1, num_blocks=256)
    s = with_fault(layout, fault).strides(0)
    blocks = [18, 200]
    key = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    tslot = jnp.asarray([b * config.ring + p for b in blocks for p in range(4)], jnp.int32)
    got = as_bytes(seed_strides(layout.allocate(SENTINEL), s, key, gate, tslot))
    want = as_bytes(ref.seed_tail_strides(layout.allocate(SENTINEL), s, key, gate, tslot))
    np.testing.assert_array_equal(got, want)
    changed = np.nonzero(got != SENTINEL)[0]
    own = np.zeros(got.size, bool)
    for b in blocks:
        a, _ = layout.block_byte_range(0, b)
        own[a:a + config.tail_block_bytes] = True
    if fault is None:
        assert changed.size > 0 and own[changed].all()
        assert np.array_equal(changed, np.nonzero(own & (got != SENTINEL))[0])
    else:
        assert changed.size > 0 and not own[changed].any()
        # dense addresses: block b's 2 * ring rows of 256 bytes at b * 2 * ring * 256 (18 -> 36864,
        # 200 -> 409600). Only those windows change, each in most of its bytes (a random byte
        # equals the sentinel 1 time in 256, so no single byte is asserted)
        window = 2 * config.ring * 256
        in_windows = np.zeros(changed.shape, bool)
        for start in (36864, 409600):
            inside = (changed >= start) & (changed < start + window)
            assert np.count_nonzero(inside) > window // 2
            in_windows |= inside
        assert in_windows.all()


def request_ends_case(rng, kpool: int):
    """A flat prefill for seed_tail's request_ends_tokens mode: a long request, requests shorter
    than kpool (their last-kpool window reaches into the previous request), one ending on
    a pool boundary, padding rows, and padding entries (0) in request_ends_tokens.
    Returns (layout, layer, (key, gate, tslot), request_ends_tokens [N] i32)."""
    cfg = IndexerConfig(kpool=kpool, block_size=512 if kpool == 4 else 2048)
    layout = CacheLayout(cfg, num_layers=2, num_blocks=14)
    lengths = [int(rng.integers(3 * kpool, 5 * kpool)), int(rng.integers(1, kpool)), 1, 2 * kpool,
               int(rng.integers(1, 3 * kpool))]
    sc = Scenario.random(rng, layout, lengths, layer=1)
    pre = sc.prefill(lengths, pad_to=sum(lengths) + int(rng.integers(0, 6)))
    ends = np.concatenate([np.cumsum(lengths), [0, 0]]).astype(np.int32)
    return layout, 1, tuple(jnp.asarray(pre[k]) for k in ("key", "gate", "tslot")), jnp.asarray(ends)


def tile_case(rng):
    """A flat prefill whose pools straddle every compression tile size: (layout, key, gate, ape, slot_mapping)."""
    layout = CacheLayout(IndexerConfig(block_size=512), num_layers=1, num_blocks=12)
    lengths = [int(x) for x in rng.integers(1, 40, size=4)]
    sc = Scenario.random(rng, layout, lengths)
    pre = sc.prefill(lengths, pad_to=sum(lengths) + int(rng.integers(0, 9)))
    return (layout, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]), jnp.asarray(sc.ape),
            jnp.asarray(pre["slot_mapping"]))


def write_ops(rng, layout, impl: str, layer: int = 0):
    """op name -> f(cache) running that write op with `impl` on a small fixed workload
    (two requests, a prefill then a 4-token decode step) drawn from `rng`."""
    sc = Scenario.random(rng, layout, [310, 45], layer=layer)
    pre = sc.prefill([300, 37])
    st = sc.decode([300, 37], [4, 4], 4)
    ape = jnp.asarray(sc.ape)
    a = {k: jnp.asarray(v) for k, v in pre.items()}
    d = {k: jnp.asarray(v) for k, v in st.items()}
    return {
        "compress_prefill": lambda c: ops.compress_prefill(c, layout, layer, a["key"], a["gate"], ape,
                                                           a["slot_mapping"], implementation=impl),
        "seed_tail": lambda c: ops.seed_tail(c, layout, layer, a["key"], a["gate"], a["tslot"],
                                             implementation=impl),
        "decode_update": lambda c: ops.decode_update(c, layout, layer, d["key"], d["gate"], ape, d["slot_mapping"],
                                                     d["tslot"], d["positions"], implementation=impl),
    }


def assert_updates_in_place(f, layout, kernel_marker: str | None = None):
    """jit(f, donate the cache): no copy of the cache in the compiled HLO, and the
    output is the same device buffer. kernel_marker: a string the HLO must hold.
    Returns the compiled HLO text."""
    import re

    import jax
    jf = jax.jit(f, donate_argnums=0)
    cache = layout.allocate(0)
    hlo = jf.lower(cache).compile().as_text()
    if kernel_marker is not None:
        assert kernel_marker in hlo, f"the compiled step has no {kernel_marker}"
    n = layout.total_words
    copies = [ln for ln in hlo.splitlines() if re.search(r"\bcopy(-start)?\(", ln) and str(n) in ln]
    assert not copies, "the compiled step copies the cache:\n" + "\n".join(copies)
    ptr = cache.unsafe_buffer_pointer()
    out = jf(cache)
    assert out.unsafe_buffer_pointer() == ptr, "the cache did not stay in place"
    return hlo


def many_pools_case(rng, per_request_tokens: int = 65536, n_requests: int = 4):
    """A prefill of n_requests x per_request_tokens fresh random rows (65,536 pools by
    default): enough pools to catch a numerics difference that hits ~1 pool in 3,000
    (Triton's FMA contraction did, in 21 of 65,536)."""
    cfg = IndexerConfig()
    layout = CacheLayout(cfg, num_layers=1,
                         num_blocks=n_requests * (per_request_tokens // cfg.block_size + 2) + 2)
    sc = Scenario.random(rng, layout, [per_request_tokens] * n_requests)
    pre = {k: jnp.asarray(v) for k, v in sc.prefill([per_request_tokens] * n_requests).items()}
    return layout, sc, pre


def assert_pools_golden(cache, layout, sc, what: str):
    """Every pool of every request equals the paging-free golden model, byte for byte."""
    keys, scales = layout.pool_keys(cache, sc.layer)
    keys, scales = np.asarray(keys).view(np.uint8), np.asarray(scales).view(np.uint32)
    bad, total = 0, 0
    for i in range(len(sc.requests)):
        gk, gs = sc.golden_pools(i)
        slots = sc.pool_slots(i, gk.shape[0])
        bad += int(((keys[slots] != gk).any(1) | (scales[slots] != gs.view(np.uint32))).sum())
        total += gk.shape[0]
    assert total > 0 and bad == 0, f"{what}: {bad} of {total} pools differ from the golden model"


def large_layout(gib: int, blocks: int = 4096):
    """(layout, last layer) of a cache of at least `gib` GiB: default indexer blocks,
    as many layers as it takes, so the last layer lies past byte 2**31 (and past
    2**32 from 5 GiB)."""
    cfg = IndexerConfig()
    layers = -(-gib * 2**30 // (blocks * cfg.index_block_bytes))
    return CacheLayout(cfg, num_layers=layers, num_blocks=blocks), layers - 1


def last_blocks_scenario(rng, layout, layer: int, lengths_tokens):
    """Scenario.random whose first request owns the layout's last blocks (its indexer
    blocks, then its tail block, as many as it drew): a block another request drew there
    trades places with one the first request gave up, so no two requests share a block."""
    sc = Scenario.random(rng, layout, lengths_tokens, layer=layer)
    first = sc.requests[0]
    mine = [*first.index_blocks, first.tail_block]
    last = list(range(layout.num_blocks - len(mine), layout.num_blocks))
    freed = [b for b in mine if b not in last]          # as many as the others hold of `last`
    for r in sc.requests[1:]:
        r.index_blocks = np.array([freed.pop() if b in last else b for b in r.index_blocks])
        if r.tail_block in last:
            r.tail_block = freed.pop()
    first.index_blocks = np.array(last[:-1])
    first.tail_block = last[-1]
    return sc
