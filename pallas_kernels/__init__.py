"""Standalone Pallas kernel library for the kpool indexer cache (no glm5_jax import)."""
from .core.strides import CacheStrides

__all__ = ["CacheStrides"]
