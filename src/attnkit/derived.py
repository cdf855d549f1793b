"""Buffers derived from hyperparameters, exact in every dtype a module is moved to.

A buffer computed from a module's hyperparameters (RetNet's decays γ_h = 1 − 2^{−5−h}, the random
features a Performer draws from its own seeded generator) is made once, at construction, in the
construction dtype. ``module.double()`` would then cast the float32 values, keeping their
rounding (γ off by 1e-9, an orthogonal draw orthogonal to 1e-7 only), while the same module built
with ``dtype=torch.float64`` holds the exact values. :class:`DerivedBuffers` keeps a float64
master of each such buffer and re-derives the buffer from it after every ``.to()``,
``.double()``, ``.float()``, ``.half()`` or device move, so both routes give the same module.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DerivedBuffers"]


class DerivedBuffers(nn.Module):
    """A module some of whose buffers are functions of its hyperparameters
    (:meth:`register_derived`); they follow casts from a float64 master."""

    def register_derived(
        self,
        name: str,
        exact: Tensor,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        persistent: bool = True,
    ) -> None:
        """Register the buffer ``name`` holding ``exact`` (computed in float64) cast to
        ``device``/``dtype`` (default: the default dtype), and keep ``exact`` as its master."""
        masters = self.__dict__.setdefault("_derived_masters", {})
        masters[name] = exact.detach().to(device="cpu", dtype=torch.float64)
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer(name, exact.to(device=device, dtype=dtype), persistent=persistent)

    def set_derived(self, name: str, exact: Tensor) -> None:
        """Replace the buffer ``name``'s values (a new draw) by ``exact``, in place, in the
        buffer's dtype, and its master by ``exact``."""
        self.__dict__["_derived_masters"][name] = exact.detach().to("cpu", torch.float64)
        buffer = self._buffers[name]
        assert buffer is not None  # registered by register_derived
        with torch.no_grad():
            buffer.copy_(exact.to(device=buffer.device, dtype=buffer.dtype))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        for name, exact in self.__dict__.get("_derived_masters", {}).items():
            buffer = self._buffers.get(name)
            if buffer is not None and buffer.is_floating_point():
                # the cast chose the dtype and device; the values come from the master
                self._buffers[name] = exact.to(device=buffer.device, dtype=buffer.dtype)
        return out
