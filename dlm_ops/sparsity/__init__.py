"""Pattern selection and step caches for DLM inference: which blocks or columns a sparse op visits
(SparseD, BA-Att, PulseCol) and when a cached result is reused (FlashBlock). One module per method;
this package re-exports their public names."""

from .tables import (
    block_table_to_indices,
    column_mask_to_indices,
    indices_to_block_table,
    indices_to_column_mask,
)
from .sparsed import sparsed_block_mass, sparsed_select
from .ba_att import ba_att_scores, ba_att_select
from .pulsecol import pulsecol_column_mass, pulsecol_select
from .flashblock import FlashBlockCache
from .caches import BAAttCache, PulseColCache, SparseDCache, StepCache, pulse_steps

__all__ = [
    "block_table_to_indices",
    "column_mask_to_indices",
    "indices_to_block_table",
    "indices_to_column_mask",
    "sparsed_block_mass",
    "sparsed_select",
    "ba_att_scores",
    "ba_att_select",
    "pulsecol_column_mass",
    "pulsecol_select",
    "StepCache",
    "SparseDCache",
    "BAAttCache",
    "PulseColCache",
    "pulse_steps",
    "FlashBlockCache",
]
