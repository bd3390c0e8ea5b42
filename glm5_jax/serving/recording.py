"""What the Engine keeps of a step besides its tokens: the recorded rows' selections,
the cache bytes of a request (``request_snapshot``, at once or at finish), and the
testing aid that scribbles over free blocks.

Nothing here waits for a device on the step's path: the recorded rows are gathered
on the devices behind the step and copied to the host in the background; they are
taken in when a request's output is read, or RECORD_LAG_STEPS steps later at the
latest (one more per step kept in flight beyond the first). A finish snapshot
gathers the request's words behind the steps in flight, before any later step can
reuse its blocks.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from pallas_kernels.core import addressing as addr

from .. import metadata as md
from . import sharding
from .dispatch import _take_rows
from .requests import Deferred, wants
from .step_metadata import StepShape, bucket

RECORD_LAG_STEPS = 2       # recorded rows reach the host at most this many steps after their step
#                            (plus one per step kept in flight beyond the first: asynchronous scheduling)


class Recorder:
    """Recorded selections and request snapshots of one engine."""

    def __init__(self, layout, kv_row_bytes: int, block_pools, mesh, *, record, snapshot_on_finish,
                 async_scheduling: int):
        self.layout = layout
        self.config = layout.config
        self.kv_row_bytes = kv_row_bytes
        self.block_pools = block_pools
        self.mesh = mesh
        self.num_shards = len(block_pools)
        self.record = record
        self.snapshot_on_finish = snapshot_on_finish
        self.lag = RECORD_LAG_STEPS + max(async_scheduling - 1, 0)
        self.fetches: list = []             # (step, [Deferred rows per shard]) not yet on the host
        self.snapshots: list = []           # (step, Deferred) finish snapshots not yet on the host

    # ---- recorded rows -------------------------------------------------------------
    def recorded_rows(self, plan, shape: StepShape) -> list:
        """Flat token rows of one shard's step whose selections are recorded."""
        nd, np_ = shape.decode_width_tokens, shape.prefill_width_tokens
        base = shape.decode_rows * nd
        rows = []
        for i, (req, row) in enumerate(zip(plan.decode, plan.dec_rows)):
            if wants(self.record, req.request_id):
                rows += range(i * nd, i * nd + len(row.token_ids))
        for j, (req, row) in enumerate(zip(plan.prefill, plan.pre_rows)):
            if wants(self.record, req.request_id):
                rows += range(base + j * np_, base + j * np_ + len(row.token_ids))
        return rows

    def fetch_selected(self, plans, shape: StepShape, selected, step: int):
        """Per shard, (Deferred selections [L, R, W] of its recorded rows, {flat row:
        column}), or None when no request of step `step` is recorded. Only those rows
        leave the devices (gathered there first: the whole [D, L, T, W] array is ~34
        MB per device for a 2,064-token step and W = 2,051), and the step does not
        wait for them: the copy runs in the background and is read when a request's
        output is (``get_output``), or after ``lag`` steps at the latest."""
        self.settle(step)
        rows = [self.recorded_rows(p, shape) for p in plans]
        if not any(rows):
            return None
        width = bucket(max(len(r) for r in rows), 8)            # few shapes: few compilations
        idx = np.zeros((self.num_shards, width), np.int32)
        for d, r in enumerate(rows):
            idx[d, :len(r)] = r
        got = _take_rows(selected, sharding.put_per_shard(idx, self.mesh), mesh=self.mesh)
        got.copy_to_host_async()                     # every shard's copy starts now, side by side
        fetched = [Deferred(got, operator.itemgetter(d)) for d in range(self.num_shards)]
        self.fetches.append((step, fetched))
        return [(f, {row: c for c, row in enumerate(r)}) for f, r in zip(fetched, rows)]

    def settle(self, step: int, lag: int | None = None):
        """Bring recorded rows and finish snapshots fetched `lag` (default: ``self.lag``)
        or more steps before `step` to the host (their copies are done by then) and free
        their device buffers."""
        lag = self.lag if lag is None else lag
        while self.fetches and step - self.fetches[0][0] >= lag:
            for f in self.fetches.pop(0)[1]:
                f.settle()
        while self.snapshots and step - self.snapshots[0][0] >= lag:
            self.snapshots.pop(0)[1].settle()

    def record_rows(self, req, start_pos, flat0, n, next_tok, sel):
        """Keep a request's n recorded rows of a step (from flat row flat0 on)."""
        if sel is None or not wants(self.record, req.request_id):
            return
        fetched, col = sel              # a request's recorded rows are consecutive (recorded_rows)
        req.records.append((start_pos, fetched, col[flat0], np.array(next_tok[flat0:flat0 + n])))

    # ---- snapshots -------------------------------------------------------------------
    def block_words(self, blocks) -> np.ndarray:
        """Word addresses of `blocks` in a shard's cache: indexer pages with their tail
        ring and attention K/V, every layer."""
        lay = self.layout
        byte_spans = [span for layer in range(lay.num_layers) for b in blocks
                      for span in (lay.block_byte_range(layer, b), lay.attn_block_byte_range(layer, b))]
        return np.concatenate([np.arange(*addr.byte_span_words(a, e)) for a, e in byte_spans if e > a])

    def image(self, words, values) -> np.ndarray:
        """uint32[total_words] host image of a shard's cache: `values` at `words`, zeros
        elsewhere (untouched pages stay unallocated)."""
        image = np.zeros(self.layout.total_words, np.uint32)
        image[words] = values
        return image

    def blocks_image(self, cache, shard: int, blocks) -> np.ndarray:
        """The host image of one shard's cache that holds the bytes of `blocks` and
        zeros elsewhere: only those words leave the device, not the whole cache
        (gigabytes on a GPU-sized layout)."""
        words = self.block_words(blocks)
        return self.image(words, sharding.host_words(cache, shard, words))

    def snapshot_parts(self, req) -> tuple:
        """(the blocks a snapshot of req reads, image [total_words] u32 -> the snapshot dict)."""
        rb = self.block_pools[req.shard].request(req.request_id)
        index_blocks, tail_block = list(rb.index_blocks), rb.tail_block
        return sorted(set(index_blocks) | {tail_block}), functools.partial(
            self.decode_snapshot, req.num_computed_tokens, index_blocks, tail_block, req.shard)

    def snapshot_later(self, req, cache, step: int) -> Deferred:
        """request_snapshot of a request as the queued steps leave it, without waiting
        for them: its words are gathered on the device now (behind those steps, before
        any later step can reuse its blocks) and reach the host in the background; the
        dict is built when read (get_output). `step`: the latest dispatched step."""
        blocks, decode = self.snapshot_parts(req)
        words = self.block_words(blocks)
        got = sharding.device_words(cache, req.shard, words)
        got.copy_to_host_async()
        snap = Deferred(got, lambda values: decode(self.image(words, values)))
        self.snapshots.append((step, snap))
        return snap

    def maybe_snapshot_later(self, req, cache, step: int) -> None:
        """snapshot_later for a request that finishes, if its snapshot is kept."""
        if cache is not None and wants(self.snapshot_on_finish, req.request_id):
            req.snapshot = self.snapshot_later(req, cache, step)

    def decode_snapshot(self, num_computed_tokens, index_blocks, tail_block, shard, cache) -> dict:
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
            ak, av = lay.attn_kv(cache, layer, self.kv_row_bytes)
            tail = {int(p): (tk[tail_block, p % c.ring].view(np.uint16).copy(),
                             tg[tail_block, p % c.ring].view(np.uint16).copy())
                    for p in range(max(0, nc - c.kpool), nc)}
            out.append(dict(pool_keys=keys.view(np.uint8)[slots].copy(),
                            pool_scales=scales.view(np.uint32)[slots].copy(), tail=tail,
                            attn_k=ak[blocks, pos % c.block_size].copy(),
                            attn_v=av[blocks, pos % c.block_size].copy()))
        return dict(num_computed_tokens=nc, index_blocks=list(index_blocks), tail_block=tail_block,
                    shard=shard, layers=out)


def scribble_free_blocks(layout, block_pools, cache_bytes, rng) -> tuple:
    """(uint32 [D, total_words] host images of every shard's cache with every free block
    that holds nothing cached filled with random bytes (all layers: indexer pages,
    tail ring, attention K/V), the number of such blocks). ``cache_bytes(shard)``
    gives a shard's cache as bytes."""
    rows, total = [], 0
    for shard, pool in enumerate(block_pools):
        blocks = [b for b in pool.free_order() if not pool.is_cached(b)]
        raw = cache_bytes(shard).copy()
        for layer in range(layout.num_layers):
            for b in blocks:
                for a, e in (layout.block_byte_range(layer, b), layout.attn_block_byte_range(layer, b)):
                    raw[a:e] = rng.integers(0, 256, e - a, dtype=np.uint8)
        rows.append(raw.view(np.uint32))
        total += len(blocks)
    return np.stack(rows), total
