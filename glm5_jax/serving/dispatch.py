"""The device side of a step: the jitted step function, the recorded-row gather and
the queue of dispatched steps whose results are not committed yet.

Every step is one call of the module-level ``jax.jit`` function ``_step`` whose
static arguments are the model structure, layout, implementation and mesh (the
layout carries an injected fault, if any: ``glm5_jax.layout.with_fault``); shapes
are bucketed, so a steady workload reuses its compiled executables, across engines
too: the jit cache is the process's. ``TRACES`` counts the traces (= compilations)
of both jitted functions in this process; an engine counts the ones its steps
caused.

The cache is donated to the step: after a call that consumed it, the input array
is deleted, and only the returned cache holds the bytes.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model import invariant as inv
from . import sharding
from .step_builder import unpack_step_arrays
from .step_metadata import StepShape


@dataclasses.dataclass
class TraceCounts:
    """Traces of this module's jitted functions in the process (each trace compiles)."""
    step: int = 0
    gather: int = 0                    # the recorded-row gather (_take_rows)


TRACES = TraceCounts()


def total_traces() -> int:
    """Step-function traces (compilations) in this process so far."""
    return TRACES.step


def _step_impl(state, cache, flat, prev_tok, *, fields, graphdef, layout, implementation, mesh,
               contractions, tokens_out):
    """One step on every device: cache [D, words], the packed step arrays flat [D, total]
    i32 (``step_builder.pack_step_arrays``) and the previous step's next tokens prev_tok
    [D, tokens_out] i32 -> (cache, next_token [D, tokens_out] i32 (the step's T tokens,
    then zeros), selected [D, num_layers, T, W] i32).

    A decode row whose input token was not on the host when the step was planned
    (asynchronous scheduling: it is the previous step's output) names its source in
    the ``dec_token_src`` field: token = prev_tok[src] where src >= 0, so that token
    never travels through the host. ``contractions`` is ``invariant.contractions()``
    when called: static, so that changing it compiles a new step instead of reusing
    one traced under the other value."""
    TRACES.step += 1                          # runs once per trace, i.e. per compilation

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
    TRACES.gather += 1                        # a step that compiles this is not timed as serving
    return sharding.per_shard(lambda sel, r: sel[:, r, :], mesh)(selected, rows)


_take_rows = jax.jit(_take_rows_impl, static_argnames=("mesh",))


@dataclasses.dataclass
class Launch:
    """A dispatched step whose results have not been committed."""
    step: int                   # its number (Engine.steps when it was dispatched)
    plans: list                 # ShardPlan per shard
    shape: StepShape
    next_tok: object            # [D, tokens_out] i32 on the devices (zeros on the host in a dry run)
    sel: list | None = None     # Recorder.fetch_selected's result
    committed: set = dataclasses.field(default_factory=set)    # id() of the requests whose results are applied


class Dispatcher:
    """What a call of ``_step`` takes besides the cache and the step arrays (the
    replicated weights, the static arguments, the previous step's tokens), and the
    dispatched steps until they are committed (oldest first; more than one only with
    asynchronous scheduling)."""

    def __init__(self, model, mesh, layout, implementation: str | None, tokens_out: int, *, dry_run: bool):
        self.mesh = mesh
        self.num_shards = sharding.check_mesh(mesh)
        self.layout = layout
        self.implementation = implementation
        self.tokens_out = tokens_out
        self.dry_run = dry_run
        self.graphdef, state = nnx.split(model)
        # weights on every device (a dry run touches no device memory)
        self.state = None if dry_run else sharding.replicated(state, mesh)
        self.inflight: collections.deque = collections.deque()
        self._no_prev = None                # zeros [D, tokens_out]: the previous tokens of a first step

    def static_args(self, fields) -> dict:
        return dict(fields=fields, graphdef=self.graphdef, layout=self.layout, implementation=self.implementation,
                    mesh=self.mesh, contractions=inv.contractions(), tokens_out=self.tokens_out)

    def zeros(self):
        """[D, tokens_out] i32 zeros on the devices."""
        return sharding.put_per_shard(np.zeros((self.num_shards, self.tokens_out), np.int32), self.mesh)

    def prev_tokens(self):
        """The next tokens of the latest dispatched step still in flight (zeros if none)."""
        if self.inflight:
            return self.inflight[-1].next_tok
        if self._no_prev is None:
            self._no_prev = self.zeros()
        return self._no_prev

    def dry_tokens(self):
        return np.zeros((self.num_shards, self.tokens_out), np.int32)

    def take_done(self, depth: int, dispatched: bool):
        """The oldest step in flight once more than `depth` are (at once when synchronous;
        every one left when nothing new was dispatched), else None."""
        if self.inflight and (len(self.inflight) > depth or not dispatched):
            return self.inflight.popleft()
        return None


def fetch_tokens(launch: Launch) -> np.ndarray:
    """The step's next tokens on the host [D, tokens_out] (waits for the devices)."""
    return np.asarray(launch.next_tok)
