"""The model side: ``indexer`` (the flax nnx indexer, safetensors weights), ``decoder``
(the tiny decoder the engine serves) and ``invariant`` (the batch-invariant math both
use). It imports the library (ops, layout, config), never ``glm5_jax.serving``.
Import the modules by name (they need flax)."""
