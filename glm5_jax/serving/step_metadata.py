"""Static-shape metadata of one serving step (host side, numpy).

A step carries two grids of new tokens, one row per request:

* the **decode grid** ``[decode_rows, decode_width_tokens]``: requests that are
  generating; row = the last sampled token plus up to ``next_n - 1`` draft
  tokens (speculative verify), left-aligned, positions -1 after;
* the **prefill grid** ``[prefill_rows, prefill_width_tokens]``: one prompt chunk
  per request, left-aligned. A chunk may start at ANY token: its first
  ``(-start) % kpool`` tokens (the *head*, at most kpool - 1) complete the pool
  that straddles the chunk start, reading the pool's earlier members from the
  tail ring; they go through ``decode_update``. The aligned rest goes through
  ``compress_prefill`` + ``seed_tail`` (``pre_slot_pools`` / ``pre_tslots``, with
  the head columns set to -1 so nothing is written twice).

One ``decode_update`` call per layer serves both: the *update grid*
``[decode_rows + prefill_rows, update_width_tokens]`` (``upd_*``) holds the decode
rows, then each prefill row's head; ``upd_token_index`` says which flat token of
the step each entry is. A step whose chunks all start on a pool boundary (every
chunk the engine cuts by itself: chunk sizes are multiples of kpool, prefix hits
end on block boundaries) has no heads: its shape has ``head_width_tokens = 0`` and
its update grid is the decode grid alone, ``[decode_rows, decode_width_tokens]``,
so the decode update walks next_n tokens of the decode rows, not kpool - 1 tokens
of every row (and at next_n = 1 runs the one-token kernel).

Every array is padded to bucketed sizes (powers of two, with per-engine minimums)
so a steady workload reuses a handful of compiled shapes. Padding: -1 in every
slot mapping and position, token id 0, table entries 0 (the null block / its
pages). Units are in the names: ``*_tokens`` token-granular, ``*_pools``
pool-granular slots, ``*_pages`` page ids, ``*_blocks`` manager block ids.

The slot mappings and page tables come from ``glm5_jax.metadata``'s builders.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np

from pallas_kernels.core import addressing as addr

from .. import metadata as md
from ..config import IndexerConfig


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum, 1)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Bucketed (static) sizes of one step: the key of one compiled step function."""
    decode_rows: int
    decode_width_tokens: int
    prefill_rows: int
    prefill_width_tokens: int
    table_blocks: int
    head_width_tokens: int          # 0 (no prefill row has a head) or kpool - 1

    @property
    def update_width_tokens(self) -> int:
        return max(self.decode_width_tokens, self.head_width_tokens)

    @property
    def update_rows(self) -> int:
        """Rows of the update grid: the decode rows, then the prefill rows if heads exist."""
        return self.decode_rows + (self.prefill_rows if self.head_width_tokens else 0)

    @property
    def num_tokens(self) -> int:
        """Flat tokens of the step: decode grid first, then the prefill grid."""
        return self.decode_rows * self.decode_width_tokens + self.prefill_rows * self.prefill_width_tokens

    @property
    def table_rows(self) -> int:
        return self.decode_rows + self.prefill_rows


@dataclasses.dataclass(frozen=True)
class BucketMins:
    """Minimum bucket sizes (raise them to pin shapes and compile fewer variants)."""
    decode_rows: int = 1
    prefill_rows: int = 1
    prefill_width_tokens: int = 8
    table_blocks: int = 1
    head_width_tokens: int = 0      # > 0: carry the head columns (kpool - 1) in every step


@dataclasses.dataclass
class RowSpec:
    """One request's new tokens in this step."""
    token_ids: list                 # new token ids (len = tokens processed this step)
    start_pos: int                  # absolute position of token_ids[0]
    index_blocks: list              # the request's manager block ids (token order)
    tail_block: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


def choose_shape(config: IndexerConfig, decode_rows, prefill_rows, *, next_n: int,
                 mins: BucketMins = BucketMins()) -> StepShape:
    """Bucketed shape holding these rows (lists of RowSpec). The head columns (kpool - 1
    of them) are there only when a prefill row starts off a pool boundary (or
    ``mins.head_width_tokens`` asks for them)."""
    bs = config.block_size
    need_blocks = max([-(-r.end_pos // bs) for r in list(decode_rows) + list(prefill_rows)] + [1])
    width = max([len(r.token_ids) for r in prefill_rows] + [1])
    heads = any(_head_tokens(r, config.kpool) for r in prefill_rows) or mins.head_width_tokens > 0
    return StepShape(
        decode_rows=bucket(len(decode_rows), mins.decode_rows),
        decode_width_tokens=int(next_n),
        prefill_rows=bucket(len(prefill_rows), mins.prefill_rows),
        prefill_width_tokens=bucket(width, mins.prefill_width_tokens),
        table_blocks=bucket(need_blocks, mins.table_blocks),
        head_width_tokens=config.kpool - 1 if heads else 0)


def _head_tokens(row: RowSpec, kpool: int) -> int:
    """Tokens of a prefill row that complete the pool straddling its start (the head)."""
    return min((-row.start_pos) % kpool, len(row.token_ids))


def attention_slot_mapping(positions_tokens, request_index, block_table_blocks, block_size_tokens: int):
    """Token-granular attention slot: table[req, pos // block_size] * block_size + pos % block_size.

    -1 for padding (pos < 0 or req < 0). A position beyond its table row is an error.
    """
    pos = np.asarray(positions_tokens, dtype=np.int64)
    req = np.asarray(request_index, dtype=np.int64)
    table = np.asarray(block_table_blocks, dtype=np.int64)
    valid = (pos >= 0) & (req >= 0)
    a = types.SimpleNamespace(block_size=block_size_tokens)      # all addressing's attn slot helpers read
    col, row = addr.attn_token_block_col(a, np.where(valid, pos, 0))
    if valid.any() and (col[valid] >= table.shape[1]).any():
        raise ValueError(f"a token lies beyond its request's block table ({table.shape[1]} blocks of "
                         f"{block_size_tokens} tokens)")
    blk = table[np.where(valid, req, 0), col]
    return np.where(valid, addr.attn_slot(a, blk, row), -1).astype(np.int32)


@dataclasses.dataclass
class StepArrays:
    """All per-step inputs of the compiled step, padded to ``shape``.

    Flat token t of the step: t < Bd*Nd is decode-grid entry (t // Nd, t % Nd),
    the rest are prefill-grid entries in row-major order.
    """
    shape: StepShape
    # decode grid [Bd, Nd]
    dec_token_ids: np.ndarray
    dec_positions: np.ndarray
    dec_attn_slots: np.ndarray
    # prefill grid [Bp, Np]
    pre_token_ids: np.ndarray
    pre_positions: np.ndarray
    pre_slot_pools: np.ndarray         # compress_prefill input: -1 on head tokens and padding
    pre_tslots: np.ndarray             # seed_tail input: -1 on head tokens and padding
    pre_attn_slots: np.ndarray
    # update grid [Bd (+ Bp with heads), U] for decode_update: decode rows, then prefill heads
    upd_token_index: np.ndarray        # flat step token of each entry (0 for padding)
    upd_positions: np.ndarray          # -1 = padding
    upd_slot_pools: np.ndarray
    upd_tslots: np.ndarray
    # tables, rows 0..Bd-1 = decode grid rows, Bd.. = prefill grid rows
    block_table_blocks: np.ndarray     # [Bd + Bp, MB] (0 = null block)
    page_table_pages: np.ndarray       # [Bd + Bp, MB * pages_per_block]
    token_table_rows: np.ndarray       # [T] table row of each flat token (0 for padding)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shape"}


def _grid(rows, n_rows, width, row_offset):
    """Positions, ids, request index, slots for one grid."""
    pos = np.full((n_rows, width), -1, np.int64)
    ids = np.zeros((n_rows, width), np.int32)
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        if n > width:
            raise ValueError(f"row {i} has {n} tokens; the grid holds {width}")
        pos[i, :n] = np.arange(r.start_pos, r.start_pos + n)
        ids[i, :n] = r.token_ids
    req = np.where(pos >= 0, row_offset + np.arange(n_rows)[:, None], -1)
    return pos, ids, req


def build_step(config: IndexerConfig, shape: StepShape, decode_rows, prefill_rows) -> StepArrays:
    """Padded arrays of one step (decode_rows / prefill_rows: lists of RowSpec)."""
    decode_rows, prefill_rows = list(decode_rows), list(prefill_rows)
    bd, nd, bp, np_ = shape.decode_rows, shape.decode_width_tokens, shape.prefill_rows, shape.prefill_width_tokens
    if len(decode_rows) > bd or len(prefill_rows) > bp:
        raise ValueError(f"{len(decode_rows)} decode / {len(prefill_rows)} prefill rows do not fit "
                         f"the shape {bd} / {bp}")
    r, bs, mb = config.kpool, config.block_size, shape.table_blocks
    # tables: decode rows first, then prefill rows (padding rows: all 0 = null block)
    bt = np.zeros((bd + bp, mb), np.int64)
    tails = np.zeros(bd + bp, np.int64)
    for row, spec in list(enumerate(decode_rows)) + [(bd + i, s) for i, s in enumerate(prefill_rows)]:
        need = -(-spec.end_pos // bs)
        if need > mb or need > len(spec.index_blocks):
            raise ValueError(f"a row reaching token {spec.end_pos} needs {need} blocks; the table holds "
                             f"{min(mb, len(spec.index_blocks))}")
        k = min(mb, len(spec.index_blocks))
        bt[row, :k] = spec.index_blocks[:k]
        tails[row] = spec.tail_block
    pages = md.page_table_pages(bt, config)

    def slots(pos, req):
        flat_p, flat_r = pos.ravel(), req.ravel()
        sp = md.compressed_slot_mapping(flat_p, flat_r, pages, config).reshape(pos.shape)
        ts = md.tail_slot_mapping(flat_p, flat_r, tails, config).reshape(pos.shape)
        at = attention_slot_mapping(flat_p, flat_r, bt, bs).reshape(pos.shape)
        return sp, ts, at

    dpos, dids, dreq = _grid(decode_rows, bd, nd, 0)
    dsp, dts, dat = slots(dpos, dreq)
    ppos, pids, preq = _grid(prefill_rows, bp, np_, bd)
    psp, pts, pat = slots(ppos, preq)

    # heads: the first (-start) % R tokens of each prefill row complete the straddling pool
    u = shape.update_width_tokens
    head_len = np.zeros(bp, np.int64)
    for i, spec in enumerate(prefill_rows):
        head_len[i] = _head_tokens(spec, r)
    if head_len.max(initial=0) > shape.head_width_tokens:
        raise ValueError(f"a prefill row starts off a pool boundary (a head of {head_len.max()} tokens) "
                         f"but the shape has head_width_tokens = {shape.head_width_tokens}")
    is_head = np.arange(np_)[None, :] < head_len[:, None]
    ucol = np.arange(u)[None, :]
    head_live = (ucol < head_len[:, None]) & (ucol < np_)
    hp = shape.update_rows - bd                                                # bp with heads, else 0
    upd_pos = np.concatenate([_take_cols(dpos, u), np.where(head_live, _take_cols(ppos, u), -1)[:hp]])
    upd_sp = np.concatenate([_take_cols(dsp, u), np.where(head_live, _take_cols(psp, u), -1)[:hp]])
    upd_ts = np.concatenate([_take_cols(dts, u), np.where(head_live, _take_cols(pts, u), -1)[:hp]])
    dec_idx = np.arange(bd)[:, None] * nd + ucol
    pre_idx = bd * nd + np.arange(hp)[:, None] * np_ + ucol
    upd_idx = np.where(upd_pos >= 0, np.concatenate([dec_idx, pre_idx]), 0)

    tok_rows = np.concatenate([np.repeat(np.arange(bd), nd), bd + np.repeat(np.arange(bp), np_)])
    live = np.concatenate([dpos.ravel(), ppos.ravel()]) >= 0
    i32 = lambda x: np.asarray(x, np.int32)                                   # noqa: E731
    return StepArrays(
        shape=shape,
        dec_token_ids=i32(dids), dec_positions=i32(dpos), dec_attn_slots=i32(dat),
        pre_token_ids=i32(pids), pre_positions=i32(ppos),
        pre_slot_pools=i32(np.where(is_head, -1, psp)), pre_tslots=i32(np.where(is_head, -1, pts)),
        pre_attn_slots=i32(pat),
        upd_token_index=i32(upd_idx), upd_positions=i32(upd_pos), upd_slot_pools=i32(upd_sp),
        upd_tslots=i32(upd_ts),
        block_table_blocks=i32(bt), page_table_pages=i32(pages),
        token_table_rows=i32(np.where(live, tok_rows, 0)))


def _take_cols(x, w):
    if x.shape[1] >= w:
        return x[:, :w]
    return np.pad(x, ((0, 0), (0, w - x.shape[1])), constant_values=-1)
