"""The cached-prompt corruption probe of spec section 6.1, as a program.

``python -m glm5_jax simulate [--json] [--inject-fault dense-tail-stride] [--device gpu]``

Workload:

1. a system prompt longer than ``topk`` tokens (so the sparse path selects, not
   the short-context fill) is served once and its full blocks enter the prefix
   cache; as soon as its prefill is done, the bytes of those blocks' indexer
   pages (every layer) are snapshotted;
2. ``rounds`` rounds of filler requests of random lengths run with
   ``concurrency`` requests at a time; the pool is sized so it wraps and evicts
   cached filler blocks, while the system prompt, re-hit every round, stays cached;
3. after every round the prompt is served again (a prefix-cache hit) together
   with a ``cache_salt`` control that forces a full recomputation.

After every engine step the watched pages are compared with the snapshot. The
report gives the bytes changed (must be 0), whether each re-hit produced the same
output tokens, the same selected tokens and the same pool bytes as its control,
tokens/s, steps, compilations and evictions. Exit code 0 when every check passes,
1 otherwise. ``--inject-fault dense-tail-stride`` serves with the historical bug
(spec B1: tail writes with the dense block stride), which the probe catches.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from .config import IndexerConfig
from .layout import FAULTS


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of one probe run (``preset("cpu")`` / ``preset("gpu")``)."""
    model_config: object                   # glm5_jax.model.ModelConfig
    prompt_tokens: int = 168
    fillers: int = 16
    rounds: int = 4
    concurrency: int = 4
    filler_min_tokens: int = 16
    filler_max_tokens: int = 140
    filler_max_new_tokens: int = 8
    prompt_max_new_tokens: int = 6
    prefill_chunk_tokens: int = 128
    max_prefill_requests: int = 2
    num_blocks: int | None = None          # None: sized so the pool wraps and evicts
    seed: int = 0
    fault: str | None = None
    implementation: str | None = None
    pin_buckets: bool = True               # one compiled shape (CPU: compile once)

    def __post_init__(self):
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {FAULTS}")
        topk = self.model_config.indexer.topk
        if self.prompt_tokens <= topk:
            raise ValueError(f"prompt_tokens ({self.prompt_tokens}) must exceed topk ({topk}) so the "
                             f"sparse selection path is exercised")
        if self.prompt_tokens < self.model_config.indexer.block_size:
            raise ValueError("the prompt must fill at least one block to be prefix cached")
        for name in ("fillers", "rounds", "concurrency", "filler_min_tokens", "filler_max_new_tokens",
                     "prompt_max_new_tokens", "prefill_chunk_tokens", "max_prefill_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.filler_max_tokens < self.filler_min_tokens:
            raise ValueError("filler_max_tokens must be >= filler_min_tokens")


def preset(device: str = "cpu", **overrides) -> Workload:
    from .model import ModelConfig
    if device == "cpu":
        base = Workload(model_config=ModelConfig())
    elif device == "gpu":
        idx = IndexerConfig(n_heads=32, topk=2048, block_size=1152, kpool=4)
        mc = ModelConfig(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=8, head_dim=64,
                         q_lora_rank=256, mlp_size=1024, indexer=idx)
        base = Workload(model_config=mc, prompt_tokens=5000, fillers=48, rounds=4, concurrency=16,
                        filler_min_tokens=200, filler_max_tokens=3000, filler_max_new_tokens=32,
                        prompt_max_new_tokens=16, prefill_chunk_tokens=512, max_prefill_requests=4,
                        pin_buckets=False)
    else:
        raise ValueError(f"unknown device preset {device!r} (cpu, gpu)")
    return dataclasses.replace(base, **overrides)


def _blocks(n_tokens: int, bs: int) -> int:
    return -(-n_tokens // bs)


def auto_num_blocks(w: Workload, filler_lengths, filler_new) -> int:
    """A conservative pool size with which the re-hit prompt (refreshed every round)
    and its salted control stay resident; ``plan_num_blocks`` shrinks it.

    Fillers take blocks from the front of the free queue; blocks they leave cached
    go to its back. The prompt survives a round if the blocks ahead of it cover
    what the round's fillers hold at once (at most the ``concurrency`` largest
    footprints) plus what they leave cached.
    """
    bs = w.model_config.indexer.block_size
    per_round = _split_rounds(list(zip(filler_lengths, filler_new)), w.rounds)
    cached = max(sum((n + m - 1) // bs for n, m in rnd) for rnd in per_round)
    held = max(sum(sorted((_blocks(n + m, bs) + 1 for n, m in rnd), reverse=True)[:w.concurrency])
               for rnd in per_round)
    prompt = _blocks(w.prompt_tokens + w.prompt_max_new_tokens, bs) + 1
    return 1 + 2 * prompt + cached + held + 1


def _split_rounds(items, rounds):
    k, out = 0, []
    for r in range(rounds):
        n = len(items) // rounds + (1 if r < len(items) % rounds else 0)
        out.append(items[k:k + n])
        k += n
    return out


class _Progress:
    """A one-line progress bar on stderr, shown only once a run passes `delay_s` seconds."""

    def __init__(self, total: int, enabled: bool = True, delay_s: float = 3.0, stream=None):
        self.total, self.enabled, self.delay_s = total, enabled, delay_s
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.shown = False
        self.last = 0.0

    def update(self, done: int, note: str = ""):
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (now - self.last < 0.25 and done < self.total):
            return
        self.last, self.shown = now, True
        width = 30
        fill = int(width * done / max(self.total, 1))
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} requests "
                          f"{now - self.t0:6.1f}s {note:<32}")
        self.stream.flush()

    def close(self):
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _sorted_rows(sel):
    import numpy as np
    return np.sort(np.asarray(sel), axis=-1)


def _drive(eng, w: Workload, prompt, fillers, news, on_step):
    """The workload's request sequence on an engine. Returns, per round, the prompt
    blocks the re-hit reused (None if it was not admitted at once)."""
    bs = eng.config.block_size
    eng.add_request("prompt", prompt, w.prompt_max_new_tokens)
    eng.run(on_step=on_step)
    hits = []
    for r, items in enumerate(_split_rounds(list(range(w.fillers)), w.rounds)):
        for i in items:
            eng.add_request(f"filler{i}", fillers[i], news[i])
        eng.run(on_step=on_step)
        eng.add_request(f"rehit{r}", prompt, w.prompt_max_new_tokens)
        eng.add_request(f"control{r}", prompt, w.prompt_max_new_tokens, cache_salt=f"control-{r}")
        eng.step()
        rh = eng.get_output(f"rehit{r}")
        hits.append(eng.request_blocks(f"rehit{r}")[0][:len(prompt) // bs]
                    if rh.status == "running" and rh.num_cached_tokens else None)
        on_step(eng)
        eng.run(on_step=on_step)
    return hits


def _engine(w: Workload, model, num_blocks: int, *, dry_run: bool = False):
    from .engine import Engine
    from .step_metadata import BucketMins, bucket
    bs = w.model_config.indexer.block_size
    mins = BucketMins()
    if w.pin_buckets:
        longest = max(w.prompt_tokens + w.prompt_max_new_tokens, w.filler_max_tokens + w.filler_max_new_tokens)
        mins = BucketMins(decode_rows=bucket(w.concurrency), prefill_rows=bucket(w.max_prefill_requests),
                          prefill_width_tokens=bucket(w.prefill_chunk_tokens),
                          table_blocks=bucket(_blocks(longest, bs)))
    return Engine(model, num_blocks, max_running_requests=w.concurrency,
                  max_prefill_requests=w.max_prefill_requests, prefill_chunk_tokens=w.prefill_chunk_tokens,
                  bucket_mins=mins, implementation=w.implementation, fault=w.fault, record=not dry_run,
                  snapshot_on_finish=not dry_run, dry_run=dry_run)


def draw_requests(w: Workload):
    """(prompt, filler prompts, filler max_new_tokens) of a workload, from its seed."""
    import numpy as np
    cfg = w.model_config
    rng = np.random.default_rng(w.seed)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, w.prompt_tokens)]
    lengths = [int(x) for x in rng.integers(w.filler_min_tokens, w.filler_max_tokens + 1, w.fillers)]
    news = [int(x) for x in rng.integers(1, w.filler_max_new_tokens + 1, w.fillers)]
    fillers = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in lengths]
    return prompt, fillers, news


def dry_run(w: Workload, num_blocks: int, model=None) -> dict:
    """The workload's scheduling and block allocation without the model.

    Block allocation does not depend on the generated token values (fillers are
    random, so they never hit each other's blocks), so this predicts the real
    run's allocations. Returns evictions and whether the re-hit reused the
    prompt's original blocks in every round.
    """
    from .model import Decoder
    model = model if model is not None else Decoder.random(w.model_config, seed=w.seed)
    prompt, fillers, news = draw_requests(w)
    bs = w.model_config.indexer.block_size
    eng = _engine(w, model, num_blocks, dry_run=True)
    first = []

    def on_step(e):
        if not first and e.get_output("prompt").num_computed_tokens >= len(prompt):
            first.append(e.request_blocks("prompt")[0][:len(prompt) // bs])
    hits = _drive(eng, w, prompt, fillers, news, on_step)
    resident = bool(first) and all(h is not None and list(h) == list(first[0]) for h in hits)
    return dict(evictions=eng.block_pool.evictions, prompt_resident=resident, steps=eng.steps)


def plan_num_blocks(w: Workload, model=None) -> int:
    """The smallest pool (most evictions) with which the prompt stays cached in every
    round: a binary search with dry runs below the conservative ``auto_num_blocks``."""
    prompt, fillers, news = draw_requests(w)
    bs = w.model_config.indexer.block_size
    hi = auto_num_blocks(w, [len(f) for f in fillers], news)
    need = max([w.prompt_tokens + w.prompt_max_new_tokens] + [len(f) + m for f, m in zip(fillers, news)])
    lo = min(hi, _blocks(need, bs) + 2)                           # the largest request must fit alone
    while lo < hi:
        mid = (lo + hi) // 2
        if dry_run(w, mid, model)["prompt_resident"]:
            hi = mid
        else:
            lo = mid + 1
    return hi


def run_workload(w: Workload, *, progress: bool = False) -> dict:
    """Run the probe; returns the report dict (see ``format_table``)."""
    import numpy as np

    from .model import Decoder

    cfg = w.model_config
    idx = cfg.indexer
    bs = idx.block_size
    model = Decoder.random(cfg, seed=w.seed)
    prompt, fillers, news = draw_requests(w)
    num_blocks = w.num_blocks or plan_num_blocks(w, model)
    eng = _engine(w, model, num_blocks)
    lay = eng.layout
    bar = _Progress(1 + w.fillers + 2 * w.rounds, enabled=progress)
    probe = dict(watched=None, snapshot=None, blocks=None, max_changed=0, first_change_step=None,
                 changed_pages=0)

    def read(ranges):
        raw = eng.cache_bytes()
        return [raw[a:e].copy() for a, e in ranges]

    def on_step(e):
        if probe["watched"] is None:
            out = e.get_output("prompt")
            if out.num_computed_tokens >= len(prompt) and out.status == "running":
                probe["blocks"] = e.request_blocks("prompt")[0][:len(prompt) // bs]
                probe["watched"] = [lay.block_byte_range(layer, b) for layer in range(lay.num_layers)
                                    for b in probe["blocks"]]
                probe["snapshot"] = read(probe["watched"])
        else:
            now = read(probe["watched"])
            changed = sum(int((a != b).sum()) for a, b in zip(now, probe["snapshot"]))
            if changed and probe["first_change_step"] is None:
                probe["first_change_step"] = e.steps
            probe["max_changed"] = max(probe["max_changed"], changed)
            pages = sum(int((a != b).reshape(-1, idx.page_bytes).any(axis=1).sum())
                        for a, b in zip(now, probe["snapshot"]))
            probe["changed_pages"] = max(probe["changed_pages"], pages)
        done = sum(1 for o in e.outputs.values() if o.status == "finished")
        bar.update(done, f"step {e.steps}, {e.block_pool.evictions} evictions")

    if progress:
        print(f"simulate: {num_blocks} blocks planned; the first step compiles the whole model "
              f"(tens of seconds on CPU) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    hits = _drive(eng, w, prompt, fillers, news, on_step)
    wall = time.perf_counter() - t0
    bar.close()
    rounds = []
    for r, items in enumerate(_split_rounds(list(range(w.fillers)), w.rounds)):
        rh, ct = eng.get_output(f"rehit{r}"), eng.get_output(f"control{r}")
        common = sorted(set(rh.selected_tokens) & set(ct.selected_tokens))
        sel_equal = bool(common) and all(
            np.array_equal(_sorted_rows(rh.selected_tokens[p]), _sorted_rows(ct.selected_tokens[p]))
            for p in common)
        pools_equal = all(np.array_equal(la["pool_keys"], lb["pool_keys"])
                          and np.array_equal(la["pool_scales"], lb["pool_scales"])
                          for la, lb in zip(rh.snapshot["layers"], ct.snapshot["layers"]))
        rounds.append(dict(
            round=r, fillers=len(items), rehit_cached_tokens=rh.num_cached_tokens,
            control_cached_tokens=ct.num_cached_tokens,
            prompt_resident=hits[r] is not None and list(hits[r]) == list(probe["blocks"] or []),
            outputs_equal=rh.output_tokens == ct.output_tokens,
            selected_equal=sel_equal, selected_rows_compared=len(common), pools_equal=pools_equal))
    st = eng.stats()
    processed = st["prefill_tokens"] + st["decode_tokens"]
    report = dict(
        device=_backend(), implementation=eng.implementation, fault=w.fault,
        seed=w.seed, layers=lay.num_layers, num_blocks=num_blocks, block_size_tokens=bs, kpool=idx.kpool,
        topk_tokens=idx.topk, prompt_tokens=len(prompt), watched_blocks=list(probe["blocks"] or []),
        watched_bytes=sum(e - a for a, e in (probe["watched"] or [])),
        bytes_changed=probe["max_changed"], pages_changed=probe["changed_pages"],
        first_change_step=probe["first_change_step"], rounds=rounds, fillers=w.fillers,
        concurrency=w.concurrency, steps=st["steps"], compilations=st["compilations"],
        shapes=st["shapes"], evictions=st["evictions"], prefix_hit_tokens=st["hit_tokens"],
        processed_tokens=processed, generated_tokens=st["generated_tokens"], wall_s=wall,
        compile_step_s=st["compile_step_seconds"],
        tokens_per_s=processed / max(wall - st["compile_step_seconds"], 1e-9),
        generated_tokens_per_s=st["generated_tokens"] / max(wall - st["compile_step_seconds"], 1e-9))
    report["rehits_equal_control"] = all(r["outputs_equal"] and r["selected_equal"] for r in rounds)
    report["rehit_pools_equal_control"] = all(r["pools_equal"] for r in rounds)
    report["prompt_stayed_cached"] = all(r["prompt_resident"] for r in rounds)
    report["ok"] = (report["bytes_changed"] == 0 and report["rehits_equal_control"]
                    and report["rehit_pools_equal_control"] and report["prompt_stayed_cached"]
                    and report["watched_bytes"] > 0)
    return report


def _backend() -> str:
    import jax
    return jax.default_backend()


def format_table(rep: dict) -> str:
    yes = lambda b: "yes" if b else "NO"                                          # noqa: E731
    lines = [
        f"kpool cache probe (spec 6.1): {rep['device']}, implementation {rep['implementation']}, "
        f"fault {rep['fault'] or 'none'}, seed {rep['seed']}",
        f"  {rep['layers']} layers x {rep['num_blocks']} blocks of {rep['block_size_tokens']} tokens, "
        f"kpool {rep['kpool']}, topk {rep['topk_tokens']} tokens; prompt {rep['prompt_tokens']} tokens, "
        f"{rep['fillers']} fillers, concurrency {rep['concurrency']}",
        "",
        f"  {'round':>5} {'fillers':>7} {'hit tokens':>10} {'resident':>8} {'outputs':>7} "
        f"{'selected':>8} {'pools':>5}",
    ]
    for r in rep["rounds"]:
        lines.append(f"  {r['round']:>5} {r['fillers']:>7} {r['rehit_cached_tokens']:>10} "
                     f"{yes(r['prompt_resident']):>8} {yes(r['outputs_equal']):>7} "
                     f"{yes(r['selected_equal']):>8} {yes(r['pools_equal']):>5}")
    lines += [
        "",
        f"  watched: blocks {rep['watched_blocks']} ({rep['watched_bytes']:,} B of indexer pages, all layers)",
        f"  bytes changed since first written: {rep['bytes_changed']:,} in {rep['pages_changed']} page(s)"
        + (f" (first at step {rep['first_change_step']})" if rep["first_change_step"] is not None else "")
        + ("   <-- CORRUPTION" if rep["bytes_changed"] else ""),
        f"  re-hits equal the cache_salt control (outputs + selected tokens): {yes(rep['rehits_equal_control'])}",
        f"  re-hit pools equal the control's recomputed pools: {yes(rep['rehit_pools_equal_control'])}",
        f"  prompt stayed cached through every round: {yes(rep['prompt_stayed_cached'])}",
        f"  {rep['processed_tokens']:,} tokens processed, {rep['generated_tokens']:,} generated in "
        f"{rep['wall_s']:.1f} s ({rep['compile_step_s']:.1f} s of it in compiling steps): "
        f"{rep['tokens_per_s']:.1f} tokens/s, {rep['generated_tokens_per_s']:.1f} generated/s excluding compiles",
        f"  steps {rep['steps']}, compilations {rep['compilations']} ({rep['shapes']} step shapes), "
        f"evictions {rep['evictions']}, prefix-hit tokens {rep['prefix_hit_tokens']}",
        f"  result: {'PASS' if rep['ok'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def _pos_int(text):
    from .__main__ import int_at_least
    return int_at_least(1)(text)


def main(argv=None) -> int:
    from .__main__ import _prog
    p = argparse.ArgumentParser(
        prog=f"{_prog()} simulate",
        description="Serve the spec 6.1 workload (cached system prompt, churn of fillers with evictions, "
                    "re-hits vs cache_salt controls) and report whether the cached prompt's indexer "
                    "pages changed. Exit code 0 = every check passed, 1 = a check failed.")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="size preset: cpu (small, default) or gpu (GLM sizes: topk 2048, blocks of 1152)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--inject-fault", choices=FAULTS, default=None,
                   help="serve with a historical bug (dense-tail-stride = spec B1) to see the probe catch it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fillers", type=_pos_int, default=None, help="filler requests in total")
    p.add_argument("--rounds", type=_pos_int, default=None, help="re-hit rounds")
    p.add_argument("--concurrency", type=_pos_int, default=None, help="requests running at once")
    p.add_argument("--prompt-tokens", type=_pos_int, default=None, help="system prompt length")
    p.add_argument("--num-blocks", type=_pos_int, default=None, help="block ids (default: sized to evict)")
    p.add_argument("--implementation", choices=("xla", "pallas"), default=None,
                   help="default: pallas on GPU, xla elsewhere")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    over = {k: v for k, v in dict(fillers=args.fillers, rounds=args.rounds, concurrency=args.concurrency,
                                   prompt_tokens=args.prompt_tokens, num_blocks=args.num_blocks).items()
            if v is not None}
    if args.device == "gpu" and _backend() != "gpu":
        print(f"simulate: note: the gpu preset on a {_backend()} backend is slow (minutes to hours)",
              file=sys.stderr)
    try:
        w = preset(args.device, seed=args.seed, fault=args.inject_fault,
                   implementation=args.implementation, **over)
        rep = run_workload(w, progress=not args.no_progress)
    except ValueError as e:
        print(f"simulate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_table(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
