"""How attention is evaluated: the dense reference path and the SDPA dispatch."""

from attnkit.kernels import dense, sdpa

__all__ = ["dense", "sdpa"]
