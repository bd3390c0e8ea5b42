"""Exact, deterministic top-k over rows of scores (docs/semantics.md 2.5, 5.9): ``topk_pools``.

The modules import one way: ``common`` (order keys, the streaming core, ``Tuning``,
the constants) <- the stages ``maxima``, ``floor``, ``filter``, ``select`` and
``fallback`` (one kernel each) <- ``driver`` (``topk_pools``, the mode dispatch).
"""
from .common import Tuning
from .driver import filter_overflowed, topk_pools

__all__ = ["Tuning", "filter_overflowed", "topk_pools"]
