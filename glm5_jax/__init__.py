"""glm5-jax: the GLM-5.3-Flash kpool sparse-attention indexer cache in JAX + Pallas."""
from .config import IndexerConfig
from .layout import CacheLayout

__version__ = "0.1.0"
__all__ = ["IndexerConfig", "CacheLayout"]
