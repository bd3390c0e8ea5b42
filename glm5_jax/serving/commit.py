"""What a step does to its requests: at dispatch the token counts (``advance``), once
its tokens are on the host the results (``commit``): output tokens, accepted
drafts, recorded rows, newly full blocks into the prefix cache, finished requests
released.

Speculative decoding (``next_n > 1``): a decode row is [last token, d1 .. dk]; the
model's greedy prediction after each row token verifies the drafts; the longest
matching prefix is accepted plus one corrected/bonus token (the output is exactly
plain greedy decoding). Rejected drafts were stashed and may have completed pools;
the next step recomputes from the first rejected position and overwrites them
before any committed query can read them (docs/semantics.md 5.4). The ring is sized for that
(``IndexerConfig.num_spec_tokens >= next_n - 1``).
"""
from __future__ import annotations

from .requests import RUNNING


class Committer:
    """Applies dispatched steps to the scheduler's requests and the shards' pools."""

    def __init__(self, scheduler, recorder, stats, next_n: int):
        self.scheduler = scheduler
        self.block_pools = scheduler.block_pools
        self.recorder = recorder
        self.stats = stats
        self.next_n = next_n

    def advance(self, launch) -> None:
        """What a dispatched step does to its requests that needs no token value: token
        counts, and the flat row of each token it generates (``Request.pending``).
        Decode rows that verify drafts (next_n > 1) advance in ``commit``: how many
        tokens they accept is known only from the results."""
        shape = launch.shape
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        for shard, plan in enumerate(launch.plans):
            count = self.stats.shards[shard]
            if self.next_n == 1:
                for i, req in enumerate(plan.decode):
                    req.num_computed_tokens += 1
                    req.pending.append((launch.step, i * nd))
                    count.decode_tokens += 1
            for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
                n = len(row.token_ids)
                req.num_computed_tokens += n
                count.prefill_tokens += n
                if req.num_computed_tokens == len(req.prompt):             # its first output token
                    req.pending.append((launch.step, base + j * np_ + n - 1))

    def commit(self, launch, next_tok, cache, latest_step: int) -> tuple:
        """Apply a step's results (next_tok [D, tokens_out] on the host), request by
        request: each one's tokens, recorded rows, prefix-cache blocks and finish are
        applied together, and its id enters ``launch.committed``. `cache`: where a
        finish snapshot is gathered (None: none is); `latest_step`: the latest
        dispatched step. Returns (ids of the requests that finished, [(request,
        exception)] of those whose commit raised: the caller fails them). Requests no
        longer running (aborted or failed since the dispatch) are skipped."""
        finished, errors = [], []
        shape = launch.shape
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        for shard, plan in enumerate(launch.plans):
            sel = None if launch.sel is None else launch.sel[shard]
            tok = next_tok[shard]
            rows = [(req, row, i * nd, drafts) for i, (req, row, drafts)
                    in enumerate(zip(plan.decode, plan.dec_rows, plan.dec_drafts))]
            rows += [(req, row, base + j * np_, None) for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows))]
            for req, row, flat0, drafts in rows:
                if req.status != RUNNING:
                    continue
                try:
                    if drafts is None:
                        self._commit_prefill(shard, req, row, flat0, tok, sel)
                    else:
                        self._commit_decode(shard, req, row, flat0, drafts, tok, sel)
                    if len(req.output) >= req.max_new_tokens:
                        del req.output[req.max_new_tokens:]
                        self.recorder.maybe_snapshot_later(req, cache, latest_step)   # no wait for the steps in flight
                        self.scheduler.finish(req)
                        finished.append(req.request_id)
                    launch.committed.add(id(req))
                except Exception as e:      # this request's results are lost; the others' are not
                    errors.append((req, e))
        return finished, errors

    def _commit_decode(self, shard, req, row, flat0, drafts, next_tok, sel) -> None:
        """A decode row's results: its token, or (verifying drafts) the accepted ones."""
        count = self.stats.shards[shard]
        if self.next_n == 1:
            step, flat = req.pending[0]
            assert flat == flat0, (step, flat, flat0)
            accepted = next_tok[flat:flat + 1]
            req.pending.popleft()
        else:
            preds = next_tok[flat0:flat0 + len(row.token_ids)]
            a = 0
            while a < len(drafts) and drafts[a] == preds[a]:
                a += 1
            accepted = preds[:a + 1]
            req.num_computed_tokens += a + 1
            req.proposed_drafts += len(drafts)
            req.accepted_drafts += a
            count.decode_tokens += len(row.token_ids)
        self.recorder.record_rows(req, row.start_pos, flat0, len(accepted), next_tok, sel)
        req.output.extend(int(t) for t in accepted)
        count.generated_tokens += len(accepted)
        self._commit_blocks(shard, req, row.start_pos + len(accepted))

    def _commit_prefill(self, shard, req, row, flat0, next_tok, sel) -> None:
        """A prompt chunk's results: its recorded rows, and after the last chunk the first output token."""
        n = len(row.token_ids)
        self.recorder.record_rows(req, row.start_pos, flat0, n, next_tok, sel)
        if row.start_pos + n == len(req.prompt):
            req.output.append(int(next_tok[req.pending[0][1]]))
            req.pending.popleft()
            self.stats.shards[shard].generated_tokens += 1
        self._commit_blocks(shard, req, row.start_pos + n)

    def _commit_blocks(self, shard, req, computed: int) -> None:
        """The request's tokens through `computed` are committed: its newly full blocks enter the prefix cache."""
        self.block_pools[shard].commit(req.request_id, req.tokens, computed)
        req.num_committed_tokens = computed
