"""A tiny decoder around the kpool indexer, for end-to-end serving runs.

Random weights, configurable sizes (the default fits a CPU: hidden 256, 2 layers,
vocab 512). Each layer is

    a   = RMSNorm(x)
    qr  = a @ Wq_a^T                       (the q-LoRA activation the indexer reads)
    sel = Indexer(a, qr)                   (writes the indexer cache, selects tokens)
    q   = qr @ Wq_b^T;  k = a @ Wk^T;  v = a @ Wv^T       (one shared K/V head)
    K/V of the step's tokens -> the attention region of the flat cache
    x  += SparseAttention(q, K/V of the selected tokens only) @ Wo^T
    x  += SwiGLU(RMSNorm(x))

then a final RMSNorm and the LM head; sampling is greedy (argmax, ties to the
lower id). The attention region lives in the SAME flat buffer as the indexer
(``CacheLayout(..., attn_block_bytes=ModelConfig.attn_block_bytes)``), addressed
only through ``pallas_kernels.core.addressing`` (``attn_*``): block b holds its
block_size K rows, then its V rows, bf16. Attention never reads a token the
indexer did not select, so a corrupted indexer page changes the output.

All math is batch invariant (``glm5_jax.model.invariant``) and the selected indices are
sorted before the gather, so a token's output depends only on its own context and
its selected token set, not on chunking, batching or the order top-k emitted.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jax import lax

from pallas_kernels.core import addressing as addr

from ..config import IndexerConfig
from ..layout import CacheLayout
from . import invariant as inv
from .indexer import Indexer, _normal

BF16_BYTES = 2
# Where the attention's contraction kernels run (``invariant.kernel_for("attention")``, a GPU
# by default) and the K/V rows are aligned (``addressing.attn_rows_aligned``), they read the
# K and V rows from the cache themselves (``sparse_attention_rows``) instead of from a
# gathered [T, W, head_dim] copy (``gather_kv``). The same bits either way; False keeps the
# gather (benchmarks/profile_step.py --gather-attention compares the two).
ATTENTION_FROM_ROWS = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4                 # attention query heads (one shared K/V head)
    head_dim: int = 64                 # attention head dim (K/V row = head_dim bf16)
    q_lora_rank: int = 128
    mlp_size: int = 512
    rms_eps: float = 1e-6
    indexer: IndexerConfig = IndexerConfig(n_heads=4, topk=64, block_size=64)

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "mlp_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (bf16 K/V rows are packed two per 32-bit word)")
        if not isinstance(self.indexer, IndexerConfig):
            raise ValueError("ModelConfig.indexer must be an IndexerConfig")

    @property
    def kv_row_bytes(self) -> int:
        return self.head_dim * BF16_BYTES

    @property
    def attn_block_bytes(self) -> int:
        """Attention bytes per block per layer: block_size K rows + block_size V rows."""
        return 2 * self.indexer.block_size * self.kv_row_bytes

    def layout(self, num_blocks: int) -> CacheLayout:
        """The flat cache for this model: attention + indexer regions of every layer."""
        return CacheLayout(self.indexer, num_layers=self.num_layers, num_blocks=num_blocks,
                           attn_block_bytes=self.attn_block_bytes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return inv.rms_norm(x, self.weight[...], self.eps)


# ---------------------------------------------------------------------------------
# attention region: writes and gathers (offsets only from pallas_kernels.core.addressing)
# ---------------------------------------------------------------------------------
def _pack_bf16(x):
    """[..., 2n] bf16 -> [..., n] uint32 (element 2w in the low half)."""
    lead = x.shape[:-1]
    h = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32).reshape(lead + (-1, 2))
    return h[..., 0] | (h[..., 1] << 16)


def _unpack_bf16(w):
    """[..., n] uint32 -> [..., 2n] bf16 (inverse of ``_pack_bf16``): a bitcast, which
    splits each word in memory order (little-endian: the low half first)."""
    return lax.bitcast_convert_type(w, jnp.bfloat16).reshape(w.shape[:-1] + (-1,))


def write_kv(cache, a, k, v, slots):
    """Store K, V rows [T, head_dim] bf16 at attention slots [T] (-1 = padding: no write)."""
    view = cache.reshape(addr.view_shape(a))
    ok = addr.attn_slot_valid(a, slots)
    s = jnp.where(ok, slots, 0)
    iota = jnp.arange(addr.attn_row_width_words(a), dtype=jnp.int32)
    for half, rows in ((0, k), (1, v)):
        row, col = addr.attn_split_word(a, addr.attn_row_words(a, s, half)[:, None] + iota)
        row = jnp.where(ok[:, None], row, view.shape[0])                 # out of range -> dropped
        view = view.at[row, col].set(_pack_bf16(rows.astype(jnp.bfloat16)), mode="drop")
    return view.reshape(-1)


def _kv_slots(a, tokens, block_tables):
    """Attention slots [T, W] of request-relative tokens [T, W] (-1 = none) through each
    row's manager block ids block_tables [T, MB], and their validity [T, W] (invalid
    slots are 0)."""
    mb = block_tables.shape[1]
    col, row_in_block = addr.attn_token_block_col(a, jnp.maximum(tokens, 0))
    ok = (tokens >= 0) & (col < mb)
    blk = jnp.take_along_axis(block_tables, jnp.clip(col, 0, mb - 1), axis=1)
    slot = addr.attn_slot(a, blk, row_in_block)
    ok = ok & addr.attn_slot_valid(a, slot)
    return jnp.where(ok, slot, 0), ok


def kv_rows(a, tokens, block_tables):
    """The K and V rows [T, W] i32 of request-relative tokens [T, W] in the buffer viewed
    as [rows, row_words] (``kv_table``; ``addressing.attn_rows_aligned`` layouts only),
    -1 where a token has no row: the rows that ``gather_kv`` reads."""
    if not addr.attn_rows_aligned(a):
        raise ValueError("kv_rows: needs addressing.attn_rows_aligned strides")
    slot, ok = _kv_slots(a, tokens, block_tables)
    return tuple(jnp.where(ok, addr.attn_row_index(a, slot, half), -1) for half in (0, 1))


def kv_table(cache, a):
    """The buffer as [rows, row_words] u32: one K or V row per row (``kv_rows``)."""
    return cache.reshape(-1, addr.attn_row_width_words(a))


def gather_kv(cache, a, tokens, block_tables, *, by_rows: bool | None = None):
    """K, V [T, W, head_dim] bf16 of request-relative tokens [T, W] (-1 = none) and a
    validity mask [T, W]; block_tables [T, MB] = each row's manager block ids.

    by_rows (None: whenever ``addressing.attn_rows_aligned``): gather whole rows, one
    index per row, from the buffer viewed as [rows, row_words]; else one (row, col)
    pair per word of the [rows, VIEW_COLS] view. The same words either way. On the H200
    the per-word form is a 2.6 ms fusion of a 15 ms serving step: its index arrays alone
    (T x W x row_words pairs) are larger than the rows."""
    slot, ok = _kv_slots(a, tokens, block_tables)
    by_rows = addr.attn_rows_aligned(a) if by_rows is None else by_rows
    if by_rows and not addr.attn_rows_aligned(a):
        raise ValueError("gather_kv: by_rows needs addressing.attn_rows_aligned strides")
    table = kv_table(cache, a) if by_rows else cache.reshape(addr.view_shape(a))
    iota = None if by_rows else jnp.arange(addr.attn_row_width_words(a), dtype=jnp.int32)   # words of a row
    out = []
    for half in (0, 1):
        if by_rows:                                   # table [total_words / row_words, row_words]
            w = jnp.take(table, addr.attn_row_index(a, slot, half), axis=0, mode="clip")    # [T, W, row_words]
        else:                                         # table [total_words / VIEW_COLS, VIEW_COLS]
            r, c = addr.attn_split_word(a, addr.attn_row_words(a, slot, half)[..., None] + iota)
            w = table.at[r, c].get(mode="clip")
        out.append(jnp.where(ok[..., None], _unpack_bf16(w), jnp.zeros((), jnp.bfloat16)))
    return out[0], out[1], ok


def sort_selected(sel):
    """Ascending token indices per row, -1 (empty) at the end: attention sees a set."""
    big = jnp.iinfo(jnp.int32).max
    s = jnp.sort(jnp.where(sel < 0, big, sel), axis=-1)
    return jnp.where(s == big, -1, s)


def sparse_attention(q, k, v, mask):
    """q [T, nh, hd] bf16; k, v [T, W, hd] bf16; mask [T, W] -> [T, nh, hd] f32 (batch invariant)."""
    hd = q.shape[2]
    scores = inv.batched_linear(q, k, b_transposed=True)                  # [T, nh, W]: q . k over hd
    scores = scores * jnp.float32(hd ** -0.5)
    p = inv.bf16(inv.masked_softmax(scores, mask[:, None, :]))
    return inv.batched_linear(p, v)                                      # [T, nh, hd]: p . v over W


def sparse_attention_rows(q, table, rows_k, rows_v, *, interpret=None):
    """``sparse_attention`` with K and V read by the contraction kernels from the cache's
    rows (``kv_table``, ``kv_rows``; -1 = no token) instead of a gathered [T, W, hd] copy:
    the same operations in the same order, so the same bits. q [T, nh, hd] bf16; rows_k,
    rows_v [T, W] -> [T, nh, hd] f32. What the serving step runs where the attention's
    contractions are kernels (``invariant.PALLAS_KERNELS``) and the rows are aligned."""
    from pallas_kernels.contractions.ordered_linear import ordered_linear_rows
    hd = q.shape[2]
    scores = ordered_linear_rows(q, table, rows_k, w_transposed=True, interpret=interpret)   # [T, nh, W]
    scores = scores * jnp.float32(hd ** -0.5)
    p = inv.bf16(inv.masked_softmax(scores, (rows_k >= 0)[:, None, :]))
    return ordered_linear_rows(p, table, rows_v, w_transposed=False, interpret=interpret)    # [T, nh, hd]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, nh, hd, ql = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.wq_a = nnx.Param(_normal(rngs, (ql, h), h ** -0.5, jnp.bfloat16))
        self.wq_b = nnx.Param(_normal(rngs, (nh * hd, ql), ql ** -0.5, jnp.bfloat16))
        self.wk = nnx.Param(_normal(rngs, (hd, h), h ** -0.5, jnp.bfloat16))
        self.wv = nnx.Param(_normal(rngs, (hd, h), h ** -0.5, jnp.bfloat16))
        self.wo = nnx.Param(_normal(rngs, (h, nh * hd), (nh * hd) ** -0.5, jnp.bfloat16))
        self.indexer = Indexer(cfg.indexer, h, ql, rngs=rngs)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w_gate = nnx.Param(_normal(rngs, (cfg.mlp_size, h), h ** -0.5, jnp.bfloat16))
        self.w_up = nnx.Param(_normal(rngs, (cfg.mlp_size, h), h ** -0.5, jnp.bfloat16))
        self.w_down = nnx.Param(_normal(rngs, (h, cfg.mlp_size), cfg.mlp_size ** -0.5, jnp.bfloat16))
        self.num_heads, self.head_dim = nh, hd

    def __call__(self, cache, x, batch, *, layout: CacheLayout, layer: int, implementation=None):
        t = x.shape[0]
        idx = self.indexer
        a = inv.bf16(self.attn_norm(x))
        # one loop per input: the attention's and the indexer's projections of `a`, then of `qr`
        qr, k, v, ik, ig = inv.linear_multi(
            a, [self.wq_a[...].T, self.wk[...].T, self.wv[...].T] + idx.x_weights())
        qr = inv.bf16(qr)
        q, iq = inv.linear_multi(qr, [self.wq_b[...].T] + idx.qr_weights())
        # Every write of the layer comes before its first read of the cache: this
        # step's K/V (attention region) first, then the indexer's writes (indexer
        # region) and its selection. A write that does not depend on an earlier read
        # (K/V after the selection) makes XLA copy the whole cache to keep the read's
        # input alive; in this order each read feeds the next layer's first write.
        astr = layout.attn_strides(layer, self.head_dim * BF16_BYTES)
        slots = jnp.concatenate([batch["dec_attn_slots"].reshape(-1), batch["pre_attn_slots"].reshape(-1)])
        cache = write_kv(cache, astr, inv.bf16(k), inv.bf16(v), slots)
        cache, sel = idx(cache, a, qr, batch, layout=layout, layer=layer, implementation=implementation,
                         projections=idx.finish_projection(a, ik, ig, iq))
        q = inv.bf16(q).reshape(t, self.num_heads, self.head_dim)
        tables = batch["block_table_blocks"][batch["token_table_rows"]]   # [T, MB]
        chosen = sort_selected(sel)
        if ATTENTION_FROM_ROWS and inv.kernel_for("attention") and addr.attn_rows_aligned(astr):
            o = sparse_attention_rows(q, kv_table(cache, astr), *kv_rows(astr, chosen, tables))
        else:
            kk, vv, ok = gather_kv(cache, astr, chosen, tables)
            o = sparse_attention(q, kk, vv, ok)
        x = x + inv.linear(inv.bf16(o.reshape(t, -1)), self.wo[...].T)
        m = inv.bf16(self.mlp_norm(x))
        g, u = inv.linear_multi(m, [self.w_gate[...].T, self.w_up[...].T])
        x = x + inv.linear(inv.bf16(inv.silu(g) * u), self.w_down[...].T)
        return cache, x, sel


class Decoder(nnx.Module):
    """Embedding, ``num_layers`` DecoderLayers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), 1.0, jnp.bfloat16))
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size),
                                         cfg.hidden_size ** -0.5, jnp.bfloat16))

    @classmethod
    def random(cls, cfg: ModelConfig = ModelConfig(), seed: int = 0) -> "Decoder":
        return cls(cfg, rngs=nnx.Rngs(params=seed))

    def __call__(self, cache, batch, *, layout: CacheLayout, implementation=None):
        """One serving step over the flat tokens of ``batch`` (step_metadata arrays).

        Returns (cache, next_token [T] i32 greedy prediction after each token,
        selected [num_layers, T, topk + kpool - 1] i32 raw selections).
        """
        if layout.num_layers != self.config.num_layers or layout.attn_block_bytes < self.config.attn_block_bytes:
            raise ValueError("layout does not match the model: use ModelConfig.layout(num_blocks)")
        ids = jnp.concatenate([batch["dec_token_ids"].reshape(-1), batch["pre_token_ids"].reshape(-1)])
        x = self.embed[...][ids].astype(jnp.float32)
        sels = []
        for i, lyr in enumerate(self.layers):
            cache, x, sel = lyr(cache, x, batch, layout=layout, layer=i, implementation=implementation)
            sels.append(sel)
        logits = inv.linear(inv.bf16(self.final_norm(x)), self.lm_head[...].T)
        return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.stack(sels)

