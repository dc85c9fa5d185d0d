"""lowprec for JAX: the same quantizers as ``lowprec.quant`` (same names, arguments and bits), jit- and vmap-able.

Import it explicitly (``import lowprec.jax``); ``import lowprec`` does not import JAX.
"""

from ._quantize import quantize as quantize

__all__ = ["quantize"]
