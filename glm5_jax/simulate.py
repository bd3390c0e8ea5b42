"""The cached-prompt corruption probe of docs/semantics.md 6.1, as a program.

``python -m glm5_jax simulate [--json] [--inject-fault dense-tail-stride] [--device gpu] [--devices N]``

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
1 otherwise.

``--devices N`` serves the workload N times over on N devices (weak scaling): the
engine holds one cache shard and one BlockPool per device, N system prompts are
added together (the least-loaded placement puts prompt s on shard s), N times the
fillers churn through the shards, and every round re-hits every prompt (the re-hit
goes to the shard that caches it) next to its control. The report gives the probe,
tokens/s (tokens the device processed / run time without compiling steps) and
evictions per device, and their totals. ``--inject-fault dense-tail-stride`` serves with the historical bug
(docs/semantics.md B1: tail writes with the dense block stride), which the probe catches.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import sys
import time

from .config import IndexerConfig
from .layout import FAULTS


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of one probe run (``preset("cpu")`` / ``preset("gpu")``); the request counts
    and limits are per device shard, ``devices`` shards serve ``devices`` times the requests."""
    model_config: object                   # glm5_jax.model.decoder.ModelConfig
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
    devices: int = 1                       # device shards; everything above is per device
    async_scheduling: int = 0              # Engine(async_scheduling=...): steps kept in flight while planning

    def __post_init__(self):
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {FAULTS}")
        topk = self.model_config.indexer.topk
        if self.prompt_tokens <= topk:
            raise ValueError(f"prompt_tokens ({self.prompt_tokens}) must exceed topk ({topk}) so the "
                             f"sparse selection path is exercised")
        if self.prompt_tokens < self.model_config.indexer.block_size:
            raise ValueError("the prompt must fill at least one block to be prefix cached")
        for name in ("devices", "fillers", "rounds", "concurrency", "filler_min_tokens", "filler_max_new_tokens",
                     "prompt_max_new_tokens", "prefill_chunk_tokens", "max_prefill_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.filler_max_tokens < self.filler_min_tokens:
            raise ValueError("filler_max_tokens must be >= filler_min_tokens")


def preset(device: str = "cpu", **overrides) -> Workload:
    from .model.decoder import ModelConfig
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


def prompt_id(s: int) -> str:
    """Request id of system prompt s (one per device shard)."""
    return f"prompt{s}"


def rehit_id(r: int, s: int) -> str:
    return f"rehit{r}.{s}"


def control_id(r: int, s: int) -> str:
    return f"control{r}.{s}"


def _drive(eng, w: Workload, prompts, fillers, news, on_step):
    """The workload's request sequence on an engine. Returns, per round, per prompt,
    (shard, prompt blocks) the re-hit reused (None if it was not admitted at once)."""
    bs = eng.config.block_size
    for s, prompt in enumerate(prompts):               # added together: one per shard (least loaded)
        eng.add_request(prompt_id(s), prompt, w.prompt_max_new_tokens)
    eng.run(on_step=on_step)
    hits = []
    for r, items in enumerate(_split_rounds(list(range(len(fillers))), w.rounds)):
        for i in items:
            eng.add_request(f"filler{i}", fillers[i], news[i])
        eng.run(on_step=on_step)
        for s, prompt in enumerate(prompts):
            eng.add_request(rehit_id(r, s), prompt, w.prompt_max_new_tokens)
            eng.add_request(control_id(r, s), prompt, w.prompt_max_new_tokens, cache_salt=f"control-{r}")
        eng.step()
        row = []
        for s, prompt in enumerate(prompts):
            rh = eng.get_output(rehit_id(r, s))
            row.append((rh.shard, eng.request_blocks(rehit_id(r, s))[0][:len(prompt) // bs])
                       if rh.status == "running" and rh.num_cached_tokens else None)
        hits.append(row)
        on_step(eng)
        eng.run(on_step=on_step)
    return hits


def workload_mesh(w: Workload):
    """A ``data`` mesh over the first ``w.devices`` devices (ValueError if jax sees fewer)."""
    import jax

    from .serving import sharding
    devs = jax.devices()
    if w.devices > len(devs):
        raise ValueError(f"{w.devices} devices requested but jax sees {len(devs)} {jax.default_backend()} "
                         f"device(s) (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={w.devices})")
    return sharding.data_mesh(devs[:w.devices])


def engine_for(w: Workload, model, num_blocks: int, mesh, *, dry_run: bool = False):
    """The Engine the probe runs: the workload's limits and bucket minimums on `mesh`;
    it records selections and snapshots of the re-hits and controls only (the
    probe compares those; a whole-cache host copy per finished filler would cost
    more than the step on a GPU-sized cache)."""
    from .layout import with_fault
    from .serving.engine import Engine
    from .serving.step_metadata import BucketMins, bucket
    bs = w.model_config.indexer.block_size
    mins = BucketMins()
    if w.pin_buckets:
        longest = max(w.prompt_tokens + w.prompt_max_new_tokens, w.filler_max_tokens + w.filler_max_new_tokens)
        mins = BucketMins(decode_rows=bucket(w.concurrency), prefill_rows=bucket(w.max_prefill_requests),
                          prefill_width_tokens=bucket(w.prefill_chunk_tokens),
                          table_blocks=bucket(_blocks(longest, bs)))
    compared = (lambda rid: str(rid).startswith(("rehit", "control"))) if not dry_run else False
    return Engine(model, num_blocks, mesh=mesh, max_running_requests=w.concurrency,
                  max_prefill_requests=w.max_prefill_requests, prefill_chunk_tokens=w.prefill_chunk_tokens,
                  bucket_mins=mins, implementation=w.implementation,
                  layout=with_fault(model.config.layout(num_blocks), w.fault), record=compared,
                  snapshot_on_finish=compared, dry_run=dry_run, async_scheduling=w.async_scheduling)


def draw_requests(w: Workload):
    """(system prompts [devices], filler prompts [devices * fillers], filler max_new_tokens)
    of a workload, from its seed (one device draws exactly what it always drew)."""
    import numpy as np
    cfg = w.model_config
    rng = np.random.default_rng(w.seed)
    n_fill = w.devices * w.fillers

    def prompt():
        return [int(t) for t in rng.integers(0, cfg.vocab_size, w.prompt_tokens)]
    first = prompt()
    lengths = [int(x) for x in rng.integers(w.filler_min_tokens, w.filler_max_tokens + 1, n_fill)]
    news = [int(x) for x in rng.integers(1, w.filler_max_new_tokens + 1, n_fill)]
    fillers = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in lengths]
    return [first] + [prompt() for _ in range(w.devices - 1)], fillers, news


def dry_run(w: Workload, num_blocks: int, model=None, mesh=None) -> dict:
    """The workload's scheduling, placement and block allocation without the model.

    Block allocation and placement do not depend on the generated token values
    (fillers are random, so they never hit each other's blocks), so this predicts
    the real run's allocations. Returns evictions (all shards) and whether every
    re-hit reused its prompt's original blocks on the prompt's shard in every round.
    """
    from .model.decoder import Decoder
    model = model if model is not None else Decoder.random(w.model_config, seed=w.seed)
    prompts, fillers, news = draw_requests(w)
    bs = w.model_config.indexer.block_size
    eng = engine_for(w, model, num_blocks, workload_mesh(w) if mesh is None else mesh, dry_run=True)
    first = {}

    def on_step(e):
        for s, p in enumerate(prompts):
            out = None if s in first else e.get_output(prompt_id(s))
            if out is not None and out.num_computed_tokens >= len(p):
                first[s] = (out.shard, e.request_blocks(prompt_id(s))[0][:len(p) // bs])
    hits = _drive(eng, w, prompts, fillers, news, on_step)
    resident = len(first) == len(prompts) and all(
        h is not None and h[0] == first[s][0] and list(h[1]) == list(first[s][1])
        for row in hits for s, h in enumerate(row))
    return dict(evictions=eng.stats()["evictions"], prompt_resident=resident, steps=eng.steps)


def plan_num_blocks(w: Workload, model=None, mesh=None) -> int:
    """The smallest pool per shard (most evictions) with which every prompt stays
    cached in every round: a binary search with dry runs below the conservative
    ``auto_num_blocks``."""
    prompts, fillers, news = draw_requests(w)
    bs = w.model_config.indexer.block_size
    mesh = workload_mesh(w) if mesh is None else mesh
    hi = auto_num_blocks(w, [len(f) for f in fillers], news)
    need = max([w.prompt_tokens + w.prompt_max_new_tokens] + [len(f) + m for f, m in zip(fillers, news)])
    lo = min(hi, _blocks(need, bs) + 2)                           # the largest request must fit alone
    while lo < hi:
        mid = (lo + hi) // 2
        if dry_run(w, mid, model, mesh)["prompt_resident"]:
            hi = mid
        else:
            lo = mid + 1
    return hi


class _WatchedBytes:
    """The watched byte ranges of one shard's cache, gathered and compared with their
    first contents on that device: only two counts come to the host per read, not
    the bytes."""

    def __init__(self, eng, shard: int, ranges_bytes, page_bytes: int):
        import jax
        import numpy as np
        from pallas_kernels.core.addressing import byte_span_words, view_row_col

        from .serving import sharding
        words = np.concatenate([np.arange(*byte_span_words(a, e)) for a, e in ranges_bytes])
        device = next(iter(sharding.device_shard(eng.cache, shard).devices()))
        self.shard = shard
        rows, cols = view_row_col(words)                                                      # [n] each
        self.rows, self.cols = jax.device_put((rows.astype(np.int32), cols.astype(np.int32)), device)
        self._page_bytes = page_bytes
        self._pending = collections.deque()          # started reads, oldest first
        self.snapshot = _jitted()[0](sharding.device_shard(eng.cache, shard), self.rows, self.cols)  # [n] u32
        self.start(eng)                      # compiles the compare now (setup), not in a later step
        self.finish()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self, eng):
        """Compare the watched bytes as they are now (after step ``eng.steps``) with the
        snapshot, on the device, and start copying the two counts to the host; the
        call does not wait (`finish` does)."""
        from .serving import sharding
        counts = _jitted()[1](sharding.device_shard(eng.cache, self.shard), self.rows, self.cols,
                              self.snapshot, page_bytes=self._page_bytes)
        counts.copy_to_host_async()
        self._pending.append((counts, eng.steps))

    def finish(self) -> tuple:
        """(bytes changed, pages changed, the step they were read after) of the oldest
        `start` not yet finished."""
        import numpy as np
        counts, step = self._pending.popleft()
        out = np.asarray(counts)
        return int(out[0]), int(out[1]), step


@functools.cache
def _jitted():
    """(gather, compare), jitted once per process: every probe (and shard) of the same
    size shares one compilation."""
    import jax

    from .serving import sharding
    return sharding.gather_view_words, jax.jit(_changed_counts, static_argnames=("page_bytes",))


def _changed_counts(cache, rows, cols, snapshot, *, page_bytes: int):
    """[2] i32: bytes of cache[rows, cols] (u32 words of the [rows, 1024] view) that differ
    from `snapshot`, and pages of page_bytes with any such byte."""
    import jax.numpy as jnp

    from pallas_kernels.core.strides import VIEW_COLS, WORD_BYTES
    x = cache.reshape(-1, VIEW_COLS)[rows, cols] ^ snapshot                               # [n] u32
    diff = jnp.stack([(x >> (8 * i)) & 0xFF for i in range(WORD_BYTES)], axis=-1) != 0   # [n, 4] bytes
    pages = jnp.any(diff.reshape(-1, page_bytes), axis=1)
    return jnp.stack([jnp.sum(diff.astype(jnp.int32)), jnp.sum(pages.astype(jnp.int32))])


def _shard_summary(d, probes, rounds, st_shard, run_s) -> dict:
    """Probe result, tokens and evictions of shard d."""
    mine = [pr for pr in probes if pr.shard == d]
    rr = [x for x in rounds if x["shard_of_prompt"] == d]
    processed = st_shard["prefill_tokens"] + st_shard["decode_tokens"]
    changed = [pr.first_change_step for pr in mine if pr.first_change_step is not None]
    out = dict(
        shard=d, prompts=[pr.prompt for pr in mine],
        watched_blocks=[b for pr in mine for b in pr.blocks],
        watched_bytes=sum(e - a for pr in mine for a, e in pr.watched),
        bytes_changed=sum(pr.max_changed for pr in mine), pages_changed=sum(pr.changed_pages for pr in mine),
        first_change_step=min(changed) if changed else None,
        evicted_after_step=min([pr.evicted_after_step for pr in mine if pr.evicted_after_step is not None],
                               default=None),
        rehits_equal_control=all(x["outputs_equal"] and x["selected_equal"] for x in rr),
        rehit_pools_equal_control=all(x["pools_equal"] for x in rr),
        prompt_stayed_cached=bool(rr) and all(x["prompt_resident"] for x in rr),
        requests=st_shard["admitted"], processed_tokens=processed,
        generated_tokens=st_shard["generated_tokens"], tokens_per_s=processed / run_s,
        generated_tokens_per_s=st_shard["generated_tokens"] / run_s,
        evictions=st_shard["evictions"], prefix_hit_tokens=st_shard["hit_tokens"])
    out["ok"] = (out["bytes_changed"] == 0 and out["rehits_equal_control"] and out["rehit_pools_equal_control"]
                 and out["prompt_stayed_cached"] and out["watched_bytes"] > 0)
    return out


@dataclasses.dataclass
class PromptProbe:
    """The watch on one system prompt's cached blocks: from the end of its prefill,
    after every engine step, while the blocks still hold the prompt's cached content
    (after an eviction the pool may hand a block to another request, whose writes
    are legitimate: the watch then stops and says when)."""
    prompt: int                                  # which system prompt (one per shard)
    shard: int | None = None
    blocks: list = dataclasses.field(default_factory=list)     # its full blocks, watched
    hashes: list = dataclasses.field(default_factory=list)     # their prefix-cache hashes
    watched: list = dataclasses.field(default_factory=list)    # byte ranges, every layer
    reader: _WatchedBytes | None = None
    max_changed: int = 0
    changed_pages: int = 0
    first_change_step: int | None = None
    evicted_after_step: int | None = None

    def begin(self, eng, prompt_tokens) -> None:
        """Start watching the prompt's full blocks as its prefill left them."""
        from .serving.blocks import chain_hashes
        lay, bs = eng.layout, eng.config.block_size
        self.shard = eng.request_shard(prompt_id(self.prompt))
        self.blocks = eng.request_blocks(prompt_id(self.prompt))[0][:len(prompt_tokens) // bs]
        self.hashes = list(chain_hashes(prompt_tokens, bs, None, len(self.blocks)))
        self.watched = [lay.block_byte_range(layer, b) for layer in range(lay.num_layers) for b in self.blocks]
        self.reader = _WatchedBytes(eng, self.shard, self.watched, eng.config.page_bytes)

    def still_cached(self, eng) -> bool:
        pool = eng.block_pools[self.shard]
        return all(pool.cached_block_of(h) == b for h, b in zip(self.hashes, self.blocks))

    def settle(self, keep: int = 0) -> None:
        """Take in the reads started after earlier steps, all but the newest `keep`."""
        while self.reader is not None and self.reader.pending > keep:
            changed, pages, step = self.reader.finish()
            if changed and self.first_change_step is None:
                self.first_change_step = step
            self.max_changed = max(self.max_changed, changed)
            self.changed_pages = max(self.changed_pages, pages)

    def after_step(self, eng) -> None:
        """Start the read of the watched bytes as this step left them (or stop watching
        blocks the step evicted)."""
        if self.evicted_after_step is not None:
            return
        if not self.still_cached(eng):
            self.evicted_after_step = eng.steps
            return
        self.reader.start(eng)


class CorruptionProbe:
    """The probe of every system prompt, run after every engine step (``on_step``).

    The reads started after the previous step ran on the devices while this step was
    dispatched: taking them in costs no wait. Then every shard's read of the cache as
    this step left it starts, to be taken in after the next step. With N steps in
    flight the host has waited only for the step N calls back: the newest N - 1
    reads stay pending (taking them in would wait for the devices)."""

    def __init__(self, prompts, bar: _Progress):
        self.prompts = prompts
        self.probes = [PromptProbe(s) for s in range(len(prompts))]
        self.bar = bar
        self.seconds = 0.0           # in on_step, setup included
        self.setup_seconds = 0.0     # one-time setup (compiles, snapshots): not serving time

    def on_step(self, eng) -> None:
        t = time.perf_counter()
        for s, pr in enumerate(self.probes):
            pr.settle(keep=max(eng.async_scheduling - 1, 0))
            if pr.reader is None:
                out = eng.get_output(prompt_id(s))
                if out.num_computed_tokens >= len(self.prompts[s]) and out.status == "running":
                    t_setup = time.perf_counter()
                    pr.begin(eng, self.prompts[s])
                    self.setup_seconds += time.perf_counter() - t_setup
            else:
                pr.after_step(eng)
        self.bar.update(eng.num_finished(), f"step {eng.steps}, {sum(p.evictions for p in eng.block_pools)} "
                                            f"evictions")
        self.seconds += time.perf_counter() - t

    def finish(self) -> None:
        """Take in the reads started after the last step."""
        for pr in self.probes:
            pr.settle()


def _compare_rounds(eng, w: Workload, probes, hits, n_fillers: int) -> list:
    """Per round and prompt: the re-hit against its salted control (outputs, selected
    tokens, pool bytes) and whether the re-hit reused the prompt's blocks."""
    import numpy as np
    rounds = []
    for r, items in enumerate(_split_rounds(list(range(n_fillers)), w.rounds)):
        for s, pr in enumerate(probes):
            rh, ct = eng.get_output(rehit_id(r, s)), eng.get_output(control_id(r, s))
            common = sorted(set(rh.selected_tokens) & set(ct.selected_tokens))
            sel_equal = bool(common) and all(
                np.array_equal(_sorted_rows(rh.selected_tokens[p]), _sorted_rows(ct.selected_tokens[p]))
                for p in common)
            pools_equal = all(np.array_equal(la["pool_keys"], lb["pool_keys"])
                              and np.array_equal(la["pool_scales"], lb["pool_scales"])
                              for la, lb in zip(rh.snapshot["layers"], ct.snapshot["layers"]))
            rounds.append(dict(
                round=r, prompt=s, shard_of_prompt=pr.shard, rehit_shard=rh.shard, control_shard=ct.shard,
                fillers=len(items), rehit_cached_tokens=rh.num_cached_tokens,
                control_cached_tokens=ct.num_cached_tokens,
                prompt_resident=hits[r][s] is not None and hits[r][s][0] == pr.shard
                and list(hits[r][s][1]) == list(pr.blocks),
                outputs_equal=rh.output_tokens == ct.output_tokens,
                selected_equal=sel_equal, selected_rows_compared=len(common), pools_equal=pools_equal))
    return rounds


def _report(w: Workload, eng, probe: CorruptionProbe, rounds, num_blocks: int, n_fillers: int,
            wall: float) -> dict:
    """The report dict of a finished run (see ``format_table``)."""
    idx = w.model_config.indexer
    st = eng.stats()
    # serving time: without the steps that compiled and without the probe's one-time
    # setup (compiling its gather and compare programs per device, the snapshot)
    run_s = max(wall - st["compile_step_seconds"] - probe.setup_seconds, 1e-9)
    shards = [_shard_summary(d, probe.probes, rounds, st["shards"][d], run_s) for d in range(eng.num_shards)]
    processed = st["prefill_tokens"] + st["decode_tokens"]
    changed = [s["first_change_step"] for s in shards if s["first_change_step"] is not None]
    report = dict(
        device=_backend(), devices=eng.num_shards, implementation=eng.implementation or "each op's default",
        fault=w.fault,
        async_scheduling=eng.async_scheduling,
        seed=w.seed, layers=eng.layout.num_layers, num_blocks=num_blocks, block_size_tokens=idx.block_size,
        kpool=idx.kpool, topk_tokens=idx.topk, prompt_tokens=w.prompt_tokens,
        watched_blocks=[b for s in shards for b in s["watched_blocks"]],
        watched_bytes=sum(s["watched_bytes"] for s in shards),
        bytes_changed=sum(s["bytes_changed"] for s in shards), pages_changed=sum(s["pages_changed"] for s in shards),
        first_change_step=min(changed) if changed else None,
        evicted_after_step=min([s["evicted_after_step"] for s in shards if s["evicted_after_step"] is not None],
                               default=None),
        rounds=rounds, fillers=n_fillers,
        concurrency=w.concurrency, steps=st["steps"], compilations=st["compilations"],
        shapes=st["shapes"], evictions=st["evictions"], prefix_hit_tokens=st["hit_tokens"],
        processed_tokens=processed, generated_tokens=st["generated_tokens"], wall_s=wall,
        compile_step_s=st["compile_step_seconds"], probe_setup_s=probe.setup_seconds,
        tokens_per_s=processed / run_s, generated_tokens_per_s=st["generated_tokens"] / run_s, shards=shards,
        phase_seconds=dict(st["phase_seconds"], probe=probe.seconds - probe.setup_seconds))
    for key in ("rehits_equal_control", "rehit_pools_equal_control", "prompt_stayed_cached", "ok"):
        report[key] = all(s[key] for s in shards)
    return report


def run_workload(w: Workload, *, progress: bool = False, mesh=None) -> dict:
    """Run the probe on ``w.devices`` devices (or on ``mesh``); returns the report
    dict (see ``format_table``): totals at the top level, one entry per device
    shard in ``shards``."""
    from .model.decoder import Decoder

    mesh = workload_mesh(w) if mesh is None else mesh
    model = Decoder.random(w.model_config, seed=w.seed)
    prompts, fillers, news = draw_requests(w)
    num_blocks = w.num_blocks or plan_num_blocks(w, model, mesh)
    eng = engine_for(w, model, num_blocks, mesh)
    bar = _Progress(len(prompts) * (1 + 2 * w.rounds) + len(fillers), enabled=progress)
    probe = CorruptionProbe(prompts, bar)
    if progress:
        print(f"simulate: {num_blocks} blocks per device planned, {eng.num_shards} device(s); the first step "
              f"compiles the whole model (tens of seconds on CPU) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    hits = _drive(eng, w, prompts, fillers, news, probe.on_step)
    probe.finish()
    wall = time.perf_counter() - t0
    bar.close()
    rounds = _compare_rounds(eng, w, probe.probes, hits, len(fillers))
    return _report(w, eng, probe, rounds, num_blocks, len(fillers), wall)


def _backend() -> str:
    import jax
    return jax.default_backend()


def format_table(rep: dict) -> str:
    yes = lambda b: "yes" if b else "NO"                                          # noqa: E731
    lines = [
        f"kpool cache probe (docs/semantics.md 6.1): {rep['device']} x {rep['devices']}, implementation "
        f"{rep['implementation']}, fault {rep['fault'] or 'none'}, seed {rep['seed']}"
        + (f", asynchronous scheduling ({rep['async_scheduling']} step(s) in flight)"
           if rep.get("async_scheduling") else ""),
        f"  {rep['layers']} layers x {rep['num_blocks']} blocks of {rep['block_size_tokens']} tokens per device, "
        f"kpool {rep['kpool']}, topk {rep['topk_tokens']} tokens; {rep['devices']} prompt(s) of "
        f"{rep['prompt_tokens']} tokens, {rep['fillers']} fillers, concurrency {rep['concurrency']} per device",
        "",
        f"  {'round':>5} {'prompt':>6} {'shard':>5} {'fillers':>7} {'hit tokens':>10} {'resident':>8} "
        f"{'outputs':>7} {'selected':>8} {'pools':>5}",
    ]
    for r in rep["rounds"]:
        lines.append(f"  {r['round']:>5} {r['prompt']:>6} {str(r['rehit_shard']):>5} {r['fillers']:>7} "
                     f"{r['rehit_cached_tokens']:>10} {yes(r['prompt_resident']):>8} {yes(r['outputs_equal']):>7} "
                     f"{yes(r['selected_equal']):>8} {yes(r['pools_equal']):>5}")
    lines += ["", f"  {'device':>6} {'requests':>8} {'tokens':>9} {'tokens/s':>10} {'gen/s':>8} "
                  f"{'evictions':>9} {'watched B':>10} {'changed B':>9} {'resident':>8} {'re-hits':>7} {'probe':>5}"]
    for s in rep["shards"] + [dict(rep, shard="total", requests=sum(x["requests"] for x in rep["shards"]))]:
        lines.append(f"  {s['shard']:>6} {s['requests']:>8} {s['processed_tokens']:>9,} {s['tokens_per_s']:>10.1f} "
                     f"{s['generated_tokens_per_s']:>8.1f} {s['evictions']:>9} {s['watched_bytes']:>10,} "
                     f"{s['bytes_changed']:>9,} {yes(s['prompt_stayed_cached']):>8} "
                     f"{yes(s['rehits_equal_control'] and s['rehit_pools_equal_control']):>7} "
                     f"{'PASS' if s['ok'] else 'FAIL':>5}")
    lines += [
        "",
        f"  watched: blocks {rep['watched_blocks']} ({rep['watched_bytes']:,} B of indexer pages, all layers)",
        f"  bytes changed since first written: {rep['bytes_changed']:,} in {rep['pages_changed']} page(s)"
        + (f" (first at step {rep['first_change_step']})" if rep["first_change_step"] is not None else "")
        + ("   <-- CORRUPTION" if rep["bytes_changed"] else ""),
        f"  re-hits equal the cache_salt control (outputs + selected tokens): {yes(rep['rehits_equal_control'])}",
        f"  re-hit pools equal the control's recomputed pools: {yes(rep['rehit_pools_equal_control'])}",
        f"  prompt stayed cached through every round: {yes(rep['prompt_stayed_cached'])}"
        + (f" (evicted after step {rep['evicted_after_step']}: watched until then)"
           if rep["evicted_after_step"] is not None else ""),
        f"  {rep['processed_tokens']:,} tokens processed, {rep['generated_tokens']:,} generated in "
        f"{rep['wall_s']:.1f} s ({rep['compile_step_s']:.1f} s of it in compiling steps, "
        f"{rep['probe_setup_s']:.1f} s in the probe's setup): "
        f"{rep['tokens_per_s']:.1f} tokens/s, {rep['generated_tokens_per_s']:.1f} generated/s excluding both",
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
        description="Serve the workload of docs/semantics.md 6.1 (cached system prompt, churn of fillers with evictions, "
                    "re-hits vs cache_salt controls) and report whether the cached prompt's indexer "
                    "pages changed; with --devices N, N times over on N devices (one cache shard and "
                    "one cached prompt each), reported per device. Exit code 0 = every check passed, "
                    "1 = a check failed.")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="size preset: cpu (small, default) or gpu (GLM sizes: topk 2048, blocks of 1152)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--inject-fault", choices=FAULTS, default=None,
                   help="serve with a historical bug (dense-tail-stride = docs/semantics.md B1) to see the probe catch it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fillers", type=_pos_int, default=None, help="filler requests per device")
    p.add_argument("--rounds", type=_pos_int, default=None, help="re-hit rounds")
    p.add_argument("--concurrency", type=_pos_int, default=None, help="requests running at once per device")
    p.add_argument("--prompt-tokens", type=_pos_int, default=None, help="system prompt length")
    p.add_argument("--num-blocks", type=_pos_int, default=None,
                   help="block ids per device (default: sized to evict)")
    p.add_argument("--devices", type=_pos_int, default=1,
                   help="devices, one cache shard each; the workload is per device (weak scaling, default 1)")
    p.add_argument("--implementation", choices=("xla", "pallas"), default=None,
                   help="default: each op's own (on a GPU the Pallas kernels, the Triton tensor-core "
                        "path for prefill selection where jax_triton is installed; xla elsewhere)")
    p.add_argument("--async-scheduling", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2),
                   help="plan and dispatch each step before waiting for the previous one's tokens "
                        "(Engine(async_scheduling=N): N steps in flight, 1 without a value)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    over = {k: v for k, v in dict(fillers=args.fillers, rounds=args.rounds, concurrency=args.concurrency,
                                   prompt_tokens=args.prompt_tokens, num_blocks=args.num_blocks,
                                   devices=args.devices, async_scheduling=args.async_scheduling or None).items()
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
