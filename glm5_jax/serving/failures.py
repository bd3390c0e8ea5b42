"""How the Engine fails: the arguments it refuses at construction, the error a failed
step raises, and what a step whose results are lost does to its requests
(``docs/engine_failures.md``)."""
from __future__ import annotations

import numpy as np

from ..model.decoder import Decoder
from .requests import RUNNING
from .step_metadata import BucketMins

# An engine names ONE implementation for every op, one that every op has ("triton" has
# the write ops and the read path only), or None: each op's default on the backend, the
# prefill rows' selection that of prefill chunks whatever the step's grid
# (model.indexer.Indexer.__call__).
IMPLEMENTATIONS = ("xla", "pallas")


def check_arguments(model, *, implementation, bucket_mins, chunk_policy, draft_fn, record, snapshot_on_finish,
                    dry_run) -> None:
    """ValueError for an Engine argument that a step would fail on later (with requests
    already holding blocks): checked at construction instead."""
    if not isinstance(model, Decoder):
        raise ValueError(f"model must be a glm5_jax.model.decoder.Decoder, got {type(model).__name__}")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    if not isinstance(bucket_mins, BucketMins):
        raise ValueError(f"bucket_mins must be a BucketMins, got {type(bucket_mins).__name__}")
    for name, fn in (("chunk_policy", chunk_policy), ("draft_fn", draft_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable or None, got {fn!r}")
    for name, flag in (("record", record), ("snapshot_on_finish", snapshot_on_finish)):
        if not (isinstance(flag, (bool, np.bool_)) or callable(flag)):
            raise ValueError(f"{name} must be a bool or a predicate request_id -> bool, got {flag!r}")
    if not isinstance(dry_run, (bool, np.bool_)):
        raise ValueError(f"dry_run must be a bool, got {dry_run!r}")


class EngineStepError(RuntimeError):
    """An exception inside ``Engine.step`` (the original is ``__cause__``), raised once
    the engine is consistent again: ``phase`` (plan, batch, dispatch, fetch_selected,
    device_wait or commit) of step number ``step`` raised; ``failed``: ids of the
    requests that ended with status "failed" (their results of that step are lost);
    ``finished``: ids of the requests that finished in this call before it raised.
    The engine serves on: the next ``step()`` plans again."""

    def __init__(self, phase: str, step: int, failed: list, finished: list):
        self.phase, self.step, self.failed, self.finished = phase, step, list(failed), list(finished)
        what = f"requests {self.failed} failed" if self.failed else "no request was affected"
        super().__init__(f"step {step}: {phase} raised; {what}")

    def __str__(self):
        cause = self.__cause__
        return super().__str__() + (f": {type(cause).__name__}: {cause}" if cause is not None else "")


def fail_launch(scheduler, launch, phase: str, exc: BaseException) -> list:
    """A dispatched step whose results are lost: every request of it not committed
    yet fails (its rows may have written past its committed tokens, which a re-run
    could not undo: ``docs/engine_failures.md``). Returns their ids."""
    error = f"{phase} of step {launch.step} raised {type(exc).__name__}: {exc}"
    failed = []
    for plan in launch.plans:
        for req in plan.requests:
            if req.status == RUNNING and id(req) not in launch.committed:
                scheduler.fail(req, error)
                failed.append(req.request_id)
    return failed
