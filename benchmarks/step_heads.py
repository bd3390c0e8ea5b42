"""Device time of serving steps with and without the head columns (session 20).

Usage (GPU machine):
    PYTHONPATH=$PWD python benchmarks/step_heads.py [--reps 30] [--json out.json]
    CPU smoke run: PYTHONPATH=$PWD python benchmarks/step_heads.py --preset cpu --reps 2 --warm-steps 12

Until session 19 every step shape carried kpool - 1 head columns, so the decode update
walked max(next_n, kpool - 1) tokens of every decode and prefill row (mostly padding),
and on the GPU the engine never ran the one-token decode kernel. Now the columns are
there only when a prefill chunk starts mid-pool (``StepShape.head_width_tokens``).

This script serves bench_scaleout's GPU workload (one device) for ``--warm-steps``
steps, keeps two of them, the decode-only step with the most decode rows and the step
with the most tokens, and replays each one with the same rows and the same cache
under both shapes: without head columns (what the engine runs now) and with them
(``BucketMins(head_width_tokens=1)``: the old shape). Each replay is ``--reps``
back-to-back calls of the engine's jitted step (cache donated, one wait at the end;
median of 3). Before timing, one call of each shape runs from the same cache and the
two resulting caches must be byte-identical (the dropped columns were padding).
Reported: ms per step of each shape and their ratio, measured in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import numpy as np
from flax import nnx

from glm5_jax import simulate
from glm5_jax.model import invariant
from glm5_jax.model.decoder import Decoder
from glm5_jax.serving import engine as eng_mod
from glm5_jax.serving import sharding

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_scaleout import GPU_OVERRIDES  # noqa: E402
from device_step import serve_steps, time_replay, workload_engine  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--warm-steps", type=int, default=60, help="serving steps to pick the replayed steps from")
    ap.add_argument("--reps", type=int, default=30, help="back-to-back steps per timing")
    ap.add_argument("--json", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.warm_steps < 1:
        ap.error("--reps and --warm-steps must be >= 1")
    return a


def capture(eng, warm_steps):
    """{kind: (plans, shape, cache row before the step)} for the decode-only step with the
    most decode rows ("decode") and the step with the most tokens ("busiest")."""
    kept, real_batch = {}, eng_mod.Engine._batch

    def batch(self, shape, plans):
        rows = [r for p in plans for r in p.dec_rows + p.pre_rows]
        score = dict(decode=len(rows) if not any(p.pre_rows for p in plans) else -1,
                     busiest=sum(len(r.token_ids) for r in rows))
        for kind, s in score.items():
            if s > kept.get(kind, (-1,))[0]:
                kept[kind] = (s, plans, shape, sharding.host_shard(self.cache, 0))
        return real_batch(self, shape, plans)
    eng_mod.Engine._batch = batch
    try:
        serve_steps(eng, warm_steps)
    finally:
        eng_mod.Engine._batch = real_batch
    return {k: v[1:] for k, v in kept.items() if v[0] > 0}


def arrays(eng, plans, shape):
    flat, fields = eng._batch(shape, plans)
    return np.asarray(flat), fields


def main(argv=None) -> int:
    a = parse(argv)
    over = dict(GPU_OVERRIDES) if a.preset == "gpu" else {}
    w = simulate.preset(a.preset, devices=1, **over)
    model = Decoder.random(w.model_config, seed=w.seed)
    eng = workload_engine(w, model, simulate.plan_num_blocks(w, model))
    print(f"step_heads: {jax.default_backend()} {jax.devices()[0].device_kind}, preset {a.preset}, "
          f"implementation {eng.implementation}", flush=True)
    kept = capture(eng, a.warm_steps)
    r = w.model_config.indexer.kpool
    rows, ok = [], True
    for kind, (plans, shape, cache) in kept.items():
        shapes = dict(no_heads=dataclasses.replace(shape, head_width_tokens=0),
                      heads=dataclasses.replace(shape, head_width_tokens=r - 1))
        res = {}
        for name, sh in shapes.items():
            flat, fields = arrays(eng, plans, sh)
            best = dict(flat=flat, fields=fields, cache=cache)
            res[name] = time_replay(best, eng, model, 1, a.reps)[0], once(eng, model, best)
        same = bool(np.array_equal(res["no_heads"][1], res["heads"][1]))
        ok &= same
        toks = sum(len(x.token_ids) for p in plans for x in p.dec_rows + p.pre_rows)
        row = dict(step=kind, tokens=toks, decode_rows=shape.decode_rows, prefill_rows=shape.prefill_rows,
                   next_n=shape.decode_width_tokens, ms_no_heads=res["no_heads"][0] * 1e3,
                   ms_heads=res["heads"][0] * 1e3, same_bytes=same)
        row["speedup"] = row["ms_heads"] / row["ms_no_heads"]
        rows.append(row)
    print(f"\n{'step':>8} {'tokens':>6} {'decode rows':>11} {'prefill rows':>12} {'ms, heads':>10} "
          f"{'ms, none':>9} {'speed-up':>8} {'same bytes':>10}")
    for x in rows:
        print(f"{x['step']:>8} {x['tokens']:>6} {x['decode_rows']:>11} {x['prefill_rows']:>12} "
              f"{x['ms_heads']:>10.3f} {x['ms_no_heads']:>9.3f} {x['speedup']:>7.2f}x {str(x['same_bytes']):>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           preset=a.preset, rows=rows), f, indent=2)
    return 0 if ok and rows else 1


def once(eng, model, best):
    """The cache row after one call of the step from the captured cache (host bytes)."""
    mesh = sharding.single_device_mesh()
    state = sharding.replicated(nnx.split(model)[1], mesh)
    cache = sharding.put_per_shard(best["cache"][None], mesh)
    flat = sharding.put_per_shard(best["flat"], mesh)
    prev = sharding.put_per_shard(np.zeros((1, eng.tokens_out), np.int32), mesh)
    cache, _, _ = eng_mod._step(state, cache, flat, prev, fields=best["fields"], graphdef=eng._graphdef,
                                layout=eng.layout, implementation=eng.implementation, mesh=mesh,
                                contractions=invariant.contractions(), tokens_out=eng.tokens_out)
    return sharding.host_shard(cache, 0)


if __name__ == "__main__":
    sys.exit(main())
