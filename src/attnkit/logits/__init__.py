"""Parts that act on the attention logits of multi-head attention: query-key normalisation
(bounded logits) and talking heads (logits and weights mixed across heads). Each is a registered
mechanism and a per-head part for ``MultiHeadAttention(attention=...)``; logit soft-capping is
an option of the scaled-dot scores (``ak.scores.ScaledDot(softcap=c)``)."""

from attnkit.logits.qk_norm import QKNormAttention
from attnkit.logits.talking_heads import TalkingHeadsAttention

__all__ = ["QKNormAttention", "TalkingHeadsAttention"]
