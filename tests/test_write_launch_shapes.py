"""Launch shapes of the write kernels write exactly the reference's bytes, on
sentinel-filled caches: the seed kernel's request-ends mode (cost independent of
the prompt length) and the compression kernel's tile sizes (completions ranked
inside the kernel, tiles cutting through pools and requests)."""
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario

SENTINEL = 0x5A


@pytest.mark.parametrize("kpool", [4, 16])
def test_seed_with_request_ends_matches_reference(rng, kpool):
    cfg = IndexerConfig(kpool=kpool, block_size=512 if kpool == 4 else 2048)
    layout = CacheLayout(cfg, num_layers=2, num_blocks=14)
    # a long request, requests shorter than kpool (their last-kpool window reaches into
    # the previous request), one that ends exactly on a pool boundary
    lengths = [int(rng.integers(3 * kpool, 5 * kpool)), int(rng.integers(1, kpool)), 1, 2 * kpool,
               int(rng.integers(1, 3 * kpool))]
    sc = Scenario.random(rng, layout, lengths, layer=1)
    pad = int(rng.integers(0, 6))
    pre = sc.prefill(lengths, pad_to=sum(lengths) + pad)
    ends = np.cumsum(lengths).astype(np.int32)
    ends = np.concatenate([ends, np.array([0, 0], np.int32)])           # padding entries
    args = [jnp.asarray(pre[k]) for k in ("key", "gate", "tslot")]
    want = np.asarray(ops.seed_tail(layout.allocate(SENTINEL), layout, 1, *args,
                                    implementation="xla")).view(np.uint8)
    assert (want != SENTINEL).any()
    for impl in ("pallas", "xla"):
        got = np.asarray(ops.seed_tail(layout.allocate(SENTINEL), layout, 1, *args,
                                       request_ends_tokens=jnp.asarray(ends), implementation=impl)).view(np.uint8)
        diff = np.nonzero(got != want)[0]
        assert diff.size == 0, f"{impl}: {diff.size} bytes differ, first at {diff[:1]}"


def test_seed_request_ends_past_the_batch_is_rejected(rng):
    layout = CacheLayout(IndexerConfig(block_size=512), num_layers=1, num_blocks=4)
    key = jnp.zeros((8, 128), jnp.bfloat16)
    cache = layout.allocate(SENTINEL)
    with pytest.raises(ValueError, match="request_ends_tokens must be <="):
        ops.seed_tail(cache, layout, 0, key, key, jnp.zeros((8,), jnp.int32),
                      request_ends_tokens=jnp.asarray([4, 9], jnp.int32), implementation="pallas")
    assert (np.asarray(cache).view(np.uint8) == SENTINEL).all()


@pytest.mark.parametrize("tile_pools, num_warps", [(1, 1), (16, 8)])
def test_compress_tile_shapes_match_reference(rng, tile_pools, num_warps):
    from pallas_kernels.writes.pool_compress import compress_prefill as kernel
    cfg = IndexerConfig(block_size=512)
    layout = CacheLayout(cfg, num_layers=1, num_blocks=12)
    lengths = [int(x) for x in rng.integers(1, 40, size=4)]          # pools straddle every tile size
    sc = Scenario.random(rng, layout, lengths)
    pre = sc.prefill(lengths, pad_to=sum(lengths) + int(rng.integers(0, 9)))
    args = [jnp.asarray(pre[k]) for k in ("key", "gate")] + [jnp.asarray(sc.ape), jnp.asarray(pre["slot_mapping"])]
    want = np.asarray(ops.compress_prefill(layout.allocate(SENTINEL), layout, 0, *args,
                                           implementation="xla")).view(np.uint8)
    got = np.asarray(kernel(layout.allocate(SENTINEL), layout.strides(0), *args,
                            tile_pools=tile_pools, num_warps=num_warps)).view(np.uint8)
    assert (want != SENTINEL).any()
    np.testing.assert_array_equal(got, want)


def test_engine_request_ends_from_step_metadata_seed_the_same_bytes(rng):
    """The indexer derives request_ends_tokens from the prefill grid (prefill_row_ends): with
    them the seed kernel writes the reference's bytes for chunks of any length and
    start (non-aligned starts put head tokens in the grid row)."""
    from glm5_jax.model.indexer import prefill_row_ends
    from glm5_jax.serving.step_metadata import RowSpec, build_step, choose_shape
    cfg = IndexerConfig(block_size=64)
    layout = CacheLayout(cfg, num_layers=1, num_blocks=20)
    rows = []
    for i in range(4):
        n, start = int(rng.integers(1, 40)), int(rng.integers(0, 3)) * 64 + int(rng.integers(0, 9))
        blocks = [1 + 4 * i + j for j in range((start + n) // 64 + 1)]
        rows.append(RowSpec(list(range(n)), start, blocks, 1 + 4 * i + 3))
    shape = choose_shape(cfg, [], rows, next_n=1)
    arr = build_step(cfg, shape, [], rows)
    pos = jnp.asarray(arr.pre_positions.astype(np.int32))
    tslot = jnp.asarray(arr.pre_tslots.reshape(-1).astype(np.int32))
    t = tslot.shape[0]
    key = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    want = np.asarray(ops.seed_tail(layout.allocate(SENTINEL), layout, 0, key, gate, tslot,
                                    implementation="xla")).view(np.uint8)
    got = np.asarray(ops.seed_tail(layout.allocate(SENTINEL), layout, 0, key, gate, tslot,
                                   request_ends_tokens=prefill_row_ends(pos, tslot.reshape(pos.shape)),
                                   implementation="pallas")).view(np.uint8)
    assert (want != SENTINEL).any()
    np.testing.assert_array_equal(got, want)
