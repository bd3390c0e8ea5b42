"""The Engine on a mesh of several devices (forced CPU devices or real GPUs).

Usage: python sharded_engine.py SEED N [N ...]   (each N: a mesh over the first N devices)

For each mesh size N, with a tiny 1-layer model:

1. placement: 2N requests added together land on shards 0..N-1, then one more per
   shard in order of blocks held (ties: lower shard id); a re-hit of a cached
   prefix goes to the shard holding it even when another shard is less loaded; a
   salted copy of it goes to the least-loaded shard;
2. per shard, the generated tokens, the selected tokens of every position and the
   whole cache shard's bytes equal a one-device engine serving only the requests
   placed on that shard (in the same phases);
3. the compiled step: one program for all devices (one trace per mesh), the
   cache donated and aliased to the output, no collective op and no copy of the
   cache in the compiled HLO, the same device buffers after a step;
4. the serving probe (simulate, docs/semantics.md 6.1) with one cached prompt per shard holds
   on every shard;
5. admission is first come first served per shard: a request waiting for its
   busy prefix owner holds back later requests for that shard only;
6. asynchronous scheduling on the mesh serves the same tokens and selections, and
   its probe holds on every shard.

Prints 'OK <N>' per mesh size.
"""
import sys

import jax
import numpy as np

from glm5_jax import simulate
from glm5_jax.config import IndexerConfig
from glm5_jax.model.decoder import Decoder, ModelConfig
from glm5_jax.serving import engine as eng_mod
from glm5_jax.serving import sharding

SEED = int(sys.argv[1])
SIZES = [int(n) for n in sys.argv[2:]]
CFG = ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_heads=2, head_dim=32, q_lora_rank=64,
                  mlp_size=64, indexer=IndexerConfig(n_heads=4, topk=32, block_size=128))
BS = CFG.indexer.block_size
# per device: one cached 150-token prompt, 6 fillers of 16..160 tokens, 2 running requests, 9
# blocks per shard (dry runs of this seed: on 2 and on 4 shards it evicts and the prompts stay).
# Blocks of 128 tokens: 32-row pages, the page height the Pallas kernels were checked with on GPU.
WORKLOAD = simulate.Workload(model_config=CFG, prompt_tokens=150, fillers=6, rounds=2, concurrency=2,
                             filler_min_tokens=16, filler_max_tokens=160, filler_max_new_tokens=4,
                             prompt_max_new_tokens=3, prefill_chunk_tokens=64, max_prefill_requests=1,
                             num_blocks=9, seed=7)

rng = np.random.default_rng(SEED)
model = Decoder.random(CFG, seed=int(rng.integers(2**31)))


def tokens(n):
    return [int(t) for t in rng.integers(0, CFG.vocab_size, n)]


def footprint_blocks(prompt, new):
    return -(-(len(prompt) + new) // BS) + 1                       # indexer blocks + the tail block


def check_hlo(eng, shape):
    """One compiled program, the cache aliased in place, nothing crosses devices."""
    hlo = eng.lower_step(shape).compile().as_text()                # the executable the steps ran (cached)
    t = sharding.cache_traffic(hlo, eng.layout)
    assert not t["cross_device"], f"the compiled step moves data between devices: {t['cross_device'][:3]}"
    assert not t["cache_copies"], f"the compiled step copies the cache: {t['cache_copies'][:3]}"
    assert t["cache_aliased"], "the cache is not updated in place (output 0 not aliased to the cache row)"


def run_phases(eng, phases):
    """Add each phase's requests together, then run it to completion."""
    for reqs in phases:
        for rid, prompt, new, salt in reqs:
            eng.add_request(rid, prompt, new, cache_salt=salt)
        eng.run()


def check_equal_to_one_device(eng, phases, num_blocks, single_mesh):
    for d in range(eng.num_shards):
        mine = [[r for r in reqs if eng.request_shard(r[0]) == d] for reqs in phases]
        one = simulate.engine_for(WORKLOAD, model, num_blocks, single_mesh)
        one.record = True
        run_phases(one, mine)
        for reqs in mine:
            for rid, *_ in reqs:
                a, b = eng.get_output(rid), one.get_output(rid)
                assert a.output_tokens == b.output_tokens, f"shard {d} request {rid}: generated tokens differ"
                assert sorted(a.selected_tokens) == sorted(b.selected_tokens) and a.selected_tokens
                for p in a.selected_tokens:
                    np.testing.assert_array_equal(a.selected_tokens[p], b.selected_tokens[p],
                                                  err_msg=f"shard {d} request {rid} position {p}")
        np.testing.assert_array_equal(eng.cache_bytes(d), one.cache_bytes(0),
                                      err_msg=f"cache shard {d} differs from the one-device run")
        mine_st, one_st = eng.shard_stats(d), one.stats()
        for k in ("prefill_tokens", "decode_tokens", "generated_tokens", "evictions", "hit_tokens", "admitted"):
            assert mine_st[k] == (one_st[k] if k != "admitted" else one_st["shards"][0][k]), (d, k)


def check_mesh_size(n, num_blocks, single_mesh):
    mesh = sharding.data_mesh(jax.devices()[:n])
    traces = eng_mod.total_traces()
    eng = simulate.engine_for(WORKLOAD, model, num_blocks, mesh)
    eng.record = True                                              # every request's selections
    assert eng.cache.shape == (n, eng.layout.total_words) and eng.cache.sharding.spec[0] == sharding.AXIS

    # phase 1: 2n requests of BS+1 .. 2BS-9 prompt tokens (a full block to re-hit; with their new
    # tokens at most 2 blocks + the tail each, so every shard admits its two at once)
    p1 = [(f"a{i}", tokens(int(rng.integers(BS + 1, 2 * BS - 8))), int(rng.integers(2, 7)), None)
          for i in range(2 * n)]
    for rid, prompt, new, salt in p1:
        eng.add_request(rid, prompt, new, cache_salt=salt)
    ptrs = [s.data.unsafe_buffer_pointer() for s in eng.cache.addressable_shards]
    eng.step()
    assert [s.data.unsafe_buffer_pointer() for s in eng.cache.addressable_shards] == ptrs, \
        "the donated cache did not stay in place"
    assert eng.cache.sharding.spec[0] == sharding.AXIS
    placed = [eng.request_shard(rid) for rid, *_ in p1]
    assert placed[:n] == list(range(n)), f"first round of placements {placed[:n]}"
    first_fp = [footprint_blocks(p1[s][1], p1[s][2]) for s in range(n)]
    assert placed[n:] == sorted(range(n), key=lambda s: (first_fp[s], s)), \
        f"second round {placed[n:]} should follow blocks held {first_fp} (ties: lower shard)"
    eng.run()

    # phase 2 (all shards idle): a fresh request takes shard 0 (tie: lower id); a re-hit
    # of shard 0's prompt goes to shard 0 although others are less loaded, one of shard
    # n-1's prompt to shard n-1; a salted copy (no hit) goes to the least loaded: shard 1
    p2 = [("x", tokens(int(rng.integers(10, BS))), 3, None),
          ("rehit0", p1[0][1], 3, None),
          ("rehit_last", p1[n - 1][1], 3, None),
          ("salted0", p1[0][1], 3, "salt")]
    run_phases(eng, [p2])
    got = {rid: eng.request_shard(rid) for rid, *_ in p2}
    assert got == {"x": 0, "rehit0": 0, "rehit_last": n - 1, "salted0": 1}, got
    assert eng.get_output("rehit0").num_cached_tokens == eng.get_output("rehit_last").num_cached_tokens == BS
    assert eng.get_output("salted0").num_cached_tokens == 0
    assert eng.get_output("rehit0").output_tokens == eng.get_output("salted0").output_tokens
    stats = eng.stats()
    assert [s["admitted"] for s in stats["shards"]] == [sum(1 for p in placed + list(got.values()) if p == d)
                                                        for d in range(n)]
    for pool in eng.block_pools:
        pool.check_invariants()

    # the serving probe, one cached prompt per shard, on the same compiled program
    rep = simulate.run_workload(simulate.dataclasses.replace(WORKLOAD, devices=n), mesh=mesh)
    assert rep["devices"] == n and len(rep["shards"]) == n
    for s in rep["shards"]:
        assert s["ok"] and s["prompts"] == [s["shard"]] and s["bytes_changed"] == 0, s
        assert s["watched_bytes"] == (WORKLOAD.prompt_tokens // BS) * CFG.indexer.index_block_bytes
    assert all(r["rehit_shard"] == r["shard_of_prompt"] == r["prompt"] for r in rep["rounds"])
    assert rep["ok"] and rep["evictions"] > 0
    assert len(eng.shapes_seen) == 1 and eng_mod.total_traces() - traces == 1, \
        "the sharded step compiled more than once"

    check_hlo(eng, next(iter(eng.shapes_seen)))
    check_async_equals_sync(eng, mesh, [p1, p2], num_blocks)
    check_equal_to_one_device(eng, [p1, p2], num_blocks, single_mesh)
    check_no_cross_shard_blocking(mesh, num_blocks)
    print("OK", n, flush=True)


def check_async_equals_sync(eng, mesh, phases, num_blocks):
    """Asynchronous scheduling on the mesh (each step dispatched before the previous
    one's tokens are read; decode inputs taken on each device from its own shard of
    the previous step's tokens): the same placement, tokens and selections as the
    synchronous engine, on the same compiled program; the probe holds on every shard."""
    traces = eng_mod.total_traces()
    a = simulate.engine_for(simulate.dataclasses.replace(WORKLOAD, async_scheduling=True), model, num_blocks, mesh)
    a.record = True
    run_phases(a, phases)
    for reqs in phases:
        for rid, *_ in reqs:
            x, y = eng.get_output(rid), a.get_output(rid)
            assert (x.shard, x.output_tokens) == (y.shard, y.output_tokens), f"async request {rid}"
            assert sorted(x.selected_tokens) == sorted(y.selected_tokens)
            for p in x.selected_tokens:
                np.testing.assert_array_equal(x.selected_tokens[p], y.selected_tokens[p],
                                              err_msg=f"async request {rid} position {p}")
    rep = simulate.run_workload(simulate.dataclasses.replace(WORKLOAD, devices=eng.num_shards,
                                                             async_scheduling=True), mesh=mesh)
    assert rep["ok"] and rep["async_scheduling"] and all(s["ok"] for s in rep["shards"]), rep["shards"]
    assert eng_mod.total_traces() == traces, "the async engine compiled its own step"


def check_no_cross_shard_blocking(mesh, num_blocks):
    """A request waiting for its busy prefix owner holds back later requests bound for
    that shard only: a fresh request behind it starts on another shard at once."""
    eng = simulate.engine_for(WORKLOAD, model, num_blocks, mesh, dry_run=True)
    cap = eng.max_running_requests
    prompt = tokens(BS + 5)
    eng.add_request("p", prompt, 2)
    eng.run()                                                      # cached on shard 0
    for i in range(cap + 1):                                       # cap re-hits fill shard 0, one waits
        eng.add_request(f"hit{i}", prompt, 8)
    eng.add_request("fresh", tokens(BS // 2), 2)
    eng.add_request("hit_late", prompt, 2)                         # must not overtake hit{cap} on shard 0
    eng.step()
    assert [eng.request_shard(f"hit{i}") for i in range(cap)] == [0] * cap
    waiting = [rid for rid in (f"hit{cap}", "hit_late") if eng.get_output(rid).status == "waiting"]
    assert waiting == [f"hit{cap}", "hit_late"], waiting
    assert eng.get_output("fresh").status != "waiting" and eng.request_shard("fresh") != 0, \
        "a request waiting for shard 0 held back one that another shard could take"
    eng.run()
    assert all(eng.get_output(r).finished for r in [f"hit{i}" for i in range(cap + 1)] + ["fresh", "hit_late"])
    assert eng.request_shard(f"hit{cap}") == eng.request_shard("hit_late") == 0


assert max(SIZES) <= len(jax.devices()), f"needs {max(SIZES)} devices, jax sees {jax.devices()}"
single = sharding.single_device_mesh()
print(f"backend {jax.default_backend()}, {len(jax.devices())} devices", flush=True)
for size in SIZES:
    check_mesh_size(size, WORKLOAD.num_blocks, single)
