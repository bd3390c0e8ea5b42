"""Requests in, rows out: the Engine's request table, admission and per-shard planning.

``Scheduler`` owns every request the engine has seen (``requests``), the arrival
queue (``waiting``) and the requests placed on a shard (``running``). Each step it

1. admits waiting requests in arrival order, placing each on a shard whose
   BlockPool can reserve its whole footprint (a prefix-cache hit reuses cached
   blocks; ``blocks``);
2. plans every shard's rows (``ShardPlan``): every generating request as one
   decode row (its last token, plus up to ``next_n - 1`` draft tokens to verify)
   and up to ``max_prefill_requests`` prompt chunks.

Placement (several shards). A request whose prompt has cached prefix blocks goes
to the shard holding the longest such prefix (ties: lower shard id) and waits for
that shard if it does not fit there now. Any other request goes to the least
loaded shard on which it fits now, where the load of a shard is the pair
(running requests, blocks held by them), compared in that order (running requests
set the step's rows, which every shard pays for); ties go to the lower shard id.
``max_running_requests`` and ``max_prefill_requests`` are per shard.

Planning reads token counts only, except a decode row's input token: when it is
the output of the latest dispatched step (asynchronous scheduling), the row names
that token's flat row in the step's next-token array (``dec_src``) instead.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .requests import ABORTED, FAILED, FINISHED, RUNNING, WAITING, Request, check_cache_salt, token_ids
from .step_metadata import RowSpec, StepShape


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
class ShardPlan:
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

    @property
    def requests(self) -> list:
        return self.decode + self.prefill


EMPTY_PLAN = ShardPlan([], [], [], [], [])


def common_shape(shapes) -> StepShape:
    """The smallest step shape holding every shard's rows: the field-wise maximum
    (all fields are powers of two or fixed per engine, so this is a bucket too)."""
    shapes = list(shapes)
    return StepShape(**{f.name: max(getattr(s, f.name) for s in shapes) for f in dataclasses.fields(StepShape)})


class Scheduler:
    """The request table, admission with placement, and each step's rows per shard."""

    def __init__(self, block_pools, *, vocab_size: int, max_running_requests: int, max_prefill_requests: int,
                 prefill_chunk_tokens: int, next_n: int, chunk_policy=None, draft_fn=None):
        self.block_pools = block_pools
        self.num_shards = len(block_pools)
        self.vocab_size = vocab_size
        self.max_running_requests = max_running_requests
        self.max_prefill_requests = max_prefill_requests
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.next_n = next_n
        self.chunk_policy = chunk_policy
        self.draft_fn = draft_fn
        self.requests: dict = {}
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self._arrivals = 0

    # ---- the request table ---------------------------------------------------------
    def add(self, request_id, prompt_tokens, max_new_tokens: int, cache_salt: str | None = None) -> Request:
        """Queue a request. ValueError (and no state change) for an unhashable or duplicate
        id, a prompt that is not a non-empty sequence of int token ids in the vocabulary
        (a str, floats and bools are refused, not converted), max_new_tokens < 1, a
        cache_salt that is not None or a non-empty UTF-8-encodable str, or a request
        that could never fit in a shard's block pool: whatever a step would fail on is
        refused here, so one bad request cannot block the ones behind it."""
        try:
            duplicate = request_id in self.requests
        except TypeError:
            raise ValueError(f"request id {request_id!r} is not hashable") from None
        if duplicate:
            raise ValueError(f"duplicate request id {request_id!r}")
        what = f"request {request_id!r}"
        prompt = token_ids(prompt_tokens, self.vocab_size, f"{what}: prompt_tokens")
        if not prompt:
            raise ValueError(f"{what}: empty prompt")
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, (bool, np.bool_)) \
                or max_new_tokens < 1:
            raise ValueError(f"{what}: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        check_cache_salt(cache_salt, what)
        try:
            self.block_pools[0].check_fits(len(prompt) + max_new_tokens)
        except ValueError as e:
            raise ValueError(f"{what}: prompt of {len(prompt)} tokens + {max_new_tokens} "
                             f"new tokens can never fit: {e}") from None
        req = Request(request_id, prompt, max_new_tokens, cache_salt, self._arrivals)
        self._arrivals += 1
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def get(self, request_id) -> Request:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r}") from None

    def abort(self, request_id) -> None:
        req = self.get(request_id)
        if req.status == RUNNING:
            self.running.remove(req)
            self.block_pools[req.shard].release(request_id)   # a step in flight wrote them before any reuse
            req.pending.clear()                               # its in-flight tokens are dropped
            req.status = ABORTED
        elif req.status == WAITING:
            self.waiting.remove(req)
            req.status = ABORTED

    def fail(self, req: Request, error: str) -> None:
        """A running request whose results of a dispatched step are lost: it ends with
        status FAILED and `error`, its committed tokens kept, its blocks released (a
        step in flight writes them before any reuse)."""
        if req.status != RUNNING:
            return
        self.running.remove(req)
        self.block_pools[req.shard].release(req.request_id)
        req.pending.clear()
        req.num_computed_tokens = req.num_committed_tokens
        req.status, req.error = FAILED, error

    def finish(self, req: Request) -> None:
        """A running request that generated all its tokens: its blocks go back."""
        self.running.remove(req)
        self.block_pools[req.shard].release(req.request_id)
        req.status = FINISHED

    def num_running(self, shard: int | None = None) -> int:
        """Running requests (on one shard, or on all)."""
        return sum(1 for r in self.running if shard is None or r.shard == shard)

    # ---- placement -----------------------------------------------------------------
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

    def admit(self) -> None:
        """Admit waiting requests in arrival order, first come first served PER SHARD: a
        request that cannot be placed blocks the shards it could go to (its prefix
        owner, or every shard it tried) for the requests behind it, but not the others,
        so one request waiting for a busy shard does not hold back the rest."""
        blocked, admitted = set(), []
        for req in self.waiting:
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
            req.num_cached_tokens = req.num_computed_tokens = req.num_committed_tokens = placed.num_cached_tokens
            self.running.append(req)
        if admitted:
            done = {id(r) for r in admitted}
            self.waiting = collections.deque(r for r in self.waiting if id(r) not in done)

    # ---- planning --------------------------------------------------------------------
    def _chunk(self, req) -> int:
        start = req.num_computed_tokens
        remaining = len(req.prompt) - start
        cap = min(remaining, self.prefill_chunk_tokens)
        if self.chunk_policy is None:
            return cap
        n = self.chunk_policy(req.request_id, start, remaining, self.prefill_chunk_tokens)
        if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)) or not 1 <= n <= cap:
            raise ValueError(f"chunk_policy returned {n!r} for request {req.request_id!r}; "
                             f"expected an int in [1, {cap}]")
        return int(n)

    def _drafts(self, req) -> list:
        k = min(self.next_n - 1, req.max_new_tokens - len(req.output) - 1)
        if k <= 0:
            return []
        fn = self.draft_fn
        d = prompt_lookup_drafts(req.tokens, k) if fn is None else fn(req.request_id, list(req.tokens), k)
        return token_ids(list(d)[:k], self.vocab_size, f"draft_fn for request {req.request_id!r}")

    def plan_shard(self, shard: int, latest_step: int) -> ShardPlan:
        """The decode and prefill rows of one shard for the step after `latest_step`
        (the latest dispatched step's number)."""
        pool = self.block_pools[shard]
        decode, prefill = [], []
        for req in self.running:
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
                assert step == latest_step and not drafts, "the latest step's token, no drafts"
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
        return ShardPlan(decode, prefill, dec_rows, dec_drafts, pre_rows, dec_src)

    def plan(self, latest_step: int) -> list:
        """Every shard's ShardPlan for the next step."""
        return [self.plan_shard(s, latest_step) for s in range(self.num_shards)]
