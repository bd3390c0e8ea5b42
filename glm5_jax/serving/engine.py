"""Serving loop: continuous batching over the tiny decoder and the kpool indexer cache.

``Engine`` owns one flat cache per device (``CacheLayout`` of the model:
attention + indexer regions of every layer), held as ONE array
``uint32[num_shards, total_words]`` sharded over the ``data`` axis of a
``jax.sharding.Mesh`` (default: a one-device mesh), one ``BlockPool`` (with its
prefix cache) per shard, and composes the parts that serve them. Each ``step()``:

1. plan (``admission``): admits waiting requests in arrival order, placing each
   on a shard whose pool can reserve its whole footprint, and plans every shard's
   decode rows and prompt chunks;
2. batch (``step_builder``): builds each shard's static-shape step arrays (one
   common bucketed shape for all shards) and packs them into one array per device;
3. dispatch (``dispatch``): runs ONE jit-compiled step for all devices (all layers:
   indexer writes, selection, sparse attention, LM head, each device on its own
   shard under ``shard_map``) with the cache donated, and starts the recorded
   rows' gather (``recording``);
4. commit (``commit``): once the step's tokens are on the host, appends sampled /
   accepted tokens, registers newly full blocks in the prefix cache, releases
   finished requests.

Chunked prefill may cut a prompt at ANY token. Policy for a chunk starting
mid-pool: its first ``(-start) % kpool`` tokens (the head) go through
``decode_update``, which completes the straddling pool reading its earlier
members from the tail ring (seeded or stashed by the previous chunk); the
pool-aligned rest goes through ``compress_prefill`` + ``seed_tail``. The ring
always holds the members of the incomplete pool, so every pool is written
exactly once with the same bytes as an unchunked prefill.

Prefix hits land on block boundaries (hence pool boundaries); the recomputed
suffix (at least one token, starting at the hit) re-seeds the request's fresh
tail ring, so no raw K/gate has to be cached.

``compilations`` counts traces (= compilations) of the jitted step this engine
caused (``dispatch``: the step is shared by every engine of the process).

Failures (``docs/engine_failures.md``): what a step would fail on is refused by
``add_request`` and the constructor; an exception inside a step leaves the engine
consistent and reaches the caller as ``EngineStepError``, after which the engine
serves on. No request ever gets a token that a clean run would not have produced:
a request whose results of a dispatched step are lost ends with status "failed".
"""
from __future__ import annotations

import time

import numpy as np

from ..layout import CacheLayout, with_fault
from ..model.decoder import Decoder
from . import sharding
from .admission import EMPTY_PLAN, Scheduler, common_shape, prompt_lookup_drafts
from .blocks import BlockPool
from .commit import Committer
from .dispatch import TRACES, Dispatcher, Launch, _step, fetch_tokens, total_traces
from .failures import IMPLEMENTATIONS, EngineStepError, check_arguments, fail_launch
from .recording import RECORD_LAG_STEPS, Recorder, scribble_free_blocks
from .requests import ABORTED, FAILED, FINISHED, RUNNING, WAITING, RequestOutput, output_of
from .stats import STEP_PHASES, EngineStats, PhaseClock
from .step_builder import pack_step_arrays, shard_step_arrays, unpack_step_arrays
from .step_metadata import BucketMins, StepShape, bucket, choose_shape

__all__ = ["Engine", "EngineStepError", "IMPLEMENTATIONS", "RequestOutput", "WAITING", "RUNNING", "FINISHED",
           "ABORTED", "FAILED", "STEP_PHASES", "RECORD_LAG_STEPS", "prompt_lookup_drafts", "common_shape",
           "pack_step_arrays", "unpack_step_arrays", "total_traces"]


def _delegated(part: str, name: str, doc: str) -> property:
    """An Engine attribute that lives on one of its parts (readable and settable)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


def _stat(name: str) -> property:
    return property(lambda self: getattr(self._stats, name), doc=f"EngineStats.{name}")


class Engine:
    """Continuous-batching engine for ``Decoder`` over one flat cache and one BlockPool
    per device shard.

    The model's parameters are captured (``nnx.split``) at construction and
    replicated on every device of ``mesh`` (a ``jax.sharding.Mesh`` with a ``data``
    axis; default: the first device alone). ``num_blocks`` is per shard. Knobs:
    ``max_running_requests`` (decode rows per shard), ``max_prefill_requests`` and
    ``prefill_chunk_tokens`` (prefill rows per shard and their width), ``next_n`` (1
    + draft tokens verified per decode row), ``bucket_mins`` (raise to pin shapes),
    ``chunk_policy(request_id, start_token, remaining_tokens, max_tokens) -> int``
    (cut prompts anywhere), ``draft_fn(request_id, tokens, k) -> list`` (default:
    prompt lookup), ``record`` (keep each position's selected tokens and greedy
    prediction; they reach the host in the background, within RECORD_LAG_STEPS
    steps, and ``get_output`` returns them), ``snapshot_on_finish`` (keep a request's cache bytes at finish;
    both take a bool or a predicate ``request_id -> bool``), ``layout`` (the cache
    layout: default ``model.config.layout(num_blocks)``; the corruption probe passes
    ``glm5_jax.layout.with_fault`` of it), ``dry_run`` (schedule and allocate blocks only: no
    model, no cache, every prediction 0), ``async_scheduling`` (below).

    Asynchronous scheduling (``async_scheduling=True`` or a number of steps kept in
    flight, True = 1; next_n = 1 only: drafts need token values). ``step()`` plans
    and dispatches step i+1 BEFORE it waits for step i's tokens (with 2: for step
    i-1's, so the next step is already queued when a device finishes one), so the
    host's work (planning, step arrays, committing step i) runs while the devices
    compute step i+1 instead of between steps. Nothing the
    plan needs depends on a token value (positions, slots and blocks follow from
    token counts, requests finish by count), except a decode row's input token:
    the step reads it on the device from step i's next-token array. The results are
    the same tokens and cache bytes as the synchronous engine (tested); what
    changes: a step's tokens reach ``get_output`` one ``step()`` call later per step
    in flight, ``num_computed_tokens`` counts the dispatched tokens, full blocks enter the
    prefix cache and finished requests free their blocks as many calls later (an
    admission may wait longer), and ``run`` ends with nothing in flight.
    """

    def __init__(self, model: Decoder, num_blocks: int, *, mesh=None, max_running_requests: int = 8,
                 max_prefill_requests: int = 2, prefill_chunk_tokens: int = 128, next_n: int = 1,
                 bucket_mins: BucketMins = BucketMins(), implementation=None, layout=None,
                 chunk_policy=None, draft_fn=None, record=False, snapshot_on_finish=False,
                 dry_run: bool = False, async_scheduling: bool | int = False):
        check_arguments(model, implementation=implementation, bucket_mins=bucket_mins, chunk_policy=chunk_policy,
                        draft_fn=draft_fn, record=record, snapshot_on_finish=snapshot_on_finish, dry_run=dry_run)
        cfg = model.config
        self.model = model
        self.layout: CacheLayout = cfg.layout(num_blocks)
        if layout is not None:
            if not isinstance(layout, CacheLayout) or with_fault(layout, None) != self.layout:
                raise ValueError(f"layout must be the model's layout of {num_blocks} blocks "
                                 f"(model.config.layout(num_blocks), or with_fault of it), got {layout!r}")
            self.layout = layout
        self.config = cfg.indexer
        for name, v in (("max_running_requests", max_running_requests),
                        ("max_prefill_requests", max_prefill_requests),
                        ("prefill_chunk_tokens", prefill_chunk_tokens), ("next_n", next_n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if next_n - 1 > self.config.num_spec_tokens:
            raise ValueError(f"next_n = {next_n} verifies {next_n - 1} draft tokens but the tail ring is "
                             f"sized for num_spec_tokens = {self.config.num_spec_tokens} (docs/semantics.md 3.4, B2)")
        if not isinstance(async_scheduling, int) or not 0 <= async_scheduling <= 2:
            raise ValueError(f"async_scheduling must be a bool or 0, 1, 2 steps in flight, got {async_scheduling!r}")
        if async_scheduling and next_n != 1:
            raise ValueError(f"async_scheduling needs next_n = 1: verifying drafts needs the previous "
                             f"step's tokens on the host (got next_n = {next_n})")
        self.mesh = sharding.single_device_mesh() if mesh is None else mesh
        self.num_shards = sharding.check_mesh(self.mesh)
        self.max_running_requests = max_running_requests
        self.max_prefill_requests = max_prefill_requests
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.next_n = next_n
        self.bucket_mins = bucket_mins
        self.implementation = implementation          # None: each op's default (Indexer.__call__)
        self.dry_run = dry_run
        self.async_scheduling = int(async_scheduling)     # steps kept in flight (0: synchronous)
        # every step returns its next tokens padded to this many per device (the most a
        # step can hold), so the array passed to the next step has one shape
        self.tokens_out = (bucket(max_running_requests, bucket_mins.decode_rows) * next_n
                           + bucket(max_prefill_requests, bucket_mins.prefill_rows)
                           * bucket(prefill_chunk_tokens, bucket_mins.prefill_width_tokens))
        self.block_pools = [BlockPool.from_layout(self.layout, shard=s) for s in range(self.num_shards)]
        # the cache uint32[num_shards, total_words], row d on device d (a dry run has none)
        self.cache = None if dry_run else sharding.allocate(self.layout, self.mesh, 0)
        self._stats = EngineStats(self.num_shards)
        self._scheduler = Scheduler(self.block_pools, vocab_size=cfg.vocab_size,
                                    max_running_requests=max_running_requests,
                                    max_prefill_requests=max_prefill_requests,
                                    prefill_chunk_tokens=prefill_chunk_tokens, next_n=next_n,
                                    chunk_policy=chunk_policy, draft_fn=draft_fn)
        self._dispatcher = Dispatcher(model, self.mesh, self.layout, self.implementation, self.tokens_out,
                                      dry_run=dry_run)
        self._recorder = Recorder(self.layout, cfg.kv_row_bytes, self.block_pools, self.mesh, record=record,
                                  snapshot_on_finish=snapshot_on_finish, async_scheduling=self.async_scheduling)
        self._committer = Committer(self._scheduler, self._recorder, self._stats, next_n)

    record = _delegated("_recorder", "record", "Which requests' selections are recorded (bool or predicate).")
    snapshot_on_finish = _delegated("_recorder", "snapshot_on_finish",
                                    "Which requests keep their cache bytes at finish (bool or predicate).")
    chunk_policy = _delegated("_scheduler", "chunk_policy", "Where prompts are cut (None: full chunks).")
    draft_fn = _delegated("_scheduler", "draft_fn", "The draft proposer (None: prompt lookup).")
    steps = _stat("steps")
    compilations = _stat("compilations")
    shapes_seen = _stat("shapes_seen")
    step_seconds = _stat("step_seconds")
    compile_step_seconds = _stat("compile_step_seconds")        # wall time of the steps that compiled
    phase_seconds = _stat("phase_seconds")      # where the time of the steps that did not compile went

    @property
    def block_pool(self) -> BlockPool:
        """The BlockPool of a one-shard engine (several shards: ``block_pools[shard]``)."""
        if self.num_shards != 1:
            raise ValueError(f"this engine has {self.num_shards} shards: use block_pools[shard]")
        return self.block_pools[0]

    @property
    def prefill_tokens(self) -> int:
        return self._stats.total("prefill_tokens")

    @property
    def decode_tokens(self) -> int:
        return self._stats.total("decode_tokens")

    @property
    def generated_tokens(self) -> int:
        return self._stats.total("generated_tokens")

    # internal views (tests and benchmarks read them)
    _reqs = property(lambda self: self._scheduler.requests)
    _inflight = property(lambda self: self._dispatcher.inflight)
    _fetches = property(lambda self: self._recorder.fetches)
    _graphdef = property(lambda self: self._dispatcher.graphdef)
    _state = property(lambda self: self._dispatcher.state)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id, prompt_tokens, max_new_tokens: int, cache_salt: str | None = None):
        """Queue a request (``Scheduler.add``: ValueError and no state change for a request
        it refuses)."""
        self._scheduler.add(request_id, prompt_tokens, max_new_tokens, cache_salt)

    def abort_request(self, request_id) -> None:
        self._scheduler.abort(request_id)

    def get_output(self, request_id) -> RequestOutput:
        return output_of(self._scheduler.get(request_id))

    @property
    def outputs(self) -> dict:
        """{request_id: RequestOutput} of every request this engine has seen."""
        return {rid: self.get_output(rid) for rid in self._scheduler.requests}

    def has_unfinished(self) -> bool:
        return bool(self._scheduler.waiting or self._scheduler.running or self._dispatcher.inflight)

    def num_finished(self) -> int:
        return sum(1 for r in self._scheduler.requests.values() if r.status == FINISHED)

    def num_running(self, shard: int | None = None) -> int:
        """Running requests (on one shard, or on all)."""
        return self._scheduler.num_running(shard)

    def request_shard(self, request_id):
        """The shard a request was placed on (None while it waits)."""
        return self._scheduler.get(request_id).shard

    def request_blocks(self, request_id):
        """(index_blocks, tail_block) of a running request: block ids of its shard."""
        req = self._scheduler.get(request_id)
        if req.shard is None:
            raise ValueError(f"request {request_id!r} holds no blocks (status {req.status})")
        rb = self.block_pools[req.shard].request(request_id)
        return list(rb.index_blocks), rb.tail_block

    def shard_load(self, shard: int) -> tuple:
        """(running requests, blocks they hold) of a shard: placement picks the smallest."""
        return self._scheduler.shard_load(shard)

    # ---- stepping ----------------------------------------------------------------------
    def step(self) -> list:
        """Run one engine step on every shard. Returns the ids of requests that finished in
        it (with asynchronous scheduling: finished in the step before, whose results
        this call committed).

        An exception inside the step leaves the engine consistent and is raised as
        EngineStepError (from the original; a KeyboardInterrupt or other
        BaseException as itself): before the step reached the devices nothing
        changed (the next call plans it again); after, the requests whose results it
        lost end with status "failed" (``docs/engine_failures.md``)."""
        clock = PhaseClock()
        phase = "plan"
        try:
            self._scheduler.admit()
            plans = self._scheduler.plan(self.steps - 1)
            idle = all(p.empty for p in plans)
            if idle and not self._dispatcher.inflight:
                return []
            if not idle:
                shape = common_shape(choose_shape(self.config, p.dec_rows, p.pre_rows, next_n=self.next_n,
                                                  mins=self.bucket_mins) for p in plans)
        except Exception as e:
            raise EngineStepError(phase, self.steps, [], []) from e
        clock.mark("plan")
        t0 = time.perf_counter()
        traced, gathers_before, launch = TRACES.step, TRACES.gather, None
        try:
            if not idle:
                launch = self._launch(plans, shape, clock)
        finally:
            traced = TRACES.step - traced
            self._stats.compilations += traced
        # commit the oldest step once more than async_scheduling are in flight (at once when
        # synchronous; every one left when nothing new was dispatched)
        done = self._dispatcher.take_done(self.async_scheduling, dispatched=launch is not None)
        finished = []
        if done is not None:
            phase = "device_wait"
            try:
                next_tok = fetch_tokens(done)                                     # [D, tokens_out]
                clock.mark("device_wait")
                phase = "commit"
                finished, errors = self._committer.commit(done, next_tok, None if self.dry_run else self.cache,
                                                          self.steps - 1)
                if errors:
                    raise errors[0][1]
            except BaseException as e:         # KeyboardInterrupt too: the engine stays consistent
                failed = fail_launch(self._scheduler, done, phase, e)
                if not isinstance(e, Exception):
                    raise
                raise EngineStepError(phase, done.step, failed, finished) from e
            clock.mark("commit")
        compiled = bool(traced) or TRACES.gather != gathers_before
        self._stats.add_step_time(time.perf_counter() - t0, compiled, clock.seconds)
        return finished

    def _batch(self, shape: StepShape, plans) -> tuple:
        """(every shard's step arrays packed into [D, total] i32 on the devices, row d on
        device d; the static field list that unpacks them): ``step_builder``."""
        flat, fields = pack_step_arrays([shard_step_arrays(self.config, shape, p) for p in plans])
        return sharding.put_per_shard(flat, self.mesh), fields

    def _launch(self, plans, shape: StepShape, clock) -> Launch:
        """Batch and dispatch one step (it runs on the devices when this returns), start
        its recorded rows' fetch, advance its requests and queue it in flight; nothing
        here waits for a device."""
        step = self.steps
        if self.dry_run:
            launch = Launch(step, plans, shape, self._dispatcher.dry_tokens())
        else:
            try:
                if shape.num_tokens > self.tokens_out:
                    raise AssertionError(f"a step of {shape.num_tokens} tokens exceeds tokens_out = "
                                         f"{self.tokens_out}")
                flat, fields = self._batch(shape, plans)
            except Exception as e:
                raise EngineStepError("batch", step, [], []) from e
            clock.mark("batch")
            d, cache = self._dispatcher, self.cache
            try:
                self.cache, next_tok, selected = _step(d.state, cache, flat, d.prev_tokens(),
                                                       **d.static_args(fields))
            except BaseException as e:
                # the step consumed the donated cache (its bytes are gone) or never ran
                failed = self._lose_cache(step, e) if cache.is_deleted() else []
                if not isinstance(e, Exception):
                    raise
                raise EngineStepError("dispatch", step, failed, []) from e
            clock.mark("dispatch")
            launch = Launch(step, plans, shape, next_tok)
        phase = "fetch_selected"
        try:
            if not self.dry_run:
                launch.next_tok.copy_to_host_async()
                # the recorded rows' gather is queued behind the step before the host waits
                # for anything: its host side (row lists, the index array) overlaps the device
                launch.sel = self._recorder.fetch_selected(plans, shape, selected, step)
                clock.mark("fetch_selected")
            phase = "dispatch"
            self._committer.advance(launch)
        except BaseException as e:
            failed = fail_launch(self._scheduler, launch, phase, e)
            if not isinstance(e, Exception):
                raise
            raise EngineStepError(phase, step, failed, []) from e
        self._stats.shapes_seen.add(shape)
        self._stats.steps += 1
        self._dispatcher.inflight.append(launch)
        return launch

    def _lose_cache(self, step: int, exc: BaseException) -> list:
        """The jitted step consumed the donated cache and raised: the bytes of every
        running request and of every prefix-cache block are gone. Every running
        request fails, the steps in flight are dropped, the prefix caches are emptied
        and a fresh cache is allocated; waiting requests are served as usual. Returns
        the failed ids."""
        error = (f"dispatch of step {step} consumed the cache and raised {type(exc).__name__}: {exc}; "
                 f"the cache's bytes are lost")
        failed = [req.request_id for req in self._scheduler.running]
        for req in list(self._scheduler.running):
            self._scheduler.fail(req, error)
        self._dispatcher.inflight.clear()
        for pool in self.block_pools:
            pool.drop_cached()
        self.cache = sharding.allocate(self.layout, self.mesh, 0)
        return failed

    def run(self, max_steps: int = 100_000, on_step=None) -> dict:
        """Step until every request finished (or max_steps); returns ``outputs``."""
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            self.step()
            if on_step is not None:
                on_step(self)
        else:
            if self.has_unfinished():
                raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        return self.outputs

    # ---- inspection ----------------------------------------------------------------------
    def lower_step(self, shape: StepShape):
        """The step lowered for `shape` with padding-only metadata (``jax.stages.Lowered``),
        to inspect the compiled program (``.compile().as_text()``) without running it."""
        flat, fields = self._batch(shape, [EMPTY_PLAN] * self.num_shards)
        d = self._dispatcher
        return _step.lower(d.state, self._live_cache(), flat, d.zeros(), **d.static_args(fields))

    def _live_cache(self):
        if self.cache is None:
            raise ValueError("a dry-run engine has no cache")
        return self.cache

    def cache_bytes(self, shard: int = 0) -> np.ndarray:
        """A host copy of one shard's flat cache as bytes (read from that device only)."""
        return sharding.host_shard(self._live_cache(), shard).view(np.uint8)

    def _blocks_image(self, shard: int, blocks) -> np.ndarray:
        return self._recorder.blocks_image(self._live_cache(), shard, blocks)

    def request_snapshot(self, request_id) -> dict:
        """The cache bytes a running request owns (on its shard), per layer, by
        request-relative position: ``pool_keys`` [n_pools, 128] u8 and ``pool_scales``
        [n_pools] u32 of its complete pools, ``tail`` {position: (K row, gate row) u16}
        of its last kpool computed tokens, ``attn_k`` / ``attn_v`` [n_tokens,
        kv_row_bytes] u8 of its computed tokens."""
        req = self._scheduler.get(request_id)
        if req.shard is None:
            raise ValueError(f"request {request_id!r} holds no blocks (status {req.status})")
        blocks, decode = self._recorder.snapshot_parts(req)
        return decode(self._blocks_image(req.shard, blocks))

    def scribble_free_blocks(self, rng) -> int:
        """Fill every free block that holds nothing cached (every shard, all layers:
        indexer pages, tail ring, attention K/V) with random bytes, so any read of
        bytes that were never written in a request's lifetime shows up as a
        difference. Returns the number of blocks scribbled. (Testing aid: a correct
        engine never reads them.)"""
        rows, total = scribble_free_blocks(self.layout, self.block_pools, self.cache_bytes, rng)
        self.cache = sharding.put_per_shard(rows, self.mesh)
        return total

    def shard_stats(self, shard: int) -> dict:
        """Tokens (processed = prompt + decode rows; tokens_per_s over the non-compiling
        steps' time), requests and block-pool counters of one shard."""
        return self._stats.shard_report(shard, self.block_pools[shard], self.shard_load(shard))

    def stats(self) -> dict:
        """Totals over all shards, and ``shards``: one ``shard_stats`` dict per shard."""
        return self._stats.report([self.shard_stats(s) for s in range(self.num_shards)],
                                  self._scheduler.requests.values())
