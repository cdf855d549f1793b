"""Reinforced self-attention, ReSA (Shen, Zhou, Long, Jiang, Wang and Zhang, "Reinforced
Self-Attention Network: a Hybrid of Hard and Soft Attention for Sequence Modeling", IJCAI 2018;
Soydaner 5.1): a hard attention trims the sequence for a soft self-attention, and the soft one's
task loss rewards the hard one.

**Reinforced sequence sampling (RSS, paper section 3.1).** Given x = [x_1, …, x_n], RSS samples
an equal-length sequence of independent binary variables, z_i = 1 keeping token i,

    p(z | x; θ) = Π_i p(z_i | x; θ),    p(z_i = 1 | x; θ) = g(f(x; θ_f)_i; θ_g),

with the context fusion f(x)_i = [x_i; x̄; x_i ⊙ x̄] (x̄ the mean of the real tokens) and g a
two-layer network ending in a sigmoid, p_i = σ(w₂ᵀ elu(W₁ f(x)_i + b₁) + b₂). In training
z_i ~ Bernoulli(p_i); in evaluation z_i = 1[p_i > 1/2]. The log-probability of the draw,
log p(z | x) = Σ_i z_i log p_i + (1 − z_i) log(1 − p_i) over the real tokens, is returned so that
the task loss adds the policy gradient (REINFORCE): −(R − b) log p(z | x) with reward R, e.g.
``attnkit.tasks.parts.task_loss``, which uses the negative per-item loss and the batch mean as
baseline.

**ReSA (section 3.2).** Two RSS modules select head tokens ẑʰ and dependent tokens ẑᵈ; the sparse
mask lets head i attend dependent j iff both are selected and i ≠ j (the paper's mask
M^rss_ij = 0 if ẑʰ_i = ẑᵈ_j = 1 and i ≠ j, −∞ otherwise: no token attends itself, as in DiSAN).
On h = elu(W_h x + b_h) the multi-dimensional (feature-wise) additive score is

    f(h_i, h_j) = c · tanh((W⁽¹⁾ h_i + W⁽²⁾ h_j + b⁽¹⁾) / c),    c = 5,

the weights a_ij = softmax_j(f(h_i, h_j) + M^rss_ij) per feature, and s_i = Σ_j a_ij ⊙ h_j; a
head that is not selected, or whose dependents are all masked, gets s_i = 0. The fusion gate
F = σ(W⁽ᶠ¹⁾ h + W⁽ᶠ²⁾ s + b⁽ᶠ⁾) gives u = F ⊙ h + (1 − F) ⊙ s.

The authors' released code also runs the attention in a forward and a backward direction
(concatenated) and mean-pools the dependents for unselected heads; this module follows the
paper's equations above. Only the policy gradient trains the samplers (no gradient reaches
them through u), which the class declares in ``policy_parameters``.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["ReSAOutput", "ReinforcedSelfAttention", "ReinforcedSequenceSampler", "SamplerOutput"]


class SamplerOutput(NamedTuple):
    """An RSS draw: ``selected`` (B, N) bool (padding never selected), ``prob`` (B, N) p_i and
    ``log_prob`` (B,) log p(z | x) over the real tokens."""

    selected: Tensor
    prob: Tensor
    log_prob: Tensor


class ReinforcedSequenceSampler(nn.Module):
    """Reinforced sequence sampling (Shen et al. section 3.1): one Bernoulli selection per token,
    p_i = σ(w₂ᵀ elu(W₁ [x_i; x̄; x_i ⊙ x̄] + b₁) + b₂).

    Args:
        d: token size; hidden: size of the first layer (default d).
        init_bias: b₂'s initial value (positive: most tokens are kept at first).
    """

    def __init__(
        self,
        d: int,
        hidden: int | None = None,
        *,
        init_bias: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d, "d")
        hidden = d if arguments.optional_positive_int(hidden, "hidden") is None else hidden
        kw = {"device": device, "dtype": dtype}
        self.first = nn.Linear(3 * d, hidden, **kw)
        self.second = nn.Linear(hidden, 1, **kw)
        with torch.no_grad():
            self.second.bias.fill_(arguments.finite_float(init_bias, "init_bias"))

    def logits(self, x: Tensor, keep: Tensor) -> Tensor:
        """The selection logits (B, N) of x (B, N, d) with real tokens ``keep`` (B, N)."""
        count = keep.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)[..., None]
        mean = torch.where(keep[..., None], x, 0.0).sum(-2, keepdim=True) / count
        fused = torch.cat([x, mean.expand_as(x), x * mean], -1)  # f(x)_i
        return self.second(F.elu(self.first(fused))).squeeze(-1)

    def forward(self, x: Tensor, keep: Tensor) -> SamplerOutput:
        logit = self.logits(x, keep)
        prob = torch.sigmoid(logit)
        if self.training:
            selected = torch.bernoulli(prob.detach()).bool()
        else:
            selected = logit.detach() > 0
        selected = selected & keep
        step = torch.where(selected, F.logsigmoid(logit), F.logsigmoid(-logit))
        log_prob = torch.where(keep, step, 0.0).sum(-1)
        return SamplerOutput(selected, prob, log_prob)


class ReSAOutput(NamedTuple):
    """What :class:`ReinforcedSelfAttention` returns.

    Attributes:
        output: u (B, N, d), the fused context-aware tokens.
        weights: (B, d, N, N) the feature-wise weights a_ij (feature first: each (N, N) slice
            is one feature's attention), zero outside the sparse mask; only on request.
        log_prob: (B,) log p(ẑʰ | x) + log p(ẑᵈ | x), for the policy gradient.
        head, dependent: (B, N) bool, the two samplers' selections.
    """

    output: Tensor
    weights: Tensor | None
    log_prob: Tensor
    head: Tensor
    dependent: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {} if self.weights is None else {"weights": self.weights}


@REGISTRY.register("resa")
class ReinforcedSelfAttention(nn.Module):
    """ReSA: two RSS samplers give the sparse mask of a multi-dimensional token-to-token
    self-attention, followed by the fusion gate. Called as ``resa(x, mask=None,
    need_weights=False)`` with x (B, N, d) and a padding mask (B, 1, N).

    Args:
        d: token size (and of h, s and u).
        hidden: hidden size of the samplers (default d).
        scale: c of the scaled tanh (5 in the paper).
        init_bias: the samplers' initial output bias (positive keeps most tokens at first).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}
    # trained by the policy gradient of ``log_prob`` only: no gradient reaches them through u
    policy_parameters: ClassVar[tuple[str, ...]] = ("head_sampler", "dependent_sampler")

    def __init__(
        self,
        d: int,
        hidden: int | None = None,
        *,
        scale: float = 5.0,
        init_bias: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d = arguments.positive_int(d, "d")
        arguments.finite_float(scale, "scale")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        self.scale = float(scale)
        kw = {"device": device, "dtype": dtype}
        self.head_sampler = ReinforcedSequenceSampler(d, hidden, init_bias=init_bias, **kw)
        self.dependent_sampler = ReinforcedSequenceSampler(d, hidden, init_bias=init_bias, **kw)
        self.map = nn.Linear(d, d, **kw)  # h = elu(W_h x + b_h)
        self.head_proj = nn.Linear(d, d, bias=False, **kw)  # W⁽¹⁾
        self.dependent_proj = nn.Linear(d, d, bias=False, **kw)  # W⁽²⁾
        self.score_bias = nn.Parameter(torch.zeros(d, **kw))  # b⁽¹⁾
        self.fuse_h = nn.Linear(d, d, **kw)
        self.fuse_s = nn.Linear(d, d, bias=False, **kw)
        self.align = Softmax()

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            module = cls(4, 3)
        with torch.no_grad():  # mixed selections well away from p = 1/2, so that dtypes agree
            for sampler, seed in ((module.head_sampler, 175), (module.dependent_sampler, 1175)):
                sampler.second.weight.copy_(3.0 * example_tensor(1, 3, seed=seed))
                sampler.second.bias.fill_(0.5)
        return module, (example_tensor(2, 6, 4, seed=30),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [
            tx.Scoring.ADDITIVE,
            tx.AlignmentKind.REINFORCED,
            tx.Dimensionality.MULTI,
            tx.QueryType.SELF_ATTENTIVE,
        ]

    def extra_repr(self) -> str:
        return f"d={self.d}, scale={self.scale}"

    def sparse_mask(self, head: Tensor, dependent: Tensor) -> Tensor:
        """M (B, N, N): head i may attend dependent j iff ẑʰ_i = ẑᵈ_j = 1 and i ≠ j."""
        n = head.shape[-1]
        off_diagonal = ~torch.eye(n, dtype=torch.bool, device=head.device)
        return head[..., :, None] & dependent[..., None, :] & off_diagonal

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> ReSAOutput:
        arguments.boolean(need_weights, "need_weights")
        x, keep = masks.padding_only(x, self.d, mask, f"ReinforcedSelfAttention(d={self.d})")
        head = self.head_sampler(x, keep)
        dependent = self.dependent_sampler(x, keep)
        allowed = self.sparse_mask(head.selected, dependent.selected)  # (B, N, N)
        h = torch.where(keep[..., None], F.elu(self.map(x)), 0.0)  # (B, N, d)
        pre = self.head_proj(h)[:, :, None] + self.dependent_proj(h)[:, None, :] + self.score_bias
        scores = self.scale * torch.tanh(pre / self.scale)  # (B, N_i, N_j, d)
        weights = self.align(scores.movedim(-1, 1), allowed[:, None]).weights  # (B, d, N, N)
        s = torch.einsum("bfij,bjf->bif", weights, h)
        gate = torch.sigmoid(self.fuse_h(h) + self.fuse_s(s))
        u = gate * h + (1 - gate) * s
        hooks.report(self, weights)
        return ReSAOutput(
            u,
            weights if need_weights else None,
            head.log_prob + dependent.log_prob,
            head.selected,
            dependent.selected,
        )
