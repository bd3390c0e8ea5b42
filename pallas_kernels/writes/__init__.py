"""The cache writers, one Pallas kernel per file: ``tail_seed``, ``pool_compress``,
``decode_update``. Each imports only ``pallas_kernels.core``."""
