"""Host-side metadata builders (numpy): slot mappings, tail slots, page tables.

Units are in the names. Padding entries are -1 in every slot mapping and 0 in
tables (block 0 is the null block). The unit rule that three historical bugs
broke (docs/semantics.md 4.2, B9-B11): the page table's column unit, the page height used by
the slot mapper and the kernels' page height are all ``page_rows`` pool rows.
"""
from __future__ import annotations

import numpy as np

from pallas_kernels.core import addressing as addr

from .config import IndexerConfig, checked_int

_INT32_MAX = 2**31 - 1


def _ints(fn: str, name: str, x) -> np.ndarray:
    """x as an int64 array, refusing arrays of floats or bools (which np.asarray(x, int64)
    would truncate or turn into 0 / 1 without a word)."""
    a = np.asarray(x)
    if a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{fn}: {name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def _config(fn: str, config) -> IndexerConfig:
    if not isinstance(config, IndexerConfig):
        raise ValueError(f"{fn}: config must be an IndexerConfig, got {type(config).__name__}")
    return config


def _int32(fn: str, name: str, x: np.ndarray) -> np.ndarray:
    """x (int64) as int32, refusing values the int32 kernels' inputs cannot hold."""
    if x.size and (x.max() > _INT32_MAX or x.min() < -_INT32_MAX - 1):
        raise ValueError(f"{fn}: {name} do not fit in int32 (max {int(x.max())})")
    return x.astype(np.int32)


def page_table_pages(block_table_blocks, config: IndexerConfig):
    """[B, max_blocks] manager block ids -> [B, max_blocks * pages_per_block] page ids.

    Page j of block b is b * pages_per_block + j (dense layer-outer layout).
    """
    fn = "page_table_pages"
    config = _config(fn, config)
    bt = _ints(fn, "block table", block_table_blocks)
    if bt.ndim != 2:
        raise ValueError(f"block table must be [B, max_blocks], got shape {bt.shape}")
    pages = addr.block_page(config, bt[:, :, None], np.arange(config.pages_per_block))
    return _int32(fn, "page ids", pages.reshape(bt.shape[0], -1))


def token_request_index(query_lens_tokens, num_tokens_padded: int | None = None):
    """Request index of every flat token of a batch (padding tokens get -1)."""
    q = _ints("token_request_index", "query lengths", query_lens_tokens)
    if (q < 0).any():
        raise ValueError("query lengths must be >= 0")
    req = np.repeat(np.arange(q.size), q)
    return _pad(req, num_tokens_padded)


def token_positions(seq_lens_tokens, query_lens_tokens, num_tokens_padded: int | None = None):
    """Absolute position of every new token: the last query_len positions of each request."""
    s = _ints("token_positions", "seq_lens", seq_lens_tokens)
    q = _ints("token_positions", "query_lens", query_lens_tokens)
    if s.shape != q.shape:
        raise ValueError("seq_lens and query_lens must have the same shape")
    if (q > s).any():
        raise ValueError("a request's query length exceeds its sequence length")
    pos = np.concatenate([np.arange(si - qi, si) for si, qi in zip(s, q)]) if s.size else np.zeros(0, np.int64)
    return _pad(pos, num_tokens_padded)


def _pad(x, n):
    x = np.asarray(x, dtype=np.int64)
    if n is None:
        return _int32("token metadata", "values", x)
    n = checked_int("metadata", "num_tokens_padded", n)
    if x.size > n:
        raise ValueError(f"{x.size} tokens do not fit in a padded batch of {n}")
    out = np.full(n, -1, np.int64)
    out[: x.size] = x
    return _int32("token metadata", "values", out)


def _tokens_and_requests(fn, positions_tokens, request_index, n_requests: int, what: str):
    """(positions, request index) as int64 arrays of one shape, request ids < n_requests."""
    pos = _ints(fn, "positions", positions_tokens)
    req = _ints(fn, "request_index", request_index)
    if pos.shape != req.shape:
        raise ValueError(f"{fn}: positions {pos.shape} and request_index {req.shape} must have the same shape")
    if req.size and req.max() >= n_requests:
        raise ValueError(f"{fn}: request index {int(req.max())} has no row in the {what} ({n_requests} rows)")
    return pos, req


def compressed_slot_mapping(positions_tokens, request_index, page_table_pages_, config: IndexerConfig):
    """Pool-granular slot of every token (docs/semantics.md 4.2): >= 0 only for pool-completing tokens.

    slot = table[req, cpos // page_rows] * page_rows + cpos % page_rows with
    cpos = pos // kpool, for tokens with (pos + 1) % kpool == 0; -1 otherwise.
    A pool beyond the request's table is an error (the B7/B11 class), not a wrap.
    """
    fn = "compressed_slot_mapping"
    config = _config(fn, config)
    table = _ints(fn, "page table", page_table_pages_)
    if table.ndim != 2:
        raise ValueError(f"{fn}: page table must be [B, max_pages], got shape {table.shape}")
    pos, req = _tokens_and_requests(fn, positions_tokens, request_index, table.shape[0], "page table")
    r, p = config.kpool, config.page_rows
    out = np.full(pos.shape, -1, np.int64)
    valid = (pos >= 0) & (req >= 0) & ((pos + 1) % r == 0)
    cpos = np.where(valid, pos // r, 0)
    col, row = addr.pool_page_row(config, cpos)
    if valid.any() and (col[valid] >= table.shape[1]).any():
        raise ValueError(f"a pool lies beyond its request's page table ({table.shape[1]} pages of "
                         f"{p} pools): the table is too short for the positions")
    page = table[np.where(valid, req, 0), np.where(valid, col, 0)]
    if valid.any() and (page[valid] < config.pages_per_block).any():
        raise ValueError("a pool maps to a page of the null block 0 (table padding): the "
                         "request's block table has no block for that position")
    out[valid] = addr.pool_slot(config, page, row)[valid]
    return _int32(fn, "pool slots", out)


def tail_slot_mapping(positions_tokens, request_index, tail_blocks, config: IndexerConfig):
    """Token-granular tail slot (docs/semantics.md 4.3): tail_block[req] * ring + pos % ring; -1 for padding."""
    fn = "tail_slot_mapping"
    config = _config(fn, config)
    tb = _ints(fn, "tail_blocks", tail_blocks).reshape(-1)
    pos, req = _tokens_and_requests(fn, positions_tokens, request_index, tb.size, "tail blocks")
    valid = (pos >= 0) & (req >= 0)
    blk = tb[np.where(valid, req, 0)] if tb.size else np.zeros_like(pos)
    out = np.where(valid & (blk > 0), addr.tail_slot(config, blk, np.where(valid, pos, 0)), -1)
    return _int32(fn, "tail slots", out)


def context_pools(seq_lens_tokens, config: IndexerConfig):
    """Complete pools visible to a request of seq_len tokens: seq_len // kpool (clamped at 0)."""
    fn = "context_pools"
    return np.maximum(_ints(fn, "seq_lens", seq_lens_tokens), 0) // _config(fn, config).kpool
