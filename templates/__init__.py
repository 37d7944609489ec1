"""Triton kernels (installed as ``dlm_ops.templates``): plain @triton.jit kernels and Inductor
templates for the backends that need them (issue #3)."""
