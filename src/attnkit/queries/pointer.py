"""Pointer networks (Vinyals et al. 2015): attention over the inputs *is* the output.

An LSTM encoder reads the inputs x_1 … x_n into states e_1 … e_n; an LSTM decoder, started
from the encoder's last state, produces a state d_i per output step, and the additive attention
of d_i over the e_j is the output distribution itself (Vinyals et al. eq. 3):

    u^i_j = vᵀ tanh(W_1 e_j + W_2 d_i),   p(C_i | C_1 … C_{i−1}, P) = softmax(u^i).

(The default :class:`attnkit.scores.Additive` adds a bias b inside the tanh.) No context vector
is formed. The decoder's next input is the input the step pointed at (the
target's during training, ``targets``; the most probable one otherwise). Any score and alignment
may replace the additive score and softmax.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnkit import arguments, checks, hooks, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = ["PointerNetwork", "PointerOutput"]


class PointerOutput(NamedTuple):
    """weights (B, m, n): the output distribution of each of the m steps over the n inputs;
    pointers (B, m): the input each step pointed at (the targets when they were given)."""

    weights: Tensor
    pointers: Tensor

    @property
    def representation(self) -> Tensor:
        """The output distributions (B, m, n): a pointer network outputs its attention."""
        return self.weights

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}

    def nll(self, targets: Tensor, steps: Tensor | None = None) -> Tensor:
        """Mean −log p(target) over the steps where ``steps`` (B, m) is True (all if None)."""
        p = self.weights.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        nll = -p.clamp_min(torch.finfo(p.dtype).tiny).log()
        if steps is None:
            return nll.mean()
        return (nll * steps).sum() / steps.sum().clamp_min(1)


@REGISTRY.register("pointer_network")
class PointerNetwork(nn.Module):
    """Pointer network (Vinyals et al. 2015): the attention weights over the inputs are the output.

    Args:
        d_in: input feature size.
        d_hidden: LSTM state size (encoder and decoder).
        score: the score of decoder states (queries) against encoder states (keys); default
            Vinyals' additive score vᵀ tanh(W_1 e_j + W_2 d_i) with hidden size ``d_hidden``.
        align: the alignment that makes the output distribution (softmax as in the paper).
        exclusive: if True, an input already pointed at is masked out for later steps (each
            input is output once, as in sorting; not in Vinyals et al., who let the model learn
            it).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        d_in: int,
        d_hidden: int,
        *,
        score: Score | None = None,
        align: str | nn.Module = "softmax",
        exclusive: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_in = arguments.positive_int(d_in, "d_in")
        arguments.positive_int(d_hidden, "d_hidden")
        self.exclusive = arguments.boolean(exclusive, "exclusive")
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Linear(d_in, d_hidden, **kw)
        self.encoder = nn.LSTM(d_hidden, d_hidden, batch_first=True, **kw)
        self.decoder = nn.LSTMCell(d_hidden, d_hidden, **kw)
        self.start = nn.Parameter(torch.randn(d_hidden, **kw) / d_hidden**0.5)  # Vinyals' "⇒"
        score = checks.optional_score(score, "score") or Additive(
            d_hidden, d_hidden, d_hidden, **kw
        )
        self.attention = Attention(score, align)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        mask = masks.from_lengths(torch.tensor([4, 2]), 4)
        return cls(2, 3, exclusive=True), (example_tensor(2, 4, 2),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.BASIC]

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        targets: Tensor | None = None,
        *,
        steps: int | None = None,
    ) -> PointerOutput:
        """x (B, n, d_in); mask (B, n) or (B, 1, n) boolean, True = a real input; targets
        (B, m) long indices into the inputs (teacher forcing: step i+1 reads the input of
        target i); steps: number of output steps without targets (default n)."""
        x = checks.features(x, "x", self.d_in, what="d_in")
        checks.part_matches(self, "PointerNetwork", "x", x)
        keep = checks.feature_mask(mask, x, "mask", "x")
        x = checks.without_padding(x, keep)
        b, n = x.shape[:2]
        if targets is not None:
            if targets.dtype != torch.long or targets.dim() != 2 or targets.shape[0] != b:
                raise ValueError(
                    f"targets must be (B, m) long with B = {b}, got {tuple(targets.shape)} "
                    f"{targets.dtype}"
                )
            if targets.numel() and (targets.min() < 0 or targets.max() >= n):
                raise ValueError(f"targets must index the n = {n} inputs, got values outside")
            if steps is not None:
                raise ValueError("give targets or steps, not both: targets fix the steps")
            steps = targets.shape[1]
        steps = n if steps is None else arguments.positive_int(steps, "steps")
        if keep is None:
            keep = torch.ones(b, n, dtype=torch.bool, device=x.device)
        lengths = keep.sum(-1)
        if not torch.equal(keep, torch.arange(n, device=x.device) < lengths.unsqueeze(-1)):
            raise ValueError(
                "mask must keep a prefix of each sequence (padding at the end), as "
                "attnkit.masks.from_lengths gives: the encoder reads the inputs in order"
            )
        h = self.embed(x)  # (B, n, d_h)
        # Packed, so that the final (h, c) is each sequence's state after its last real input.
        if b == 0:  # nothing to pack: the encoder runs on the empty batch as it is
            enc, (h_n, c_n) = self.encoder(h)
        else:
            packed = pack_padded_sequence(
                h, lengths.clamp_min(1).cpu(), batch_first=True, enforce_sorted=False
            )
            enc_packed, (h_n, c_n) = self.encoder(packed)
            enc, _ = pad_packed_sequence(enc_packed, batch_first=True, total_length=n)
        rows = torch.arange(b, device=x.device)
        state = (h_n[-1], c_n[-1])
        inp = self.start.expand(b, -1)
        # The keys' part of the score once for all steps (Bahdanau's precomputation of W_1 e_j).
        score = self.attention.score
        score.check(enc[:, :1], enc)
        keys = score.project_key(enc)
        allowed = keep.clone()
        weights, pointers = [], []
        for i in range(steps):
            state = self.decoder(inp, state)
            e = score.pairwise(score.project_query(state[0].unsqueeze(-2)), keys)  # (B, 1, n)
            w = self.attention.align(e, allowed.unsqueeze(-2)).weights
            hooks.report(self.attention, w)
            w = w.squeeze(-2)  # (B, n): the output distribution of step i
            pick = targets[:, i] if targets is not None else w.detach().argmax(-1)
            weights.append(w)
            pointers.append(pick)
            if self.exclusive:
                allowed = allowed & (torch.arange(n, device=x.device) != pick.unsqueeze(-1))
            inp = h[rows, pick]
        if not weights:
            return PointerOutput(x.new_zeros(b, 0, n), torch.zeros(b, 0, dtype=torch.long))
        return PointerOutput(torch.stack(weights, 1), torch.stack(pointers, 1))
