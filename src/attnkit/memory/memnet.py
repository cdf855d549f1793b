"""Memory networks (Weston, Chopra and Bordes, 2015, "Memory Networks", Sec. 3; Soydaner Sec. 3).

The I and G components store each sentence, as a bag-of-words vector over a vocabulary of V
words, in the next memory slot (the caller passes the memories, (B, S, V)). The O component
finds supporting memories by hard max addressing, hop by hop (paper eqs. 2-3):

    o_1 = argmax_i s_O(x, m_i),    o_2 = argmax_i s_O([x, m_o1], m_i),

with s_O(x, y) = Φ_x(x)ᵀ U_Oᵀ U_O Φ_y(y) (eq. 5). As in the paper, Φ maps into a 3V-dimensional
space: one block of V for the words of the question, one for the words of the supporting
memories found so far, and one for the candidate memory, so U_O (n × 3V) has one V-column block
for each role. The R component scores every answer word r, s_R([x, m_o1, m_o2], r) with its own
U_R, and returns the scores (the paper's response is the argmax word).

Training is strongly supervised (eqs. 6-8): :meth:`MemoryNetwork.margin_ranking_loss` takes the
gold supporting facts and the answer, and sums max(0, γ − s(gold) + s(other)) over every other
memory at each hop (the hop's query built from the gold facts) and over every other answer word.

The addressing is an alignment module: the default ``"hard"`` gives the paper's argmax in eval
mode (in training mode it samples, Xu et al.'s stochastic hard attention; strong supervision
never needs the forward pass to choose). A hard choice sends no gradient to U_O through the
answer, which the paper trains through the margin loss alone; a soft alignment
(``align="softmax"``) reads the expected memory and is differentiable end to end.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks, inputs
from attnkit import taxonomy as tx
from attnkit.alignments import Hard
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["MemoryNetwork", "MemoryNetworkOutput"]


class MemoryNetworkOutput(NamedTuple):
    """logits (B, n_answers) = s_R for every answer word; weights (B, hops, S), the addressing
    of each hop (one-hot under hard addressing); scores (B, hops, S), s_O of each hop."""

    logits: Tensor
    weights: Tensor
    scores: Tensor

    @property
    def representation(self) -> Tensor:
        return self.logits

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("memory_network")
@arguments.renamed(embedding_dim="embed_dim")
class MemoryNetwork(nn.Module):
    """The O and R components of a memory network over bag-of-words memories.

    Args:
        vocab_size: V, the size of the bag-of-words vectors.
        embed_dim: n, the rows of U_O and U_R.
        hops: supporting memories found one after the other (2 in the paper's experiments).
        n_answers: the answer words R ranks (default V).
        align: the addressing over memories (default hard: argmax in eval mode).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("memories",)}

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        *,
        hops: int = 2,
        n_answers: int | None = None,
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(vocab_size=vocab_size, embed_dim=embed_dim, hops=hops)
        if n_answers is not None:
            n_answers = arguments.positive_int(n_answers, "n_answers")
        n_answers = vocab_size if n_answers is None else n_answers
        kw = {"device": device, "dtype": dtype}
        self.vocab_size, self.hops, self.n_answers = vocab_size, hops, n_answers
        # U_O = [question | supports found | candidate] blocks; U_R likewise with answer words.
        self.u_o = nn.Parameter(torch.randn(embed_dim, 3 * vocab_size, **kw) * 0.1)
        self.u_r = nn.Parameter(torch.randn(embed_dim, 2 * vocab_size, **kw) * 0.1)
        self.u_r_answer = nn.Parameter(torch.randn(embed_dim, n_answers, **kw) * 0.1)
        self.align = (
            Hard() if align is None else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(soft addressing so that the example is differentiable end to end; V = 5, n = 3,
        2 hops; question (2, 5), memories (2, 4, 5), the second item with 3 real memories)."""
        mask = torch.tensor([[True] * 4, [True] * 3 + [False]])[:, None]
        x, memories = example_tensor(2, 5, seed=0), example_tensor(2, 4, 5, seed=1)
        return cls(5, 3, align="softmax"), (x, memories), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.MULTIPLICATIVE, tx.QueryMultiplicity.MULTI_HOP]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hops={self.hops}, n_answers={self.n_answers}"

    def _query(self, u: Tensor, x: Tensor, found: Tensor) -> Tensor:
        """U Φ_x([x, found]) (…, n): the question block and the supports-found block."""
        v = self.vocab_size
        return x @ u[:, :v].T + found @ u[:, v : 2 * v].T

    def memory_scores(self, x: Tensor, found: Tensor, memories: Tensor) -> Tensor:
        """s_O([x, found], m_i) (B, S) for a question x (B, V), the sum of the supporting
        memories found so far (B, V) and memories (B, S, V)."""
        q = self._query(self.u_o, x, found)
        m = memories @ self.u_o[:, 2 * self.vocab_size :].T  # U_O Φ_y(m_i)
        return (m @ q.unsqueeze(-1)).squeeze(-1)

    def answer_scores(self, x: Tensor, found: Tensor) -> Tensor:
        """s_R([x, m_o1, …], r) (B, n_answers) for every answer word r."""
        return self._query(self.u_r, x, found) @ self.u_r_answer

    def _check(self, x: Tensor, memories: Tensor, mask: Tensor | None) -> Tensor | None:
        x = inputs.tensor(x, "x", min_dim=1)
        memories = inputs.tensor(memories, "memories", min_dim=1)
        v = self.vocab_size
        if x.dim() != 2 or x.shape[-1] != v:
            raise ValueError(f"x must be (B, vocab_size={v}), got shape {tuple(x.shape)}")
        if memories.dim() != 3 or memories.shape[-1] != v or memories.shape[0] != x.shape[0]:
            raise ValueError(
                f"memories must be (B={x.shape[0]}, S, vocab_size={v}), got shape "
                f"{tuple(memories.shape)}"
            )
        if mask is None:
            return None
        b, s = memories.shape[:2]
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor, got {type(mask).__name__}")
        if mask.shape not in ((b, s), (b, 1, s)):
            raise ValueError(
                f"mask must be (B, 1, S) or (B, S) = ({b}, 1, {s}), got shape {tuple(mask.shape)}"
            )
        return mask.reshape(b, 1, s)

    def forward(
        self, x: Tensor, memories: Tensor, *, mask: Tensor | None = None
    ) -> MemoryNetworkOutput:
        """x (B, V) the question, memories (B, S, V), mask (B, 1, S) True = a stored memory."""
        keep = self._check(x, memories, mask)
        if keep is not None:  # padded slots (even NaN) never enter
            memories = torch.where(keep.transpose(-2, -1), memories, torch.zeros((), dtype=x.dtype))
        found = torch.zeros_like(x)
        weights, scores = [], []
        for _ in range(self.hops):
            s = self.memory_scores(x, found, memories)
            w = self.align(s.unsqueeze(-2), keep).weights  # (B, 1, S)
            hooks.report(self, w)
            found = found + (w @ memories).squeeze(-2)  # m_o of this hop
            weights.append(w.squeeze(-2))
            scores.append(s)
        return MemoryNetworkOutput(
            self.answer_scores(x, found), torch.stack(weights, 1), torch.stack(scores, 1)
        )

    def margin_ranking_loss(
        self,
        x: Tensor,
        memories: Tensor,
        supports: Tensor,
        answer: Tensor,
        *,
        mask: Tensor | None = None,
        margin: float = 0.1,
    ) -> Tensor:
        """Weston et al. eqs. 6-8 with the gold facts, averaged over the batch.

        Args:
            supports: (B, hops) the index of the gold supporting memory of each hop.
            answer: (B,) the gold answer word.
            margin: γ.
        """
        keep = self._check(x, memories, mask)
        margin = arguments.finite_float(margin, "margin")
        b = memories.shape[0]
        if supports.shape != (b, self.hops) or answer.shape != (b,):
            raise ValueError(
                f"supports must be (B, hops) = ({b}, {self.hops}) and answer (B,) = ({b},), got "
                f"{tuple(supports.shape)} and {tuple(answer.shape)}"
            )
        rows = torch.arange(b, device=x.device)
        found = torch.zeros_like(x)
        loss = x.new_zeros(b)
        for hop in range(self.hops):
            sc = self.memory_scores(x, found, memories)  # (B, S)
            gold = supports[:, hop]
            hinge = (margin - sc[rows, gold, None] + sc).clamp_min(0)
            others = torch.ones_like(hinge, dtype=torch.bool)
            others[rows, gold] = False
            if keep is not None:
                others &= keep.squeeze(-2)
            loss = loss + (hinge * others).sum(-1)
            found = found + memories[rows, gold]
        sr = self.answer_scores(x, found)
        hinge = (margin - sr[rows, answer, None] + sr).clamp_min(0)
        hinge[rows, answer] = 0
        return (loss + hinge.sum(-1)).mean()
