"""The kpool indexer as a flax (nnx) layer, and its safetensors loader.

Parameters carry the checkpoint's names and shapes (docs/semantics.md 0):

==============================  ======================  =====  ===============================
name                            shape                   dtype  use
==============================  ======================  =====  ===============================
``wq_b``                        [H*D, q_lora_rank]      bf16   q = qr @ wq_b^T -> [H, D]
``wk``                          [D, hidden]             bf16   k = LayerNorm(x @ wk^T)
``k_norm.weight``, ``.bias``    [D]                     f32    LayerNorm(D, eps 1e-6), in fp32
``weights_proj``                [H, hidden]             f32    w = fp32(x) @ fp32(W_p)^T
``index_kpool_compress_gate``   [D, hidden]             bf16   gate = x @ gate^T
``index_kpool_compress_ape``    [R, D]                  f32    pooling position bias
==============================  ======================  =====  ===============================

(H = ``n_heads``, D = 128, R = ``kpool``.) ``weights_proj`` is kept as the fp32
copy docs/semantics.md 1.1 asks for (bf16 rounding of the per-head weights flips close
pool rankings); a bf16 checkpoint tensor converts to it exactly.

A forward pass (docs/semantics.md 1.4) computes the projections of every token of the step,
writes the cache through ``glm5_jax.ops`` (decode grid and the heads of
non-aligned prefill chunks through ``decode_update``, the aligned prefill rest
through ``compress_prefill`` + ``seed_tail``), then selects each query row's
tokens with ``ops.select_tokens``. All projections are batch invariant
(``glm5_jax.model.invariant``): a token's k, gate, q and weights do not depend on what
else is in the step.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import ops
from ..config import IndexerConfig
from ..layout import CacheLayout
from . import invariant as inv

K_NORM_EPS = 1e-6


class LayerNorm(nnx.Module):
    """LayerNorm with the checkpoint's parameter names (``weight``, ``bias``), computed in fp32."""

    def __init__(self, dim: int, eps: float = K_NORM_EPS):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return inv.layer_norm(x, self.weight[...], self.bias[...], self.eps)


def _normal(rngs, shape, std, dtype):
    """N(0, std^2) initial weights. Drawn with numpy from a seed taken off the nnx
    key stream (no per-shape jax compilation on first use, which cost seconds)."""
    import jax
    import ml_dtypes
    seed = np.asarray(jax.random.key_data(rngs.params())).astype(np.uint64).tolist()
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(std)
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jnp.asarray(x.astype(ml_dtypes.bfloat16))
    return jnp.asarray(x.astype(dtype))


def prefill_row_ends(pre_positions, pre_tslots=None):
    """[bp] i32: one past the last flat row of each prefill grid row's chunk, 0 for a
    row that seeds nothing (seed_tail's request_ends_tokens).

    pre_positions: [bp, width] i32, each grid row one chunk, left-aligned, -1 after
    it (``step_metadata``); row r's chunk ends at flat row r * width + its tokens.
    pre_tslots: the grid's [bp, width] tail slots (-1 on head tokens and padding), if
    given: a row without one (empty, or all head tokens) gets 0, as does an empty row
    without them.
    """
    bp, width = pre_positions.shape
    n = jnp.sum(pre_positions >= 0, axis=1).astype(jnp.int32)
    seeds = n > 0 if pre_tslots is None else jnp.any(pre_tslots >= 0, axis=1)
    return jnp.where(seeds, jnp.arange(bp, dtype=jnp.int32) * width + n, 0)


class Indexer(nnx.Module):
    """One kpool indexer layer: projections, cache writes, token selection."""

    def __init__(self, config: IndexerConfig, hidden_size: int, q_lora_rank: int, *, rngs: nnx.Rngs):
        if not isinstance(config, IndexerConfig):
            raise ValueError("config must be an IndexerConfig")
        h, d, r = config.n_heads, config.head_dim, config.kpool
        self.config = config
        self.hidden_size = int(hidden_size)
        self.q_lora_rank = int(q_lora_rank)
        self.wq_b = nnx.Param(_normal(rngs, (h * d, q_lora_rank), q_lora_rank ** -0.5, jnp.bfloat16))
        self.wk = nnx.Param(_normal(rngs, (d, hidden_size), hidden_size ** -0.5, jnp.bfloat16))
        self.k_norm = LayerNorm(d)
        # bf16-valued fp32 copy, like an fp32 copy of a bf16 checkpoint tensor
        self.weights_proj = nnx.Param(_normal(rngs, (h, hidden_size), hidden_size ** -0.5,
                                              jnp.bfloat16).astype(jnp.float32))
        self.index_kpool_compress_gate = nnx.Param(
            _normal(rngs, (d, hidden_size), hidden_size ** -0.5, jnp.bfloat16))
        self.index_kpool_compress_ape = nnx.Param(_normal(rngs, (r, d), 0.5, jnp.float32))

    # ---- projections (docs/semantics.md 1.1) -----------------------------------------------------
    def x_weights(self) -> list:
        """Transposed bf16 weights applied to x ([hidden, D] each): wk, then the gate."""
        return [self.wk[...].T, self.index_kpool_compress_gate[...].T]

    def qr_weights(self) -> list:
        """Transposed bf16 weights applied to qr: wq_b ([q_lora_rank, H*D])."""
        return [self.wq_b[...].T]

    def finish_projection(self, x, k_raw, gate_raw, q_raw):
        """From the bf16-GEMM outputs (f32) to (k, gate, q, weights); see ``project``."""
        c = self.config
        t = x.shape[0]
        k = inv.bf16(self.k_norm(inv.bf16(k_raw)))                   # bf16 GEMM out, LN in fp32, bf16
        gate = inv.bf16(gate_raw)
        q = inv.bf16(q_raw).reshape(t, c.n_heads, c.head_dim)
        w = inv.linear_f32(x.astype(jnp.float32), self.weights_proj[...].astype(jnp.float32).T)
        return k, gate, q, w

    def project(self, x, qr):
        """x [T, hidden] bf16, qr [T, q_lora_rank] bf16 ->
        (k [T, D] bf16, gate [T, D] bf16, q [T, H, D] bf16, weights [T, H] f32).

        k = bf16(LayerNorm_fp32(bf16(x @ wk^T))); gate = bf16(x @ gate^T);
        q = bf16(qr @ wq_b^T); weights = fp32(x) @ fp32(W_p)^T (docs/semantics.md 1.1).
        """
        k_raw, gate_raw = inv.linear_multi(x, self.x_weights())
        (q_raw,) = inv.linear_multi(qr, self.qr_weights())
        return self.finish_projection(x, k_raw, gate_raw, q_raw)

    # ---- one layer of a serving step --------------------------------------------------
    def __call__(self, cache, x, qr, batch, *, layout: CacheLayout, layer: int,
                 implementation=None, projections=None):
        """Write this step's tokens into the cache, then select tokens for every query row.

        x, qr: [T, ...] bf16 for the step's flat tokens (decode grid first, then the
        prefill grid; ``glm5_jax.serving.step_metadata``). ``batch``: the step arrays (dict).
        ``projections``: (k, gate, q, weights) if already computed (``project``).
        ``implementation``: one name for every op, or None for each op's default, the
        prefill grid's selection taking the default of prefill chunks
        (``ops.default_select_implementation`` at ``ops.TC_MIN_ROWS`` rows, and on the
        Pallas kernels their prefill path, ``ops.default_read_path``) whatever its width.
        Returns (cache, selected [T, topk + kpool - 1] i32 request-relative tokens,
        decode-grid rows first).
        """
        bd, nd = batch["dec_positions"].shape
        bp, np_ = batch["pre_positions"].shape
        k, gate, q, w = self.project(x, qr) if projections is None else projections
        ape = self.index_kpool_compress_ape[...].astype(jnp.float32)
        kw = dict(implementation=implementation)
        # 1. decode rows and the heads of non-aligned prefill chunks: stash in the
        #    ring, complete pools reading earlier members from the ring (docs/semantics.md 5.4)
        ui = batch["upd_token_index"]
        cache = ops.decode_update(cache, layout, layer, k[ui], gate[ui], ape, batch["upd_slot_pools"],
                                  batch["upd_tslots"], batch["upd_positions"], **kw)
        # 2. aligned rest of each prefill chunk: compress completed pools, seed the
        #    tail ring with the chunk's last kpool tokens (docs/semantics.md 5.2, 5.3)
        nd_tok = bd * nd
        pk, pg = k[nd_tok:], gate[nd_tok:]
        cache = ops.compress_prefill(cache, layout, layer, pk, pg, ape,
                                     batch["pre_slot_pools"].reshape(-1), **kw)
        # the seed visits only each chunk's last kpool rows (same bytes, cost per request)
        cache = ops.seed_tail(cache, layout, layer, pk, pg, batch["pre_tslots"].reshape(-1),
                              request_ends_tokens=prefill_row_ends(batch["pre_positions"],  batch["pre_tslots"]), **kw)
        # 3. read path, after every write of this layer (docs/semantics.md 1.3, 1.4)
        q8, wq = ops.prepare_queries(q, w, **kw)
        pages = batch["page_table_pages"]
        sel_d = ops.select_tokens(cache, layout, layer, q8[:nd_tok].reshape(bd, nd, *q8.shape[1:]),
                                  wq[:nd_tok].reshape(bd, nd, -1), pages[:bd], batch["dec_positions"], **kw)
        # prefill rows take one implementation (and for the Pallas kernels one path)
        # whatever the width of this step's grid (bucketed from the batch's longest
        # chunk), so a prompt's selection does not depend on how it was chunked or
        # what it was batched with
        impl_p = implementation if implementation is not None else \
            ops.default_select_implementation(layout, layer, q8.shape[-2], ops.TC_MIN_ROWS)
        path_p = ops.default_read_path(ops.TC_MIN_ROWS) if impl_p == "pallas" else None
        sel_p = ops.select_tokens(cache, layout, layer, q8[nd_tok:].reshape(bp, np_, *q8.shape[1:]),
                                  wq[nd_tok:].reshape(bp, np_, -1), pages[bd:], batch["pre_positions"],
                                  implementation=impl_p, path=path_p)
        return cache, jnp.concatenate([sel_d, sel_p], axis=0)


# ---------------------------------------------------------------------------------
# checkpoint loading (safetensors)
# ---------------------------------------------------------------------------------
PARAM_NAMES = ("wq_b", "wk", "k_norm.weight", "k_norm.bias", "weights_proj",
               "index_kpool_compress_gate", "index_kpool_compress_ape")


def expected_shapes(indexer: Indexer) -> dict:
    c = indexer.config
    h, d, r = c.n_heads, c.head_dim, c.kpool
    return {"wq_b": (h * d, indexer.q_lora_rank), "wk": (d, indexer.hidden_size), "k_norm.weight": (d,),
            "k_norm.bias": (d,), "weights_proj": (h, indexer.hidden_size),
            "index_kpool_compress_gate": (d, indexer.hidden_size), "index_kpool_compress_ape": (r, d)}


def _param(indexer: Indexer, name: str):
    obj = indexer
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _lookup(tensors: dict, prefix: str, name: str):
    """A checkpoint may name a linear layer ``<name>.weight`` or a raw parameter ``<name>``."""
    for key in (f"{prefix}{name}.weight", f"{prefix}{name}") if not name.startswith("k_norm.") \
            else (f"{prefix}{name}",):
        if key in tensors:
            return key
    return None


def indexer_state_dict(indexer: Indexer, prefix: str = "") -> dict:
    """{checkpoint name: numpy array} of the indexer's parameters (linear weights as ``<name>.weight``)."""
    import ml_dtypes
    out = {}
    for name in PARAM_NAMES:
        v = np.asarray(_param(indexer, name)[...])
        if v.dtype == jnp.bfloat16:
            v = v.view(np.uint16).view(ml_dtypes.bfloat16)
        key = f"{prefix}{name}" if name.startswith("k_norm.") or name == "index_kpool_compress_ape" \
            else f"{prefix}{name}.weight"
        out[key] = v
    return out


def _safetensors(name: str):
    """safetensors.numpy.<name>, or an ImportError saying which extra installs it."""
    try:
        import safetensors.numpy as st
    except ImportError as e:
        raise ImportError("loading or saving indexer weights needs the safetensors package: "
                          "pip install 'glm5-jax[weights]'") from e
    return getattr(st, name)


def load_indexer_safetensors(indexer: Indexer, path, prefix: str = "") -> list:
    """Load an indexer's parameters from a safetensors file into ``indexer`` (in place).

    ``prefix``: e.g. ``"model.layers.3.self_attn.indexer."``. Every name of
    ``PARAM_NAMES`` must be present (as ``<prefix><name>.weight`` or
    ``<prefix><name>``) with the expected shape; a missing tensor or a shape
    mismatch is a ValueError naming it. Tensors are converted to the parameter's
    dtype (bf16 -> fp32 is exact; an fp32 tensor loaded into a bf16 parameter is
    rounded). Returns the checkpoint keys used.
    """
    load_file = _safetensors('load_file')
    tensors = load_file(str(path))
    shapes = expected_shapes(indexer)
    used = []
    for name in PARAM_NAMES:
        key = _lookup(tensors, prefix, name)
        if key is None:
            raise ValueError(f"checkpoint {path} has no tensor {prefix}{name}(.weight)")
        arr = tensors[key]
        if tuple(arr.shape) != shapes[name]:
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(arr.shape)}, "
                             f"expected {shapes[name]}")
        p = _param(indexer, name)
        p[...] = jnp.asarray(arr).astype(p[...].dtype)
        used.append(key)
    return used


def save_indexer_safetensors(indexer: Indexer, path, prefix: str = "") -> None:
    """Write the indexer's parameters under their checkpoint names (for tests and tools)."""
    save_file = _safetensors('save_file')
    save_file(indexer_state_dict(indexer, prefix), str(path))
