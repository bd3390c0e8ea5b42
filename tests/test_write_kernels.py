"""Pallas write kernels == the XLA reference, byte for byte, on sentinel-filled caches.

On CPU the kernels run in interpret mode; on a GPU backend they run compiled
(the same tests; ``python -m pytest tests -m "not slow"`` on the H200).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
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


def _bytes(cache):
    return np.asarray(cache).view(np.uint8)


def _run(impl, layout, layer, sc, pre, steps):
    cache = layout.allocate(SENTINEL)
    ape = jnp.asarray(sc.ape)
    cache = ops.compress_prefill(cache, layout, layer, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                                 ape, jnp.asarray(pre["slot_mapping"]), implementation=impl)
    cache = ops.seed_tail(cache, layout, layer, jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
                          jnp.asarray(pre["tslot"]), implementation=impl)
    snaps = [_bytes(cache).copy()]
    for st in steps:
        cache = ops.decode_update(cache, layout, layer, jnp.asarray(st["key"]), jnp.asarray(st["gate"]), ape,
                                  jnp.asarray(st["slot_mapping"]), jnp.asarray(st["tslot"]),
                                  jnp.asarray(st["positions"]), implementation=impl)
        snaps.append(_bytes(cache).copy())
    return cache, snaps


@pytest.mark.parametrize("cfg, lay", CASES)
def test_pallas_matches_reference_prefill_then_decode(rng, cfg, lay):
    config = IndexerConfig(**cfg)
    layout = CacheLayout(config, num_layers=lay["num_layers"], num_blocks=12,
                         attn_block_bytes=lay["attn_block_bytes"])
    R = config.kpool
    lengths = [int(x) for x in rng.integers(1, 6 * R + 3, size=3)]
    lengths[0] = max(lengths[0], 3 * R + 1)                   # at least one long request
    sc = Scenario.random(rng, layout, [L + 2 * R for L in lengths], layer=lay["layer"])
    pre = sc.prefill(lengths, pad_to=sum(lengths) + int(rng.integers(0, 5)))
    # decode: two steps of up to 2R tokens each, uneven per request (padding at the end)
    width = 2 * R
    starts, steps = list(lengths), []
    for _ in range(2):
        counts = [int(rng.integers(0, min(width, r.length_tokens - s0) + 1))
                  for r, s0 in zip(sc.requests, starts)]
        steps.append(sc.decode(starts, counts, width))
        starts = [s + n for s, n in zip(starts, counts)]
    ref_cache, ref_snaps = _run("xla", layout, lay["layer"], sc, pre, steps)
    _, pal_snaps = _run("pallas", layout, lay["layer"], sc, pre, steps)
    for i, (a, b) in enumerate(zip(ref_snaps, pal_snaps)):
        diff = np.nonzero(a != b)[0]
        assert diff.size == 0, f"after step {i}: {diff.size} bytes differ, first at byte {diff[0]}"
    # and the reference itself holds the golden pools / tails, sentinel everywhere else
    sc.check_cache(ref_cache, starts, SENTINEL)


def test_vllm_seed_vector_pallas(rng):
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    layout, sent, key, gate, tslot, want = V.seed_case()
    c = ops.seed_tail(layout.allocate(sent), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                      jnp.asarray(tslot), implementation="pallas")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


def test_vllm_compress_vector_pallas():
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    layout, key, gate, ape, slot, want = V.compress_case()
    c = ops.compress_prefill(layout.allocate(0), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                             jnp.asarray(ape), jnp.asarray(slot), implementation="pallas")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


@pytest.mark.parametrize("fault", [None, "dense-tail-stride"])
def test_padded_stride_regression_kernel(rng, fault):
    """Spec B1 through the Pallas seed kernel: with the real strides only the own tail
    blocks (18 and 200) change; with the injected dense stride the own blocks stay
    sentinel and other requests' indexer bytes change (so the probe can see it)."""
    from pallas_kernels.tail_seed import seed_tail as kernel
    from glm5_jax import reference as ref
    config = IndexerConfig()                                   # 1152-token blocks, ring 4
    layout = CacheLayout(config, num_layers=1, num_blocks=256)
    s = layout.strides(0, fault=fault)
    blocks = [18, 200]
    key = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    tslot = jnp.asarray([b * config.ring + p for b in blocks for p in range(4)], jnp.int32)
    got = _bytes(kernel(layout.allocate(SENTINEL), s, key, gate, tslot))
    want = _bytes(ref.seed_tail_strides(layout.allocate(SENTINEL), s, key, gate, tslot))
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
        # dense addresses: block b at b * 2 * ring * 256 bytes (18 -> 36864, 200 -> 409600)
        hit = set(changed.tolist())
        assert 36864 in hit and 409600 in hit and changed.min() == 36864
