"""dlm_ops: fused attention operators for diffusion language models."""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path


def _alias_repo_packages() -> None:
    """lowerings/ and templates/ sit beside dlm_ops/ in the repository and install as
    dlm_ops.lowerings / dlm_ops.templates (pyproject package-dir). When this dlm_ops is imported
    from a checkout (PYTHONPATH=., a git worktree while another checkout is installed editable),
    the folders beside it win over whatever an installed finder would map, so that the kernels
    always come from the same tree as the Python code."""
    root = _Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").exists():  # installed in site-packages: nothing beside it is ours
        return
    for name in ("lowerings", "templates"):
        full = f"{__name__}.{name}"
        init = root / name / "__init__.py"
        if full in _sys.modules or not init.exists():
            continue
        spec = _importlib_util.spec_from_file_location(full, init,
                                                       submodule_search_locations=[str(init.parent)])
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[full] = module
        spec.loader.exec_module(module)


_alias_repo_packages()

from . import geometry, masks, reference
from .errors import UnsupportedConfig
from .ops.exact import attention, is_eligible
from .ops.diffusion import (
    block_causal_attn_func,
    diffusion_attn_func,
    diffusion_attn_varlen_func,
)
from .ops.cached import (
    block_decode_attn,
    flashblock_attn,
    flashblock_refresh,
    merge_attn_states,
)
from .ops.hybrid import block_hybrid_attn, block_hybrid_train_attn, hybrid_state_update
from .ops.sparse import block_sparse_attn, column_sparse_attn
from . import sparsity  # pattern selection, step caches, FlashBlockCache

from . import compile  # noqa: E402  (after the ops: the rewrite pass emits them)

compile.install()

__version__ = "0.1.0"

__all__ = [
    "UnsupportedConfig",
    # exact attention
    "attention",
    "is_eligible",
    # block diffusion
    "block_causal_attn_func",
    "diffusion_attn_func",
    "diffusion_attn_varlen_func",
    # cached-block attention
    "block_decode_attn",
    "merge_attn_states",
    "flashblock_attn",
    "flashblock_refresh",
    # block-hybrid attention (LLaDA-Hybrid)
    "block_hybrid_attn",
    "block_hybrid_train_attn",
    "hybrid_state_update",
    # sparse attention
    "block_sparse_attn",
    "column_sparse_attn",
    # modules
    "compile",
    "geometry",
    "masks",
    "reference",
    "sparsity",
]
