"""An RNN encoder-decoder with attention (Bahdanau et al.; Luong et al.): the decoder state is
the (basic) query over the encoder states at every output step."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, hooks
from attnkit.alignments import Alignment, AlignOutput
from attnkit.arguments import sizes
from attnkit.core import Attention, attention
from attnkit.output import AttentionOutput
from attnkit.queries.query_types import QueryTagged

__all__ = ["Seq2SeqAttention", "Seq2SeqOutput"]


class Seq2SeqOutput(NamedTuple):
    """Logits (B, T, V_out), attention weights (B, T, N), log-probabilities of stochastic
    alignments (B, T) or None."""

    logits: Tensor
    weights: Tensor
    log_prob: Tensor | None


class _AtStep(Alignment):
    """The decoder's alignment at one step: the step is the query position p_t = t of a
    position-based alignment (local-m, Brauwers eq. 27), which would otherwise read the row
    index of a one-row score matrix, 0 at every step."""

    def __init__(self, inner: Alignment, step: int) -> None:
        super().__init__()
        self.inner, self.step = inner, step
        self.label = inner.label
        self.normalized = inner.normalized

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        return self.inner(scores, mask, query=query, positions=self.step)


@arguments.renamed(d="embed_dim")
class Seq2SeqAttention(nn.Module):
    """Embedding → GRU encoder → GRU-cell decoder that attends over the encoder states.

    Args:
        vocab_in, vocab_out: vocabulary sizes.
        embed_dim: embedding and decoder state size.
        attention: the attention part; its score takes queries of size embed_dim (the decoder state)
            and keys of size d_enc = 2·enc_hidden if ``bidirectional`` else enc_hidden.
        bidirectional: bidirectional encoder (Bahdanau) or not (Luong).
        enc_hidden: encoder GRU size per direction (default embed_dim).
        device, dtype: of the model's own layers (the attention part is built by the caller).

    ``forward(src, tgt_in, src_mask)`` runs teacher forcing: the decoder reads ``tgt_in`` (B, T)
    and predicts the next tokens; ``src_mask`` (B, N) marks real source tokens.

    An alignment that takes query positions (``takes_positions``, e.g. monotonic local
    alignment, local-m) is given the decoder step t as p_t at step t.
    """

    def __init__(
        self,
        vocab_in: int,
        vocab_out: int,
        embed_dim: int,
        attention: Attention,
        *,
        bidirectional: bool = True,
        enc_hidden: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(vocab_in=vocab_in, vocab_out=vocab_out, embed_dim=embed_dim)
        arguments.optional_positive_int(enc_hidden, "enc_hidden")
        arguments.boolean(bidirectional, "bidirectional")
        if not isinstance(attention, Attention):
            raise TypeError(
                f"attention must be an attnkit Attention, got {type(attention).__name__}"
            )
        enc_hidden = embed_dim if enc_hidden is None else enc_hidden
        d_enc = 2 * enc_hidden if bidirectional else enc_hidden
        self.d_enc = d_enc
        kw = {"device": device, "dtype": dtype}
        self.embed_in = nn.Embedding(vocab_in, embed_dim, **kw)
        self.embed_out = nn.Embedding(vocab_out, embed_dim, **kw)
        self.encoder = nn.GRU(
            embed_dim, enc_hidden, batch_first=True, bidirectional=bidirectional, **kw
        )
        self.bridge = nn.Linear(d_enc, embed_dim, **kw)
        self.cell = nn.GRUCell(embed_dim + d_enc, embed_dim, **kw)
        self.attention = QueryTagged(attention, "basic")
        self.out = nn.Linear(embed_dim + d_enc, vocab_out, **kw)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        states, _ = self.encoder(self.embed_in(src))
        if src_mask is None:
            mean = states.mean(dim=1)
        else:
            m = src_mask.unsqueeze(-1).to(states.dtype)
            mean = (states * m).sum(1) / m.sum(1).clamp_min(1)
        return states, torch.tanh(self.bridge(mean))

    def _tokens(self, x: object, name: str, vocab: int) -> Tensor:
        if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
            what = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"{name} must be an integer tensor of token ids (B, L), got {what}")
        if x.dim() != 2:
            raise ValueError(f"{name} must be (B, L) token ids, got shape {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
            raise ValueError(
                f"{name} holds ids outside [0, {vocab}): min {int(x.min())}, max {int(x.max())}"
            )
        return x

    def _source(self, src: object, src_mask: object) -> tuple[Tensor, Tensor | None]:
        src = self._tokens(src, "src", self.embed_in.num_embeddings)
        if src_mask is None:
            return src, None
        if not isinstance(src_mask, Tensor) or src_mask.dtype != torch.bool:
            what = src_mask.dtype if isinstance(src_mask, Tensor) else type(src_mask).__name__
            raise TypeError(f"src_mask must be a boolean tensor (True = a real token), got {what}")
        b, n = src.shape
        if tuple(src_mask.shape) == (b, 1, n):
            src_mask = src_mask.squeeze(-2)
        if tuple(src_mask.shape) != (b, n):
            raise ValueError(
                f"src_mask of shape {tuple(src_mask.shape)} does not fit src of shape {(b, n)}: "
                f"expected {(b, n)} or {(b, 1, n)} (as attnkit.masks.from_lengths gives)"
            )
        return src, src_mask

    def forward(self, src: Tensor, tgt_in: Tensor, src_mask: Tensor | None = None) -> Seq2SeqOutput:
        """src (B, N) and tgt_in (B, T) token ids; src_mask (B, N) or (B, 1, N), True = a real
        source token."""
        src, src_mask = self._source(src, src_mask)
        tgt_in = self._tokens(tgt_in, "tgt_in", self.embed_out.num_embeddings)
        if tgt_in.shape[0] != src.shape[0] or tgt_in.shape[1] == 0:
            raise ValueError(
                f"tgt_in of shape {tuple(tgt_in.shape)} must have src's batch size "
                f"{src.shape[0]} and at least one step"
            )
        return self._decode(src, src_mask, tgt_in.shape[1], tgt_in)

    @torch.no_grad()
    def generate(
        self, src: Tensor, length: int, bos: int, src_mask: Tensor | None = None
    ) -> tuple[Tensor, Seq2SeqOutput]:
        """Greedy decoding of ``length`` ≥ 1 tokens from the start token ``bos``: (tokens
        (B, length), the step outputs). src and src_mask as :meth:`forward`."""
        src, src_mask = self._source(src, src_mask)
        arguments.positive_int(length, "length")
        vocab = self.embed_out.num_embeddings
        if not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab:
            raise ValueError(f"bos must be a token id in [0, {vocab}), got {bos!r}")
        out = self._decode(src, src_mask, length, None, bos=bos)
        return out.logits.argmax(-1), out

    def _attend(self, q: Tensor, states: Tensor, mask: Tensor | None, step: int) -> AttentionOutput:
        att = self.attention.module
        if not getattr(att.align, "takes_positions", False):
            return self.attention(q, states, mask=mask, need_weights=True)
        out = attention(
            q,
            states,
            score=att.score,
            align=_AtStep(att.align, step),
            mask=mask,
            need_weights=True,
            dropout=att.dropout if att.training else 0.0,
        )
        hooks.report(att, out.weights)
        return out

    def _decode(
        self, src: Tensor, src_mask: Tensor | None, length: int, tgt_in: Tensor | None, bos: int = 1
    ) -> Seq2SeqOutput:
        states, h = self.encode(src, src_mask)
        mask = None if src_mask is None else src_mask.unsqueeze(-2)
        context = states.new_zeros(states.shape[0], states.shape[-1])
        logits, weights, log_probs = [], [], []
        token = torch.full((src.shape[0],), bos, dtype=torch.long, device=src.device)
        for t in range(length):
            inp = self.embed_out(tgt_in[:, t] if tgt_in is not None else token)
            h = self.cell(torch.cat([inp, context], dim=-1), h)
            out = self._attend(h.unsqueeze(-2), states, mask, t)
            context = out.context.squeeze(-2)
            logits.append(self.out(torch.cat([h, context], dim=-1)))
            token = logits[-1].argmax(-1)
            weights.append(out.weights.squeeze(-2))
            if out.log_prob is not None:
                log_probs.append(out.log_prob.squeeze(-1))
        return Seq2SeqOutput(
            torch.stack(logits, 1),
            torch.stack(weights, 1),
            torch.stack(log_probs, 1) if log_probs else None,
        )
