"""Weak scaling of the serving loop over devices: simulate's throughput on 1 device vs N.

Usage (on a machine with 2 GPUs; STEPS=scaleout bash benchmarks/gpu.sh runs it):
    PYTHONPATH=$PWD python benchmarks/bench_scaleout.py [--devices 1,2] [--goal 1.8] [--json out.json]
    CPU smoke run: XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        PYTHONPATH=$PWD python benchmarks/bench_scaleout.py --preset cpu --fillers 4 --rounds 1

Each device count N serves N times the same per-device workload (the ``simulate``
probe of docs/semantics.md 6.1: N cached system prompts, one per shard, N x fillers churning
with evictions, re-hits next to cache_salt controls) through one Engine whose
cache has one shard per device, all N devices in one jit-compiled step. Every run
uses the same pool size per device (the largest of the sizes the planner picks
for each N) and one pinned step shape, so a device does the same work per step
whatever N is. Throughput = tokens processed (prompt + decode rows) / run time
without the steps that compiled; the ratio to one device is the weak-scaling
speed-up (ideal: N). The engine keeps 2 steps in flight by default
(``--async-scheduling``; 0 measures the synchronous engine). Exit code 0 when the
largest N reaches ``--goal`` x one device and every probe passed, 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax

from glm5_jax import simulate
from glm5_jax.model.decoder import Decoder

# per device (the gpu preset otherwise): a 5000-token cached prompt, 24 fillers of 200..3000
# tokens over 2 rounds, 16 running, one pinned step shape of 16 decode rows + 4 x 512 prefill
# tokens (a dry run: about 120 steps per run, whatever the device count)
GPU_OVERRIDES = dict(fillers=24, rounds=2, pin_buckets=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default=None,
                    help="comma-separated device counts, 1 first (default: 1 and all devices, at most 2)")
    ap.add_argument("--preset", choices=("gpu", "cpu"), default="gpu", help="simulate size preset (default gpu)")
    ap.add_argument("--fillers", type=int, default=None, help="filler requests per device")
    ap.add_argument("--rounds", type=int, default=None, help="re-hit rounds")
    ap.add_argument("--concurrency", type=int, default=None, help="running requests per device")
    ap.add_argument("--goal", type=float, default=1.8, help="required speed-up of the largest count over 1")
    ap.add_argument("--contractions", choices=("xla", "pallas"), default=None,
                    help="who runs the model's projections (glm5_jax.model.invariant.CONTRACTIONS; default: its value, "
                         "auto = pallas on a GPU)")
    ap.add_argument("--kernels", default=None,
                    help="with pallas contractions, which ones run as kernels: a comma list of "
                         "linear, attention, norms (glm5_jax.model.invariant.PALLAS_KERNELS; default: all)")
    ap.add_argument("--async-scheduling", type=int, nargs="?", const=1, default=2, choices=(0, 1, 2),
                    help="Engine(async_scheduling=N): plan and dispatch step i+1 before waiting for step i+1-N "
                         "(N steps in flight; 1 without a value; default 2, the serving configuration; "
                         "0 = the synchronous engine)")
    ap.add_argument("--json", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.kernels is not None:
        bad = sorted(set(a.kernels.split(",")) - {"linear", "attention", "norms"})
        if bad:
            ap.error(f"--kernels: unknown {bad} (linear, attention, norms)")
    counts = [1, min(2, jax.device_count())] if a.devices is None else [int(x) for x in a.devices.split(",")]
    counts = sorted(set(counts))
    if counts[0] != 1 or max(counts) > jax.device_count():
        ap.error(f"--devices needs 1 and at most {jax.device_count()} (the devices jax sees), got {counts}")
    return a, counts


def workload(a, devices: int, num_blocks=None) -> simulate.Workload:
    over = dict(GPU_OVERRIDES) if a.preset == "gpu" else {}
    over.update({k: v for k, v in dict(fillers=a.fillers, rounds=a.rounds, concurrency=a.concurrency).items()
                 if v is not None})
    over["async_scheduling"] = a.async_scheduling
    return simulate.preset(a.preset, devices=devices, num_blocks=num_blocks, **over)


def main(argv=None) -> int:
    a, counts = parse(argv)
    from glm5_jax.model import invariant
    if a.contractions is not None:
        invariant.CONTRACTIONS = a.contractions
    if a.kernels is not None:
        invariant.PALLAS_KERNELS = tuple(a.kernels.split(","))
    how = invariant.contractions()
    if how == "pallas":
        how += f" ({', '.join(invariant.PALLAS_KERNELS)})"
    print(f"bench_scaleout: {jax.default_backend()} {jax.devices()[0].device_kind} x {jax.device_count()}, "
          f"device counts {counts}, preset {a.preset}, contractions by {how}"
          f"{f', asynchronous scheduling ({a.async_scheduling} in flight)' if a.async_scheduling else ''}", flush=True)
    try:
        base = workload(a, 1)
        model = Decoder.random(base.model_config, seed=base.seed)
        t0 = time.perf_counter()
        num_blocks = max(simulate.plan_num_blocks(workload(a, n), model) for n in counts)
    except ValueError as e:
        print(f"bench_scaleout: error: {e}", file=sys.stderr)
        return 2
    print(f"planned {num_blocks} blocks per device in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for n in counts:
        rep = simulate.run_workload(workload(a, n, num_blocks))
        row = dict(devices=n, requests=sum(s["requests"] for s in rep["shards"]),
                   processed_tokens=rep["processed_tokens"], steps=rep["steps"],
                   compilations=rep["compilations"], wall_s=rep["wall_s"], compile_step_s=rep["compile_step_s"],
                   probe_setup_s=rep["probe_setup_s"],
                   tokens_per_s=rep["tokens_per_s"], per_device_tokens_per_s=[s["tokens_per_s"] for s in rep["shards"]],
                   evictions=rep["evictions"], per_device_evictions=[s["evictions"] for s in rep["shards"]],
                   probe_ok=rep["ok"], per_device_probe_ok=[s["ok"] for s in rep["shards"]],
                   phase_seconds=rep["phase_seconds"])
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0
        row["efficiency"] = row["speedup"] / n
        rows.append(row)
        print(f"  {n} device(s): {row['processed_tokens']:,} tokens in {row['steps']} steps, "
              f"{row['tokens_per_s']:,.0f} tokens/s (per device {[round(x) for x in row['per_device_tokens_per_s']]}), "
              f"compile {row['compile_step_s']:.1f} s, probe setup {row['probe_setup_s']:.2f} s (both not timed), "
              f"probe {'PASS' if row['probe_ok'] else 'FAIL'}", flush=True)

    print()
    print(f"{'devices':>7} {'requests':>8} {'tokens':>10} {'steps':>6} {'run s':>7} {'tokens/s':>10} "
          f"{'per device':>22} {'speed-up':>8} {'eff.':>5} {'evict':>6} {'probe':>5}")
    for r in rows:
        per = "/".join(f"{x:,.0f}" for x in r["per_device_tokens_per_s"])
        run_s = r["wall_s"] - r["compile_step_s"] - r["probe_setup_s"]
        print(f"{r['devices']:>7} {r['requests']:>8} {r['processed_tokens']:>10,} {r['steps']:>6} {run_s:>7.1f} "
              f"{r['tokens_per_s']:>10,.0f} {per:>22} {r['speedup']:>7.2f}x {r['efficiency']:>5.0%} "
              f"{r['evictions']:>6} {'PASS' if r['probe_ok'] else 'FAIL':>5}")
    phases = list(rows[0]["phase_seconds"])
    print("\nwhere a step's wall time goes (ms per step, steps that did not compile; probe = simulate's "
          "watched-bytes check):")
    print(f"{'devices':>7} " + " ".join(f"{p:>14}" for p in phases))
    for r in rows:
        print(f"{r['devices']:>7} " + " ".join(f"{r['phase_seconds'][p] / max(r['steps'] - r['compilations'], 1) * 1e3:>14.2f}"
                                             for p in phases))
    top = rows[-1]
    probes_ok = all(r["probe_ok"] for r in rows)
    ok = probes_ok and (len(rows) == 1 or top["speedup"] >= a.goal)
    print(f"weak scaling {top['devices']} devices: {top['speedup']:.2f}x one device (goal >= {a.goal}x): "
          f"{'met' if top['speedup'] >= a.goal else 'MISSED'}; probes {'all pass' if probes_ok else 'FAILED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           preset=a.preset, num_blocks=num_blocks, goal=a.goal, contractions=how,
                           async_scheduling=a.async_scheduling,
                           workload=dataclasses.asdict(workload(a, 1)),
                           rows=rows, ok=ok), f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
