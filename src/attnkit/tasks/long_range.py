"""What the long-range tasks (``listops``, ``kv-recall``) share: a small Transformer encoder
classifier whose attention is chosen by name, and the task plumbing (cross-entropy, accuracy
with its chance level, heatmaps of the last layer's weights).

The attention (run configuration key ``attention``) is ``full`` — :class:`attnkit.
MultiHeadAttention` with the run's score and alignment (the tasks default to scaled dot-product
and softmax) — or any registered mechanism that is a per-head attention-slot part
(:func:`attnkit.tasks.parts.slot_mechanisms`), built for the model's head size and sequence
length; a mechanism registered later is offered without any change here. No attention mask is
passed (a sequence is padded with a padding token that the model learns to ignore), so that
every mechanism sees the same input, including those that refuse masks (Linformer).

A task that sets ``context_parallel = True`` (``kv-recall``) trains with each sequence split
over the ranks of a ring (``attnkit run --context-parallel P``): every rank embeds its part of
the tokens at their global positions and runs the layers' ring twins
(:func:`attnkit.distributed.context_parallel`); the rank holding the read-out position gives the
loss, the others a zero that still runs the backward turn of the ring.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, distributed, layer_plan
from attnkit.evaluation.capture import capture
from attnkit.mixers import REGISTRY as MIXERS
from attnkit.tasks import parts
from attnkit.tasks.base import Task, Unused
from attnkit.transformer import TransformerEncoderLayer

__all__ = ["EncoderClassifier", "LongRangeTask", "SlotAttentions"]

HEADS = 2
LAYERS = 2
LAYOUT = "contiguous"  # of a sequence over the ring (an encoder attends both ways: balanced)


class SlotAttentions(Sequence):
    """``("full", *registered attention-slot mechanisms)``, read from the registry each time."""

    def _names(self) -> tuple[str, ...]:
        return ("full", *parts.slot_mechanisms())

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class EncoderClassifier(nn.Module):
    """Token embeddings (one table per input channel, summed) + learned positions → a stack of
    pre-norm encoder layers → LayerNorm → a linear classifier read at position ``readout``.

    Args:
        vocab: tokens per channel; inputs are (B, N, C) integer tensors with C = len(vocab).
        classes: output classes. embed_dim, num_heads, layers: sizes. max_len: longest input.
        attention: ``"full"`` (multi-head attention with ``score``/``align``) or a registered
            attention-slot mechanism's name (one instance per layer).
        readout: the position whose final state is classified (e.g. 0 or -1).
        names: the mixing of each layer instead (then ``attention`` and ``layers`` are not
            read): ``"full"``, ``"sliding:W"`` (full attention over the positions less than W
            away), a registered attention-slot mechanism or a token mixer of
            :mod:`attnkit.mixers` (``mixer.NAME``); see :func:`layer_arguments`.
    """

    def __init__(
        self,
        vocab: Sequence[int],
        classes: int,
        *,
        embed_dim: int,
        max_len: int,
        attention: str = "full",
        score: str = "scaled_dot",
        align: str = "softmax",
        num_heads: int = HEADS,
        layers: int = LAYERS,
        readout: int = 0,
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.ModuleList([nn.Embedding(v, embed_dim) for v in vocab])
        self.position = nn.Embedding(max_len, embed_dim)
        nn.init.normal_(self.position.weight, std=0.02)
        head_dim = embed_dim // num_heads

        def layer() -> TransformerEncoderLayer:
            if attention == "full":
                part = parts.build_attention(score, align, head_dim, max_len)
            else:
                part = parts.build_slot_attention(
                    attention, head_dim=head_dim, num_heads=num_heads, max_len=max_len
                )
            return TransformerEncoderLayer(
                embed_dim, num_heads, 2 * embed_dim, norm_first=True, attention=part
            )

        if names is None:
            self.layers = nn.ModuleList([layer() for _ in range(layers)])
        else:
            sizes = {"score": score, "align": align, "num_heads": num_heads, "max_len": max_len}
            self.layers = nn.ModuleList(
                TransformerEncoderLayer(
                    embed_dim,
                    num_heads,
                    2 * embed_dim,
                    norm_first=True,
                    **layer_arguments(name, embed_dim, index=i, depth=len(names), **sizes),
                )
                for i, name in enumerate(names)
            )
        self.norm = nn.LayerNorm(embed_dim)
        self.out = nn.Linear(embed_dim, classes)
        self.readout = readout

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, N, C) → logits (B, classes)."""
        if tokens.dim() != 3 or tokens.shape[-1] != len(self.embed):
            raise ValueError(f"tokens must be (B, N, {len(self.embed)}), got {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if n > self.position.num_embeddings:
            raise ValueError(
                f"sequence of {n} tokens, longer than max_len = {self.position.num_embeddings}"
            )
        x = sum(e(tokens[..., c]) for c, e in enumerate(self.embed))
        x = x + self.position(torch.arange(n, device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x[:, self.readout]))

    def last_weights(self, tokens: Tensor) -> Tensor:
        """The last layer's self-attention weights (B, H, N, N) on tokens (B, N, C), with their
        graph (for a loss on them); the layers are pre-norm, so the last attention reads the
        LayerNorm of the states before it."""
        n = tokens.shape[1]
        x = sum(e(tokens[..., c]) for c, e in enumerate(self.embed))
        x = x + self.position(torch.arange(n, device=tokens.device))
        for layer in self.layers[:-1]:
            x = layer(x)
        last = self.layers[-1]
        return last.self_attention(last.norm1(x), need_weights=True).weights

    def part_states(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """The last layer's states (B, N_l, D) of a part of each sequence, tokens (B, N_l, C)
        at global ``positions`` (N_l,): under context parallelism, on the ring twin."""
        x = sum(e(tokens[..., c]) for c, e in enumerate(self.embed))
        x = x + self.position(positions.to(tokens.device))
        for layer in self.layers:
            x = layer(x)
        return x


def layer_arguments(
    name: str,
    embed_dim: int,
    *,
    score: str,
    align: str,
    num_heads: int,
    max_len: int,
    index: int = 0,
    depth: int = 1,
) -> dict:
    """The arguments of an encoder layer named ``name`` in a plan (:mod:`attnkit.layer_plan`):
    ``full``, ``sliding:W``, an attention-slot mechanism or a token mixer. ValueError naming the
    options for another name."""
    head_dim = embed_dim // num_heads
    if name == "full" or name.startswith("sliding"):
        window = None if name == "full" else layer_plan.parse(name)[0].window
        return {"attention": parts.build_attention(score, align, head_dim, max_len),
                "window": window}  # fmt: skip
    if name in parts.slot_mechanisms():
        part = parts.build_slot_attention(
            name, head_dim=head_dim, num_heads=num_heads, max_len=max_len
        )
        return {"attention": part}
    mixer = layer_plan.mixer_name(name)
    if mixer is None:
        mixers = [f"mixer.{m}" for m in MIXERS.available()]
        raise ValueError(
            f"layers: unknown layer {name!r}; a layer is one of: full, sliding:W, "
            f"{', '.join(parts.slot_mechanisms())}, {', '.join(mixers)}"
        )
    built = layer_plan.build_mixer(
        mixer, embed_dim=embed_dim, num_heads=num_heads, index=index, depth=depth
    )
    return {"mixer": built}


class LongRangeTask(Task):
    """A classification task over generated token sequences. Subclasses set ``vocab``,
    ``classes``, ``readout`` and make ``self.train`` and ``self.splits`` as (tokens (n, N, C),
    labels (n,)) pairs, and may give gold positions per example for the heatmaps
    (``gold_positions``)."""

    attentions: ClassVar[SlotAttentions] = SlotAttentions()
    vocab: ClassVar[tuple[int, ...]] = ()
    classes: ClassVar[int] = 10
    readout: ClassVar[int] = 0

    @classmethod
    def attention_name(cls, config) -> str:
        return "full" if config.attention == "default" else config.attention

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        name = cls.attention_name(config)
        if name == "full":
            return {}
        why = (
            f"mechanism {name!r} computes its own attention (no score function or alignment "
            "is built for it)"
        )
        return {key: Unused(f"--attention {name}", why) for key in ("score", "align")}

    @classmethod
    def validate(cls, config) -> None:
        name = cls.attention_name(config)
        if name != "full":  # a mechanism attnkit cannot build from the sizes: refused now
            parts.build_slot_attention(name, head_dim=max(config.d_model // HEADS, 1),
                                       num_heads=HEADS, max_len=config.seq_len)  # fmt: skip
        if config.d_model % HEADS:
            raise ValueError(
                f"d_model must be divisible by the {HEADS} heads, got {config.d_model}"
            )
        if getattr(config, "context_parallel", 1) > 1:
            cls._validate_context_parallel(config)

    @classmethod
    def _validate_context_parallel(cls, config) -> None:
        cp = config.context_parallel
        if cls.attention_name(config) != "full":
            raise ValueError(
                f"context_parallel {cp}: attention {config.attention!r} cannot be split over a "
                "ring; only the full attention (score × alignment) can"
            )
        if config.seq_len % cp:
            raise ValueError(
                f"context_parallel {cp}: seq_len {config.seq_len} does not split into {cp} "
                f"equal parts; choose a seq_len divisible by {cp}"
            )
        d = max(config.d_model // HEADS, 1)
        with torch.random.fork_rng(devices=[]):
            part = parts.build_attention(config.score, config.align, d, config.seq_len)
        reasons = distributed.reasons_not_supported(part.score, part.align)
        if reasons:
            raise ValueError(
                f"context_parallel {cp}: ring attention cannot evaluate score {config.score!r} "
                f"with align {config.align!r}: {'; '.join(reasons)}"
            )

    def build_model(self) -> EncoderClassifier:
        c = self.config
        return EncoderClassifier(
            self.vocab,
            self.classes,
            embed_dim=c.d_model,
            max_len=self.length(),
            attention=self.attention_name(c),
            score=c.score,
            align=c.align,
            readout=self.readout,
        )

    def length(self) -> int:
        return self.config.seq_len

    def context_parallel_model(self, model, group) -> nn.Module:
        return distributed.context_parallel(model, group=group, layout=LAYOUT)

    def context_parallel_loss(self, model, index: Tensor, group) -> Tensor:
        import torch.distributed as dist

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        tokens, labels = (t[index] for t in self.train)
        part = distributed.shard(tokens, rank, size, layout=LAYOUT, dim=1)
        n = tokens.shape[1]
        positions = distributed.global_positions(rank, size, part.shape[1], LAYOUT)
        states = model.part_states(part, positions)
        held = (positions == self.readout % n).nonzero().flatten()
        if held.numel() == 0:  # another rank reads out: a zero through this rank's part
            return states.sum() * 0.0
        logits = model.out(model.norm(states[:, int(held[0])]))
        return F.cross_entropy(logits, labels)

    def n_train(self) -> int:
        return self.train[0].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def objective(self, model, index: Tensor) -> Tensor:
        tokens, labels = (t[index] for t in self.train)
        return F.cross_entropy(model(tokens), labels)

    @torch.no_grad()
    def predict(self, model, tokens: Tensor, batch: int = 256) -> Tensor:
        model.eval()
        return torch.cat(
            [model(tokens[i : i + batch]).argmax(-1) for i in range(0, len(tokens), batch)]
        )

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        tokens, labels = self.splits[split]
        accuracy = (self.predict(model, tokens) == labels).float().mean()
        majority = torch.bincount(labels, minlength=self.classes).max() / len(labels)
        return {"accuracy": float(accuracy), "majority_share": float(majority)}

    def gold_positions(self, split: str) -> Tensor | None:
        """(n,) the position the readout should attend to, or None."""
        return None

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        tokens, labels = (t[:n] for t in self.splits["test"])
        with capture(model) as records:
            predicted = model(tokens).argmax(-1)
        last = [k for k in records if k.startswith(f"layers.{len(model.layers) - 1}.")]
        gold_at = self.gold_positions("test")
        show = min(tokens.shape[1], 48)
        maps = []
        for i in range(min(n, tokens.shape[0])):
            if last:
                w = records[last[0]][-1][i].float()
                w = w.mean(0) if w.dim() == 3 else w  # mean over heads
            else:
                w = torch.zeros(tokens.shape[1], tokens.shape[1])
            w = w[-show:, -show:] if self.readout == -1 else w[:show, :show]
            gold = torch.zeros_like(w, dtype=torch.bool)
            if gold_at is not None:
                offset = tokens.shape[1] - show if self.readout == -1 else 0
                col = int(gold_at[i]) - offset
                row = show - 1 if self.readout == -1 else 0
                if 0 <= col < show:
                    gold[row, col] = True
            labels_x = self.token_labels(tokens[i])
            labels_x = labels_x[-show:] if self.readout == -1 else labels_x[:show]
            maps.append(
                {
                    "title": f"example {i}: label {int(labels[i])}, predicted {int(predicted[i])}"
                    + ("" if last else " (this attention reports no weights)"),
                    "weights": w.numpy(),
                    "gold": gold.numpy(),
                    "x_labels": labels_x,
                    "y_labels": labels_x,
                    "x_title": "key position (token)",
                    "y_title": "query position, last layer, mean over heads",
                }
            )
        return maps

    def token_labels(self, tokens: Tensor) -> list[str]:
        return [str(t.tolist()) for t in tokens]
