"""Batch-invariant contractions of the tiny model: ``ordered_linear``, ``ordered_sumsq``."""
