"""The Engine's counters: steps, compilations, step shapes, tokens per shard and where
the host's time went, phase by phase.

Phases of ``Engine.step``, in order (``STEP_PHASES``); ``phase_seconds`` sums each
over the steps that did not compile. plan: admission and per-shard row planning;
batch: the step's metadata arrays built and put on the devices; dispatch: the
jitted step call until it returns (asynchronous); fetch_selected: the recorded
requests' selected tokens gathered on the devices and their host copies started
(queued behind the step, not waited for); device_wait: until the next tokens reach
the host (with asynchronous scheduling: the tokens of the oldest step in flight,
while the new step is queued behind it); commit: results applied to requests and
block pools.
"""
from __future__ import annotations

import dataclasses
import time

STEP_PHASES = ("plan", "batch", "dispatch", "fetch_selected", "device_wait", "commit")


@dataclasses.dataclass
class ShardCounters:
    """Tokens one shard processed and generated."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0


class PhaseClock:
    """Host seconds between marks, by phase, within one step."""

    def __init__(self):
        self.last = time.perf_counter()
        self.seconds: dict = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self.last
        self.last = now


@dataclasses.dataclass
class EngineStats:
    """What one engine counted: steps dispatched, compilations its steps caused, the
    step shapes seen, wall time (all steps, and the steps that compiled), the phase
    split of the steps that did not compile, and per-shard token counters."""
    num_shards: int
    steps: int = 0
    compilations: int = 0
    shapes_seen: set = dataclasses.field(default_factory=set)
    step_seconds: float = 0.0
    compile_step_seconds: float = 0.0
    phase_seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    shards: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.shards:
            self.shards = [ShardCounters() for _ in range(self.num_shards)]

    def total(self, name: str) -> int:
        return sum(getattr(c, name) for c in self.shards)

    def add_step_time(self, seconds: float, compiled: bool, phases: dict) -> None:
        """Account one step() call: its wall time, and its phases unless it compiled."""
        self.step_seconds += seconds
        if compiled:
            self.compile_step_seconds += seconds
        else:
            for phase, sec in phases.items():
                self.phase_seconds[phase] += sec

    def tokens_per_s(self, tokens: int) -> float:
        """tokens / seconds spent in steps that did not compile (0 before any such step)."""
        run_s = self.step_seconds - self.compile_step_seconds
        return tokens / run_s if run_s > 0 else 0.0

    def shard_report(self, shard: int, pool, load: tuple) -> dict:
        """Tokens (processed = prompt + decode rows; tokens_per_s over the non-compiling
        steps' time), requests and block-pool counters of one shard."""
        count = self.shards[shard]
        running, held = load
        return dict(shard=shard, **dataclasses.asdict(count),
                    tokens_per_s=self.tokens_per_s(count.prefill_tokens + count.decode_tokens),
                    running_requests=running, held_blocks=held, admitted=pool.admitted,
                    **{k: v for k, v in pool.stats().items() if k in
                       ("evictions", "hit_tokens", "cached_blocks", "free_blocks")})

    def report(self, shard_reports: list, requests) -> dict:
        """Totals over all shards, and ``shards``: the shard reports."""
        reqs = list(requests)
        processed = self.total("prefill_tokens") + self.total("decode_tokens")
        return dict(steps=self.steps, compilations=self.compilations, shapes=len(self.shapes_seen),
                    prefill_tokens=self.total("prefill_tokens"), decode_tokens=self.total("decode_tokens"),
                    generated_tokens=self.total("generated_tokens"), step_seconds=self.step_seconds,
                    compile_step_seconds=self.compile_step_seconds,
                    phase_seconds=dict(self.phase_seconds), tokens_per_s=self.tokens_per_s(processed),
                    proposed_drafts=sum(r.proposed_drafts for r in reqs),
                    accepted_drafts=sum(r.accepted_drafts for r in reqs),
                    **{k: sum(s[k] for s in shard_reports) for k in
                       ("evictions", "hit_tokens", "cached_blocks", "free_blocks")},
                    num_shards=self.num_shards, shards=shard_reports)
