"""Device time of ONE serving step on 1 device vs N, with no host work between steps.

Usage (GPU machine with 2 GPUs):
    PYTHONPATH=$PWD python benchmarks/device_step.py [--devices 1,2] [--reps 30] [--json out.json]
    CPU smoke run: XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        PYTHONPATH=$PWD python benchmarks/device_step.py --preset cpu --reps 2

Why: bench_scaleout measures whole serving steps (host work included). With
asynchronous scheduling the host work overlaps the devices, so what is left of the
gap to N x is the step program itself. This script serves the bench_scaleout
workload on one device until it has seen ``--warm-steps`` steps, keeps the step
that processed the most tokens (its packed step arrays and the cache as it was),
and replays exactly that step on every mesh size: on N devices each device gets
the same arrays and the same cache row, so every device does the one-device work.
Each replay is ``--reps`` back-to-back calls of the engine's jitted step (cache
donated, one wait at the end; median of 3). The ratio N-device / 1-device step
time is the best weak scaling any scheduling can reach for that step
(N / ratio). It also counts the kernels of the compiled one-device step.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time

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


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default=None, help="comma-separated device counts, 1 first (default 1 and 2)")
    ap.add_argument("--preset", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--warm-steps", type=int, default=40, help="serving steps to pick the replayed step from")
    ap.add_argument("--reps", type=int, default=30, help="back-to-back steps per timing")
    ap.add_argument("--json", help="write the results as JSON here")
    a = ap.parse_args(argv)
    counts = [1, min(2, jax.device_count())] if a.devices is None else [int(x) for x in a.devices.split(",")]
    counts = sorted(set(counts))
    if counts[0] != 1 or max(counts) > jax.device_count():
        ap.error(f"--devices needs 1 and at most {jax.device_count()} devices, got {counts}")
    if a.reps < 1 or a.warm_steps < 1:
        ap.error("--reps and --warm-steps must be >= 1")
    return a, counts


def workload_engine(w, model, num_blocks):
    """A one-device Engine for workload w (simulate.engine_for) holding its system prompt
    and fillers, not yet stepped."""
    eng = simulate.engine_for(w, model, num_blocks, sharding.single_device_mesh())
    prompts, fillers, news = simulate.draw_requests(w)
    eng.add_request("prompt", prompts[0], w.prompt_max_new_tokens)
    for i, (f, n) in enumerate(zip(fillers, news)):
        eng.add_request(f"filler{i}", f, n)
    return eng


def serve_steps(eng, warm_steps: int):
    """Step eng until it is done or has run warm_steps steps."""
    for _ in range(warm_steps):
        if not eng.has_unfinished():
            break
        eng.step()


def capture(eng, warm_steps):
    """Serve eng for warm_steps steps; return {kind: (plans, shape, cache row before the
    step)} for the decode-only step with the most decode rows ("decode") and the step with
    the most tokens ("busiest")."""
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


def capture_step(w, model, num_blocks, warm_steps):
    """Serve w on one device for warm_steps steps; return (packed step arrays [1, total]
    i32, fields, real tokens, the cache row before that step [words] u32, the engine)."""
    eng = workload_engine(w, model, num_blocks)
    best = dict(tokens=-1)
    real_pack, real_batch = eng_mod.pack_step_arrays, eng_mod.Engine._batch
    seen = {}

    def pack(per_shard):
        seen["flat"], seen["fields"] = real_pack(per_shard)
        return seen["flat"], seen["fields"]

    def batch(self, shape, plans):
        n = sum(len(r.token_ids) for p in plans for r in p.dec_rows + p.pre_rows)
        before = sharding.host_shard(self.cache, 0) if n > best["tokens"] else None
        out = real_batch(self, shape, plans)
        if before is not None:
            best.update(tokens=n, flat=seen["flat"].copy(), fields=seen["fields"], cache=before, shape=shape)
        return out
    eng_mod.pack_step_arrays, eng_mod.Engine._batch = pack, batch
    try:
        serve_steps(eng, warm_steps)
    finally:
        eng_mod.pack_step_arrays, eng_mod.Engine._batch = real_pack, real_batch
    return best, eng


def time_replay(best, eng, model, n, reps):
    """(median seconds per step, mean seconds until each call returned) of the captured
    step replayed reps times back to back on the first n devices."""
    mesh = sharding.data_mesh(jax.devices()[:n])
    state = sharding.replicated(nnx.split(model)[1], mesh)
    cache = sharding.put_per_shard(np.repeat(best["cache"][None], n, axis=0), mesh)
    flat = sharding.put_per_shard(np.repeat(best["flat"], n, axis=0), mesh)
    prev = sharding.put_per_shard(np.zeros((n, eng.tokens_out), np.int32), mesh)
    kw = dict(fields=best["fields"], graphdef=eng._graphdef, layout=eng.layout, implementation=eng.implementation,
              mesh=mesh, contractions=invariant.contractions(), tokens_out=eng.tokens_out)
    cache, tok, _ = eng_mod._step(state, cache, flat, prev, **kw)          # compile + warm up
    jax.block_until_ready((cache, tok))
    per_step, dispatch = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        d = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            cache, tok, _ = eng_mod._step(state, cache, flat, prev, **kw)
            d += time.perf_counter() - t
        jax.block_until_ready((cache, tok))
        per_step.append((time.perf_counter() - t0) / reps)
        dispatch.append(d / reps)
    lowered = eng_mod._step.lower(state, cache, flat, prev, **kw)
    return float(np.median(per_step)), float(np.mean(dispatch)), lowered


def kernel_counts(hlo: str) -> dict:
    """Rough launch counts of a compiled GPU step: Triton (Pallas) custom calls, fusions,
    while loops (each runs its body's kernels once per iteration)."""
    return dict(triton_calls=len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo)),
                fusions=len(re.findall(r"\bfusion\(", hlo)),
                while_loops=len(re.findall(r"\bwhile\(", hlo)))


def main(argv=None) -> int:
    a, counts = parse(argv)
    over = dict(GPU_OVERRIDES) if a.preset == "gpu" else {}
    w = simulate.preset(a.preset, devices=1, **over)
    model = Decoder.random(w.model_config, seed=w.seed)
    num_blocks = simulate.plan_num_blocks(w, model)
    print(f"device_step: {jax.default_backend()} {jax.devices()[0].device_kind} x {jax.device_count()}, preset "
          f"{a.preset}, contractions by {invariant.contractions()}, {num_blocks} blocks", flush=True)
    best, eng = capture_step(w, model, num_blocks, a.warm_steps)
    print(f"replayed step: {best['tokens']} real tokens of {best['shape'].num_tokens} "
          f"({best['shape'].decode_rows} decode rows, {best['shape'].prefill_rows} x "
          f"{best['shape'].prefill_width_tokens} prefill tokens)", flush=True)
    rows = []
    for n in counts:
        sec, disp, lowered = time_replay(best, eng, model, n, a.reps)
        row = dict(devices=n, ms_per_step=sec * 1e3, dispatch_ms=disp * 1e3)
        if n == 1 and jax.default_backend() == "gpu":
            row["kernels"] = kernel_counts(lowered.compile().as_text())
        rows.append(row)
    base = rows[0]["ms_per_step"]
    print(f"\n{'devices':>7} {'ms/step':>9} {'vs 1 device':>11} {'best weak scaling':>17} {'call returns ms':>15}")
    for r in rows:
        r["vs_one"] = r["ms_per_step"] / base
        r["best_scaling"] = r["devices"] / r["vs_one"]
        print(f"{r['devices']:>7} {r['ms_per_step']:>9.2f} {r['vs_one']:>10.2f}x {r['best_scaling']:>16.2f}x "
              f"{r['dispatch_ms']:>15.2f}")
    if "kernels" in rows[0]:
        print(f"compiled one-device step: {rows[0]['kernels']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           preset=a.preset, replayed_tokens=best["tokens"], rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
