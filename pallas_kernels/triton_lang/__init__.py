"""Write kernels in the Triton language, called through ``jax_triton.triton_call``.

The same three cache writers as the Pallas kernels one directory up
(``tail_seed``, ``pool_compress``, ``decode_update``), byte-identical to
``glm5_jax.reference``. Importing this package needs neither ``triton`` nor
``jax_triton``; ``_call.unavailable_reason()`` says whether they can run here
(a GPU backend and an importable ``jax_triton``), and the kernel modules are
imported only after that check passes.
"""
