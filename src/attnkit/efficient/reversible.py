"""Reversible residual layers (RevNet: Gomez et al. 2017; as used by the Reformer, Kitaev et al.
2020, Sec. 3, and Brauwers 3.1 on the Reformer).

The features are split into two halves and each layer computes

    y₁ = x₁ + F(x₂),    y₂ = x₂ + G(y₁),

whose inverse is x₂ = y₂ − G(y₁), x₁ = y₁ − F(x₂). The backward pass therefore needs only the
stack's output: every layer's input is reconstructed from its output while going back, so the
activations stored for backward do not grow with the number of layers. F is typically attention
and G a feed-forward block. Random draws inside F and G (dropout, fresh LSH rotations) are
replayed exactly: the random state before each call is kept and restored for the recomputation.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import hooks, masks
from attnkit import taxonomy as tx
from attnkit.efficient.lsh import LSHAttention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention

__all__ = ["ReversibleOutput", "ReversibleStack"]


class ReversibleOutput(NamedTuple):
    """The stack's output (B, …, L, 2h), the halves y₁ and y₂ concatenated, and the attention
    weights the blocks reported (with ``need_weights=True``), by block."""

    output: Tensor
    weights: dict[str, Tensor]

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return dict(self.weights)


def _takes_mask(block: nn.Module) -> bool:
    return "mask" in inspect.signature(block.forward).parameters


def _call(block: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    out = block(x, mask=mask) if _takes_mask(block) else block(x)
    if not isinstance(out, Tensor) or out.shape != x.shape:
        raise ValueError(
            f"a reversible block must map (…, L, h) to the same shape; {type(block).__name__} "
            f"gave {getattr(out, 'shape', type(out).__name__)} for {tuple(x.shape)}"
        )
    return out


class _RandomState:
    """The random state before a call, to replay the call's draws in the backward pass."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def replay(self):
        devices = [self.device] if self.cuda is not None else []
        forked = torch.random.fork_rng(devices=devices)
        forked.__enter__()
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        return forked


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, stack, mask, *params):
        states = []
        with torch.no_grad():
            for f, g in zip(stack.f, stack.g, strict=True):
                states.append(_RandomState(x1.device))
                x1 = x1 + _call(f, x2, mask)
                states.append(_RandomState(x1.device))
                x2 = x2 + _call(g, x1, mask)
        ctx.stack, ctx.states, ctx.has_mask = stack, states, mask is not None
        ctx.save_for_backward(x1, x2, *([mask] if mask is not None else []))
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        stack = ctx.stack
        y1, y2, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        params = list(stack.parameters())
        grads = {id(p): torch.zeros_like(p) for p in params}
        states = list(ctx.states)

        def rerun(block, x, dout, state):
            """Recompute block(x) with its random draws, and its vector-Jacobian product."""
            own = [p for p in block.parameters() if p.requires_grad]
            forked = state.replay()
            try:
                with torch.enable_grad(), hooks.listen(lambda report: None):
                    x = x.detach().requires_grad_()
                    out = _call(block, x, mask)
                got = torch.autograd.grad(out, [x, *own], dout, allow_unused=True)
            finally:
                forked.__exit__(None, None, None)
            for p, gp in zip(own, got[1:], strict=True):
                if gp is not None:
                    grads[id(p)] += gp
            return out.detach(), got[0]

        for f, g in zip(reversed(stack.f), reversed(stack.g), strict=True):
            g_state, f_state = states.pop(), states.pop()
            gy1, dx = rerun(g, y1, dy2, g_state)
            dy1 = dy1 + dx
            x2 = y2 - gy1  # the inverse: x₂ = y₂ − G(y₁)
            fx2, dx = rerun(f, x2, dy1, f_state)
            dy2 = dy2 + dx
            y1, y2 = y1 - fx2, x2  # x₁ = y₁ − F(x₂)
        return (dy1, dy2, None, None, *(grads[id(p)] for p in params))


@REGISTRY.register("reversible")
class ReversibleStack(nn.Module):
    """A stack of reversible residual layers y₁ = x₁ + F(x₂), y₂ = x₂ + G(y₁) (RevNet; Reformer
    Sec. 3) whose backward pass reconstructs each layer's input from its output instead of
    storing it.

    Args:
        f: the F blocks (e.g. attention), each mapping (…, L, h) to (…, L, h).
        g: the G blocks (e.g. feed-forward), as many as ``f``.

    ``forward(x, mask=None)`` takes x (B, …, L, 2h), split into x₁ = x[..., :h], x₂ = x[..., h:]
    (the Reformer feeds the same embedding to both halves: pass ``torch.cat([e, e], -1)``), and
    passes ``mask`` to the blocks whose forward takes a ``mask``; a mask that no block takes is
    refused. Gradients are those of the plain stack (second derivatives are not supported).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(self, f: Sequence[nn.Module], g: Sequence[nn.Module]) -> None:
        super().__init__()
        f, g = list(f), list(g)
        for name, blocks in (("f", f), ("g", g)):
            bad = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module)]
            if bad:
                raise TypeError(f"{name} must hold nn.Modules, got {bad}")
        if not f or len(f) != len(g):
            raise ValueError(
                f"need as many F blocks as G blocks, at least one; got {len(f)} and {len(g)}"
            )
        self.f, self.g = nn.ModuleList(f), nn.ModuleList(g)

    @classmethod
    def example(cls):
        f = [_SelfAttentionBlock(4, seed=s) for s in range(2)]
        g = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4)) for _ in range(2)]
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(f, g), (example_tensor(2, 6, 8),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        # its blocks see one sequence only, so the attention inside is self-attention
        return [tx.QueryType.SELF_ATTENTIVE]

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] % 2:
            raise ValueError(
                f"ReversibleStack: x must be (…, L, 2h) with an even feature size, got "
                f"{getattr(x, 'shape', type(x).__name__)}"
            )
        h = x.shape[-1] // 2
        return x[..., :h], x[..., h:]

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> ReversibleOutput:
        x1, x2 = self._split(x)
        if mask is not None and not any(_takes_mask(b) for b in [*self.f, *self.g]):
            raise ValueError("ReversibleStack: a mask was given but no block takes a mask")
        params = [p for p in self.parameters() if p.requires_grad]
        grad = torch.is_grad_enabled() and (x.requires_grad or bool(params))
        found: dict[str, Tensor] = {}
        if need_weights or hooks.listening():
            with hooks.listen() as reports:
                y1, y2 = self._run(x1, x2, mask, params, grad)
            for i, report in enumerate(reports):  # by call: F of layer 1, (G,) F of layer 2, …
                found[f"{report.name}{i}"] = report.weights
                hooks.report(self, report.weights, f"{report.name}{i}")  # to an outer listener
        else:
            y1, y2 = self._run(x1, x2, mask, params, grad)
        return ReversibleOutput(torch.cat([y1, y2], -1), found if need_weights else {})

    def _run(self, x1, x2, mask, params, grad):
        if grad:
            return _Reversible.apply(x1, x2, self, mask, *params)
        for f, g in zip(self.f, self.g, strict=True):
            x1 = x1 + _call(f, x2, mask)
            x2 = x2 + _call(g, x1, mask)
        return x1, x2

    @torch.no_grad()
    def inverse(self, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """The input x of the output y: x₂ = y₂ − G(y₁), x₁ = y₁ − F(x₂), layer by layer back.
        (Blocks that draw random numbers, e.g. dropout in training, are inverted only by the
        backward pass, which replays their draws.)"""
        y1, y2 = self._split(y)
        for f, g in zip(reversed(self.f), reversed(self.g), strict=True):
            y2 = y2 - _call(g, y1, mask)
            y1 = y1 - _call(f, y2, mask)
        return torch.cat([y1, y2], -1)


class _SelfAttentionBlock(nn.Module):
    """F of the example: LSH multi-head self-attention, as in the Reformer."""

    def __init__(self, d: int, seed: int = 0) -> None:
        super().__init__()
        self.mha = MultiHeadAttention(d, 2, attention=LSHAttention(d // 2, 2, 2, 3, seed=seed))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None:  # padded positions neither attend nor are attended
            mask = mask & mask.transpose(-1, -2)
        return self.mha(x, mask=mask).context
