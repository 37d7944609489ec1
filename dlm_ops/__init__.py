"""dlm_ops: fused attention operators for diffusion language models."""

from . import geometry, reference
from .errors import UnsupportedConfig
from .ops.diffusion import (
    block_causal_attn_func,
    diffusion_attn_func,
    diffusion_attn_varlen_func,
)

__version__ = "0.1.0"

__all__ = [
    "UnsupportedConfig",
    "block_causal_attn_func",
    "diffusion_attn_func",
    "diffusion_attn_varlen_func",
    "geometry",
    "reference",
]
