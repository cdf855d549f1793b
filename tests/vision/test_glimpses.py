"""Recurrent visual attention (Mnih et al. 2014): the glimpse sensor against a pixel loop, the
hard location policy (one cell per glimpse, log π for REINFORCE), and learning where to look."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks.parts import task_loss
from attnkit.vision import RecurrentAttention, glimpse_sensor


def test_glimpse_sensor_matches_a_pixel_loop():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 2, 9, 9, generator=g, dtype=torch.float64)
    centres = torch.tensor([[4, 4], [0, 8], [7, 2]])
    got = glimpse_sensor(images, centres, 2, 3)  # sides 2, 4, 8, each pooled to 2 × 2
    assert got.shape == (2, 3, 3, 2, 2, 2)

    def pixel(b, c, r, col):
        return float(images[b, c, r, col]) if 0 <= r < 9 and 0 <= col < 9 else 0.0

    for b in range(2):
        for li, (r0, c0) in enumerate(centres.tolist()):
            for s in range(3):
                side, block = 2 * 2**s, 2**s
                top, left = r0 - side // 2, c0 - side // 2
                for c in range(2):
                    for i in range(2):
                        for j in range(2):
                            cells = [
                                pixel(b, c, top + i * block + u, left + j * block + v)
                                for u in range(block)
                                for v in range(block)
                            ]
                            ref = sum(cells) / len(cells)
                            assert got[b, li, s, c, i, j].item() == pytest.approx(ref)


def test_hard_policy_takes_one_glimpse_per_step_and_gives_log_prob():
    torch.manual_seed(0)
    model = RecurrentAttention(16, 3, glimpses=3, grid=4, glimpse_size=4, hidden=8)
    images = torch.randn(5, 1, 16, 16)
    model.train()
    out = model(images)
    assert ((out.weights == 0) | (out.weights == 1)).all() and (out.weights.sum(-1) == 1).all()
    assert out.log_prob.shape == (5,) and (out.log_prob <= 0).all()
    # the location is the chosen cell's centre
    cell = out.weights.argmax(-1)
    torch.testing.assert_close(out.locations, model.coords[cell])
    model.eval()  # the most probable cell: deterministic
    torch.testing.assert_close(model(images).weights, model(images).weights)


def test_soft_policy_reads_the_expected_glimpse():
    torch.manual_seed(0)
    model = RecurrentAttention(8, 2, glimpses=1, grid=2, glimpse_size=2, hidden=4, align="softmax")
    images = torch.randn(1, 1, 8, 8)
    out = model(images)
    assert out.log_prob is None
    w = out.weights[0, 0]
    sensed = glimpse_sensor(images, model.centres, 2, 2).flatten(2)[0]
    h_g = torch.relu(model.what(w @ sensed))
    h_l = torch.relu(model.where(w @ model.coords))
    g_t = torch.relu(model.what_out(h_g) + model.where_out(h_l))
    h, _ = model.core(g_t[None])
    torch.testing.assert_close(out.logits, model.act(h))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="grid = 9 has more cells"):
        RecurrentAttention(8, 2, grid=9)
    with pytest.raises(ValueError, match=r"images must be 8 × 8 \(image_size\)"):
        RecurrentAttention(8, 2, grid=2)(torch.randn(1, 1, 9, 9))


def _bright_corner(n: int, g: torch.Generator):
    """Class = which of the 4 quadrants holds a bright 3 × 3 square, among faint noise."""
    images = 0.1 * torch.rand(n, 1, 16, 16, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    for i, q in enumerate(labels.tolist()):
        r, c = 8 * (q // 2) + 2, 8 * (q % 2) + 2
        images[i, 0, r : r + 3, c : c + 3] = 1.0
    return images, labels


def test_hard_glimpses_learn_where_to_look_with_reinforce():
    """A task solvable only by looking at the right place with a small glimpse: a 2-px glimpse
    with 2 scales (4 px) at cell centres of a 4 × 4 grid must find the bright square. After
    training with REINFORCE (reward: −loss, batch-mean baseline), accuracy is far above chance
    (1/4) and the glimpses land on the square's quadrant."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = RecurrentAttention(16, 4, glimpses=3, grid=4, glimpse_size=2, scales=2, hidden=32)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(300):
            images, labels = _bright_corner(64, g)
            out = model(images)
            per_item = torch.nn.functional.cross_entropy(out.logits, labels, reduction="none")
            optim.zero_grad()
            task_loss(per_item, out.log_prob).backward()
            optim.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    images, labels = _bright_corner(400, torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(images)
    accuracy = (out.logits.argmax(-1) == labels).float().mean()
    assert accuracy > 0.85
    # the last glimpse's centre lies in the labelled quadrant (rows/cols < 0 are the top/left)
    row, col = out.locations[:, -1, 0], out.locations[:, -1, 1]
    quadrant = 2 * (row > 0).long() + (col > 0).long()
    assert (quadrant == labels).float().mean() > 0.7


def _img():
    return torch.randn(1, 1, 8, 8)


BAD_CALLS = [
    (
        "centres of 3 coordinates",
        lambda: glimpse_sensor(_img(), torch.tensor([[1, 2, 3]]), 2, 2),
        ValueError,
        r"centres must be \(L, 2\) \(row, column\), got shape \(1, 3\)",
    ),
    (
        "float centres",
        lambda: glimpse_sensor(_img(), torch.tensor([[1.0, 2.0]]), 2, 2),
        TypeError,
        r"centres must be integer.*torch.float32",
    ),
    (
        "centre outside the image",
        lambda: glimpse_sensor(_img(), torch.tensor([[1, 2], [3, 8]]), 2, 2),
        ValueError,
        r"centres must be pixels of the 8 × 8 images.*centre 1 = \[3, 8\]",
    ),
    (
        "negative centre",
        lambda: glimpse_sensor(_img(), torch.tensor([[-20, 2]]), 2, 2),
        ValueError,
        r"centre 0 = \[-20, 2\]",
    ),
    (
        "size 0",
        lambda: glimpse_sensor(_img(), torch.tensor([[1, 2]]), 0, 2),
        ValueError,
        r"size must be a positive int, got 0",
    ),
    (
        "scales 0",
        lambda: glimpse_sensor(_img(), torch.tensor([[1, 2]]), 2, 0),
        ValueError,
        r"scales must be a positive int, got 0",
    ),
    (
        "images of rank 3",
        lambda: glimpse_sensor(torch.randn(1, 8, 8), torch.tensor([[1, 2]]), 2, 2),
        ValueError,
        r"images must be a feature map \(B, C, H, W\)",
    ),
    (
        "centres not a tensor",
        lambda: glimpse_sensor(_img(), [[1, 2]], 2, 2),
        TypeError,
        r"centres must be a torch.Tensor \(L, 2\), got list",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
