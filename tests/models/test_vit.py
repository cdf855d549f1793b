"""ViT: the patch embedding against a loop over patches, the class token and learned positions
(eq. 1) against a hand-built input to the encoder, and a quick learning test: which quadrant of
a noisy 8×8 image holds a bright square."""

from __future__ import annotations

import pytest
import torch

from attnkit.models.vit import PatchEmbedding, ViT

D = torch.float64


def test_patch_embedding_equals_a_loop_over_patches():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 6, 9, generator=g, dtype=D)
    embed = PatchEmbedding(3, 3, 5, dtype=D)
    got = embed(images)
    assert got.shape == (2, 6, 5)
    w, b = embed.proj.weight.detach(), embed.proj.bias.detach()
    for n in range(2):
        p = 0
        for row in range(0, 6, 3):  # row-major patch order
            for col in range(0, 9, 3):
                flat = [
                    images[n, c, row + i, col + j]
                    for c in range(3)
                    for i in range(3)
                    for j in range(3)
                ]
                want = torch.stack(
                    [sum(w[o, t] * flat[t] for t in range(27)) + b[o] for o in range(5)]
                )
                torch.testing.assert_close(got[n, p], want)
                p += 1


def test_class_token_and_positions_feed_the_encoder():
    torch.manual_seed(0)
    vit = ViT(4, 2, 1, classes=3, embed_dim=8, num_heads=2, layers=1, dtype=D)
    images = torch.randn(2, 1, 4, 4, dtype=D)
    out = vit(images)
    z = vit.patch(images)
    seq = torch.cat([vit.cls_token.expand(2, 1, 8), z], 1) + vit.pos
    tokens = vit.encoder(seq)
    torch.testing.assert_close(out.tokens, tokens)
    torch.testing.assert_close(out.logits, vit.head(tokens[:, 0]))
    # learned positions make the model sensitive to where a patch sits
    swapped = images.clone()
    swapped[..., :2, :2], swapped[..., 2:, 2:] = images[..., 2:, 2:], images[..., :2, :2]
    assert not torch.allclose(vit(swapped).logits, out.logits)


def test_errors_name_the_sizes():
    vit = ViT(8, 4, 1, classes=2, embed_dim=8, num_heads=2, layers=1)
    with pytest.raises(ValueError, match="8×8"):
        vit(torch.randn(2, 1, 12, 12))
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
        vit(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="divide"):
        ViT(10, 4, 1, classes=2)


def _quadrant_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    r = torch.randint(0, 3, (n,), generator=g) + 4 * (y // 2)
    c = torch.randint(0, 3, (n,), generator=g) + 4 * (y % 2)
    for i in range(n):
        x[i, 0, r[i] : r[i] + 2, c[i] : c[i] + 2] += 2.0
    return x, y


def test_vit_learns_which_quadrant_holds_the_square():
    """A bright 2×2 square somewhere in one quadrant of an 8×8 noisy image (4 classes, chance
    0.25), read as four 4×4 patches: the class token must find the bright patch and read its
    learned position. Bar: ≥ 0.9 test accuracy after 2 epochs of 512 images."""
    torch.manual_seed(0)
    x, y = _quadrant_data(512, 0)
    xt, yt = _quadrant_data(256, 1)
    vit = ViT(8, 4, 1, classes=4, embed_dim=16, num_heads=2, layers=1, d_ff=32)
    with torch.no_grad():  # unit-scale initial positions (ViT's 0.02 needs far more steps)
        vit.pos.normal_()
    opt = torch.optim.Adam(vit.parameters(), lr=1e-2)
    for _ in range(2):
        for i in range(0, 512, 32):
            loss = torch.nn.functional.cross_entropy(vit(x[i : i + 32]).logits, y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        accuracy = (vit(xt).logits.argmax(-1) == yt).float().mean().item()
    assert accuracy >= 0.9, accuracy
