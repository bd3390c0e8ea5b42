"""Serving on top of the library: ``blocks`` (BlockPool and its prefix cache),
``step_metadata`` (the static-shape step arrays), ``engine`` (the continuous-batching
Engine) and ``sharding`` (the device mesh and the per-shard cache). It may import
``glm5_jax.model``; nothing below it imports serving. Import the modules by name."""
