"""torch.compile integration (installed as ``dlm_ops.lowerings``): the pass that rewrites
flex_attention calls with a block-diffusion mask_mod to the dlm:: ops lands here (issue #4)."""
