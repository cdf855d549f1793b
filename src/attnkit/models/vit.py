"""Vision Transformer, ViT (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021;
Soydaner 5.2): an image read as a sequence of patches by a standard Transformer encoder.

1. Patch embedding: the image (B, C, H, W) is cut into non-overlapping P×P patches in row-major
   order; each patch is flattened channel-major to x_p ∈ ℝ^{C·P·P} and projected, z_p = E x_p + b.
2. A learned class token z_cls is prepended and learned positions are added:
   z⁰ = [z_cls; z_1; …; z_{N_p}] + E_pos (ViT eq. 1).
3. L encoder layers (pre-norm, as ViT), a final LayerNorm, and a linear head on the class
   token's output (eq. 4).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.transformer import TransformerEncoder

__all__ = ["PatchEmbedding", "ViT", "ViTOutput"]


@arguments.renamed(d_model="embed_dim")
class PatchEmbedding(nn.Module):
    """Non-overlapping P×P patches of (B, C, H, W) images, flattened and projected to embed_dim:
    (B, N_p, embed_dim) with N_p = (H/P)·(W/P), patches in row-major order.

    Args:
        channels: C; patch_size: P (must divide H and W); embed_dim: the embedding size.
    """

    def __init__(
        self,
        channels: int,
        patch_size: int,
        embed_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.channels = arguments.positive_int(channels, "channels")
        self.patch_size = arguments.positive_int(patch_size, "patch_size")
        arguments.positive_int(embed_dim, "embed_dim")
        self.proj = nn.Linear(channels * patch_size**2, embed_dim, device=device, dtype=dtype)

    def patches(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N_p, C·P·P): each patch flattened channel-major, then by row."""
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != self.channels:
            raise ValueError(
                f"images must be (B, {self.channels}, H, W), got "
                f"{getattr(images, 'shape', type(images).__name__)}"
            )
        p = self.patch_size
        b, c, h, w = images.shape
        if h % p or w % p:
            raise ValueError(f"patch_size = {p} must divide the image size {h}×{w}")
        x = images.reshape(b, c, h // p, p, w // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)

    def forward(self, images: Tensor) -> Tensor:
        return self.proj(self.patches(images))


class ViTOutput(NamedTuple):
    """Class logits (B, classes) and the encoder's output sequence (B, 1 + N_p, embed_dim), the
    class token first."""

    logits: Tensor
    tokens: Tensor


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class ViT(nn.Module):
    """Vision Transformer for (B, C, H, W) images of a fixed size.

    Args:
        image_size: (H, W) or one int for square images.
        patch_size: P, dividing H and W.
        channels: C.
        classes: the number of output classes.
        embed_dim, num_heads, layers: the encoder's sizes; ``d_ff`` its feed-forward size.
        layer: further keyword arguments of :class:`attnkit.TransformerEncoderLayer` (``score``,
            ``align``, ``attention``, ``dropout``, ...); ``norm_first`` defaults to True (ViT).
    """

    def __init__(
        self,
        image_size: int | tuple[int, int],
        patch_size: int,
        channels: int,
        classes: int,
        embed_dim: int = 64,
        num_heads: int = 4,
        layers: int = 2,
        d_ff: int | None = None,
        **layer: Any,
    ) -> None:
        super().__init__()
        h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        arguments.positive_int(h, "image_size")
        arguments.positive_int(w, "image_size")
        arguments.positive_int(classes, "classes")
        if h % patch_size or w % patch_size:
            raise ValueError(f"patch_size = {patch_size} must divide the image size {h}×{w}")
        self.image_size = (h, w)
        kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
        self.patch = PatchEmbedding(channels, patch_size, embed_dim, **kw)
        n = (h // patch_size) * (w // patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **kw))
        self.pos = nn.Parameter(torch.randn(1, n + 1, embed_dim, **kw) * 0.02)
        layer.setdefault("norm_first", True)
        self.encoder = TransformerEncoder(
            layers, embed_dim, num_heads, d_ff, final_norm=True, **layer
        )
        self.head = nn.Linear(embed_dim, classes, **kw)

    def forward(self, images: Tensor) -> ViTOutput:
        """images (B, C, H, W) of the model's image size -> :class:`ViTOutput`."""
        z = self.patch(images)
        if tuple(images.shape[-2:]) != self.image_size:
            raise ValueError(
                f"this ViT reads {self.image_size[0]}×{self.image_size[1]} images, got "
                f"{tuple(images.shape)}"
            )
        cls = self.cls_token.expand(z.shape[0], 1, -1)
        z = torch.cat([cls, z], 1) + self.pos
        tokens = self.encoder(z)
        return ViTOutput(self.head(tokens[:, 0]), tokens)
