"""End-to-end memory network (Sukhbaatar et al., 2015, "End-To-End Memory Networks"; Soydaner
Sec. 3, Brauwers 3.3.2 on multi-hop attention).

A story of n sentences, each a bag of L words over a vocabulary of V, is written into an input
memory m_i = Σ_j l_j ⊙ A x_ij + T_A(i) and an output memory c_i = Σ_j l_j ⊙ C x_ij + T_C(i);
the question gives u = Σ_j l_j ⊙ B q_j. Each hop k attends the input memory with the controller
state, p = softmax(uᵀ m_i) (paper eq. 1), reads o = Σ_i p_i c_i (eq. 2) and updates the state
u^{k+1} = u^k + o^k (eq. 4; H u^k + o^k under layer-wise tying); the answer is
â = softmax(W(o^K + u^K)) (eq. 3).

Words are given either as integer ids (B, n, L) — an embedding lookup — or as float word
vectors (B, n, L, V) (one-hot or soft), multiplied by the embedding matrix: the same map, and
the float form lets gradients reach the words.

Linear start (Sec. 4.2): a network built with ``linear_start=True`` first takes the softmax out
of every hop, p_i = uᵀ m_i (the score itself), so that the model is linear up to the answer's
softmax; :meth:`EndToEndMemoryNetwork.linear_start_step`, called with the validation loss after
each epoch, re-inserts the softmax once that loss stops decreasing (the paper's rule). The state
is kept in buffers, so it survives a checkpoint.
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, checks
from attnkit import taxonomy as tx
from attnkit.alignments.base import Alignment, AlignOutput
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Dot, Score

__all__ = ["EndToEndMemoryNetwork", "MemN2NOutput", "position_encoding"]


@arguments.renamed(d="embed_dim")
def position_encoding(lengths: Tensor, max_len: int, embed_dim: int) -> Tensor:
    """Sukhbaatar et al. Sec. 4.1: l_kj = (1 − j/J) − (k/d)(1 − 2j/J) for word j = 1 … J of a
    sentence of J words and embedding dimension k = 1 … d (d = ``embed_dim``).

    Args:
        lengths: (…,) the number of real words J of each sentence (≥ 0; 0 gives zeros).
        max_len: L, the padded sentence length.
        embed_dim: the embedding size d.

    Returns:
        (…, L, embed_dim) weights, zero for j > J.
    """
    dtype = torch.get_default_dtype() if not lengths.is_floating_point() else lengths.dtype
    j = torch.arange(1, max_len + 1, device=lengths.device, dtype=dtype)  # (L,)
    k = torch.arange(1, embed_dim + 1, device=lengths.device, dtype=dtype)  # (d,)
    big_j = lengths.to(dtype).clamp_min(1)[..., None, None]  # (…, 1, 1)
    ratio = j[:, None] / big_j  # (…, L, 1)
    weights = (1 - ratio) - (k / embed_dim) * (1 - 2 * ratio)
    real = j[:, None] <= lengths.to(dtype)[..., None, None]
    return torch.where(real, weights, torch.zeros((), dtype=dtype, device=lengths.device))


class MemN2NOutput(NamedTuple):
    """Answer logits W(o^K + u^K) (B, n_answers), the final state u^{K+1} (B, d), and each
    hop's weights over the memories (B, K, n)."""

    logits: Tensor
    state: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The answer logits (B, n_answers)."""
        return self.logits

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


class _ScoresAsWeights(Alignment):
    """p_i = e_i (masked keys 0): the hops of linear start (Sukhbaatar et al. Sec. 4.2)."""

    label = tx.AlignmentKind.GLOBAL
    normalized = False

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        if mask is None:
            return AlignOutput(scores)
        return AlignOutput(torch.where(mask, scores, torch.zeros((), dtype=scores.dtype)))


@REGISTRY.register("memn2n")
@arguments.renamed(d="embed_dim")
class EndToEndMemoryNetwork(nn.Module):
    """End-to-end memory network with K hops (Sukhbaatar et al. 2015, Sec. 2).

    Args:
        vocab_size: V, words are ids in [0, V) or V-dim word vectors.
        embed_dim: embedding size (d).
        hops: K ≥ 1.
        tying: ``"adjacent"`` (Sec. 2.2: A^{k+1} = C^k, B = A^1, W = C^{K}ᵀ; K + 1 embedding
            matrices) or ``"layer_wise"`` (RNN-like: one A and one C for every hop, a separate
            B and W, and u^{k+1} = H u^k + o^k).
        position_encoding: weight the words of a sentence by l_j (Sec. 4.1) instead of a plain
            bag of words.
        max_memories: if given, add temporal encodings T_A(i), T_C(i) (Sec. 4.1) for up to this
            many sentences, i counted from the most recent real sentence (i = 0 is the last).
        n_answers: size of the answer vocabulary (default V); must be V under adjacent tying,
            where W = C^{K}ᵀ.
        score: the score of u against m_i (default :class:`attnkit.scores.Dot`, the paper's
            uᵀ m_i); one module shared by every hop.
        align: the alignment of every hop (default softmax, eq. 1).
        linear_start: begin without the hops' alignment, p_i = the score (Sec. 4.2), until
            :meth:`linear_start_step` or :meth:`end_linear_start` re-inserts it.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {
        "mask": ("story",),
        "query_mask": ("query",),
    }

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        *,
        hops: int = 3,
        tying: Literal["adjacent", "layer_wise"] = "adjacent",
        position_encoding: bool = True,
        max_memories: int | None = None,
        n_answers: int | None = None,
        score: Score | None = None,
        align: str | nn.Module = "softmax",
        linear_start: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = arguments.positive_int(vocab_size, "vocab_size")
        linear_start = arguments.boolean(linear_start, "linear_start")
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.hops = arguments.positive_int(hops, "hops")
        self.position_encoding = arguments.boolean(position_encoding, "position_encoding")
        self.max_memories = arguments.optional_positive_int(max_memories, "max_memories")
        self.n_answers = vocab_size if n_answers is None else n_answers
        arguments.positive_int(self.n_answers, "n_answers")
        if tying not in ("adjacent", "layer_wise"):
            raise ValueError(f"tying must be 'adjacent' or 'layer_wise', got {tying!r}")
        if tying == "adjacent" and self.n_answers != vocab_size:
            raise ValueError(
                f"n_answers = {self.n_answers} but adjacent tying sets W = C^Kᵀ, so n_answers "
                f"must equal vocab_size = {vocab_size}"
            )
        self.tying = tying
        kw = {"device": device, "dtype": dtype}

        def table(rows: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(rows, embed_dim, **kw) * 0.1)

        # Adjacent: E_0 … E_K with A^k = E_{k-1}, C^k = E_k, B = E_0, W = E_Kᵀ.
        # Layer-wise: E_0 = A, E_1 = C, plus B, H and W.
        n_tables = hops + 1 if tying == "adjacent" else 2
        self.embeddings = nn.ParameterList([table(vocab_size) for _ in range(n_tables)])
        self.temporal = (
            nn.ParameterList([table(self.max_memories) for _ in range(n_tables)])
            if self.max_memories is not None
            else None
        )
        if tying == "layer_wise":
            self.query_embedding = table(vocab_size)
            self.H = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
            self.W = nn.Linear(embed_dim, self.n_answers, bias=False, **kw)
        # p = softmax(uᵀ m_i): a dot score and a softmax by default, through the core.
        score = checks.optional_score(score, "score")
        self.attention = Attention(Dot() if score is None else score, align)
        # Linear start: the same score module, the scores as weights; state in buffers.
        self.linear_attention = Attention(self.attention.score, _ScoresAsWeights())
        self.register_buffer("linear", torch.tensor(linear_start, device=device))
        self.register_buffer("linear_best", torch.tensor(float("inf"), device=device))

    @property
    def linear_start_active(self) -> bool:
        """True while the hops use the scores as weights (linear start, Sec. 4.2)."""
        return bool(self.linear)

    def end_linear_start(self) -> None:
        """Re-insert the hops' alignment (the softmax) for good."""
        self.linear.fill_(False)

    def linear_start_step(self, validation_loss: float) -> bool:
        """The paper's rule, after an epoch of linear start: if ``validation_loss`` is not
        below the best seen so far, re-insert the softmax. Returns True when this call ended
        linear start (False when it goes on or had already ended)."""
        if not self.linear_start_active:
            return False
        if validation_loss < float(self.linear_best):
            self.linear_best.fill_(validation_loss)
            return False
        self.end_linear_start()
        return True

    # Which table each role reads, per hop (the tying scheme in one place).
    def input_table(self, hop: int) -> int:
        """Index of A^{hop+1} among ``embeddings`` (hop counted from 0)."""
        return hop if self.tying == "adjacent" else 0

    def output_table(self, hop: int) -> int:
        """Index of C^{hop+1} among ``embeddings`` (hop counted from 0)."""
        return hop + 1 if self.tying == "adjacent" else 1

    def query_table(self) -> Tensor:
        """B: A^1 under adjacent tying, its own matrix under layer-wise tying."""
        return self.embeddings[0] if self.tying == "adjacent" else self.query_embedding

    def answer_table(self) -> Tensor:
        """W (n_answers, d): C^K under adjacent tying, its own matrix under layer-wise tying."""
        return self.embeddings[-1] if self.tying == "adjacent" else self.W.weight

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(2 hops, V = 4, d = 3; story (2, 3, 2, 4) float word vectors, query (2, 2, 4)),
        with word masks."""
        story, query = example_tensor(2, 3, 2, 4, seed=0), example_tensor(2, 2, 4, seed=1)
        mask = torch.tensor([[True, True]] * 3 + [[True, False]] * 3).reshape(2, 3, 2)
        query_mask = torch.tensor([[True, True], [True, False]])
        module = cls(4, 3, hops=2, max_memories=3)
        return module, (story, query), {"mask": mask, "query_mask": query_mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP]

    def _words(self, x: Tensor, name: str, rank: int) -> Tensor:
        """Validate ids (rank dims) or word vectors (rank + 1 dims, last V)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.is_floating_point():
            return checks.features(x, name, self.vocab_size, what="vocab_size", rank=rank + 1)
        if x.dtype in (torch.bool, torch.complex64, torch.complex128) or x.dim() != rank:
            raise ValueError(
                f"{name} must be integer word ids with {rank} dims or float word vectors with "
                f"{rank + 1} dims (last = vocab_size {self.vocab_size}), got shape "
                f"{tuple(x.shape)} and dtype {x.dtype}"
            )
        if x.numel() and (x.min() < 0 or x.max() >= self.vocab_size):
            raise ValueError(f"{name} has word ids outside [0, vocab_size = {self.vocab_size})")
        return x

    def _word_mask(self, mask: object, shape: tuple[int, ...], name: str) -> Tensor | None:
        """A (…, L) word mask from (…, L) or (…, 1, L) (as masks.from_lengths gives)."""
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a boolean tensor (True = a real word)")
        if tuple(mask.shape) == shape:
            return mask
        if tuple(mask.shape) == (*shape[:-1], 1, shape[-1]):
            return mask.squeeze(-2)
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not fit: expected {shape} or "
            f"{(*shape[:-1], 1, shape[-1])}"
        )

    def _embed(self, x: Tensor, table: Tensor, mask: Tensor | None) -> Tensor:
        """Σ_j l_j ⊙ (table x_j) over the words (…, L) → (…, d), padded words dropped."""
        if x.is_floating_point():
            if mask is not None:  # 0·NaN would be NaN: drop padded words before the product
                x = torch.where(mask[..., None], x, torch.zeros((), dtype=x.dtype))
            words = x @ table  # (…, L, d)
        else:
            words = F.embedding(x, table)
        if self.position_encoding:
            n_words = (
                torch.full(words.shape[:-2], words.shape[-2], device=words.device)
                if mask is None
                else mask.sum(-1)
            )
            words = words * position_encoding(
                n_words.to(words.dtype), words.shape[-2], self.embed_dim
            ).to(words.dtype)
        elif mask is not None:
            words = words * mask[..., None].to(words.dtype)
        return words.sum(-2)

    def forward(
        self,
        story: Tensor,
        query: Tensor,
        mask: Tensor | None = None,
        query_mask: Tensor | None = None,
    ) -> MemN2NOutput:
        """story: ids (B, n, L) or word vectors (B, n, L, V); query: ids (B, L_q) or
        (B, L_q, V); mask: (B, n, L) (or (B, n, 1, L)) True = a real word — a sentence with
        no real word is no memory; query_mask: (B, L_q) (or (B, 1, L_q))."""
        story = self._words(story, "story", 3)
        query = self._words(query, "query", 2)
        if story.is_floating_point() and query.is_floating_point():
            checks.same_batch(("story", story), ("query", query))
        elif story.shape[0] != query.shape[0]:
            raise ValueError(
                f"query has batch size {query.shape[0]} (shape {tuple(query.shape)}) but story "
                f"has {story.shape[0]} (shape {tuple(story.shape)})"
            )
        n = story.shape[1]
        if self.max_memories is not None and n > self.max_memories:
            raise ValueError(
                f"story has {n} sentences (shape {tuple(story.shape)}) but temporal encoding "
                f"was built for max_memories = {self.max_memories}"
            )
        mask = self._word_mask(mask, tuple(story.shape[:3]), "mask")
        query_mask = self._word_mask(query_mask, tuple(query.shape[:2]), "query_mask")
        real = None if mask is None else mask.any(-1)  # (B, n): which sentences are memories
        dtype = story.dtype if story.is_floating_point() else self.embeddings[0].dtype

        if self.temporal is not None:
            # T(i), i counted back from the last real sentence (Sec. 4.1: "x_1 is the last").
            count = n if real is None else real.sum(-1, keepdim=True)
            time = (count - 1 - torch.arange(n, device=story.device)).clamp_min(0)  # (B|1, n)

        def memory(index: int) -> Tensor:
            m = self._embed(story, self.embeddings[index], mask)
            if self.temporal is not None:
                m = m + self.temporal[index][time].expand_as(m)
            return m

        u = self._embed(query, self.query_table(), query_mask).to(dtype)
        attend_mask = None if real is None else real.unsqueeze(-2)  # (B, 1, n)
        weights = []
        attend = self.linear_attention if self.linear_start_active else self.attention
        for hop in range(self.hops):
            m, c = memory(self.input_table(hop)), memory(self.output_table(hop))
            out = attend(u.unsqueeze(-2), m, c, mask=attend_mask, need_weights=True)
            o = out.context.squeeze(-2)  # eq. 2
            weights.append(out.weights.squeeze(-2))  # eq. 1
            u = (self.H(u) if self.tying == "layer_wise" else u) + o  # eq. 4
        logits = u @ self.answer_table().transpose(0, 1)  # eq. 3 (before the softmax)
        return MemN2NOutput(logits, u, torch.stack(weights, 1))
