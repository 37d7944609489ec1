"""One module per op family; importing it registers the family's dlm:: ops."""

from . import diffusion, exact  # noqa: F401
