"""Serving loop: chunked prefill at any token, prefix hits, the cached-prompt probe
under churn (and the injected dense-stride fault), speculative decoding, bad
input, and compilation counts.

Every comparison is of bytes (cache pools, scales, tail ring rows, attention K/V)
or of exact token ids; selected tokens are compared per row as sorted sets (the
short-context fill and the sparse path emit the same set in different orders).

Compile budget: the 2-layer tests share ONE compiled step (same model structure,
layout, bucket minimums, no head columns); the chunked-prefill test's engine with
pinned head columns adds one, and the fault probe and the speculative test each add
one 1-layer compile.
"""
import dataclasses

import numpy as np
import pytest

from glm5_jax import simulate
from glm5_jax.config import IndexerConfig
from glm5_jax.model.decoder import Decoder, ModelConfig
from glm5_jax.serving import engine as eng_mod
from glm5_jax.serving.blocks import BlockPool
from glm5_jax.serving.engine import Engine
from glm5_jax.serving.step_metadata import BucketMins, RowSpec, bucket, build_step, choose_shape
from pallas_kernels.core import addressing as addr

MODEL_CFG = ModelConfig()                       # hidden 256, 2 layers, vocab 512, topk 64, blocks of 64
NB = 18
MINS = BucketMins(decode_rows=4, prefill_rows=2, prefill_width_tokens=128, table_blocks=4)
R = MODEL_CFG.indexer.kpool
TOPK = MODEL_CFG.indexer.topk
BS = MODEL_CFG.indexer.block_size


def make_engine(model, rng=None, **kw):
    """The shared 2-layer engine configuration; with rng, every free block starts as
    random garbage, so a read of never-written bytes cannot match between runs."""
    kw.setdefault("bucket_mins", MINS)
    e = Engine(model, NB, max_running_requests=4, max_prefill_requests=2, prefill_chunk_tokens=128, **kw)
    if rng is not None:
        e.scribble_free_blocks(rng)
    return e


def random_model(rng, cfg=MODEL_CFG):
    return Decoder.random(cfg, seed=int(rng.integers(2**31)))


def tokens(rng, n, cfg=MODEL_CFG):
    return [int(t) for t in rng.integers(0, cfg.vocab_size, n)]


def step_until_prefilled(engine, rid):
    while engine.get_output(rid).num_computed_tokens < len(engine.get_output(rid).prompt_tokens):
        engine.step()
    return engine.request_snapshot(rid)


def assert_same_bytes(a, b, what, positions=None):
    """Snapshots (Engine.request_snapshot) a and b hold the same bytes."""
    assert a["num_computed_tokens"] == b["num_computed_tokens"], what
    for layer, (la, lb) in enumerate(zip(a["layers"], b["layers"])):
        for key in ("pool_keys", "pool_scales", "attn_k", "attn_v"):
            assert la[key].shape == lb[key].shape and la[key].size > 0, f"{what}: layer {layer} {key} empty"
            np.testing.assert_array_equal(la[key], lb[key], err_msg=f"{what}: layer {layer} {key}")
        assert sorted(la["tail"]) == sorted(lb["tail"]) and la["tail"], f"{what}: tail positions"
        for p in la["tail"]:
            for half in (0, 1):
                np.testing.assert_array_equal(la["tail"][p][half], lb["tail"][p][half],
                                              err_msg=f"{what}: layer {layer} tail position {p} half {half}")


def assert_same_selection(sa, sb, positions, what):
    assert positions, f"{what}: no rows to compare"
    for p in positions:
        np.testing.assert_array_equal(np.sort(sa[p], axis=-1), np.sort(sb[p], axis=-1),
                                      err_msg=f"{what}: selected tokens of position {p}")


def sparse_rows(sel):
    """Positions whose row is a real sparse selection (fewer tokens than the causal p + 1)."""
    return [p for p, s in sel.items() if p >= TOPK and (s[0] >= 0).sum() < p + 1]


# ---------------------------------------------------------------------------------
# host-side step metadata (no compilation)
# ---------------------------------------------------------------------------------
def test_step_metadata_heads_padding_and_units(rng):
    cfg = MODEL_CFG.indexer
    bt = [int(b) for b in rng.permutation(np.arange(1, 40))[:4]]
    start = int(rng.integers(1, 3 * BS)) | 1                           # odd: never pool aligned
    n = int(rng.integers(1, 40))
    dec = [RowSpec([7], 3 * BS - 5, bt[:3], 40)]
    pre = [RowSpec(list(range(n)), start, bt, 41)]
    shape = choose_shape(cfg, dec, pre, next_n=2, mins=BucketMins(prefill_width_tokens=8))
    assert shape.prefill_width_tokens == bucket(n, 8) and shape.table_blocks == bucket(max(3, -(-(start + n) // BS)))
    a = build_step(cfg, shape, dec, pre)
    head = min((-start) % R, n)
    pos = a.pre_positions[0]
    assert list(pos[:n]) == list(range(start, start + n)) and (pos[n:] == -1).all()
    # head tokens: decode_update only (update grid row 1), never compress/seed
    assert (a.pre_slot_pools[0, :head] == -1).all() and (a.pre_tslots[0, :head] == -1).all()
    assert list(a.upd_positions[1, :head]) == list(range(start, start + head))
    assert (a.upd_positions[1, head:] == -1).all()
    live = a.upd_positions >= 0
    assert (a.upd_token_index[1, :head] == shape.decode_rows * 2 + np.arange(head)).all()
    # every pool-completing token of the chunk gets exactly one writer, with the page-unit slot
    for j in range(n):
        p = start + j
        slot = a.upd_slot_pools[1, j] if j < head else a.pre_slot_pools[0, j]
        if (p + 1) % R:
            assert slot == -1
        else:
            blk = bt[p // BS]
            pool_in_block = (p % BS) // R
            assert slot == (blk * cfg.pages_per_block + pool_in_block // cfg.page_rows) * cfg.page_rows \
                + pool_in_block % cfg.page_rows
        if j >= head:
            assert a.pre_tslots[0, j] == 41 * cfg.ring + p % cfg.ring
            assert a.pre_attn_slots[0, j] == bt[p // BS] * BS + p % BS
    # padding conventions
    assert (a.dec_positions[0] == [3 * BS - 5, -1]).all() and a.dec_attn_slots[0, 1] == -1
    assert (a.block_table_blocks[0, 3:] == 0).all() and list(a.block_table_blocks[0, :3]) == bt[:3]
    assert (a.upd_slot_pools[~live] == -1).all() and (a.upd_tslots[~live] == -1).all()
    with pytest.raises(ValueError, match="needs"):
        build_step(cfg, shape, dec, [RowSpec([1] * 4, 0, [], 41)])


def test_step_without_heads_updates_the_decode_grid_only(rng):
    """Chunks that start on pool boundaries have no head: the shape carries no head
    columns, the update grid is the decode grid itself (next_n tokens of the decode rows
    only), and a row with a head does not fit such a shape."""
    cfg = MODEL_CFG.indexer
    bt = [int(b) for b in rng.permutation(np.arange(1, 40))[:4]]
    next_n = int(rng.integers(1, 4))
    dec = [RowSpec([7] * next_n, int(rng.integers(0, 2 * BS)), bt[:3], 40)]
    pre = [RowSpec(list(range(int(rng.integers(1, 40)))), R * int(rng.integers(0, 2 * BS // R)), bt, 41)]
    shape = choose_shape(cfg, dec, pre, next_n=next_n, mins=BucketMins(prefill_width_tokens=8))
    assert shape.head_width_tokens == 0 and shape.update_rows == shape.decode_rows
    a = build_step(cfg, shape, dec, pre)
    assert a.upd_positions.shape == a.dec_positions.shape == (shape.decode_rows, next_n)
    np.testing.assert_array_equal(a.upd_positions, a.dec_positions)
    live = a.upd_positions >= 0
    np.testing.assert_array_equal(a.upd_token_index[live], np.flatnonzero(a.dec_positions.ravel() >= 0))
    assert (a.pre_slot_pools[a.pre_positions >= 0] != -1).any() or len(pre[0].token_ids) < R
    pinned = choose_shape(cfg, dec, pre, next_n=next_n, mins=BucketMins(head_width_tokens=1))
    assert pinned.head_width_tokens == R - 1 and pinned.update_rows == pinned.decode_rows + pinned.prefill_rows
    head = RowSpec([1, 2, 3], R * 5 + 1, bt, 41)                         # starts mid-pool
    assert choose_shape(cfg, dec, [head], next_n=next_n).head_width_tokens == R - 1
    with pytest.raises(ValueError, match="off a pool boundary"):
        build_step(cfg, shape, dec, [head])


def test_kv_row_gather_equals_the_word_gather(rng):
    """The attention's K/V gather by whole rows (one index per 128-byte row of the buffer
    viewed as [rows, 32] words) returns the words of the per-word (row, col) gather, for
    every layer, with -1 tokens, tokens past the block table and block ids past the pool;
    a layout whose rows are not aligned to their size refuses the row form."""
    import jax.numpy as jnp
    from glm5_jax.model.decoder import gather_kv
    from pallas_kernels.core.strides import AttnStrides
    lay = MODEL_CFG.layout(NB)
    cache = jnp.asarray(rng.integers(0, 2**32, lay.total_bytes // 4, dtype=np.uint64).astype(np.uint32))
    t, w, mb = 12, 40, 3
    tokens = rng.integers(-1, mb * BS + BS // 2, (t, w)).astype(np.int32)     # -1 and past the table
    tables = rng.integers(0, NB + 2, (t, mb)).astype(np.int32)                # some ids past the pool
    for layer in range(MODEL_CFG.num_layers):
        a = lay.attn_strides(layer, MODEL_CFG.kv_row_bytes)
        assert addr.attn_rows_aligned(a)
        rows = gather_kv(cache, a, jnp.asarray(tokens), jnp.asarray(tables), by_rows=True)
        words = gather_kv(cache, a, jnp.asarray(tokens), jnp.asarray(tables), by_rows=False)
        for x, y in zip(rows[:2], words[:2]):                                 # K, V: the same bits
            np.testing.assert_array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(rows[2]), np.asarray(words[2]))
        assert np.asarray(rows[2]).any() and not np.asarray(rows[2]).all()
        assert (np.asarray(rows[0])[~np.asarray(rows[2])].view(np.uint16) == 0).all()
    odd = AttnStrides(block_size=BS, kv_row_bytes=128, num_blocks=2, attn_base_bytes=4,
                      attn_block_bytes=2 * BS * 128, total_bytes=4 * 1024 * 64)
    assert not addr.attn_rows_aligned(odd)
    with pytest.raises(ValueError, match="attn_rows_aligned"):
        gather_kv(jnp.zeros(odd.total_bytes // 4, jnp.uint32), odd, jnp.asarray(tokens), jnp.asarray(tables),
                  by_rows=True)


def test_attention_from_rows_equals_the_gathered_attention(rng):
    """The sparse attention with K/V read by the contraction kernels from the cache's
    rows (``sparse_attention_rows``, what a GPU step runs) gives the bits of the attention
    on ``gather_kv``'s copy, for every layer, with -1 tokens, tokens past the block table
    and block ids past the pool (no row: masked, zero)."""
    import jax.numpy as jnp
    import ml_dtypes
    from glm5_jax.model.decoder import gather_kv, kv_rows, kv_table, sparse_attention, sparse_attention_rows
    lay = MODEL_CFG.layout(NB)
    vals = (rng.standard_normal(lay.total_bytes // 2) * 0.5).astype(ml_dtypes.bfloat16)   # finite K/V everywhere
    cache = jnp.asarray(vals.view(np.uint32))
    t, w, mb = 6, 40, 3
    nh, hd = MODEL_CFG.num_heads, MODEL_CFG.head_dim
    tokens = rng.integers(-1, mb * BS + BS // 2, (t, w)).astype(np.int32)
    tables = rng.integers(0, NB + 2, (t, mb)).astype(np.int32)
    q = jnp.asarray((rng.standard_normal((t, nh, hd))).astype(ml_dtypes.bfloat16))
    for layer in range(MODEL_CFG.num_layers):
        a = lay.attn_strides(layer, MODEL_CFG.kv_row_bytes)
        k, v, ok = gather_kv(cache, a, jnp.asarray(tokens), jnp.asarray(tables))
        want = np.asarray(sparse_attention(q, k, v, ok)).view(np.uint32)
        rk, rv = kv_rows(a, jnp.asarray(tokens), jnp.asarray(tables))
        np.testing.assert_array_equal(np.asarray(rk) >= 0, np.asarray(ok))
        assert np.asarray(ok).any() and not np.asarray(ok).all()
        got = np.asarray(sparse_attention_rows(q, kv_table(cache, a), rk, rv, interpret=True)).view(np.uint32)
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")


def test_step_arrays_pack_into_one_copy_per_device(rng):
    """The step's metadata goes to each device as one int32 array; unpacking it (what
    the jitted step does) gives back every field, and mismatched shards are refused."""
    import jax.numpy as jnp
    cfg = MODEL_CFG.indexer
    shape = choose_shape(cfg, [], [RowSpec([1] * 40, 0, np.arange(1, 4), 5)], next_n=1, mins=MINS)
    per = [build_step(cfg, shape, [], [RowSpec(tokens(rng, n), 0, np.arange(1, 4), 5)]).as_dict()
           for n in (7, 33)]
    flat, fields = eng_mod.pack_step_arrays(per)
    assert flat.dtype == np.int32 and flat.shape[0] == 2 and [f for f, _ in fields] == sorted(per[0])
    for d in range(2):
        got = eng_mod.unpack_step_arrays(jnp.asarray(flat[d]), fields)
        for k, v in per[d].items():
            np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    bad = dict(per[1], dec_positions=per[1]["dec_positions"].astype(np.int64))
    with pytest.raises(ValueError, match="dec_positions"):
        eng_mod.pack_step_arrays([per[0], bad])


def test_bucketed_shapes_stop_growing(rng):
    """A dry-run engine (scheduler + BlockPool, no model) with natural buckets: a
    steady workload (the same request sizes again, new tokens) adds no step shape."""
    model = random_model(rng)
    e = Engine(model, 64, max_running_requests=6, max_prefill_requests=2, prefill_chunk_tokens=128,
               dry_run=True, bucket_mins=BucketMins(prefill_width_tokens=32, table_blocks=2))
    sizes = [(int(rng.integers(8, 300)), int(rng.integers(1, 40))) for _ in range(24)]

    def round_(tag):
        for i, (n, m) in enumerate(sizes):
            e.add_request(f"{tag}{i}", tokens(rng, n), m)
        e.run()
    round_("warm")
    seen, steps = set(e.shapes_seen), e.steps
    round_("steady")
    assert e.steps == 2 * steps and e.shapes_seen == seen
    assert 1 < len(seen) <= 4 * 2 * 3 * 3                  # rows x prefill rows x widths x tables


# ---------------------------------------------------------------------------------
# chunked prefill at any token
# ---------------------------------------------------------------------------------
def random_boundaries(rng, n):
    """Chunk ends in (0, n): at least one start off the pool grid and one chunk inside a pool."""
    cuts = set(int(c) for c in rng.integers(1, n, int(rng.integers(2, 6))))
    a = int(rng.integers(TOPK // 2, n - 8))
    a += (1 + int(rng.integers(0, R - 1))) if a % R == 0 else 0          # starts mid-pool ...
    cuts |= {a, a + int(rng.integers(1, R))}                             # ... and a chunk shorter than a pool
    return sorted(c for c in cuts if 0 < c < n)


def test_chunked_prefill_any_boundary_matches_unchunked(rng):
    model = random_model(rng)
    n = int(rng.integers(TOPK + 30, 129))                                # > topk: sparse rows exist
    prompt = tokens(rng, n)
    new = int(rng.integers(3, 8))
    ends = random_boundaries(rng, n) + [n]
    assert any(e % R for e in ends[:-1])

    def policy(rid, start, remaining, cap):
        return next(e for e in ends if e > start) - start

    # `one` never has a head (its update grid is the decode grid); `many` pins the head
    # columns, so its chunks and its decode steps share one compiled step
    one = make_engine(model, rng, record=True, snapshot_on_finish=True)
    many = make_engine(model, rng, record=True, snapshot_on_finish=True, chunk_policy=policy,
                       bucket_mins=dataclasses.replace(MINS, head_width_tokens=1))
    one.add_request("r", prompt, new)
    many.add_request("r", prompt, new)
    snap_one, snap_many = step_until_prefilled(one, "r"), step_until_prefilled(many, "r")
    assert many.steps == len(ends) and one.steps == 1
    assert {s.head_width_tokens for s in one.shapes_seen} == {0}
    assert {s.head_width_tokens for s in many.shapes_seen} == {R - 1}
    assert_same_bytes(snap_one, snap_many, f"after prefill in chunks ending at {ends}")
    in_flight = []                                  # recorded rows not yet on the host, per step
    one.run(), many.run(on_step=lambda e: in_flight.append(len(e._fetches)))
    assert 0 < max(in_flight) <= eng_mod.RECORD_LAG_STEPS
    a, b = one.get_output("r"), many.get_output("r")
    assert a.output_tokens == b.output_tokens and len(a.output_tokens) == new
    assert_same_bytes(a.snapshot, b.snapshot, f"at finish, chunks ending at {ends}")
    assert sorted(a.selected_tokens) == list(range(n + new - 1))
    assert a.predicted_tokens == b.predicted_tokens and sorted(a.predicted_tokens) == sorted(a.selected_tokens)
    again = many.get_output("r")                    # reading twice gives the same rows
    assert all(np.array_equal(again.selected_tokens[p], b.selected_tokens[p]) for p in b.selected_tokens)
    assert_same_selection(a.selected_tokens, b.selected_tokens, sorted(a.selected_tokens), f"chunks {ends}")
    assert sparse_rows(a.selected_tokens), "no row took the sparse path: the test would not see pools"


# ---------------------------------------------------------------------------------
# prefix-cache hits
# ---------------------------------------------------------------------------------
def test_prefix_hit_matches_salted_recompute(rng):
    model = random_model(rng)
    e = make_engine(model, rng, record=True, snapshot_on_finish=True)
    n = int(rng.integers(2 * BS + 1, 3 * BS - 8))                        # 2 full blocks + a partial one
    prompt = tokens(rng, n)
    e.add_request("first", prompt, 4)
    e.run()
    first_blocks = e.get_output("first").snapshot["index_blocks"]
    # the re-hit prompt shares k full blocks (random boundary), then diverges
    k = int(rng.integers(1, 3))
    suffix_len = int(rng.integers(1, 3 * BS - k * BS - 6))
    suffix_len -= 1 if suffix_len % R == 0 else 0                        # the prompt ends mid-pool
    hit_prompt = prompt[:k * BS] + tokens(rng, suffix_len)
    assert len(hit_prompt) % R                                           # the re-seeded tail matters
    new = int(rng.integers(3, 7))
    assert e.scribble_free_blocks(rng) > 0                              # the first request's tail too
    e.add_request("hit", hit_prompt, new)
    e.add_request("salted", hit_prompt, new, cache_salt="control")
    e.step()
    hit_blocks, _ = e.request_blocks("hit")
    assert hit_blocks[:k] == first_blocks[:k]                           # the cached blocks themselves
    e.run()
    h, s = e.get_output("hit"), e.get_output("salted")
    assert h.num_cached_tokens == min(k * BS, (len(hit_prompt) - 1) // BS * BS) > 0
    assert s.num_cached_tokens == 0
    assert h.output_tokens == s.output_tokens
    assert_same_bytes(h.snapshot, s.snapshot, f"hit of {h.num_cached_tokens} tokens vs salted recompute")
    assert_same_selection(h.selected_tokens, s.selected_tokens, sorted(h.selected_tokens), "hit vs salted")
    assert min(h.selected_tokens) == h.num_cached_tokens                 # only the suffix was recomputed
    # teacher forcing: prefilling prompt + generated tokens predicts the same tokens
    e.add_request("forced", hit_prompt + list(h.output_tokens[:-1]), 1, cache_salt="forced")
    e.run()
    pred = e.get_output("forced").predicted_tokens
    assert [pred[len(hit_prompt) - 1 + j] for j in range(new)] == list(h.output_tokens)


def test_full_prompt_hit_recomputes_last_block(rng):
    """A prompt of whole blocks, all cached: the hit stops one block short, so the
    recomputed suffix re-seeds the fresh tail ring."""
    model = random_model(rng)
    e = make_engine(model, rng, snapshot_on_finish=True, record=True)
    prompt = tokens(rng, 2 * BS)
    e.add_request("a", prompt, 3)
    e.run()
    e.scribble_free_blocks(rng)
    e.add_request("b", prompt, 3)
    e.add_request("c", prompt, 3, cache_salt="x")
    e.run()
    b, c = e.get_output("b"), e.get_output("c")
    assert b.num_cached_tokens == BS and c.num_cached_tokens == 0
    assert b.output_tokens == c.output_tokens == e.get_output("a").output_tokens
    assert_same_bytes(b.snapshot, c.snapshot, "whole-block prompt hit")


# ---------------------------------------------------------------------------------
# churn: the cached prompt's pages under fillers with evictions; the injected fault
# ---------------------------------------------------------------------------------
def _churn_workload(rng, model_config, num_blocks, **kw):
    """A random workload whose dry run (scheduler + BlockPool, no model) evicts while
    the prompt stays cached; a few seeds are tried."""
    # the prompt ends inside its third block: a prompt of whole blocks is never hit whole (its
    # last block is recomputed), so it could not stay resident (128 tokens failed 1 in 56 runs)
    base = dict(model_config=model_config, prompt_tokens=int(rng.integers(TOPK + BS + 1, 3 * BS - 8)),
                fillers=12, rounds=3, concurrency=4, filler_min_tokens=16, filler_max_tokens=140,
                filler_max_new_tokens=6, prompt_max_new_tokens=4, num_blocks=num_blocks)
    base.update(kw)
    model = Decoder.random(model_config, seed=0)
    for _ in range(30):
        w = simulate.Workload(seed=int(rng.integers(2**31)), **base)
        d = simulate.dry_run(w, num_blocks, model)
        if d["evictions"] > 0 and d["prompt_resident"]:
            return w
    pytest.fail("no random workload both evicts and keeps the prompt cached")


@pytest.mark.parametrize("in_flight", [0, 2])
def test_churn_keeps_cached_prompt_pages_byte_identical(rng, in_flight):
    w = _churn_workload(rng, MODEL_CFG, NB, async_scheduling=in_flight)
    rep = simulate.run_workload(w)
    assert rep["evictions"] > 0 and rep["prompt_stayed_cached"]
    assert rep["watched_bytes"] == MODEL_CFG.num_layers * (w.prompt_tokens // BS) * \
        MODEL_CFG.indexer.index_block_bytes
    assert rep["bytes_changed"] == 0 and rep["first_change_step"] is None
    assert rep["rehits_equal_control"] and rep["rehit_pools_equal_control"]
    assert all(r["rehit_cached_tokens"] == (w.prompt_tokens // BS) * BS for r in rep["rounds"])
    assert all(r["selected_rows_compared"] > 0 for r in rep["rounds"])
    assert rep["ok"] and rep["compilations"] <= 1


@pytest.mark.parametrize("in_flight", [0, 2])
def test_churn_probe_catches_dense_tail_stride_fault(rng, in_flight):
    """Also with two steps in flight, where the probe's reads are taken in two calls
    after they start (the last ones after the run)."""
    cfg = dataclasses.replace(MODEL_CFG, num_layers=1)                 # one more compile, kept small
    w = dataclasses.replace(_churn_workload(rng, cfg, NB, async_scheduling=in_flight), fault="dense-tail-stride")
    rep = simulate.run_workload(w)
    assert rep["prompt_stayed_cached"]
    assert rep["bytes_changed"] > 0 and rep["pages_changed"] > 0, "the probe missed the injected fault"
    assert not rep["ok"]


def test_request_snapshot_reads_only_the_request_blocks(rng, monkeypatch):
    """request_snapshot brings only the request's blocks to the host (not the whole
    shard) and returns exactly what a whole-cache copy gives, with random garbage in
    every other block; the words it gathers lie in the request's blocks."""
    from glm5_jax.serving import sharding
    e = make_engine(random_model(rng), rng)
    for i in range(3):
        e.add_request(f"r{i}", tokens(rng, int(rng.integers(70, 150))), 50)
    for _ in range(4):
        e.step()
    assert all(e.get_output(f"r{i}").status == "running" for i in range(3))
    asked = []
    real = sharding.host_words
    monkeypatch.setattr(sharding, "host_words", lambda c, s, w: asked.append(np.asarray(w)) or real(c, s, w))
    for i in range(3):
        rid = f"r{i}"
        got = e.request_snapshot(rid)
        index_blocks, tail_block = e.request_blocks(rid)
        owned = set(index_blocks) | {tail_block}
        lay, words = e.layout, asked.pop()
        block_words = sum(e_ - a_ for layer in range(lay.num_layers)
                          for a_, e_ in (lay.block_byte_range(layer, 1), lay.attn_block_byte_range(layer, 1))) // 4
        assert words.size == len(owned) * block_words < lay.total_bytes // 4, rid
        index_blocks_read = {hit[0] for w in words for layer in range(lay.num_layers)
                             if (hit := addr.index_block_of_byte(lay.strides(layer), int(w) * 4)) is not None}
        assert index_blocks_read == owned, f"{rid}: read indexer blocks {index_blocks_read}, owns {owned}"
        with monkeypatch.context() as m:                  # the same snapshot from a whole-cache copy
            m.setattr(e, "_blocks_image", lambda shard, blocks: e.cache_bytes(shard).view(np.uint32))
            want = e.request_snapshot(rid)
        assert_same_bytes(got, want, rid)
        assert got["index_blocks"] == want["index_blocks"] and got["tail_block"] == want["tail_block"]


def test_finish_snapshot_holds_the_bytes_at_finish(rng):
    """snapshot_on_finish gathers on the device when the request finishes and reads the
    result later: rewriting the freed blocks (here with garbage) before get_output
    does not reach the snapshot, which equals that of an engine read at once."""
    model = random_model(rng)
    prompt, new = tokens(rng, int(rng.integers(70, 150))), int(rng.integers(2, 6))
    snaps = []
    for scribble in (False, True):
        e = make_engine(model, rng, snapshot_on_finish=True, async_scheduling=1)
        e.add_request("r", prompt, new)
        while e.has_unfinished():                                   # (run() returns outputs: it would read it)
            e.step()
        if scribble:
            assert e.scribble_free_blocks(rng) > 0                    # the request's tail block among them
        snaps.append(e.get_output("r").snapshot)
    assert_same_bytes(snaps[0], snaps[1], "finish snapshot read after its blocks were rewritten")


def test_probe_stops_watching_a_prompt_evicted_after_its_last_rehit():
    """With one filler the planned pool is so small that the last round's control
    takes the prompt's blocks after the re-hit (evicted, then rewritten: legitimate, not
    corruption). The probe watches only while the blocks hold the prompt's cached
    content and reports when that ended."""
    w = simulate.preset("cpu", fillers=1, rounds=1)     # the preset's fixed seed: a workload that evicts
    rep = simulate.run_workload(w)
    assert rep["evictions"] > 0 and rep["prompt_stayed_cached"]
    assert rep["evicted_after_step"] is not None, "the prompt was not evicted: the case no longer tests this"
    assert rep["bytes_changed"] == 0 and rep["first_change_step"] is None
    assert rep["ok"]
    assert "evicted after step" in simulate.format_table(rep)


def test_simulate_main_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as ei:
        simulate.main(["--fillers", "0"])
    assert ei.value.code == 2
    assert simulate.main(["--prompt-tokens", "10", "--no-progress"]) == 2
    assert "must exceed topk" in capsys.readouterr().err


# ---------------------------------------------------------------------------------
# speculative decoding with random rejections == plain decoding
# ---------------------------------------------------------------------------------
SPEC_CFG = ModelConfig(num_layers=1, indexer=IndexerConfig(n_heads=4, topk=64, block_size=128,
                                                           num_spec_tokens=3))


def test_speculative_verify_with_rejections_matches_plain_decode(rng):
    model = random_model(rng, SPEC_CFG)
    mins = BucketMins(decode_rows=2, prefill_rows=1, prefill_width_tokens=128, table_blocks=2)
    prompts = [tokens(rng, int(rng.integers(TOPK + 1, 120)), SPEC_CFG) for _ in range(2)]
    new = [int(rng.integers(20, 40)) for _ in prompts]

    def run(draft_fn):
        e = Engine(model, 12, max_running_requests=2, max_prefill_requests=1, prefill_chunk_tokens=128,
                   next_n=4, bucket_mins=mins, draft_fn=draft_fn, record=True, snapshot_on_finish=True)
        for i, (p, m) in enumerate(zip(prompts, new)):
            e.add_request(i, p, m)
        e.run()
        return e

    plain = run(lambda rid, toks, k: [])                                 # one token per step
    truth = {i: list(prompts[i]) + list(plain.get_output(i).output_tokens) for i in range(2)}

    def drafts(rid, toks, k):                                           # the true continuation, corrupted
        fut = truth[rid][len(toks):len(toks) + k]
        return [t if rng.random() < 0.7 else (t + 1) % SPEC_CFG.vocab_size for t in fut]

    spec = run(drafts)
    st = spec.stats()
    assert st["proposed_drafts"] > st["accepted_drafts"] > 0, "no rejection or no acceptance happened"
    assert spec.steps < plain.steps
    for i in range(2):
        a, b = plain.get_output(i), spec.get_output(i)
        assert a.output_tokens == b.output_tokens
        assert_same_bytes(a.snapshot, b.snapshot, f"request {i}: spec decode vs plain")
        assert_same_selection(a.selected_tokens, b.selected_tokens, sorted(a.selected_tokens), f"request {i}")
        assert sorted(b.selected_tokens) == sorted(a.selected_tokens)


def test_next_n_needs_a_ring_sized_for_it(rng):
    with pytest.raises(ValueError, match="num_spec_tokens"):
        Engine(random_model(rng), NB, next_n=2)


# ---------------------------------------------------------------------------------
# bad input and compilations
# ---------------------------------------------------------------------------------
def test_engine_rejects_bad_input_and_others_are_unaffected(rng):
    model = random_model(rng)
    e = make_engine(model)
    prompt = tokens(rng, int(rng.integers(20, 120)))
    e.add_request("ok", prompt, 5)
    e.step()
    bad = [
        (("empty", [], 3), "empty prompt"),
        (("ok", tokens(rng, 5), 3), "duplicate request id"),
        (("vocab", [1, MODEL_CFG.vocab_size], 3), "outside the vocabulary"),
        (("neg", [-1, 2], 3), "outside the vocabulary"),
        (("long", tokens(rng, (NB - 2) * BS), 1), "can never fit"),
        (("new0", [1, 2], 0), "max_new_tokens"),
        (("salt", [1, 2], 2, 5), "cache_salt"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            e.add_request(*args)
    for fn in (e.get_output, e.abort_request, e.request_blocks):
        with pytest.raises(ValueError, match="unknown request id"):
            fn("nope")
    assert set(e.outputs) == {"ok"}
    e.block_pool.check_invariants()
    e.run()
    clean = make_engine(model)
    clean.add_request("ok", prompt, 5)
    clean.run()
    assert e.get_output("ok").output_tokens == clean.get_output("ok").output_tokens
    assert e.get_output("ok").finished
    e.block_pool.check_invariants()
    assert e.block_pool.num_free_blocks == NB - 1


def test_waiting_request_is_admitted_when_blocks_free(rng):
    model = random_model(rng)
    e = make_engine(model)
    big = (NB - 3) * BS // 2                                             # two of these cannot coexist
    e.add_request("a", tokens(rng, 100), big - 100)
    e.add_request("b", tokens(rng, 100), big - 100)
    e.step()
    assert e.get_output("a").status == "running" and e.get_output("b").status == "waiting"
    e.step()
    assert e.get_output("b").status == "waiting"
    e.abort_request("a")
    assert e.get_output("a").status == "aborted"
    e.step()
    assert e.get_output("b").status == "running"
    e.abort_request("b")
    e.block_pool.check_invariants()
    assert e.block_pool.num_free_blocks == NB - 1 and not e.has_unfinished()


def test_no_recompile_in_steady_state(rng):
    model = random_model(rng)
    e = make_engine(model)

    def round_(tag):
        for i in range(3):
            e.add_request(f"{tag}{i}", tokens(rng, int(rng.integers(5, 200))), int(rng.integers(1, 6)))
        e.run()
    round_("warm")
    warm_compiles, warm_steps = e.compilations, e.steps
    before = eng_mod.total_traces()
    round_("steady")
    assert e.steps > warm_steps
    assert eng_mod.total_traces() == before and e.compilations == warm_compiles
    assert warm_compiles <= 1 and len(e.shapes_seen) == 1


def test_block_pool_per_shard_state():
    pools = [BlockPool(8, 4, shard=i) for i in range(2)]
    pools[0].admit("r", [1, 2, 3], 4)
    assert pools[0].requests() == ["r"] and pools[1].requests() == []
    assert pools[1].stats()["shard"] == 1


def test_step_updates_the_cache_in_place(rng):
    """The one-device step (the N = 1 case of the sharded step) keeps the donated cache
    in place: no copy of it in the compiled program, the same device buffer after a step;
    and it has no instruction that makes the runtime wait for the device."""
    from glm5_jax.serving import sharding
    e = make_engine(random_model(rng))
    e.add_request("r", tokens(rng, int(rng.integers(20, 120))), 3)
    ptr = e.cache.addressable_shards[0].data.unsafe_buffer_pointer()
    e.step()
    assert e.cache.addressable_shards[0].data.unsafe_buffer_pointer() == ptr
    text = e.lower_step(next(iter(e.shapes_seen))).compile().as_text()
    t = sharding.cache_traffic(text, e.layout)
    assert t == dict(cross_device=[], cache_copies=[], cache_aliased=True), t
    # no loop in the step makes the runtime wait for the device before it returns
    assert sharding.host_waits(text) == []


def test_projection_kernel_changes_no_byte(rng, monkeypatch):
    """invariant.CONTRACTIONS = "pallas" (one kernel per projection instead of the
    XLA loop) serves the same requests to the same tokens and cache bytes; the
    engine runs a different compiled step for it (the mode is a static argument of
    the jitted step: which of the two compiles here depends on what earlier tests
    in the process compiled, so the static argument itself is checked)."""
    from glm5_jax.model import invariant as inv
    model = random_model(rng)
    prompts = [tokens(rng, int(rng.integers(40, 100)))]                 # small: interpret mode on CPU
    garbage_seed = int(rng.integers(2**31))                             # the same garbage in both caches
    runs, seen = [], []
    real_step = eng_mod._step

    def spy(*args, **kw):
        seen.append(kw["contractions"])
        return real_step(*args, **kw)
    monkeypatch.setattr(eng_mod, "_step", spy)
    for mode in ("xla", "pallas"):
        monkeypatch.setattr(inv, "CONTRACTIONS", mode)
        e = make_engine(model, np.random.default_rng(garbage_seed))
        del seen[:]
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, 2)
        e.run()
        assert seen and set(seen) == {mode}, seen           # every step ran the mode's compiled program
        runs.append(([e.get_output(f"r{i}").output_tokens for i in range(len(prompts))], e.cache_bytes(0)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


# ---------------------------------------------------------------------------------
# asynchronous scheduling: step i+1 planned and dispatched before step i's tokens are read
# ---------------------------------------------------------------------------------
def _waves(rng):
    """Two waves of requests: prompts of 5..250 tokens (longer than a chunk: several
    prefill steps; the first longer than a block and one token), then a re-hit of the
    first wave's longest prompt, a block of it cached, and two more."""
    first = [(f"a{i}", tokens(rng, int(rng.integers(BS + 2 if i == 0 else 5, 251))), int(rng.integers(1, 9)))
             for i in range(4)]
    longest = max(first, key=lambda r: len(r[1]))[1]
    second = [("hit", longest[:BS + int(rng.integers(1, min(BS, len(longest) - BS)))], 5),
              ("b0", tokens(rng, int(rng.integers(5, 200))), int(rng.integers(1, 9))),
              ("b1", tokens(rng, int(rng.integers(5, 200))), int(rng.integers(1, 9)))]
    return first, second


def test_async_scheduling_serves_the_same_tokens_and_bytes(rng, monkeypatch):
    """Async engines with one and two steps in flight (each step dispatched before the
    previous one's tokens reach the host; decode inputs read on the device) serve the
    same tokens, selections and cache bytes as the synchronous engine; results show
    up one step() later per step in flight."""
    model = random_model(rng)
    first, second = _waves(rng)
    lag_prompt = tokens(rng, 40)
    srcs = {1: [], 2: []}                          # device-sourced decode inputs per async step
    real_batch = Engine._batch

    def spy(self, shape, plans):
        if self.async_scheduling:
            srcs[self.async_scheduling].append(sum(s >= 0 for p in plans for s in p.dec_src))
        return real_batch(self, shape, plans)
    monkeypatch.setattr(Engine, "_batch", spy)
    outs, engines = [], []
    for mode in (0, 1, 2):
        e = make_engine(model, rng, record=True, snapshot_on_finish=True, async_scheduling=mode)
        e.add_request("lag", lag_prompt, 3)
        for calls in range(mode + 1):              # a one-chunk prompt: its first token is sampled at once
            assert len(e.get_output("lag").output_tokens) == 0
            e.step()
            assert e.get_output("lag").num_computed_tokens == 40 + calls
        assert len(e.get_output("lag").output_tokens) == 1       # the prefill step's token, `mode` calls late
        for wave in (first, second):
            for r in wave:
                e.add_request(*r)
            e.run()
        assert not e.has_unfinished() and not e._inflight
        e.block_pool.check_invariants()
        outs.append(e.outputs)
        engines.append(e)
    for depth in (1, 2):
        assert engines[depth].compilations == 0    # the synchronous engine's compiled step, reused
        assert sum(srcs[depth]) > 0 and len(srcs[depth]) == engines[depth].steps
    assert outs[1]["hit"].num_cached_tokens == outs[0]["hit"].num_cached_tokens >= BS
    for rid, a in outs[0].items():
        for depth in (1, 2):
            b = outs[depth][rid]
            what = f"{rid}: sync vs {depth} step(s) in flight"
            assert a.finished and b.finished and a.output_tokens == b.output_tokens, what
            assert a.num_cached_tokens == b.num_cached_tokens, what
            assert a.predicted_tokens == b.predicted_tokens and sorted(a.selected_tokens) == sorted(b.selected_tokens)
            # as sets: a step whose every row is short takes the short-context path (another order)
            assert_same_selection(a.selected_tokens, b.selected_tokens, sorted(a.selected_tokens), what)
            assert_same_bytes(a.snapshot, b.snapshot, what)


def test_async_scheduling_abort_in_flight_and_dry_run(rng):
    """Dry runs (no model): an async engine finishes every request with its token
    count, returns every block, and a request aborted while its token is in flight
    is dropped cleanly; drafts (next_n > 1) are refused."""
    model = Decoder.random(MODEL_CFG, seed=0)
    reqs = [(f"r{i}", tokens(rng, int(rng.integers(5, 300))), int(rng.integers(1, 12))) for i in range(9)]
    finished = {}
    for mode in (0, 1, 2):
        e = Engine(model, NB, max_running_requests=4, dry_run=True, async_scheduling=mode)
        for r in reqs:
            e.add_request(*r)
        done = []
        while e.has_unfinished():
            done += e.step()
            if "r0" not in done and e.get_output("r0").status == "running" and e._reqs["r0"].pending:
                e.abort_request("r0")               # its token is in flight (async) / never (sync)
        finished[mode] = done
        assert e.get_output("r0").status in ("aborted", "finished")
        for rid, _, new in reqs[1:]:
            assert e.get_output(rid).finished and len(e.get_output(rid).output_tokens) == new, rid
        e.block_pool.check_invariants()
        assert e.block_pool.num_free_blocks == NB - 1
        if mode:
            assert e.get_output("r0").status == "aborted" and "r0" not in finished[mode]
            assert sorted(finished[mode]) == sorted(r for r, *_ in reqs[1:])
    with pytest.raises(ValueError, match="async_scheduling needs next_n = 1"):
        Engine(Decoder.random(SPEC_CFG, seed=0), NB, next_n=2, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling must be"):
        Engine(model, NB, async_scheduling=3)
