"""Every pattern's mask equals a loop written from its definition; composition; errors."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import patterns as pt


def loop(m, n, allowed):
    return torch.tensor([[bool(allowed(i, j)) for j in range(n)] for i in range(m)])


CASES = [
    ("causal", pt.causal(), lambda i, j: j <= i),
    ("window 2", pt.sliding_window(2), lambda i, j: abs(i - j) <= 2),
    ("window 2 causal", pt.sliding_window(2, causal=True), lambda i, j: 0 <= i - j <= 2),
    ("dilated 2×3", pt.dilated_window(2, 3), lambda i, j: abs(i - j) <= 6 and (i - j) % 3 == 0),
    (
        "dilated causal",
        pt.dilated_window(2, 3, causal=True),
        lambda i, j: 0 <= i - j <= 6 and (i - j) % 3 == 0,
    ),
    # Child et al.: previous `stride` positions, or every stride-th one before
    ("strided 4", pt.strided(4), lambda i, j: j <= i and (i - j < 4 or (i - j) % 4 == 0)),
    (
        "strided 4 both ways",
        pt.strided(4, causal=False),
        lambda i, j: abs(i - j) < 4 or (i - j) % 4 == 0,
    ),
    ("fixed 4", pt.fixed(4), lambda i, j: j <= i and (i // 4 == j // 4 or j % 4 == 3)),
    (
        "fixed 4, 2 summaries",
        pt.fixed(4, 2, causal=False),
        lambda i, j: i // 4 == j // 4 or j % 4 >= 2,
    ),
    (
        "longformer",
        pt.longformer(1, [0, 7]),
        lambda i, j: abs(i - j) <= 1 or i in (0, 7) or j in (0, 7),
    ),
    (
        "2-D 5 wide r1",
        pt.local_2d(5, 1),
        lambda i, j: abs(i // 5 - j // 5) <= 1 and abs(i % 5 - j % 5) <= 1,
    ),
    (
        "query blocks 4+2",
        pt.query_blocks(4, 2),
        lambda i, j: (i // 4) * 4 - 2 <= j < (i // 4) * 4 + 4,
    ),
    (
        "query blocks causal",
        pt.query_blocks(4, 0, causal=True),
        lambda i, j: (i // 4) * 4 <= j <= i,
    ),
]


@pytest.mark.parametrize(("name", "mod", "allowed"), CASES, ids=[c[0] for c in CASES])
def test_pattern_equals_its_definition(name, mod, allowed):
    torch.testing.assert_close(pt.dense(mod, 13, 17), loop(13, 17, allowed))


def test_bigbird_is_window_globals_and_random_blocks():
    def make(seed):
        return pt.dense(
            pt.bigbird(1, 32, global_positions=[0], random_blocks=2, block=8, seed=seed), 32, 32
        )

    mask = make(3)
    base = loop(32, 32, lambda i, j: abs(i - j) <= 1 or i == 0 or j == 0)
    assert (mask >= base).all()
    # Random part: for every query block, a set of at most 2 whole key blocks.
    tiles = mask.reshape(4, 8, 4, 8)  # (query block, row, key block, key)
    full = tiles.all(dim=(1, 3))  # (query block, key block)
    random = (tiles & ~base.reshape(4, 8, 4, 8)).any(dim=(1, 3))
    assert (random <= full).all()
    assert (full.sum(-1) >= 1).all() and (random.sum(-1) <= 2).all()
    assert torch.equal(mask, make(3)) and not torch.equal(mask, make(4))


def test_and_or():
    a, b = pt.causal(), pt.sliding_window(1)
    torch.testing.assert_close(
        pt.dense(pt.and_masks(a, b), 6, 6), loop(6, 6, lambda i, j: 0 <= i - j <= 1)
    )
    torch.testing.assert_close(
        pt.dense(pt.or_masks(a, b), 6, 6), loop(6, 6, lambda i, j: j <= i + 1)
    )
    with pytest.raises(ValueError, match="at least one"):
        pt.and_masks()
    with pytest.raises(TypeError, match="argument 1 is not a mask function"):
        pt.or_masks(a, 3)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: pt.sliding_window(-1), "size must be an int >= 0"),
        (lambda: pt.strided(0), "stride must be a positive int"),
        (lambda: pt.fixed(4, 5), "summary = 5 must be at most stride = 4"),
        (lambda: pt.bigbird(2, 0), "n must be a positive int"),
        (lambda: pt.local_2d(0, 1), "width must be a positive int"),
        (lambda: pt.longformer(2, [-1]), "global position must be an int >= 0"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_patterns_reach_attention():
    q = torch.randn(1, 20, 8)
    bm = pt.block_mask(pt.sliding_window(2), 20, block_q=8, block_k=8)
    out = ak.attention(q, q, block_mask=bm, need_weights=True)
    assert (out.weights[0][~pt.dense(pt.sliding_window(2), 20, 20)] == 0).all()
