"""An RNN encoder-decoder with attention (Bahdanau et al.; Luong et al.): the decoder state is
the (basic) query over the encoder states at every output step."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit.attention import Attention
from attnkit.queries.self_attentive import QueryTagged

__all__ = ["Seq2SeqAttention", "Seq2SeqOutput"]


class Seq2SeqOutput(NamedTuple):
    """Logits (B, T, V_out), attention weights (B, T, N), log-probabilities of stochastic
    alignments (B, T) or None."""

    logits: Tensor
    weights: Tensor
    log_prob: Tensor | None


class Seq2SeqAttention(nn.Module):
    """Embedding → GRU encoder → GRU-cell decoder that attends over the encoder states.

    Args:
        vocab_in, vocab_out: vocabulary sizes.
        d: embedding and decoder state size.
        attention: the attention part; its score takes queries of size d (the decoder state)
            and keys of size d_enc = 2d if ``bidirectional`` else d.
        bidirectional: bidirectional encoder (Bahdanau) or not (Luong).

    ``forward(src, tgt_in, src_mask)`` runs teacher forcing: the decoder reads ``tgt_in`` (B, T)
    and predicts the next tokens; ``src_mask`` (B, N) marks real source tokens.
    """

    def __init__(
        self,
        vocab_in: int,
        vocab_out: int,
        d: int,
        attention: Attention,
        *,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        d_enc = 2 * d if bidirectional else d
        self.embed_in = nn.Embedding(vocab_in, d)
        self.embed_out = nn.Embedding(vocab_out, d)
        self.encoder = nn.GRU(d, d, batch_first=True, bidirectional=bidirectional)
        self.bridge = nn.Linear(d_enc, d)
        self.cell = nn.GRUCell(d + d_enc, d)
        self.attention = QueryTagged(attention, "basic")
        self.out = nn.Linear(d + d_enc, vocab_out)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        states, _ = self.encoder(self.embed_in(src))
        if src_mask is None:
            mean = states.mean(dim=1)
        else:
            m = src_mask.unsqueeze(-1).to(states.dtype)
            mean = (states * m).sum(1) / m.sum(1).clamp_min(1)
        return states, torch.tanh(self.bridge(mean))

    def forward(self, src: Tensor, tgt_in: Tensor, src_mask: Tensor | None = None) -> Seq2SeqOutput:
        states, h = self.encode(src, src_mask)
        mask = None if src_mask is None else src_mask.unsqueeze(-2)
        context = states.new_zeros(states.shape[0], states.shape[-1])
        logits, weights, log_probs = [], [], []
        emb = self.embed_out(tgt_in)
        for t in range(tgt_in.shape[1]):
            h = self.cell(torch.cat([emb[:, t], context], dim=-1), h)
            out = self.attention(h.unsqueeze(-2), states, mask=mask, need_weights=True)
            context = out.context.squeeze(-2)
            logits.append(self.out(torch.cat([h, context], dim=-1)))
            weights.append(out.weights.squeeze(-2))
            if out.log_prob is not None:
                log_probs.append(out.log_prob.squeeze(-1))
        return Seq2SeqOutput(
            torch.stack(logits, 1),
            torch.stack(weights, 1),
            torch.stack(log_probs, 1) if log_probs else None,
        )
