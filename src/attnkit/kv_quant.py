"""An 8-bit key/value cache: keys quantised per channel, values per token (KIVI: Liu et al.,
"KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024), dequantised when
read.

Why this split. Keys have outlier *channels* (a few of the d dimensions are large for every
token, Liu et al. Fig. 2), so one scale per token would be set by the outliers and crush the
other channels; a scale per channel, shared by a group of tokens, fits each channel's range.
Values show no such channels, and each token's value enters the output through its own weight,
so a scale per token keeps every token's error relative to its own size.

Layout. Every number is stored as an unsigned 8-bit code c with an asymmetric (min-max) map
x ≈ zero + scale · c, scale = (max − min) / 255, rounding to nearest:

- values: one (scale, zero) per token and head over its d_v channels, quantised as they arrive;
- keys: one (scale, zero) per channel and head over a group of ``group`` consecutive tokens.
  The keys of the last, incomplete group wait in full precision (the residual, fewer than
  ``group`` tokens, as in KIVI) and are quantised when the group fills.

A step reads the dequantised keys and values (the attention runs in the inputs' dtype), so the
cache is a drop-in :class:`attnkit.kv_cache.LayerCache` for :class:`attnkit.MultiHeadAttention`
and, as :class:`QuantizedKVCache`, for a decoder stack. The scales and zeros are kept in the
inputs' dtype. Per token and head the cache holds d_v value bytes plus a value scale and zero,
and d key bytes plus 2d / ``group`` key scales and zeros (the residual aside): with
d = d_v = 64, group = 32 and float32 scales, 152 bytes for 128 numbers against 512 in float32,
0.30 of the memory.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.kv_cache import KVCache, LayerCache

__all__ = ["QuantizedKVCache", "QuantizedLayerCache", "dequantize", "quantize"]

_LEVELS = 255  # the largest 8-bit code


def quantize(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 8-bit codes of ``x`` with one scale and zero per slice along ``dim``: returns
    (codes uint8 like x, scale, zero), scale and zero with ``dim`` of size 1, such that
    :func:`dequantize` gives x to within scale / 2. A constant slice gets scale 1 and codes 0
    (exact)."""
    low = x.amin(dim, keepdim=True)
    high = x.amax(dim, keepdim=True)
    scale = (high - low) / _LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((x - low) / scale).round_().clamp_(0, _LEVELS).to(torch.uint8)
    return codes, scale, low


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """zero + scale · codes, in the dtype of ``scale``."""
    return codes.to(scale.dtype) * scale + zero


class QuantizedLayerCache(LayerCache):
    """One layer's keys and values in 8 bits (module docstring): a :class:`LayerCache` whose
    :meth:`append` stores the new positions quantised and returns every position dequantised.

    Args:
        group: the tokens per key group (one scale and zero per channel and group); the keys of
            an incomplete group are kept in full precision until it fills.
    """

    # keys quantised as projected, per channel (KIVI), placed when read
    holds_placed_keys: ClassVar[bool] = False

    def __init__(self, group: int = 32) -> None:
        super().__init__()
        self.group = arguments.positive_int(group, "group")
        self.k_codes: Tensor | None = None  # (…, H_kv, G · group, d) uint8
        self.k_scale: Tensor | None = None  # (…, H_kv, G, d)
        self.k_zero: Tensor | None = None
        self.k_residual: Tensor | None = None  # (…, H_kv, < group, d), full precision
        self.v_codes: Tensor | None = None  # (…, H_kv, N, d_v) uint8
        self.v_scale: Tensor | None = None  # (…, H_kv, N, 1)
        self.v_zero: Tensor | None = None

    def __len__(self) -> int:
        """N, the number of cached positions."""
        return 0 if self.v_codes is None else self.v_codes.shape[-2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Quantise and keep the keys (…, H_kv, M, d) and values (…, H_kv, M, d_v) of M new
        positions; return all keys and values, dequantised (the residual keys as they are)."""
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"quantized cache: new {name} must be a float tensor, got {got}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(
                f"quantized cache: new k {tuple(k.shape)} and v {tuple(v.shape)} must have the "
                "same dims except the last"
            )
        if self.v_codes is not None:
            assert self.k_residual is not None and self.v_scale is not None
            for name, new, old in (("k", k, self.k_residual), ("v", v, self.v_codes)):
                if new.shape[:-2] != old.shape[:-2] or new.shape[-1] != old.shape[-1]:
                    raise ValueError(
                        f"cache: new {name} of shape {tuple(new.shape)} does not extend the "
                        f"cached {name} of shape {tuple(old.shape)} (same dims except the "
                        "length N)"
                    )
            if k.dtype != self.v_scale.dtype or v.dtype != self.v_scale.dtype:
                raise ValueError(
                    f"quantized cache: new k and v are {k.dtype} and {v.dtype}, the cache "
                    f"holds {self.v_scale.dtype}"
                )
        codes, scale, zero = quantize(v, -1)
        self.v_codes = _cat(self.v_codes, codes)
        self.v_scale, self.v_zero = _cat(self.v_scale, scale), _cat(self.v_zero, zero)
        residual = _cat(self.k_residual, k)
        full = residual.shape[-2] // self.group * self.group
        if full:
            done = residual[..., :full, :]
            groups = done.unflatten(-2, (full // self.group, self.group))  # (…, G, group, d)
            codes, scale, zero = quantize(groups, -2)
            self.k_codes = _cat(self.k_codes, codes.flatten(-3, -2))
            self.k_scale = _cat(self.k_scale, scale.squeeze(-2))
            self.k_zero = _cat(self.k_zero, zero.squeeze(-2))
            residual = residual[..., full:, :].clone()
        self.k_residual = residual
        return self.keys(), self.values()

    def keys(self) -> Tensor:
        """Every cached key (…, H_kv, N, d): the quantised groups dequantised, then the
        residual."""
        if self.k_residual is None:
            raise ValueError("the quantized cache is empty")
        if self.k_codes is None:
            return self.k_residual
        assert self.k_scale is not None and self.k_zero is not None
        groups = self.k_codes.unflatten(-2, (-1, self.group))
        done = dequantize(groups, self.k_scale.unsqueeze(-2), self.k_zero.unsqueeze(-2))
        return torch.cat([done.flatten(-3, -2), self.k_residual], -2)

    def values(self) -> Tensor:
        """Every cached value (…, H_kv, N, d_v), dequantised."""
        if self.v_codes is None:
            raise ValueError("the quantized cache is empty")
        assert self.v_scale is not None and self.v_zero is not None
        return dequantize(self.v_codes, self.v_scale, self.v_zero)

    def rollback(self, k: int) -> None:
        """Forget the last ``k`` positions. Values are per token, so any k is exact; keys can
        be given back only from the full-precision residual (a quantised group's scales were
        set by all its tokens, and re-quantising it without the forgotten ones would not give
        what a cache that never saw them holds): k beyond the residual is refused."""
        arguments.nonnegative_int(k, "k")
        if k > len(self):
            raise ValueError(f"k = {k}: the cache holds only {len(self)} positions to roll back")
        held = 0 if self.k_residual is None else self.k_residual.shape[-2]
        if k > held:
            raise ValueError(
                f"QuantizedLayerCache.rollback: k = {k} reaches into a quantised key group (only "
                f"the last {held} keys are in full precision, group = {self.group}); roll back "
                "at most that many, or use a larger group"
            )
        if k:
            n = len(self) - k
            assert self.v_codes is not None and self.v_scale is not None
            self.v_codes, self.v_scale = self.v_codes[..., :n, :], self.v_scale[..., :n, :]
            self.v_zero = self.v_zero[..., :n, :]  # type: ignore[index]
            self.k_residual = self.k_residual[..., : held - k, :]  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes, scales and zeros, the residual keys and the cross-attention
        memory."""
        parts = (
            self.k_codes,
            self.k_scale,
            self.k_zero,
            self.k_residual,
            self.v_codes,
            self.v_scale,
            self.v_zero,
        )
        own = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return own + self.memory.nbytes


class QuantizedKVCache(KVCache):
    """A :class:`attnkit.kv_cache.KVCache` of :class:`QuantizedLayerCache` layers, one per
    layer of a decoder stack (e.g. for :meth:`attnkit.models.decoder_lm.DecoderLM.forward`)."""

    def __init__(self, layers: int, *, group: int = 32) -> None:
        super().__init__(layers)
        self.layers = [QuantizedLayerCache(group) for _ in range(layers)]


def _cat(old: Tensor | None, new: Tensor) -> Tensor:
    return new if old is None else torch.cat([old, new], -2)
