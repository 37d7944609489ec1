"""torch.compile integration switches: the flex_attention rewrite (lowerings/flex_rewrite.py).

Importing dlm_ops installs the rewrite into Inductor's pre-grad passes, chained in front of any pass
already configured there. ``disable()`` (or DLM_OPS_REWRITE_FLEX=0 before import) leaves flex alone;
``stats()`` counts rewrites and declines with their reasons; each decision is logged at INFO on the
``dlm_ops.compile`` logger. Graphs already compiled keep what they were compiled with: call
``torch._dynamo.reset()`` after switching.
"""

from .lowerings.flex_rewrite import disable, enable, install, is_enabled, reset_stats, stats

__all__ = ["disable", "enable", "install", "is_enabled", "reset_stats", "stats"]
