"""glm5-jax: the GLM-5.3-Flash kpool sparse-attention indexer cache in JAX + Pallas.

The public API: ``IndexerConfig``, ``CacheLayout``, the ops (``glm5_jax.ops``, and
its public ops by name here) and ``Engine`` (``glm5_jax.serving.engine``).

``import glm5_jax`` imports numpy only (the layout planner, ``python -m glm5_jax
layout``, never imports jax): the ops (jax) and the Engine (jax, flax) are imported
when first asked for.
"""
import importlib as _importlib
from typing import TYPE_CHECKING

from .config import IndexerConfig
from .layout import CacheLayout

if TYPE_CHECKING:
    from . import ops
    from .ops import (compress_prefill, decode_update, expand_pools, fwht_quant, paged_logits,
                      prepare_queries, seed_tail, select_tokens, topk_pools)
    from .serving.engine import Engine

__version__ = "0.1.0"

_OPS = ("seed_tail", "compress_prefill", "decode_update", "fwht_quant", "prepare_queries",
        "paged_logits", "topk_pools", "expand_pools", "select_tokens")
__all__ = ["IndexerConfig", "CacheLayout", "ops", *_OPS, "Engine"]


def __getattr__(name: str):
    if name == "ops" or name in _OPS:
        ops = _importlib.import_module(f"{__name__}.ops")
        value = ops if name == "ops" else getattr(ops, name)
    elif name == "Engine":
        value = _importlib.import_module(f"{__name__}.serving.engine").Engine
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
