"""Serving loop: continuous batching over the tiny decoder and the kpool indexer cache.

``Engine`` owns one flat cache per device (``CacheLayout`` of the model:
attention + indexer regions of every layer), held as ONE array
``uint32[num_shards, total_words]`` sharded over the ``data`` axis of a
``jax.sharding.Mesh`` (default: a one-device mesh), one ``BlockPool`` (with its
prefix cache) per shard, and a scheduler. Each ``step()``:

1. admits waiting requests in arrival order, placing each on a shard (below)
   whose pool can reserve its whole footprint (a prefix-cache hit reuses cached
   blocks; see ``blocks``);
2. schedules, on every shard, every generating request as one decode row (its
   last token, plus up to ``next_n - 1`` draft tokens to verify) and up to
   ``max_prefill_requests`` prompt chunks;
3. builds each shard's static-shape step arrays (``step_metadata``; one common
   bucketed shape for all shards), stacks them on a leading device axis and runs
   ONE jit-compiled step for all devices (all layers: indexer writes, selection,
   sparse attention, LM head, each device on its own shard under ``shard_map``)
   with the cache donated, then reads back the greedy next token of every row;
4. commits: appends sampled / accepted tokens, registers newly full blocks in
   the prefix cache, releases finished requests.

Placement (several shards). A request whose prompt has cached prefix blocks goes
to the shard holding the longest such prefix (ties: lower shard id) and waits for
that shard if it does not fit there now. Any other request goes to the least
loaded shard on which it fits now, where the load of a shard is the pair
(running requests, blocks held by them), compared in that order (running requests
set the step's rows, which every shard pays for); ties go to the lower shard id.
``max_running_requests`` and ``max_prefill_requests`` are per shard, so D shards
serve D times the rows of one at the same step shape.

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

Speculative decoding (``next_n > 1``): a decode row is [last token, d1 .. dk];
the model's greedy prediction after each row token verifies the drafts; the
longest matching prefix is accepted plus one corrected/bonus token (the output
is exactly plain greedy decoding). Rejected drafts were stashed and may have
completed pools; the next step recomputes from the first rejected position and
overwrites them before any committed query can read them (spec 5.4). The ring
is sized for that (``IndexerConfig.num_spec_tokens >= next_n - 1``).

Every step is one call of a module-level ``jax.jit`` function whose static
arguments are the model structure, layout, implementation and mesh; shapes are
bucketed, so a steady workload reuses its compiled executables. ``compilations``
counts traces (= compilations) this engine caused.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.core import addressing as addr

from .. import metadata as md
from .. import ops
from ..layout import CacheLayout, with_fault
from ..model import invariant as inv
from ..model.decoder import Decoder
from . import sharding
from .blocks import BlockPool
from .step_metadata import BucketMins, RowSpec, StepShape, bucket, build_step, choose_shape

_TRACE_COUNT = [0]
_GATHER_TRACES = [0]                         # traces of the recorded-row gather (_take_rows)


def pack_step_arrays(per_shard: list) -> tuple:
    """Every shard's step arrays (``StepArrays.as_dict()``, all int32) as ONE int32 array
    [D, total] (the fields of shard d raveled one after another, in name order) and
    the static field list ((name, shape), ...) that unpacks it. One host-to-device
    copy per device and step instead of one per field (15)."""
    names = sorted(per_shard[0])
    fields = tuple((k, tuple(per_shard[0][k].shape)) for k in names)
    for d in per_shard:
        for k, shape in fields:
            if d[k].dtype != np.int32 or tuple(d[k].shape) != shape:
                raise ValueError(f"step array {k}: every shard needs int32 {shape}, got {d[k].dtype} "
                                 f"{tuple(d[k].shape)}")
    return np.stack([np.concatenate([d[k].ravel() for k in names]) for d in per_shard]), fields


def unpack_step_arrays(flat, fields) -> dict:
    """Inverse of pack_step_arrays for one device's row: flat [total] -> {name: array}."""
    out, at = {}, 0
    for name, shape in fields:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = flat[at:at + n].reshape(shape)
        at += n
    return out


def _step_impl(state, cache, flat, prev_tok, *, fields, graphdef, layout, implementation, mesh,
               contractions, tokens_out):
    """One step on every device: cache [D, words], the packed step arrays flat [D, total]
    i32 (``pack_step_arrays``) and the previous step's next tokens prev_tok [D,
    tokens_out] i32 -> (cache, next_token [D, tokens_out] i32 (the step's T tokens,
    then zeros), selected [D, num_layers, T, W] i32).

    A decode row whose input token was not on the host when the step was planned
    (asynchronous scheduling: it is the previous step's output) names its source in
    the ``dec_token_src`` field: token = prev_tok[src] where src >= 0, so that token
    never travels through the host. ``contractions`` is ``invariant.contractions()``
    when called: static, so that changing it compiles a new step instead of reusing
    one traced under the other value."""
    _TRACE_COUNT[0] += 1                      # runs once per trace, i.e. per compilation

    def one_device(state, cache, flat, prev):  # cache [words], flat [total], prev [tokens_out]: this device's
        model = nnx.merge(graphdef, state)
        batch = unpack_step_arrays(flat, fields)
        src = batch.pop("dec_token_src")                                    # [Bd, Nd], -1 = host token
        batch["dec_token_ids"] = jnp.where(src >= 0, prev[jnp.maximum(src, 0)], batch["dec_token_ids"])
        cache, next_tok, selected = model(cache, batch, layout=layout, implementation=implementation)
        return cache, jnp.pad(next_tok, (0, tokens_out - next_tok.shape[0])), selected

    return sharding.per_shard(one_device, mesh, replicated_args=1)(state, cache, flat, prev_tok)


_step = jax.jit(_step_impl, static_argnames=("fields", "graphdef", "layout", "implementation", "mesh",
                                             "contractions", "tokens_out"),
                donate_argnames=("cache",))


def _take_rows_impl(selected, rows, *, mesh):
    """selected [D, L, T, W], rows [D, R] i32 -> [D, L, R, W]: on each device, its own rows."""
    _GATHER_TRACES[0] += 1                    # a step that compiles this is not timed as serving
    return sharding.per_shard(lambda sel, r: sel[:, r, :], mesh)(selected, rows)


_take_rows = jax.jit(_take_rows_impl, static_argnames=("mesh",))


# Phases of Engine.step, in order; Engine.phase_seconds sums each over the steps that
# did not compile. plan: admission and per-shard row planning; batch: the step's
# metadata arrays built and put on the devices; dispatch: the jitted step call until
# it returns (asynchronous); fetch_selected: the recorded requests' selected tokens
# gathered on the devices and their host copies started (queued behind the step,
# not waited for); device_wait: until the next tokens reach the host (with
# asynchronous scheduling: the tokens of the oldest step in flight, while the new
# step is queued behind it); commit: results applied to requests and block pools.
STEP_PHASES = ("plan", "batch", "dispatch", "fetch_selected", "device_wait", "commit")
RECORD_LAG_STEPS = 2       # recorded rows reach the host at most this many steps after their step
#                            (plus one per step kept in flight beyond the first: asynchronous scheduling)


def total_traces() -> int:
    """Step-function traces (compilations) in this process so far."""
    return _TRACE_COUNT[0]


WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"


@dataclasses.dataclass
class _Request:
    request_id: object
    prompt: list
    max_new_tokens: int
    cache_salt: str | None
    arrival: int
    status: str = WAITING
    output: list = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # recorded steps, in order: (first position, _Deferred rows [L, R, W], the column of
    # the first position's row (the n rows are consecutive), greedy next tokens [n]);
    # turned into dicts only when read
    records: list = dataclasses.field(default_factory=list)
    snapshot: "_Deferred | None" = None                          # request_snapshot at finish
    shard: int | None = None                                     # placed at admission
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    # tokens generated by dispatched steps whose results are not on the host yet, oldest
    # first: (the step's number, the token's flat row in that step's next_token array)
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    def recorded(self) -> tuple:
        """(selected {position: [L, W] i32}, predicted {position: token}) of the recorded steps."""
        selected, predicted = {}, {}
        for start, fetched, col0, tokens in self.records:
            rows = fetched.host()
            for j, t in enumerate(tokens):
                selected[start + j] = rows[:, col0 + j]
                predicted[start + j] = int(t)
        return selected, predicted

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt)

    @property
    def num_generated(self) -> int:
        """Output tokens on the host plus those of dispatched steps still on the devices."""
        return len(self.output) + len(self.pending)


class _Deferred:
    """A value built from a device array copied to the host in the background (started
    by the caller): ``settle()`` takes the copy in and frees the device array (the
    engine does so a few steps later, when the copy is done); ``host()`` builds the
    value on first read and keeps it."""

    def __init__(self, array, make):
        self._array, self._make, self._value = array, make, None

    def settle(self):
        if self._array is not None:
            self._array = np.asarray(self._array)

    def host(self):
        if self._make is not None:
            self.settle()
            self._value, self._make, self._array = self._make(self._array), None, None
        return self._value


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: object
    prompt_tokens: tuple
    output_tokens: tuple
    status: str
    num_cached_tokens: int          # prefix-cache hit at admission
    num_computed_tokens: int
    selected_tokens: dict           # position -> [num_layers, W] (when recording)
    predicted_tokens: dict          # position -> greedy next token (when recording)
    snapshot: dict | None           # cache bytes of the request at finish (snapshot_on_finish)
    shard: int | None = None        # the device shard it was placed on (None while waiting)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


def prompt_lookup_drafts(tokens, k: int, max_ngram: int = 3) -> list:
    """Default draft proposer: the k tokens that followed the most recent earlier
    occurrence of the last n tokens (n = max_ngram .. 1); none if no match."""
    toks = list(tokens)
    for n in range(min(max_ngram, len(toks) - 1), 0, -1):
        tail = toks[-n:]
        for s in range(len(toks) - n - 1, -1, -1):
            if toks[s:s + n] == tail:
                return toks[s + n:s + n + k]
    return []


@dataclasses.dataclass
class _ShardCounters:
    """Tokens one shard processed and generated."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0


@dataclasses.dataclass
class _ShardPlan:
    """What one shard runs in a step: its requests and their rows."""
    decode: list
    prefill: list
    dec_rows: list
    dec_drafts: list
    pre_rows: list
    dec_src: list = dataclasses.field(default_factory=list)    # per decode row: flat row of its input
    #                                  token in the previous step's next_token array, or -1 (on the host)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)


@dataclasses.dataclass
class _Launch:
    """A dispatched step whose results have not been committed."""
    plans: list                 # _ShardPlan per shard
    shape: StepShape
    next_tok: object            # [D, tokens_out] i32 on the devices (zeros on the host in a dry run)
    sel: list | None            # _fetch_selected's result


def _wants(flag, request_id) -> bool:
    """A per-request option given as a bool or a predicate request_id -> bool."""
    return bool(flag(request_id)) if callable(flag) else bool(flag)


def common_shape(shapes) -> StepShape:
    """The smallest step shape holding every shard's rows: the field-wise maximum
    (all fields are powers of two or fixed per engine, so this is a bucket too)."""
    shapes = list(shapes)
    return StepShape(**{f.name: max(getattr(s, f.name) for s in shapes) for f in dataclasses.fields(StepShape)})


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
                             f"sized for num_spec_tokens = {self.config.num_spec_tokens} (spec 3.4, bug B2)")
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
        self.implementation = ops.default_implementation() if implementation is None else implementation
        self.chunk_policy = chunk_policy
        self.draft_fn = draft_fn
        self.record = record
        self.snapshot_on_finish = snapshot_on_finish
        self.dry_run = dry_run
        self.async_scheduling = int(async_scheduling)     # steps kept in flight (0: synchronous)
        # every step returns its next tokens padded to this many per device (the most a
        # step can hold), so the array passed to the next step has one shape
        self.tokens_out = (bucket(max_running_requests, bucket_mins.decode_rows) * next_n
                           + bucket(max_prefill_requests, bucket_mins.prefill_rows)
                           * bucket(prefill_chunk_tokens, bucket_mins.prefill_width_tokens))
        self._no_prev = None                # zeros [D, tokens_out]: the previous tokens of a first step
        self._inflight: collections.deque = collections.deque()   # dispatched, not committed (async), oldest first
        self.block_pools = [BlockPool.from_layout(self.layout, shard=s) for s in range(self.num_shards)]
        self._graphdef, state = nnx.split(model)
        # weights on every device; the cache uint32[num_shards, total_words], row d on device d
        # (a dry run touches no device memory)
        self._state = None if dry_run else sharding.replicated(state, self.mesh)
        self.cache = None if dry_run else sharding.allocate(self.layout, self.mesh, 0)
        self._reqs: dict = {}
        self._waiting: collections.deque = collections.deque()
        self._running: list = []
        self._arrivals = 0
        self._counters = [_ShardCounters() for _ in range(self.num_shards)]
        self.steps = 0
        self.compilations = 0
        self.shapes_seen: set = set()
        self.step_seconds = 0.0
        self.compile_step_seconds = 0.0     # wall time of the steps that compiled
        # where the wall time of the steps that did not compile went (host seconds)
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._fetches: list = []            # (step, [_Deferred rows per shard]) not yet on the host
        self._snapshots: list = []          # (step, _Deferred) finish snapshots not yet on the host

    @property
    def block_pool(self) -> BlockPool:
        """The BlockPool of a one-shard engine (several shards: ``block_pools[shard]``)."""
        if self.num_shards != 1:
            raise ValueError(f"this engine has {self.num_shards} shards: use block_pools[shard]")
        return self.block_pools[0]

    @property
    def prefill_tokens(self) -> int:
        return sum(c.prefill_tokens for c in self._counters)

    @property
    def decode_tokens(self) -> int:
        return sum(c.decode_tokens for c in self._counters)

    @property
    def generated_tokens(self) -> int:
        return sum(c.generated_tokens for c in self._counters)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id, prompt_tokens, max_new_tokens: int, cache_salt: str | None = None):
        """Queue a request. ValueError (and no state change) for an empty prompt, token ids
        outside the vocabulary, max_new_tokens < 1, a duplicate id, or a request that
        could never fit in a shard's block pool."""
        if request_id in self._reqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        try:
            prompt = [int(t) for t in prompt_tokens]
        except (TypeError, ValueError):
            raise ValueError("prompt_tokens must be a sequence of ints") from None
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be a positive int, "
                             f"got {max_new_tokens!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"request {request_id!r}: cache_salt must be a str or None")
        try:
            self.block_pools[0].check_fits(len(prompt) + max_new_tokens)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens + {max_new_tokens} "
                             f"new tokens can never fit: {e}") from None
        req = _Request(request_id, prompt, max_new_tokens, cache_salt, self._arrivals)
        self._arrivals += 1
        self._reqs[request_id] = req
        self._waiting.append(req)

    def _get(self, request_id) -> _Request:
        try:
            return self._reqs[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r}") from None

    def abort_request(self, request_id) -> None:
        req = self._get(request_id)
        if req.status == RUNNING:
            self._running.remove(req)
            self.block_pools[req.shard].release(request_id)   # a step in flight wrote them before any reuse
            req.pending.clear()                               # its in-flight tokens are dropped
        elif req.status == WAITING:
            self._waiting.remove(req)
        req.status = ABORTED if req.status != FINISHED else req.status

    def get_output(self, request_id) -> RequestOutput:
        req = self._get(request_id)
        selected, predicted = req.recorded()
        return RequestOutput(req.request_id, tuple(req.prompt), tuple(req.output), req.status,
                             req.num_cached_tokens, req.num_computed_tokens, selected,
                             predicted, None if req.snapshot is None else req.snapshot.host(), req.shard)

    @property
    def outputs(self) -> dict:
        """{request_id: RequestOutput} of every request this engine has seen."""
        return {rid: self.get_output(rid) for rid in self._reqs}

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._inflight)

    def num_finished(self) -> int:
        return sum(1 for r in self._reqs.values() if r.status == FINISHED)

    def num_running(self, shard: int | None = None) -> int:
        """Running requests (on one shard, or on all)."""
        return sum(1 for r in self._running if shard is None or r.shard == shard)

    def request_shard(self, request_id):
        """The shard a request was placed on (None while it waits)."""
        return self._get(request_id).shard

    def request_blocks(self, request_id):
        """(index_blocks, tail_block) of a running request: block ids of its shard."""
        req = self._get(request_id)
        if req.shard is None:
            raise ValueError(f"request {request_id!r} holds no blocks (status {req.status})")
        rb = self.block_pools[req.shard].request(request_id)
        return list(rb.index_blocks), rb.tail_block

    # ---- placement and scheduling ------------------------------------------------------
    def shard_load(self, shard: int) -> tuple:
        """(running requests, blocks they hold) of a shard: placement picks the smallest."""
        pool = self.block_pools[shard]
        return self.num_running(shard), pool.usable_blocks - pool.num_free_blocks

    def _candidate_shards(self, req) -> list:
        """Shards to try for a request, best first: the holder of its longest cached
        prefix alone if any shard has one, else every shard by load then id."""
        hits = [len(pool.lookup(req.prompt, req.cache_salt)) for pool in self.block_pools]
        if max(hits) > 0:
            return [hits.index(max(hits))]
        return sorted(range(self.num_shards), key=lambda s: (self.shard_load(s), s))

    def _admit(self):
        """Admit waiting requests in arrival order, first come first served PER SHARD: a
        request that cannot be placed blocks the shards it could go to (its prefix
        owner, or every shard it tried) for the requests behind it, but not the others,
        so one request waiting for a busy shard does not hold back the rest."""
        blocked, admitted = set(), []
        for req in self._waiting:
            if len(blocked) == self.num_shards:
                break
            cands = self._candidate_shards(req)
            placed = None
            for s in cands:
                if s in blocked or self.num_running(s) >= self.max_running_requests:
                    continue
                placed = self.block_pools[s].admit(req.request_id, req.prompt,
                                                   len(req.prompt) + req.max_new_tokens, req.cache_salt)
                if placed is not None:
                    req.shard = s
                    break
            if placed is None:
                blocked.update(cands)
                continue
            admitted.append(req)
            req.status = RUNNING
            req.num_cached_tokens = req.num_computed_tokens = placed.num_cached_tokens
            self._running.append(req)
        if admitted:
            done = {id(r) for r in admitted}
            self._waiting = collections.deque(r for r in self._waiting if id(r) not in done)

    def _chunk(self, req) -> int:
        start = req.num_computed_tokens
        remaining = len(req.prompt) - start
        cap = min(remaining, self.prefill_chunk_tokens)
        if self.chunk_policy is None:
            return cap
        n = self.chunk_policy(req.request_id, start, remaining, self.prefill_chunk_tokens)
        if not isinstance(n, (int, np.integer)) or not 1 <= n <= cap:
            raise ValueError(f"chunk_policy returned {n!r} for request {req.request_id!r}; "
                             f"expected an int in [1, {cap}]")
        return int(n)

    def _drafts(self, req) -> list:
        k = min(self.next_n - 1, req.max_new_tokens - len(req.output) - 1)
        if k <= 0:
            return []
        fn = self.draft_fn
        d = prompt_lookup_drafts(req.tokens, k) if fn is None else fn(req.request_id, list(req.tokens), k)
        d = [int(t) for t in list(d)[:k]]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in d):
            raise ValueError(f"draft_fn proposed a token outside the vocabulary for {req.request_id!r}")
        return d

    def _plan(self, shard: int) -> _ShardPlan:
        """The decode and prefill rows of one shard for this step."""
        pool = self.block_pools[shard]
        decode, prefill = [], []
        for req in self._running:
            if req.shard != shard or req.num_generated >= req.max_new_tokens:
                continue                     # another shard's, or finishing in the step in flight
            if req.prefill_done:
                decode.append(req)
            elif len(prefill) < self.max_prefill_requests:
                prefill.append(req)
        dec_rows, dec_drafts, dec_src = [], [], []
        for req in decode:
            rb = pool.request(req.request_id)
            drafts = self._drafts(req)
            dec_drafts.append(drafts)
            if req.pending:                  # its last token is still on the device
                step, src = req.pending[-1]
                assert step == self.steps - 1 and not drafts, "the latest step's token, no drafts"
                last = 0
            else:
                last, src = req.tokens[-1], -1
            dec_src.append(src)
            dec_rows.append(RowSpec([last] + drafts, req.num_computed_tokens, rb.index_blocks, rb.tail_block))
        pre_rows = []
        for req in prefill:
            rb = pool.request(req.request_id)
            n = self._chunk(req)
            s = req.num_computed_tokens
            pre_rows.append(RowSpec(req.prompt[s:s + n], s, rb.index_blocks, rb.tail_block))
        return _ShardPlan(decode, prefill, dec_rows, dec_drafts, pre_rows, dec_src)

    def _batch(self, shape: StepShape, plans) -> tuple:
        """(every shard's step arrays packed into [D, total] i32 on the devices, row d on
        device d; the static field list that unpacks them). Besides build_step's arrays:
        dec_token_src [Bd, Nd], the previous step's flat row of each decode row's input
        token (-1: the token is in dec_token_ids)."""
        per_shard = []
        for p in plans:
            arrays = build_step(self.config, shape, p.dec_rows, p.pre_rows).as_dict()
            src = np.full((shape.decode_rows, shape.decode_width_tokens), -1, np.int32)
            src[:len(p.dec_src), 0] = p.dec_src
            arrays["dec_token_src"] = src
            per_shard.append(arrays)
        flat, fields = pack_step_arrays(per_shard)
        return sharding.put_per_shard(flat, self.mesh), fields

    def step(self) -> list:
        """Run one engine step on every shard. Returns the ids of requests that finished in
        it (with asynchronous scheduling: finished in the step before, whose results
        this call committed)."""
        clock = [time.perf_counter()]
        marks = {}

        def mark(phase):
            now = time.perf_counter()
            marks[phase] = now - clock[0]
            clock[0] = now

        self._admit()
        plans = [self._plan(s) for s in range(self.num_shards)]
        idle = all(p.empty for p in plans)
        if idle and not self._inflight:
            return []
        traced, gathers_before, launch = 0, _GATHER_TRACES[0], None
        if not idle:
            shape = common_shape(choose_shape(self.config, p.dec_rows, p.pre_rows, next_n=self.next_n,
                                              mins=self.bucket_mins) for p in plans)
        mark("plan")
        t0 = time.perf_counter()
        if not idle:
            before = _TRACE_COUNT[0]
            launch = self._launch(plans, shape, mark)
            traced = _TRACE_COUNT[0] - before
            self.compilations += traced
            for s, plan in enumerate(plans):
                self._advance(s, plan, shape)
            self.shapes_seen.add(shape)
            self.steps += 1
            self._inflight.append(launch)
        # commit the oldest step once more than async_scheduling are in flight (at once when
        # synchronous; every one left when nothing new was dispatched)
        done = (self._inflight.popleft() if len(self._inflight) > self.async_scheduling or launch is None
                else None)
        finished = []
        if done is not None:
            next_tok = np.asarray(done.next_tok)                              # [D, tokens_out]
            mark("device_wait")
            for s, plan in enumerate(done.plans):
                finished += self._resolve(s, plan, done.shape, next_tok[s], None if done.sel is None else done.sel[s])
            mark("commit")
        compiled = traced or _GATHER_TRACES[0] != gathers_before
        if compiled:
            self.compile_step_seconds += time.perf_counter() - t0
        self.step_seconds += time.perf_counter() - t0
        if not compiled:
            for phase, sec in marks.items():
                self.phase_seconds[phase] += sec
        return finished

    def _launch(self, plans, shape: StepShape, mark) -> _Launch:
        """Batch and dispatch one step (it runs on the devices when this returns) and
        start its recorded rows' fetch; nothing here waits for a device."""
        if self.dry_run:
            return _Launch(plans, shape, np.zeros((self.num_shards, self.tokens_out), np.int32), None)
        if shape.num_tokens > self.tokens_out:
            raise AssertionError(f"a step of {shape.num_tokens} tokens exceeds tokens_out = {self.tokens_out}")
        flat, fields = self._batch(shape, plans)
        mark("batch")
        if self._inflight:                   # the latest dispatched step's tokens
            prev = self._inflight[-1].next_tok
        else:
            if self._no_prev is None:
                self._no_prev = sharding.put_per_shard(np.zeros((self.num_shards, self.tokens_out), np.int32),
                                                       self.mesh)
            prev = self._no_prev
        self.cache, next_tok, selected = _step(self._state, self.cache, flat, prev, fields=fields,
                                               graphdef=self._graphdef, layout=self.layout,
                                               implementation=self.implementation,
                                               mesh=self.mesh, contractions=inv.contractions(),
                                               tokens_out=self.tokens_out)
        mark("dispatch")
        next_tok.copy_to_host_async()
        # the recorded rows' gather is queued behind the step before the host waits
        # for anything: its host side (row lists, the index array) overlaps the device
        sel = self._fetch_selected(plans, shape, selected)
        mark("fetch_selected")
        return _Launch(plans, shape, next_tok, sel)

    def _recorded_rows(self, plan: _ShardPlan, shape: StepShape) -> list:
        """Flat token rows of one shard's step whose selections are recorded."""
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        rows = []
        for i, (req, row) in enumerate(zip(plan.decode, plan.dec_rows)):
            if _wants(self.record, req.request_id):
                rows += range(i * nd, i * nd + len(row.token_ids))
        for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
            if _wants(self.record, req.request_id):
                rows += range(base + j * np_, base + j * np_ + len(row.token_ids))
        return rows

    def _fetch_selected(self, plans, shape: StepShape, selected):
        """Per shard, (_Deferred selections [L, R, W] of its recorded rows, {flat row:
        column}), or None when no request of the step is recorded. Only those rows
        leave the devices (gathered there first: the whole [D, L, T, W] array is ~34
        MB per device for a 2,064-token step and W = 2,051), and the step does not
        wait for them: the copy runs in the background and is read when a request's
        output is (``get_output``), or after RECORD_LAG_STEPS steps at the latest (with
        two steps in flight one more: the step two back may still be running)."""
        self._settle_fetches(RECORD_LAG_STEPS + max(self.async_scheduling - 1, 0))
        rows = [self._recorded_rows(p, shape) for p in plans]
        if not any(rows):
            return None
        width = bucket(max(len(r) for r in rows), 8)            # few shapes: few compilations
        idx = np.zeros((self.num_shards, width), np.int32)
        for d, r in enumerate(rows):
            idx[d, :len(r)] = r
        got = _take_rows(selected, sharding.put_per_shard(idx, self.mesh), mesh=self.mesh)
        got.copy_to_host_async()                     # every shard's copy starts now, side by side
        fetched = [_Deferred(got, operator.itemgetter(d)) for d in range(self.num_shards)]
        self._fetches.append((self.steps, fetched))
        return [(f, {row: c for c, row in enumerate(r)}) for f, r in zip(fetched, rows)]

    def _settle_fetches(self, lag: int):
        """Bring recorded rows and finish snapshots fetched `lag` or more steps ago to the
        host (their copies are done by then) and free their device buffers."""
        while self._fetches and self.steps - self._fetches[0][0] >= lag:
            for f in self._fetches.pop(0)[1]:
                f.settle()
        while self._snapshots and self.steps - self._snapshots[0][0] >= lag:
            self._snapshots.pop(0)[1].settle()

    def _advance(self, shard: int, plan: _ShardPlan, shape: StepShape):
        """What a dispatched step does to its requests that needs no token value: token
        counts, and the flat row of each token it generates (``_Request.pending``).
        Decode rows that verify drafts (next_n > 1) advance in ``_resolve``: how many
        tokens they accept is known only from the results."""
        count = self._counters[shard]
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        if self.next_n == 1:
            for i, req in enumerate(plan.decode):
                req.num_computed_tokens += 1
                req.pending.append((self.steps, i * nd))
                count.decode_tokens += 1
        for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
            n = len(row.token_ids)
            req.num_computed_tokens += n
            count.prefill_tokens += n
            if req.num_computed_tokens == len(req.prompt):             # its first output token
                req.pending.append((self.steps, base + j * np_ + n - 1))

    def _resolve(self, shard: int, plan: _ShardPlan, shape: StepShape, next_tok, sel) -> list:
        """Apply one shard's results of a step (next_tok [tokens_out]; sel: (selections
        [L, R, W] of the recorded rows, {flat row: column}) or None): output tokens,
        recorded rows, newly full blocks into the prefix cache, finished requests
        released. Returns their ids. Requests aborted since the dispatch are skipped."""
        pool, count = self.block_pools[shard], self._counters[shard]
        finished, through = [], []
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        for i, (req, row, drafts) in enumerate(zip(plan.decode, plan.dec_rows, plan.dec_drafts)):
            if req.status != RUNNING:
                continue
            if self.next_n == 1:
                _, flat = req.pending.popleft()
                assert flat == i * nd
                accepted = next_tok[flat:flat + 1]
            else:
                preds = next_tok[i * nd:i * nd + len(row.token_ids)]
                a = 0
                while a < len(drafts) and drafts[a] == preds[a]:
                    a += 1
                accepted = preds[:a + 1]
                req.num_computed_tokens += a + 1
                req.proposed_drafts += len(drafts)
                req.accepted_drafts += a
                count.decode_tokens += len(row.token_ids)
            self._record(req, row.start_pos, i * nd, len(accepted), next_tok, sel)
            req.output.extend(int(t) for t in accepted)
            count.generated_tokens += len(accepted)
            through.append((req, row.start_pos + len(accepted)))
        for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
            if req.status != RUNNING:
                continue
            n = len(row.token_ids)
            self._record(req, row.start_pos, base + j * np_, n, next_tok, sel)
            if row.start_pos + n == len(req.prompt):
                req.output.append(int(next_tok[req.pending.popleft()[1]]))
                count.generated_tokens += 1
            through.append((req, row.start_pos + n))
        for req, computed in through:
            pool.commit(req.request_id, req.tokens, computed)
            if len(req.output) >= req.max_new_tokens:
                del req.output[req.max_new_tokens:]
                if _wants(self.snapshot_on_finish, req.request_id) and not self.dry_run:
                    req.snapshot = self._snapshot_later(req)      # no wait for the steps in flight
                self._running.remove(req)
                pool.release(req.request_id)
                req.status = FINISHED
                finished.append(req.request_id)
        return finished

    def _record(self, req, start_pos, flat0, n, next_tok, sel):
        if sel is None or not _wants(self.record, req.request_id):
            return
        fetched, col = sel              # a request's recorded rows are consecutive (_recorded_rows)
        req.records.append((start_pos, fetched, col[flat0], np.array(next_tok[flat0:flat0 + n])))

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
        empty = _ShardPlan([], [], [], [], [])
        flat, fields = self._batch(shape, [empty] * self.num_shards)
        prev = sharding.put_per_shard(np.zeros((self.num_shards, self.tokens_out), np.int32), self.mesh)
        return _step.lower(self._state, self._live_cache(), flat, prev, fields=fields, graphdef=self._graphdef,
                           layout=self.layout, implementation=self.implementation,
                           mesh=self.mesh, contractions=inv.contractions(), tokens_out=self.tokens_out)

    def _block_words(self, blocks) -> np.ndarray:
        """Word addresses of `blocks` in a shard's cache: indexer pages with their tail
        ring and attention K/V, every layer."""
        lay = self.layout
        byte_spans = [span for layer in range(lay.num_layers) for b in blocks
                      for span in (lay.block_byte_range(layer, b), lay.attn_block_byte_range(layer, b))]
        return np.concatenate([np.arange(*addr.byte_span_words(a, e)) for a, e in byte_spans if e > a])

    def _image(self, words, values) -> np.ndarray:
        """uint32[total_words] host image of a shard's cache: `values` at `words`, zeros
        elsewhere (untouched pages stay unallocated)."""
        image = np.zeros(self.layout.total_words, np.uint32)
        image[words] = values
        return image

    def _blocks_image(self, shard: int, blocks) -> np.ndarray:
        """The host image of one shard's cache that holds the bytes of `blocks` and
        zeros elsewhere: only those words leave the device, not the whole cache
        (gigabytes on a GPU-sized layout)."""
        words = self._block_words(blocks)
        return self._image(words, sharding.host_words(self._live_cache(), shard, words))

    def cache_bytes(self, shard: int = 0) -> np.ndarray:
        """A host copy of one shard's flat cache as bytes (read from that device only)."""
        return sharding.host_shard(self._live_cache(), shard).view(np.uint8)

    def _live_cache(self):
        if self.cache is None:
            raise ValueError("a dry-run engine has no cache")
        return self.cache

    def scribble_free_blocks(self, rng) -> int:
        """Fill every free block that holds nothing cached (every shard, all layers:
        indexer pages, tail ring, attention K/V) with random bytes, so any read of
        bytes that were never written in a request's lifetime shows up as a
        difference. Returns the number of blocks scribbled. (Testing aid: a correct
        engine never reads them.)"""
        lay, rows, total = self.layout, [], 0
        for shard, pool in enumerate(self.block_pools):
            blocks = [b for b in pool.free_order() if not pool.is_cached(b)]
            raw = self.cache_bytes(shard).copy()
            for layer in range(lay.num_layers):
                for b in blocks:
                    for a, e in (lay.block_byte_range(layer, b), lay.attn_block_byte_range(layer, b)):
                        raw[a:e] = rng.integers(0, 256, e - a, dtype=np.uint8)
            rows.append(raw.view(np.uint32))
            total += len(blocks)
        self.cache = sharding.put_per_shard(np.stack(rows), self.mesh)
        return total

    def request_snapshot(self, request_id) -> dict:
        """The cache bytes a running request owns (on its shard), per layer, by
        request-relative position: ``pool_keys`` [n_pools, 128] u8 and ``pool_scales``
        [n_pools] u32 of its complete pools, ``tail`` {position: (K row, gate row) u16}
        of its last kpool computed tokens, ``attn_k`` / ``attn_v`` [n_tokens,
        kv_row_bytes] u8 of its computed tokens."""
        req = self._get(request_id)
        blocks, decode = self._snapshot_parts(req)
        return decode(self._blocks_image(req.shard, blocks))

    def _snapshot_later(self, req) -> "_Deferred":
        """request_snapshot of a request as the queued steps leave it, without waiting
        for them: its words are gathered on the device now (behind those steps, before
        any later step can reuse its blocks) and reach the host in the background; the
        dict is built when read (get_output)."""
        blocks, decode = self._snapshot_parts(req)
        words = self._block_words(blocks)
        got = sharding.device_words(self._live_cache(), req.shard, words)
        got.copy_to_host_async()
        snap = _Deferred(got, lambda values: decode(self._image(words, values)))
        self._snapshots.append((self.steps - 1, snap))          # behind the latest dispatched step
        return snap

    def _snapshot_parts(self, req) -> tuple:
        """(the blocks a snapshot of req reads, image [total_words] u32 -> the snapshot dict)."""
        index_blocks, tail_block = self.request_blocks(req.request_id)
        return sorted(set(index_blocks) | {tail_block}), functools.partial(
            self._decode_snapshot, req.num_computed_tokens, list(index_blocks), tail_block, req.shard)

    def _decode_snapshot(self, num_computed_tokens, index_blocks, tail_block, shard, cache) -> dict:
        """request_snapshot's dict from a host image of the shard's cache."""
        c, lay, nc = self.config, self.layout, num_computed_tokens
        pages = md.page_table_pages(np.asarray([index_blocks]), c)
        n_pools = nc // c.kpool
        pool_pos = np.arange(n_pools) * c.kpool + c.kpool - 1
        slots = md.compressed_slot_mapping(pool_pos, np.zeros(n_pools, np.int64), pages, c)
        pos = np.arange(nc)
        blocks = np.asarray(index_blocks)[pos // c.block_size]
        out = []
        for layer in range(lay.num_layers):
            keys, scales = lay.pool_keys(cache, layer)
            tk, tg = lay.tail_ring(cache, layer)
            ak, av = lay.attn_kv(cache, layer, self.model.config.kv_row_bytes)
            tail = {int(p): (tk[tail_block, p % c.ring].view(np.uint16).copy(),
                             tg[tail_block, p % c.ring].view(np.uint16).copy())
                    for p in range(max(0, nc - c.kpool), nc)}
            out.append(dict(pool_keys=keys.view(np.uint8)[slots].copy(),
                            pool_scales=scales.view(np.uint32)[slots].copy(), tail=tail,
                            attn_k=ak[blocks, pos % c.block_size].copy(),
                            attn_v=av[blocks, pos % c.block_size].copy()))
        return dict(num_computed_tokens=nc, index_blocks=list(index_blocks), tail_block=tail_block,
                    shard=shard, layers=out)

    def _tokens_per_s(self, tokens: int) -> float:
        """tokens / seconds spent in steps that did not compile (0 before any such step)."""
        run_s = self.step_seconds - self.compile_step_seconds
        return tokens / run_s if run_s > 0 else 0.0

    def shard_stats(self, shard: int) -> dict:
        """Tokens (processed = prompt + decode rows; tokens_per_s over the non-compiling
        steps' time), requests and block-pool counters of one shard."""
        pool, count = self.block_pools[shard], self._counters[shard]
        running, held = self.shard_load(shard)
        return dict(shard=shard, **dataclasses.asdict(count),
                    tokens_per_s=self._tokens_per_s(count.prefill_tokens + count.decode_tokens),
                    running_requests=running, held_blocks=held, admitted=pool.admitted,
                    **{k: v for k, v in pool.stats().items() if k in
                       ("evictions", "hit_tokens", "cached_blocks", "free_blocks")})

    def stats(self) -> dict:
        """Totals over all shards, and ``shards``: one ``shard_stats`` dict per shard."""
        reqs = list(self._reqs.values())
        shards = [self.shard_stats(s) for s in range(self.num_shards)]
        return dict(steps=self.steps, compilations=self.compilations, shapes=len(self.shapes_seen),
                    prefill_tokens=self.prefill_tokens, decode_tokens=self.decode_tokens,
                    generated_tokens=self.generated_tokens, step_seconds=self.step_seconds,
                    compile_step_seconds=self.compile_step_seconds,
                    phase_seconds=dict(self.phase_seconds),
                    tokens_per_s=self._tokens_per_s(self.prefill_tokens + self.decode_tokens),
                    proposed_drafts=sum(r.proposed_drafts for r in reqs),
                    accepted_drafts=sum(r.accepted_drafts for r in reqs),
                    **{k: sum(s[k] for s in shards) for k in
                       ("evictions", "hit_tokens", "cached_blocks", "free_blocks")},
                    num_shards=self.num_shards, shards=shards)
