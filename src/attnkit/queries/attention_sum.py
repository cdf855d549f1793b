"""The attention-sum reader (Kadlec et al. 2016): attention over the document's tokens *is* the
answer distribution, summed over the occurrences of each candidate.

A bidirectional GRU encodes each document token, f_i = [→h_i; ←h_i]; another encodes the
question into g = [→h_last; ←h_first]. The weight of token i is s_i = softmax_i(f_i · g) and the
probability of a candidate word w is the sum of the weights of its occurrences (Kadlec et al.
eq. 1-2):

    P(w | q, d) = Σ_{i ∈ I(w, d)} s_i.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnkit import arguments, checks, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Dot

__all__ = ["AttentionSumOutput", "AttentionSumReader", "occurrences"]


def occurrences(tokens: Tensor, candidates: Tensor) -> Tensor:
    """(B, n, c) bool: document token i (tokens (B, n)) is candidate c (candidates (B, c))."""
    if tokens.dim() != 2 or candidates.dim() != 2 or tokens.shape[0] != candidates.shape[0]:
        raise ValueError(
            f"tokens must be (B, n) and candidates (B, c) with the same B, got "
            f"{tuple(tokens.shape)} and {tuple(candidates.shape)}"
        )
    return tokens.unsqueeze(-1) == candidates.unsqueeze(-2)


class AttentionSumOutput(NamedTuple):
    """probabilities (B, c): P(candidate | question, document); weights (B, n): s_i."""

    probabilities: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.probabilities

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


def _prefix_lengths(keep: Tensor, name: str) -> Tensor:
    lengths = keep.sum(-1)
    n = keep.shape[-1]
    if not torch.equal(keep, torch.arange(n, device=keep.device) < lengths.unsqueeze(-1)):
        raise ValueError(
            f"{name} must keep a prefix of each sequence (padding at the end), as "
            "attnkit.masks.from_lengths gives: the encoder reads the tokens in order"
        )
    return lengths


@REGISTRY.register("attention_sum_reader")
class AttentionSumReader(nn.Module):
    """Attention-sum reader (Kadlec et al. 2016).

    Args:
        d: feature size of the document and question token embeddings.
        d_hidden: GRU state size per direction (f_i and g have 2·d_hidden features).
        align: the alignment of s (softmax in the paper).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {
        "document_mask": ("document", "occurrence"),
        "question_mask": ("question",),
    }

    def __init__(
        self,
        d: int,
        d_hidden: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d = arguments.positive_int(d, "d")
        arguments.positive_int(d_hidden, "d_hidden")
        kw = {"device": device, "dtype": dtype}
        self.document_encoder = nn.GRU(d, d_hidden, batch_first=True, bidirectional=True, **kw)
        self.question_encoder = nn.GRU(d, d_hidden, batch_first=True, bidirectional=True, **kw)
        self.attention = Attention(Dot(), align)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        tokens = torch.tensor([[1, 2, 1, 3, 2], [4, 4, 5, 1, 0]])
        candidates = torch.tensor([[1, 2, 3], [4, 5, 1]])
        kwargs = {
            "document_mask": masks.from_lengths(torch.tensor([5, 4]), 5),
            "question_mask": masks.from_lengths(torch.tensor([3, 2]), 3),
        }
        args = (example_tensor(2, 5, 3, seed=1), example_tensor(2, 3, 3, seed=2))
        return cls(3, 2), (*args, occurrences(tokens, candidates)), kwargs

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def _encode(self, gru: nn.GRU, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """States (B, n, 2h) and [→h_last; ←h_first] (B, 2h), reading only the real tokens."""
        if x.shape[0] == 0:  # nothing to pack: the GRU runs on the empty batch as it is
            states, h_n = gru(x)
            return states, torch.cat([h_n[0], h_n[1]], -1)
        packed = pack_padded_sequence(
            x, lengths.clamp_min(1).cpu(), batch_first=True, enforce_sorted=False
        )
        out, h_n = gru(packed)
        states, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return states, torch.cat([h_n[0], h_n[1]], -1)

    def forward(
        self,
        document: Tensor,
        question: Tensor,
        occurrence: Tensor,
        document_mask: Tensor | None = None,
        question_mask: Tensor | None = None,
    ) -> AttentionSumOutput:
        """document (B, n, d), question (B, m, d) embeddings; occurrence (B, n, c) bool (see
        :func:`occurrences`); masks (B, n) / (B, m) or (B, 1, n) / (B, 1, m), True = a real
        token, padding at the end."""
        document = checks.features(document, "document", self.d, what="d")
        question = checks.features(question, "question", self.d, what="d")
        checks.same_batch(("document", document), ("question", question))
        checks.part_matches(self, "AttentionSumReader", "document", document)
        if occurrence.dtype != torch.bool or occurrence.shape[:2] != document.shape[:2]:
            raise TypeError(
                f"occurrence must be a bool tensor (B, n, c) matching document "
                f"{tuple(document.shape[:2])}, got {tuple(occurrence.shape)} {occurrence.dtype}"
            )
        dmask = checks.feature_mask(document_mask, document, "document_mask", "document")
        qmask = checks.feature_mask(question_mask, question, "question_mask", "question")
        b, n, m = document.shape[0], document.shape[1], question.shape[1]
        dev = document.device
        dkeep = torch.ones(b, n, dtype=torch.bool, device=dev) if dmask is None else dmask
        qkeep = torch.ones(b, m, dtype=torch.bool, device=dev) if qmask is None else qmask
        document = checks.without_padding(document, dmask)
        question = checks.without_padding(question, qmask)
        f, _ = self._encode(
            self.document_encoder, document, _prefix_lengths(dkeep, "document_mask")
        )
        _, g = self._encode(
            self.question_encoder, question, _prefix_lengths(qkeep, "question_mask")
        )
        # A question with no real token gives no query: its document weights are all zero.
        keep = dkeep & qkeep.any(-1, keepdim=True)
        out = self.attention(g.unsqueeze(-2), f, f, mask=keep.unsqueeze(-2), need_weights=True)
        s = out.weights.squeeze(-2)  # (B, n)
        probabilities = (s.unsqueeze(-1) * (occurrence & dkeep.unsqueeze(-1))).sum(-2)
        return AttentionSumOutput(probabilities, s)
