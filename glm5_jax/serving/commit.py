"""What a step does to its requests: at dispatch the token counts (``advance``), once
its tokens are on the host the results (``commit``): output tokens, accepted
drafts, recorded rows, newly full blocks into the prefix cache, finished requests
released.

Speculative decoding (``next_n > 1``): a decode row is [last token, d1 .. dk]; the
model's greedy prediction after each row token verifies the drafts; the longest
matching prefix is accepted plus one corrected/bonus token (the output is exactly
plain greedy decoding). Rejected drafts were stashed and may have completed pools;
the next step recomputes from the first rejected position and overwrites them
before any committed query can read them (spec 5.4). The ring is sized for that
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

    def commit(self, launch, next_tok, cache, latest_step: int) -> list:
        """Apply a step's results (next_tok [D, tokens_out] on the host). `cache`: where a
        finish snapshot is gathered (None: none is); `latest_step`: the latest dispatched
        step. Returns the ids of the requests that finished."""
        finished = []
        for shard, plan in enumerate(launch.plans):
            sel = None if launch.sel is None else launch.sel[shard]
            finished += self._commit_shard(shard, plan, launch.shape, next_tok[shard], sel, cache, latest_step)
        return finished

    def _commit_shard(self, shard, plan, shape, next_tok, sel, cache, latest_step) -> list:
        """One shard's results of a step (next_tok [tokens_out]; sel: (selections [L, R, W]
        of the recorded rows, {flat row: column}) or None). Requests aborted since the
        dispatch are skipped."""
        pool, count = self.block_pools[shard], self.stats.shards[shard]
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
            self.recorder.record_rows(req, row.start_pos, i * nd, len(accepted), next_tok, sel)
            req.output.extend(int(t) for t in accepted)
            count.generated_tokens += len(accepted)
            through.append((req, row.start_pos + len(accepted)))
        for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
            if req.status != RUNNING:
                continue
            n = len(row.token_ids)
            self.recorder.record_rows(req, row.start_pos, base + j * np_, n, next_tok, sel)
            if row.start_pos + n == len(req.prompt):
                req.output.append(int(next_tok[req.pending.popleft()[1]]))
                count.generated_tokens += 1
            through.append((req, row.start_pos + n))
        for req, computed in through:
            pool.commit(req.request_id, req.tokens, computed)
            if len(req.output) >= req.max_new_tokens:
                del req.output[req.max_new_tokens:]
                self.recorder.maybe_snapshot_later(req, cache, latest_step)   # no wait for the steps in flight
                self.scheduler.finish(req)
                finished.append(req.request_id)
        return finished
