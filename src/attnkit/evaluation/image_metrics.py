"""Extrinsic metrics for vision tasks with attention (Brauwers Sec. 4.1; Galassi VI): PSNR and
SSIM for image generation and restoration, intersection over union for detection (boxes) and
segmentation (masks). Written from the definitions; the tests check SSIM and PSNR against
scikit-image and SciPy filters and IoU against loops over boxes and pixels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["box_iou", "mask_iou", "psnr", "ssim"]


def _images(prediction: object, target: object, min_dim: int, layout: str) -> tuple[Tensor, Tensor]:
    for name, x in (("prediction", prediction), ("target", target)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a Tensor {layout}, got {type(x).__name__}")
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be a real-valued Tensor {layout}, got {x.dtype}")
        if x.dim() < min_dim:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} must have "
            "one shape"
        )
    return prediction.double(), target.double()


def _data_range(data_range: object) -> float:
    if (
        isinstance(data_range, bool)
        or not isinstance(data_range, int | float)
        or not math.isfinite(data_range)
        or data_range <= 0
    ):
        raise ValueError(
            "data_range must be a finite number > 0, the span of possible pixel values (1.0 for "
            f"images in [0, 1], 255 for 8-bit images), got {data_range!r}"
        )
    return float(data_range)


def psnr(prediction: Tensor, target: Tensor, *, data_range: float) -> float:
    """Peak signal-to-noise ratio in dB: 10 log₁₀(L² / MSE), L = ``data_range`` and MSE the
    mean squared difference over every element; +inf for identical inputs. Call it per image
    and average for the usual per-image mean.

    Args:
        prediction, target: tensors of one shape (any, e.g. (C, H, W)).
        data_range: L, the span of possible values (1.0 for [0, 1], 255 for 8-bit).
    """
    p, t = _images(prediction, target, 1, "(…)")
    if p.numel() == 0:
        raise ValueError("psnr: the images are empty")
    peak = _data_range(data_range)
    mse = float(((p - t) ** 2).mean())
    if math.isnan(mse):
        raise ValueError("psnr: the inputs contain NaN")
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def _gaussian(size: int, sigma: float) -> Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(
    prediction: Tensor,
    target: Tensor,
    *,
    data_range: float,
    window_size: int = 11,
    sigma: float = 1.5,
    k1: float = 0.01,
    k2: float = 0.03,
) -> float:
    """Mean structural similarity (Wang et al. 2004, eq. 13 and Sec. III-C): with local means
    μ, variances σ² and covariance σ_xy weighted by a ``window_size`` × ``window_size``
    Gaussian window of standard deviation ``sigma``,

        SSIM(x, y) = (2 μ_x μ_y + C₁)(2 σ_xy + C₂) / ((μ_x² + μ_y² + C₁)(σ_x² + σ_y² + C₂)),
        C₁ = (k₁ L)², C₂ = (k₂ L)², L = ``data_range``,

    averaged over every window lying wholly inside the image (no padding) and over the leading
    dims (channels, batch). With the defaults this is scikit-image's
    ``structural_similarity(..., gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=L)``, the paper's setting. In [−1, 1]; 1 for
    identical images.

    Args:
        prediction, target: (…, H, W) of one shape, H and W at least ``window_size``.
        data_range: L, the span of possible pixel values.
    """
    p, t = _images(prediction, target, 2, "(…, H, W)")
    peak = _data_range(data_range)
    if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size must be an int ≥ 1, got {window_size!r}")
    if window_size % 2 == 0:
        raise ValueError(
            f"window_size must be odd (a window centred on a pixel), got {window_size}"
        )
    h, w = p.shape[-2:]
    if h < window_size or w < window_size:
        raise ValueError(
            f"the images (…, H, W) = {tuple(p.shape)} must be at least window_size = "
            f"{window_size} pixels high and wide"
        )
    if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not sigma > 0:
        raise ValueError(f"sigma must be a number > 0, got {sigma!r}")
    for name, k in (("k1", k1), ("k2", k2)):
        if isinstance(k, bool) or not isinstance(k, int | float) or not k > 0:
            raise ValueError(f"{name} must be a number > 0, got {k!r}")
    if p.numel() == 0:
        raise ValueError("ssim: the images are empty")
    g = _gaussian(window_size, float(sigma))
    window = (g[:, None] * g[None, :]).view(1, 1, window_size, window_size)
    x, y = p.reshape(-1, 1, h, w), t.reshape(-1, 1, h, w)

    def blur(z: Tensor) -> Tensor:
        return F.conv2d(z, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (k1 * peak) ** 2, (k2 * peak) ** 2
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    value = float((num / den).mean())
    if math.isnan(value):
        raise ValueError("ssim: the inputs contain NaN or infinity")
    return value


def _boxes(x: object, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(
            f"{name} must be a Tensor (N, 4) of (x1, y1, x2, y2), got {type(x).__name__}"
        )
    if x.dim() != 2 or x.shape[-1] != 4:
        raise ValueError(f"{name} must be (N, 4) boxes (x1, y1, x2, y2), got {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold real coordinates, got {x.dtype}")
    b = x.double()
    if not bool(torch.isfinite(b).all()):
        raise ValueError(f"{name} must hold finite coordinates")
    bad = (b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{name}[{i}] = {b[i].tolist()} is not (x1, y1, x2, y2) with x1 ≤ x2 and y1 ≤ y2"
        )
    return b


def box_iou(boxes_a: Tensor, boxes_b: Tensor) -> Tensor:
    """Pairwise intersection over union of axis-aligned boxes (x1, y1, x2, y2), corners in
    continuous coordinates (area (x2 − x1)(y2 − y1), as torchvision's ``box_iou``):
    |A ∩ B| / |A ∪ B|. Returns (N, M) float64; NaN where both boxes have zero area and so the
    union is empty (undefined).

    Args:
        boxes_a: (N, 4); boxes_b: (M, 4).
    """
    a, b = _boxes(boxes_a, "boxes_a"), _boxes(boxes_b, "boxes_b")
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lo = torch.maximum(a[:, None, :2], b[None, :, :2])
    hi = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (hi - lo).clamp_min(0).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1e-300), torch.full_like(union, math.nan))


def mask_iou(masks_a: Tensor, masks_b: Tensor) -> Tensor:
    """Intersection over union of boolean masks (…, H, W), the leading dims broadcast:
    |A ∩ B| / |A ∪ B| counted in pixels. Returns (…) float64; NaN where both masks are empty
    (undefined). For a segmentation's per-class IoU pass one mask per class, (K, H, W).
    """
    for name, m in (("masks_a", masks_a), ("masks_b", masks_b)):
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            got = m.dtype if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(
                f"{name} must be a boolean Tensor (…, H, W), True = in the region, got {got}; "
                "compare labels first, e.g. labels == k"
            )
        if m.dim() < 2:
            raise ValueError(f"{name} must be (…, H, W), got shape {tuple(m.shape)}")
    if masks_a.shape[-2:] != masks_b.shape[-2:]:
        raise ValueError(
            f"masks_a {tuple(masks_a.shape)} and masks_b {tuple(masks_b.shape)} must have the "
            "same (H, W)"
        )
    try:
        inter = (masks_a & masks_b).sum((-2, -1)).double()
    except RuntimeError as err:
        raise ValueError(
            f"the leading dims of masks_a {tuple(masks_a.shape)} and masks_b "
            f"{tuple(masks_b.shape)} must broadcast"
        ) from err
    union = (masks_a | masks_b).sum((-2, -1)).double()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(union, math.nan))
