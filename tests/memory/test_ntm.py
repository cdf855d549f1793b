"""Neural Turing machine: each addressing step against a loop written from its equation in
Graves et al. (2014), memory read/write (eqs. 2-4), a deterministic head walk, and learning to
copy (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.memory import NeuralTuringMachine
from attnkit.memory.ntm import content_weights, interpolate, read, sharpen, shift, write

G = torch.Generator().manual_seed(0)


def _rand(*shape):
    return torch.rand(*shape, generator=G, dtype=torch.float64)


def test_content_addressing_matches_eqs_5_6():
    key, memory, beta = _rand(2, 3, 4) - 0.5, _rand(2, 6, 4) - 0.5, 3 * _rand(2, 3)
    got = content_weights(key, memory, beta)
    for b in range(2):
        for h in range(3):
            k = key[b, h].tolist()
            sims = []
            for i in range(6):
                m = memory[b, i].tolist()
                dot = sum(x * y for x, y in zip(k, m, strict=True))
                norm = math.sqrt(sum(x * x for x in k)) * math.sqrt(sum(y * y for y in m))
                sims.append(math.exp(float(beta[b, h]) * dot / norm))
            ref = [s / sum(sims) for s in sims]
            torch.testing.assert_close(got[b, h], torch.tensor(ref, dtype=torch.float64))


def test_interpolation_matches_eq_7():
    wc, prev, g = _rand(2, 3, 5), _rand(2, 3, 5), _rand(2, 3)
    got = interpolate(wc, prev, g)
    for b in range(2):
        for h in range(3):
            for i in range(5):
                ref = g[b, h] * wc[b, h, i] + (1 - g[b, h]) * prev[b, h, i]
                torch.testing.assert_close(got[b, h, i], ref)


@pytest.mark.parametrize("r", [0, 1, 2])
def test_shift_matches_the_circular_convolution_of_eq_8(r):
    n = 6
    w, s = _rand(2, 3, n), _rand(2, 3, 2 * r + 1).softmax(-1)
    got = shift(w, s)
    for b in range(2):
        for h in range(3):
            for i in range(n):
                total = 0.0
                for j in range(n):
                    # s(i − j) with i − j taken modulo N into −r … r (zero outside the range)
                    delta = (i - j) % n
                    delta = delta - n if delta > n // 2 else delta
                    if -r <= delta <= r:
                        total += float(w[b, h, j]) * float(s[b, h, delta + r])
                torch.testing.assert_close(got[b, h, i].item(), total)


def test_shift_moves_a_one_hot_weighting_by_one():
    w = torch.zeros(1, 1, 5, dtype=torch.float64)
    w[..., 4] = 1
    forward = torch.tensor([[[0.0, 0.0, 1.0]]], dtype=torch.float64)  # s(+1) = 1
    assert shift(w, forward)[0, 0].tolist() == [1, 0, 0, 0, 0]  # wraps around
    with pytest.raises(ValueError, match="odd size"):
        shift(w, torch.ones(1, 1, 2))


def test_sharpening_matches_eq_9():
    w, gamma = _rand(2, 3, 5).softmax(-1), 1 + 3 * _rand(2, 3)
    got = sharpen(w, gamma)
    for b in range(2):
        for h in range(3):
            powered = [float(w[b, h, i]) ** float(gamma[b, h]) for i in range(5)]
            ref = torch.tensor([p / sum(powered) for p in powered], dtype=torch.float64)
            torch.testing.assert_close(got[b, h], ref, atol=1e-7, rtol=1e-6)


def test_read_and_write_match_eqs_2_to_4():
    memory, w = _rand(2, 4, 3), _rand(2, 2, 4).softmax(-1)
    erase, add = _rand(2, 2, 3), _rand(2, 2, 3)
    got_read = read(memory, w)
    got = write(memory, w, erase, add)
    for b in range(2):
        for h in range(2):
            for k in range(3):
                ref = sum(float(w[b, h, i] * memory[b, i, k]) for i in range(4))
                torch.testing.assert_close(got_read[b, h, k].item(), ref)
        for i in range(4):
            for k in range(3):
                kept = float(memory[b, i, k])
                for h in range(2):  # eq. 3, erasures from every head multiply
                    kept *= 1 - float(w[b, h, i] * erase[b, h, k])
                added = sum(float(w[b, h, i] * add[b, h, k]) for h in range(2))  # eq. 4
                torch.testing.assert_close(got[b, i, k].item(), kept + added)


def test_write_with_full_erase_then_read_returns_the_added_vector():
    """Deterministic memory round trip: a one-hot write with e = 1 replaces the row."""
    memory = _rand(1, 5, 3)
    w = torch.zeros(1, 1, 5, dtype=torch.float64)
    w[..., 2] = 1
    add = torch.tensor([[[0.5, -1.0, 2.0]]], dtype=torch.float64)
    new = write(memory, w, torch.ones(1, 1, 3, dtype=torch.float64), add)
    torch.testing.assert_close(read(new, w), add)
    torch.testing.assert_close(new[0, [0, 1, 3, 4]], memory[0, [0, 1, 3, 4]])


def test_addressing_pipeline_finds_by_content_then_walks_by_location():
    """A key equal to row 3 with a large β finds row 3; then g = 0 and s(+1) = 1 move the
    previous weighting one step per call, as the copy algorithm in the paper does."""
    memory = torch.eye(5, dtype=torch.float64)[None] + 0.01
    model = NeuralTuringMachine(1, 1, memory_size=5, memory_width=5).double()
    prev = torch.full((1, 1, 5), 0.2, dtype=torch.float64)
    big = torch.full((1, 1), 50.0, dtype=torch.float64)
    stay = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=torch.float64)
    step = torch.tensor([[[0.0, 0.0, 1.0]]], dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    heads = [memory[:, 3:4], big, one, stay, 20 * one]
    w = model._address(heads, memory, prev)
    assert int(w.argmax()) == 3 and float(w.max()) > 0.99
    for expected in (4, 0, 1):
        w = model._address([memory[:, 0:1], big, 0 * one, step, 20 * one], memory, w)
        assert int(w.argmax()) == expected and float(w.max()) > 0.99


def test_shapes_and_errors():
    model = NeuralTuringMachine(3, 2, memory_size=6, memory_width=4, read_heads=2, write_heads=2)
    out = model(torch.randn(2, 5, 3))
    assert out.outputs.shape == (2, 5, 2) and out.memory.shape == (2, 6, 4)
    assert out.read_weights.shape == out.write_weights.shape == (2, 5, 2, 6)
    torch.testing.assert_close(out.read_weights.sum(-1), torch.ones(2, 5, 2))
    with pytest.raises(ValueError, match=r"shift_range = 3 allows 7 shifts.*memory_size = 6"):
        NeuralTuringMachine(3, 2, memory_size=6, shift_range=3)
    with pytest.raises(ValueError, match=r"x has 4 features.*d_in = 3"):
        model(torch.randn(2, 5, 4))


def _copy_batch(batch: int, length: int, width: int, g: torch.Generator):
    """Copy task (Graves et al. Sec. 4.1): random bits, a delimiter, then blank steps during
    which the sequence must be reproduced."""
    bits = torch.randint(0, 2, (batch, length, width), generator=g).float()
    x = torch.zeros(batch, 2 * length + 1, width + 1)
    x[:, :length, :width] = bits
    x[:, length, width] = 1.0  # delimiter
    return x, bits


@pytest.mark.slow
def test_ntm_learns_to_copy():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    width = 4
    model = NeuralTuringMachine(
        width + 1, width, memory_size=12, memory_width=8, controller_size=64
    )
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(2500):
        length = int(torch.randint(1, 6, (1,), generator=g))
        x, bits = _copy_batch(16, length, width, g)
        logits = model(x).outputs[:, length + 1 :]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, bits)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optim.step()
    with torch.no_grad():
        x, bits = _copy_batch(200, 5, width, torch.Generator().manual_seed(1))
        predicted = model(x).outputs[:, 6:] > 0
    bit_errors = (predicted != bits.bool()).float().sum((1, 2)).mean()
    assert bit_errors < 0.5  # of 20 bits per sequence; chance is 10
