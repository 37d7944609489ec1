"""Pattern selection and step caches for DLM inference: which blocks or columns a sparse op visits
(SparseD, BA-Att, PulseCol) and when a cached result is reused (FlashBlock). One module per method;
this package re-exports their public names."""

from .flashblock import FlashBlockCache  # noqa: E402,F401
