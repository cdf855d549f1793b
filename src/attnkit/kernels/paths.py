"""Paths inside a kernel: the ways one kernel evaluates the calls it supports.

A kernel may hold a fast path that serves only some of its calls (the chunked kernel's fused
block-sparse path runs PyTorch's CPU kernel, which needs float32/float64 CPU tensors with as
many value features as query and key features) beside its general path. Each path declares
what it needs beyond its kernel with the capabilities of :class:`attnkit.kernels.base.
Capabilities` and its own :meth:`Path.extra_reasons`; the kernel takes the first path that
serves a call (:meth:`attnkit.kernels.Kernel.choose_path`), and :func:`attnkit.kernels.explain`
reports the path taken and why each path before it was skipped. :meth:`Path.run` forces one
path, for checks: a call it does not serve is refused with a ValueError naming the kernel and
the path.
"""

from __future__ import annotations

from typing import ClassVar

from attnkit.kernels.base import Call, Capabilities, get
from attnkit.output import AttentionOutput

__all__ = ["Path"]


class Path(Capabilities):
    """One way a kernel evaluates a call.

    Subclasses set ``kernel`` (the registered name of the kernel the path belongs to) and
    ``name``, declare what they need beyond the kernel (the capabilities' defaults ask nothing
    more) and implement :meth:`attend`, which may assume that the kernel and the path both
    serve the call.
    """

    kernel: ClassVar[str]
    name: ClassVar[str]
    # A path takes the arguments its kernel takes unless it says otherwise.
    accepts_chunk_size: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return f"the {self.kernel} kernel's {self.name} path"

    def attend(self, call: Call) -> AttentionOutput:
        raise NotImplementedError

    def run(self, call: Call) -> AttentionOutput:
        """Evaluate ``call`` on this path, whatever the kernel would choose; raise ValueError
        naming the kernel and the path when either does not serve the call."""
        reasons = get(self.kernel).reasons_not_supported(call) + self.reasons_not_supported(call)
        if reasons:
            raise ValueError(
                f"kernel {self.kernel!r}, path {self.name!r} cannot evaluate this call: "
                + "; ".join(reasons)
            )
        return self.attend(call)

    def __repr__(self) -> str:
        return f"<path {self.name!r} of kernel {self.kernel!r}>"
