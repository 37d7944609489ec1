"""dlm_ops: fused attention operators for diffusion language models."""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path


def _alias_repo_packages() -> None:
    """lowerings/ and templates/ sit beside dlm_ops/ in the repository and install as
    dlm_ops.lowerings / dlm_ops.templates (pyproject package-dir). When dlm_ops is imported from a
    plain checkout instead (PYTHONPATH=., a non-editable install shadowed by the working tree), map
    them here so that the kernels are found the same way."""
    root = _Path(__file__).resolve().parent.parent
    for name in ("lowerings", "templates"):
        full = f"{__name__}.{name}"
        init = root / name / "__init__.py"
        if full in _sys.modules or _importlib_util.find_spec(full) is not None or not init.exists():
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

from . import compile  # noqa: E402  (after the ops: the rewrite pass emits them)

compile.install()

__version__ = "0.1.0"

__all__ = [
    "UnsupportedConfig",
    "attention",
    "is_eligible",
    "block_causal_attn_func",
    "diffusion_attn_func",
    "diffusion_attn_varlen_func",
    "compile",
    "geometry",
    "masks",
    "reference",
]

# -- sparse attention (issue #5) ----------------------------------------------------------------
from .ops.sparse import block_sparse_attn, column_sparse_attn  # noqa: E402

__all__ += ["block_sparse_attn", "column_sparse_attn"]
