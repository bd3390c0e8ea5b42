"""The read path, one Pallas kernel per file: ``query_quant``, ``paged_logits``,
``paged_topk`` (logits fused with the top-k of ``pallas_kernels.topk``) and ``expand``."""
