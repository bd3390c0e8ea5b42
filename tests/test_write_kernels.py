"""Pallas write kernels == the XLA reference, byte for byte, on sentinel-filled caches.

On CPU the kernels run in interpret mode; on a GPU backend they run compiled
(the same tests; ``python -m pytest tests -m "not slow"`` on the H200). The cases
and the run are shared with test_triton.py (tests/write_cases.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from write_cases import (CASES, SENTINEL, as_bytes, assert_same_snapshots, check_padded_stride,
                         last_blocks_scenario, ops_writers, random_workload, run_writes)


@pytest.mark.parametrize("cfg, lay", CASES)
def test_pallas_matches_reference_prefill_then_decode(rng, cfg, lay):
    layout, sc, pre, steps, upto = random_workload(rng, cfg, lay)
    ref_cache, ref_snaps = run_writes(ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
    _, pal_snaps = run_writes(ops_writers("pallas"), layout, lay["layer"], sc, pre, steps)
    assert_same_snapshots(ref_snaps, pal_snaps)
    # and the reference itself holds the golden pools / tails, sentinel everywhere else
    sc.check_cache(ref_cache, upto, SENTINEL)


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
    """Bug B1 (docs/semantics.md 6) through the Pallas seed kernel (see write_cases.check_padded_stride)."""
    from pallas_kernels.writes.tail_seed import seed_tail as kernel
    check_padded_stride(rng, kernel, fault)


def test_decode_update_moves_row_bits_exactly(rng):
    """-0.0, subnormal and large bf16 key / gate values reach the ring (and the pools they
    complete) bit for bit, as through the reference. (A kernel that moved rows as floats,
    e.g. picking a row out of a tile with a sum, would turn -0.0 into +0.0; moving the
    bits as integers keeps it.)"""
    cfg, lay = CASES[1].values                                  # ring of 2 x kpool, 3 layers
    layout, sc, pre, steps, _ = random_workload(rng, cfg, lay)
    special = np.array([-0.0, 0.0, 1e-40, -1e-40, 65504.0, -448.0, 2.0**-133, 1.0], np.float32)
    for st in steps:
        for name in ("key", "gate"):
            a = np.asarray(st[name], np.float32)
            live = np.asarray(st["positions"]) >= 0
            pick = rng.integers(0, special.size, size=a.shape)
            a = np.where(live[..., None] & (rng.random(a.shape) < 0.3), special[pick], a)
            a[live, 0] = -0.0                                   # every live row holds one for sure
            if name == "gate":                                  # keep the softmax finite
                a = np.clip(a, -60.0, 60.0)
            st[name] = a.astype(st[name].dtype)
    ref_cache, ref_snaps = run_writes(ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
    _, pal_snaps = run_writes(ops_writers("pallas"), layout, lay["layer"], sc, pre, steps)
    assert_same_snapshots(ref_snaps, pal_snaps)
    neg_zero = [(np.asarray(st["key"]).view(np.uint16) == 0x8000).any() for st in steps]
    assert any(neg_zero), "the case must hold -0.0 keys"


def _tail_slots(blk, pos, cfg):
    """[b, n] tail slots of tokens at positions pos [b, n] stashing into tail blocks blk
    [b, n] (one block per token, not per request), through metadata.tail_slot_mapping.
    Padding tokens (pos < 0) keep the slot of position 0, so a kernel must skip them by
    their position, not by an invalid slot."""
    from glm5_jax import metadata as md
    b, n = pos.shape
    return md.tail_slot_mapping(np.maximum(pos, 0).ravel(), np.arange(b * n), np.ravel(blk), cfg).reshape(b, n)


def _odd_decode_batch(rng, layout, n, blocks_per_request=2):
    """A decode batch that no scheduler sends but the walk still defines: positions
    repeated, out of order and padded (-1, -7); tail slots that point at either of the
    request's tail blocks, at no block (-1) or past the last one; pool slots valid, -1
    or out of range (each valid one used once in the batch). What docs/semantics.md does
    guarantee holds: requests keep to their own tail blocks (5.4), and a block holding
    pools is never a tail block (3.5: one owner per block id), so pool records never
    overlap ring rows. Tail blocks 1 .. 2b, pools in blocks 2b + 1 and up."""
    cfg = layout.config
    s = layout.strides(0)
    b = 3
    pos = rng.integers(0, 3 * cfg.ring, size=(b, n))
    pos[0] = rng.integers(0, 40) + np.arange(n)                            # one request in order
    pos[rng.random((b, n)) < 0.15] = -1
    pos[2, n - 1] = -7
    own = 1 + np.arange(b * blocks_per_request).reshape(b, blocks_per_request)
    blk = own[np.arange(b)[:, None], rng.integers(0, blocks_per_request, size=(b, n))]
    tslot = _tail_slots(blk, pos, cfg)
    odd = rng.random((b, n))
    tslot[odd < 0.1] = -1
    tslot[(odd >= 0.1) & (odd < 0.15)] = s.num_tail_slots + 3
    first_pool = (b * blocks_per_request + 1) * s.pools_per_block
    valid = first_pool + rng.permutation(s.num_pool_slots - first_pool)[:b * n].reshape(b, n)
    slot = valid.copy()
    odd = rng.random((b, n))
    slot[odd < 0.15] = -1
    slot[(odd >= 0.15) & (odd < 0.2)] = s.num_pool_slots
    # one completion for sure: request 1's last token ends pool 2 into a valid slot
    pos[1, n - 1] = 3 * cfg.kpool - 1
    slot[1, n - 1] = valid[1, n - 1]
    tslot[1, n - 1] = own[1, 0] * cfg.ring + pos[1, n - 1] % cfg.ring
    key = rng.standard_normal((b, n, 128)).astype(jnp.bfloat16)
    gate = (3 * rng.standard_normal((b, n, 128))).astype(jnp.bfloat16)
    return [jnp.asarray(x) for x in (key, gate)], [jnp.asarray(x, jnp.int32) for x in (slot, tslot, pos)]


@pytest.mark.parametrize("path", ["forward", "walk"])
@pytest.mark.parametrize("kpool, spec", [(4, 0), (4, 3), (16, 0)], ids=["R4-ring4", "R4-ring8", "R16-ring16"])
def test_decode_update_follows_the_walk_on_odd_batches(rng, kpool, spec, path):
    """Both programs of the decode update (pallas_kernels/writes/decode_update.py; "forward"
    takes stashes of earlier tokens of the launch from registers instead of re-reading
    the ring) must give the reference's literal token-by-token walk whatever the batch.
    The ring starts with random finite bf16 rows, so a member read from the wrong place
    shows. kpool 16 keeps to 2 tokens: the forwarding code grows with tokens x members."""
    _check_odd_batches(rng, kpool, spec, path=path)


def test_decode_update_apes_in_branch_follows_the_walk(rng):
    """The forward program with its ape rows and exp table loaded in the completion
    branch (the default for one token per request in large batches only) gives the walk's
    bytes too, for one and six tokens per request (a static launch argument, so the
    compiled kernels of the two forms never share a cache entry)."""
    _check_odd_batches(rng, 4, 0, path="forward", apes_in_branch=True)
    # the flag reaches the kernel: the two forms lower to different programs
    from pallas_kernels.writes.decode_update import decode_update as kernel
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=4)
    z, row = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1, 128), jnp.bfloat16)
    text = [jax.jit(lambda c, flag=flag: kernel(c, layout.strides(0), row, row, jnp.zeros((4, 128)), z, z, z,
                                                apes_in_branch=flag)).lower(layout.allocate(0)).as_text()
            for flag in (False, True)]
    assert text[0] != text[1]


WINDOW_KINDS = ("well formed", "well formed, no pool slot", "gap", "shuffled", "other tail block", "no tail slot",
                "pool in the tail block", "padding first")


def _window_batch(rng, layout, n, kinds):
    """A decode batch of one request per entry of `kinds`, n tokens each. "well formed" is
    a verify window as a scheduler sends it: consecutive positions from a random start
    (the completing token at a random index), a random number of live tokens then padding
    (all live in the first window, so at least one completes), every token stashing into
    its request's tail block, pool slots outside it; "well formed, no pool slot" the same
    with the pool slots invalid (-1 or past the last). Each other kind breaks one of those
    properties. Tail blocks 1 .. 2b (two per
    request), pools after them, except that "pool in the tail block" completes at its
    first token a pool whose key bytes are half of the ring row that its second token
    stashes into (the walk writes the pool first, then the stash over it)."""
    from pallas_kernels.core import addressing as addr
    cfg, s = layout.config, layout.strides(0)
    b, r = len(kinds), cfg.kpool
    own = 1 + np.arange(2 * b).reshape(b, 2)
    first_pool = (2 * b + 1) * s.pools_per_block
    valid = first_pool + rng.permutation(s.num_pool_slots - first_pool)[:b * n].reshape(b, n)
    pos = np.zeros((b, n), np.int64)
    blk = np.repeat(own[:, :1], n, axis=1)
    slot = valid.copy()
    for i, kind in enumerate(kinds):
        c = 0 if kind == "pool in the tail block" else rng.integers(0, n)   # the completing token, mostly
        p0 = r * rng.integers(1, 8) + (r - 1 - c) % r
        pos[i] = p0 + np.arange(n)
        live = rng.integers(1, n + 1) if kind.startswith("well formed") and i > 0 else n   # the first completes
        pos[i, live:] = -1
        if kind == "well formed, no pool slot":
            slot[i] = np.where(rng.random(n) < 0.5, -1, s.num_pool_slots)
        elif kind == "gap":
            pos[i, rng.integers(1, n):] += 1
        elif kind == "shuffled":
            pos[i] = pos[i, rng.permutation(n)]
        elif kind == "other tail block":
            blk[i, rng.integers(1, n)] = own[i, 1]
        elif kind == "pool in the tail block":                   # its key bytes inside token 1's ring row
            ring_row_words = addr.tail_row_words(s, own[i, 0], pos[i, 1] % cfg.ring, 0)
            block_pools = own[i, 0] * s.pools_per_block + np.arange(s.pools_per_block)
            inside = block_pools[(addr.pool_key_words(s, block_pools) >= ring_row_words)
                                 & (addr.pool_key_words(s, block_pools) < ring_row_words + addr.TAIL_ROW_WORDS)]
            slot[i] = inside[0]
        elif kind == "padding first":
            pos[i, 0] = -1
    tslot = _tail_slots(blk, pos, cfg)
    for i, kind in enumerate(kinds):
        if kind == "no tail slot":
            tslot[i, rng.integers(0, n)] = -1 if rng.random() < 0.5 else s.num_tail_slots + 1
    key = rng.standard_normal((b, n, 128)).astype(jnp.bfloat16)
    gate = (3 * rng.standard_normal((b, n, 128))).astype(jnp.bfloat16)
    return [jnp.asarray(x) for x in (key, gate)], [jnp.asarray(x, jnp.int32) for x in (slot, tslot, pos)]


@pytest.mark.parametrize("kpool, spec, n", [(4, 0, 4), (4, 3, 2), (16, 0, 2)], ids=["R4-ring4-n4", "R4-ring8-n2",
                                                                                   "R16-ring16-n2"])
def test_decode_update_follows_the_walk_on_verify_windows(rng, kpool, spec, n):
    """Both programs of the decode update on verify windows of
    2 to kpool tokens, the shape of every speculative decode step, give the walk's bytes:
    windows that complete a pool at every token index, with and without a valid pool slot
    and with padding after their live tokens, in one launch with windows that break one
    property each. The ring starts random, so a member read from the wrong place, or a
    stash that lands before a read of its row or before the pool write it must overwrite,
    shows."""
    from glm5_jax import reference as ref
    from pallas_kernels.writes import decode_update as du
    layout, s, start, ape = _random_ring_case(rng, kpool, spec, num_blocks=40)
    well = 4                                                   # well-formed windows, then one of each other kind
    (key, gate), (slot, tslot, pos) = _window_batch(rng, layout, n, ["well formed"] * well + list(WINDOW_KINDS[1:]))
    want = as_bytes(ref.decode_update_strides(start, s, key, gate, ape, slot, tslot, pos))
    for path in du.PATHS:
        got = as_bytes(du.decode_update(start, s, key, gate, ape, slot, tslot, pos, path=path))
        diff = np.nonzero(got != want)[0]
        assert diff.size == 0, f"{path}: {diff.size} bytes differ from the walk, first at byte {diff[0]}"
    p, sl = np.asarray(pos)[:well], np.asarray(slot)[:well]
    assert ((p >= 0) & (p % kpool == kpool - 1) & (sl >= 0)).sum() > 0, "the windows must complete pools"
    assert (got != as_bytes(start)).sum() > 0


def _random_ring_case(rng, kpool, spec, num_blocks):
    """(layout, strides of layer 0, a cache of random bytes whose every bf16 half-word is
    finite, random ape rows) for a one-layer layout at kpool, with spec draft tokens."""
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    config = IndexerConfig(kpool=kpool, num_spec_tokens=spec, block_size=512 if kpool == 4 else 1536)
    layout = CacheLayout(config, num_layers=1, num_blocks=num_blocks)
    raw = rng.integers(0, 256, size=layout.total_words * 4, dtype=np.uint8)
    raw[1::2] &= 0xBF                                          # every bf16 half-word finite, |x| < 2
    ape = jnp.asarray(rng.standard_normal((kpool, 128)), jnp.float32)
    return layout, layout.strides(0), jnp.asarray(raw.view(np.uint32)), ape


def _check_odd_batches(rng, kpool, spec, **kernel_kw):
    from glm5_jax import reference as ref
    from pallas_kernels.writes.decode_update import decode_update as kernel
    layout, s, start, ape = _random_ring_case(rng, kpool, spec, num_blocks=12)
    completions = 0
    for n in ((1, 6) if kpool == 4 else (1, 2)):
        (key, gate), (slot, tslot, pos) = _odd_decode_batch(rng, layout, n)
        want = as_bytes(ref.decode_update_strides(start, s, key, gate, ape, slot, tslot, pos))
        got = as_bytes(kernel(start, s, key, gate, ape, slot, tslot, pos, **kernel_kw))
        diff = np.nonzero(got != want)[0]
        assert diff.size == 0, f"{kernel_kw}, n={n}: {diff.size} bytes differ from the walk, first at byte {diff[0]}"
        p, sl = np.asarray(pos), np.asarray(slot)
        completions += int(((p >= 0) & (p % kpool == kpool - 1) & (sl >= 0) & (sl < s.num_pool_slots)).sum())
    assert completions > 0, "the batches must complete pools"


def test_decode_update_default_path_and_bad_path():
    from pallas_kernels.writes import decode_update as du
    assert du.default_path(4, 4) == "forward" and du.default_path(10, 4) == "forward"
    assert du.default_path(11, 4) == "walk" and du.default_path(32, 16) == "walk"
    assert du._apes_in_branch(1, 64) and du._apes_in_branch(1, 256)
    assert not du._apes_in_branch(1, 63) and not du._apes_in_branch(4, 256)
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=2)
    z = jnp.zeros((1, 1), jnp.int32)
    row = jnp.zeros((1, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="path must be one of"):
        du.decode_update(layout.allocate(0), layout.strides(0), row, row, jnp.zeros((4, 128)), z, z, z, path="fast")


def test_compiled_write_kernels_use_the_ptx_forms():
    """Lowered for CUDA (here on the CPU, as benchmarks/offline_sass.py does), the
    compression and decode kernels round each of their 20 products that meet an add with
    one inline ``mul.rn.f32`` (3 per exp x 4, the 4 pooled products, 4 Newton steps; at one
    token per request the decode update's knockout takes 3 exps: 17, and 3 floors against
    4, and its words are stored as [32, 4] / [64, 2]) and
    carry none of ``numerics.rounded``'s integer mins; they round to bf16 twice with
    ``cvt.rn.bf16x2.f32``, turn -0 into +0 once with ``add.rn.f32`` and leave the clip
    before the fp8 conversion out (no 448 in their IR). In interpret mode they use the
    numerics' defaults (the tests above). The GPU tests hold both to the reference."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import offline_sass as osass
    from pallas_kernels.core import backend as B
    from pallas_kernels.writes.decode_update import decode_update
    from pallas_kernels.writes.pool_compress import compress_prefill
    from glm5_jax.config import IndexerConfig
    from glm5_jax.layout import CacheLayout
    assert B.mul_rn(True) is None and B.bf16_round_rn(True) is None and B.plus_zero_rn(True) is None
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=8)
    s = layout.strides(0)
    n_tokens = 64
    row = jnp.zeros((n_tokens, 128), jnp.bfloat16)
    ape = jnp.zeros((4, 128), jnp.float32)
    sl = jnp.arange(n_tokens, dtype=jnp.int32)
    comp = osass.capture(lambda c, k, g, a, m: compress_prefill(c, s, k, g, a, m, interpret=False),
                         layout.allocate(0), row, row, ape, sl)
    z = jnp.zeros((2, 4), jnp.int32)
    rows = jnp.zeros((2, 4, 128), jnp.bfloat16)
    dec = osass.capture(lambda c, *a: decode_update(c, s, *a, interpret=False), layout.allocate(0), rows, rows, ape,
                        z, z, z)
    z1, rows1 = z[:, :1], rows[:, :1]
    dec1 = osass.capture(lambda c, *a: decode_update(c, s, *a, interpret=False), layout.allocate(0), rows1, rows1,
                         ape, z1, z1, z1)
    assert [k[0] for k in comp + dec + dec1] == ["kpool_compress_prefill"] + ["kpool_decode_update"] * 2
    for (name, _, _, ir), exps in zip(comp + dec + dec1, (4, 4, 3)):
        assert ir.count("mul.rn.f32") == 3 * exps + 8, name
        assert ir.count("__nv_floorf") == exps, name                 # one floor per exp
        assert ir.count("cvt.rn.bf16x2.f32") == 2 and ir.count("add.rn.f32") == 1, name
        assert "fma.rn" not in ir, name
        assert "arith.minui" not in ir, name
        assert "4.480000e+02" not in ir, name                        # the clip's constant is gone
    # one token stores its words from the packing's shape (decode_update._stores_keep_parts)
    stores = [sorted({ln.rsplit(":", 1)[-1].strip() for ln in k[3].splitlines() if "tt.store" in ln})
              for k in dec + dec1]
    assert stores[0] == ["!tt.ptr<i32>", "tensor<32x!tt.ptr<i32>>", "tensor<64x!tt.ptr<i32>>"]
    assert stores[1] == ["!tt.ptr<i32>", "tensor<32x4x!tt.ptr<i32>>", "tensor<64x2x!tt.ptr<i32>>"]


def test_backend_rejects_a_non_boolean_mask():
    """core.backend's masked loads and stores take boolean masks only. The GPU's Triton
    lowering rejects an int mask, but interpret mode reads it as a truth value, so a
    kernel that builds one (``~False`` is the int -1) would pass on the CPU and fail only
    on the GPU. It fails here too, for gather, scatter, load and store, while a boolean
    mask still works."""
    from jax.experimental import pallas as pl
    from pallas_kernels.core import backend as B

    def run(op, mask_dtype):
        def body(x_ref, o_ref):
            i = jax.lax.broadcasted_iota(jnp.int32, (8,), 0)
            mask = (i < 4).astype(mask_dtype)
            o_ref[...] = jnp.zeros((1, 8), jnp.float32)
            if op == "gather":
                o_ref[0, :] = B.gather(x_ref, i * 0, i, mask=mask)
            elif op == "scatter":
                B.scatter(o_ref, i * 0, i, x_ref[0, :], mask)
            elif op == "load":
                o_ref[...] = B.load(x_ref, mask=mask[None, :], other=0.0)
            else:
                B.store(o_ref, x_ref[...], mask=mask[None, :])
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((1, 8), jnp.float32),
                              interpret=True)(jnp.full((1, 8), 7.0, jnp.float32))
    for op in ("gather", "scatter", "load", "store"):
        np.testing.assert_array_equal(np.asarray(run(op, jnp.bool_))[0], [7.0] * 4 + [0.0] * 4)
        with pytest.raises(TypeError, match="mask must be boolean"):
            run(op, jnp.int32)


def test_write_bytes_do_not_depend_on_the_cpu_emitters(rng):
    """tests/conftest.py compiles the CPU tests with XLA's legacy CPU emitters (faster to
    compile); users' processes use XLA's default fusion emitters. The cache writes must
    give the same bytes under both: one random workload through the XLA reference and the
    interpret-mode kernels, hashed here and in a process without the flag."""
    import os
    import subprocess
    import sys
    import conftest
    if os.environ.get(conftest.FLAGS_PROBED_ENV) != "set":
        pytest.skip("this process runs XLA's default emitters (conftest set no flag): nothing to compare")
    import pathlib
    script = pathlib.Path(__file__).parent / "scripts" / "write_digest.py"
    sys.path.insert(0, str(script.parent))
    from write_digest import digest
    seed = int(rng.integers(0, 2**31))
    flags = os.environ["XLA_FLAGS"].replace(conftest.TEST_XLA_FLAGS, "").strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)     # its own compiles: nothing from this run's shared cache
    r = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == digest(seed), f"seed {seed}: the default emitters wrote other bytes"


@pytest.mark.parametrize("first_tokens", [5, 1000, 2000, 3000])
def test_last_blocks_scenario_gives_the_first_request_the_last_blocks_alone(rng, first_tokens):
    """The large-cache tests' scenario: request 0 owns the layout's last blocks and no two
    requests share a block, on a layout small enough that the random draw lands there."""
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=14)
    for _ in range(50):
        sc = last_blocks_scenario(rng, layout, 0, [first_tokens, 999, 5])
        held = [b for r in sc.requests for b in [*r.index_blocks, r.tail_block]]
        assert len(held) == len(set(held))
        first = sc.requests[0]
        mine = [*first.index_blocks, first.tail_block]
        assert mine == list(range(layout.num_blocks - len(mine), layout.num_blocks))
