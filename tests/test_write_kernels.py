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

# (kpool, num_spec_tokens -> ring, block_size -> page_rows)
CONFIGS = [
    pytest.param(dict(kpool=4, num_spec_tokens=0, block_size=1152), id="R4-ring4-P32"),
    pytest.param(dict(kpool=4, num_spec_tokens=1, block_size=512), id="R4-ring8-P64"),
    pytest.param(dict(kpool=16, num_spec_tokens=0, block_size=1536), id="R16-ring16-P32"),
    pytest.param(dict(kpool=16, num_spec_tokens=1, block_size=2048), id="R16-ring32-P64"),
]
LAYOUTS = [
    pytest.param(dict(num_layers=1, attn_block_bytes=0, layer=0), id="1layer"),
    pytest.param(dict(num_layers=3, attn_block_bytes=1056, layer=1), id="3layers-attn"),
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


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("cfg", CONFIGS)
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
