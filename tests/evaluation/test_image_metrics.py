import math

import numpy as np
import pytest
import torch
from scipy import ndimage

from attnkit.evaluation.image_metrics import box_iou, mask_iou, psnr, ssim


def images(shape=(3, 24, 30), noise=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64)
    y = (x + noise * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    return x, y


def reference_ssim(x, y, data_range, sigma=1.5, k1=0.01, k2=0.03):
    """Wang et al. (2004) with SciPy's Gaussian filter (truncated at 3.5 sigma: an 11-tap
    window for sigma 1.5), averaged over the pixels whose window lies inside the image."""
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    values = []
    for a, b in zip(
        x.reshape(-1, *x.shape[-2:]).numpy(), y.reshape(-1, *y.shape[-2:]).numpy(), strict=True
    ):

        def blur(z):
            return ndimage.gaussian_filter(z, sigma, truncate=3.5, mode="reflect")

        mx, my = blur(a), blur(b)
        vx, vy, cxy = blur(a * a) - mx**2, blur(b * b) - my**2, blur(a * b) - mx * my
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
        values.append(s[5:-5, 5:-5])
    return float(np.mean(values))


@pytest.mark.parametrize("noise", [0.02, 0.3])
def test_ssim_matches_a_scipy_reference(noise):
    x, y = images(noise=noise)
    assert ssim(y, x, data_range=1.0) == pytest.approx(reference_ssim(y, x, 1.0), abs=1e-12)
    scaled = ssim(255 * y, 255 * x, data_range=255)
    assert scaled == pytest.approx(ssim(y, x, data_range=1.0), abs=1e-12)


def test_ssim_matches_scikit_image():
    metrics = pytest.importorskip("skimage.metrics", reason="scikit-image not installed")
    x, y = images((2, 20, 26))
    theirs = metrics.structural_similarity(
        x.numpy(), y.numpy(), channel_axis=0, gaussian_weights=True, sigma=1.5,
        use_sample_covariance=False, data_range=1.0,
    )  # fmt: skip
    assert ssim(y, x, data_range=1.0) == pytest.approx(theirs, abs=1e-12)
    assert psnr(y, x, data_range=1.0) == pytest.approx(
        metrics.peak_signal_noise_ratio(x.numpy(), y.numpy(), data_range=1.0), abs=1e-12
    )


def test_ssim_and_psnr_worked_values():
    x, _ = images((1, 16, 16))
    assert ssim(x, x, data_range=1.0) == pytest.approx(1.0)
    assert psnr(x, x, data_range=1.0) == math.inf
    # constant images a and b: σ = 0, so SSIM = (2ab + C1) C2 / ((a² + b² + C1) C2)
    a, b, c1 = 0.2, 0.6, 0.01**2
    expected = (2 * a * b + c1) / (a * a + b * b + c1)
    const = torch.full((16, 16), a, dtype=torch.float64)
    assert ssim(const, torch.full_like(const, b), data_range=1.0) == pytest.approx(expected)
    # MSE 0.01 at peak 1: 20 dB
    assert psnr(const, const + 0.1, data_range=1.0) == pytest.approx(20.0)
    assert ssim(x, 1 - x, data_range=1.0) < 0  # anticorrelated structure


def zeros(*shape, dtype=torch.float64):
    return torch.zeros(*shape, dtype=dtype)


def falses(*shape):
    return torch.zeros(*shape, dtype=torch.bool)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: psnr(zeros(3), zeros(4), data_range=1.0), ValueError, "one shape"),
        (lambda: psnr(zeros(3), zeros(3), data_range=0), ValueError, "data_range"),
        (lambda: psnr(zeros(3), zeros(3), data_range=None), ValueError, "data_range"),
        (lambda: psnr([0.0], zeros(1), data_range=1.0), TypeError, "prediction"),
        (lambda: psnr(zeros(0), zeros(0), data_range=1.0), ValueError, "empty"),
        (lambda: ssim(zeros(8, 8), zeros(8, 8), data_range=1.0), ValueError, "window_size"),
        (lambda: ssim(zeros(20), zeros(20), data_range=1.0), ValueError, "H, W"),
        (
            lambda: ssim(zeros(12, 12), zeros(12, 12), data_range=1, window_size=4),
            ValueError,
            "odd",
        ),
        (lambda: ssim(zeros(12, 12), zeros(12, 12), data_range=1, sigma=0), ValueError, "sigma"),
        (lambda: ssim(falses(12, 12), zeros(12, 12), data_range=1.0), TypeError, "real"),
        (lambda: ssim(zeros(12, 12) / 0, zeros(12, 12), data_range=1.0), ValueError, "NaN"),
    ],
)
def test_image_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call()


def reference_box_iou(a, b):
    out = torch.empty(len(a), len(b), dtype=torch.float64)
    for i, (ax1, ay1, ax2, ay2) in enumerate(a.tolist()):
        for j, (bx1, by1, bx2, by2) in enumerate(b.tolist()):
            w = max(0.0, min(ax2, bx2) - max(ax1, bx1))
            h = max(0.0, min(ay2, by2) - max(ay1, by1))
            union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - w * h
            out[i, j] = w * h / union if union > 0 else math.nan
    return out


def test_box_iou_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    corners = torch.rand(7, 2, 2, generator=g) * 10
    a = torch.cat([corners.min(1).values, corners.max(1).values], -1)
    corners = torch.rand(5, 2, 2, generator=g) * 10
    b = torch.cat([corners.min(1).values, corners.max(1).values], -1)
    b[0] = a[0]  # identical boxes: 1
    b[1] = torch.tensor([20.0, 20.0, 21.0, 21.0])  # disjoint from all: 0
    ours = box_iou(a, b)
    torch.testing.assert_close(ours, reference_box_iou(a, b))
    assert float(ours[0, 0]) == pytest.approx(1.0)
    assert bool((ours[:, 1] == 0).all())
    # integer pixel boxes; a zero-area pair is undefined
    ints = torch.tensor([[0, 0, 2, 2], [1, 1, 1, 1]])
    assert box_iou(ints, ints)[0, 0] == 1.0
    assert math.isnan(float(box_iou(ints, ints)[1, 1]))
    assert float(box_iou(ints[:1], torch.tensor([[1, 1, 3, 3]]))[0, 0]) == pytest.approx(1 / 7)


def test_mask_iou_matches_a_loop_and_broadcasts():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(4, 6, 7, generator=g) > 0.5
    b = torch.rand(4, 6, 7, generator=g) > 0.4
    expected = []
    for k in range(4):
        inter = union = 0
        for i in range(6):
            for j in range(7):
                inter += bool(a[k, i, j]) and bool(b[k, i, j])
                union += bool(a[k, i, j]) or bool(b[k, i, j])
        expected.append(inter / union)
    torch.testing.assert_close(mask_iou(a, b), torch.tensor(expected, dtype=torch.float64))
    pairwise = mask_iou(a[:, None], b[None])  # (4, 4): every mask against every mask
    assert pairwise.shape == (4, 4)
    torch.testing.assert_close(pairwise.diagonal(), mask_iou(a, b))
    empty = torch.zeros(3, 3, dtype=torch.bool)
    assert math.isnan(float(mask_iou(empty, empty)))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: box_iou(zeros(3, 5), zeros(2, 4)), ValueError, "boxes_a"),
        (lambda: box_iou(torch.tensor([[2.0, 0, 1, 1]]), zeros(1, 4)), ValueError, "x1 ≤ x2"),
        (lambda: box_iou(zeros(1, 4), torch.tensor([[0, 0, math.inf, 1]])), ValueError, "finite"),
        (lambda: box_iou([[0, 0, 1, 1]], zeros(1, 4)), TypeError, "boxes_a"),
        (lambda: mask_iou(zeros(3, 3), zeros(3, 3)), TypeError, "boolean"),
        (lambda: mask_iou(falses(3), falses(3)), ValueError, "H, W"),
        (lambda: mask_iou(falses(3, 3), falses(3, 4)), ValueError, "same"),
        (lambda: mask_iou(falses(2, 3, 3), falses(3, 3, 3)), ValueError, "broadcast"),
    ],
)
def test_iou_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call()
