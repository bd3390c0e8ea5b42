"""The ground floor of the kernel library: strides (``CacheStrides``), addressing (the
only offset arithmetic), bit-exact shared numerics and the Pallas backend glue.

Importing this package imports no jax: ``strides`` and ``addressing`` are plain
Python, so the layout planner stays instant; import the modules by name.
"""
