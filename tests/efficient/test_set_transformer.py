"""Set Transformer: MAB against the paper's equations written out (torch's own multihead
attention and layer norm), SAB/ISAB permutation-equivariant, PMA permutation-invariant, masked
elements == removed elements, and a PMA set model learning the maximum of a set."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit.efficient.set_transformer import ISAB, MAB, PMA, SAB

D, H = 8, 2


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mha_reference(mha, x, y, keep=None):
    """Multihead(X, Y, Y) (Vaswani / Lee eq. 5) in a loop over heads, with mha's weights."""
    e, d = mha.embed_dim, mha.head_dim
    wq, wk, wv = mha.in_proj_weight.split(e)
    bq, bk, bv = mha.in_proj_bias.split(e)
    q, k, v = x @ wq.T + bq, y @ wk.T + bk, y @ wv.T + bv
    heads = []
    for h in range(mha.num_heads):
        cols = slice(h * d, (h + 1) * d)
        s = q[..., cols] @ k[..., cols].transpose(-1, -2) / d**0.5
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        heads.append(torch.softmax(s, -1) @ v[..., cols])
    return mha.out_proj(torch.cat(heads, -1))


def _mab_reference(mab, x, y, keep=None):
    """LayerNorm(H + rFF(H)), H = LayerNorm(X + Multihead(X, Y, Y)) (Lee et al. eqs. 6-7)."""
    ln1, ln2 = mab.norm1, mab.norm2
    h = F.layer_norm(x + _mha_reference(mab.attention, x, y, keep), (D,), ln1.weight, ln1.bias)
    lin1, lin2 = mab.ff[0], mab.ff[2]
    ff = torch.relu(h @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
    return F.layer_norm(h + ff, (D,), ln2.weight, ln2.bias)


def _randomise(module):
    """Non-trivial LayerNorm affine and projection biases (defaults are 1 and 0)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return module


def test_mab_matches_the_paper_equations():
    torch.manual_seed(0)
    mab = _randomise(MAB(D, H, 16).double())
    x, y = _x(2, 3, D, seed=1), _x(2, 5, D, seed=2)
    keep = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    out = mab(x, y, mask=keep)
    torch.testing.assert_close(out.output, _mab_reference(mab, x, y, keep))


def test_isab_and_pma_match_the_paper_equations():
    torch.manual_seed(0)
    isab = _randomise(ISAB(D, H, 3).double())
    pma = _randomise(PMA(D, H, 2).double())
    x = _x(2, 6, D, seed=3)
    keep = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    i = isab.inducing.expand(2, -1, -1)
    h = _mab_reference(isab.induce, i, x, keep)  # H = MAB(I, X)
    out = isab(x, mask=keep)
    torch.testing.assert_close(out.induced, h)
    ref = _mab_reference(isab.broadcast, x, h)
    real = keep[:, 0]  # rows of padded elements are padding
    torch.testing.assert_close(out.output[real], ref[real])
    lin1, lin2 = pma.ff[0], pma.ff[2]
    rff = torch.relu(x @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
    s = pma.seeds.expand(2, -1, -1)
    torch.testing.assert_close(pma(x, mask=keep).output, _mab_reference(pma.mab, s, rff, keep))


@pytest.mark.parametrize("block", [SAB(D, H), ISAB(D, H, 3)], ids=["sab", "isab"])
def test_sab_and_isab_are_permutation_equivariant(block):
    block = block.double()
    x = _x(2, 7, D, seed=4)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(block(x[:, perm]).output, block(x).output[:, perm])


def test_pma_is_permutation_invariant():
    pma = PMA(D, H, 3).double()
    x = _x(2, 7, D, seed=6)
    keep = ak.masks.from_lengths(torch.tensor([7, 5]), 7)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(7))
    out = pma(x, mask=keep).output
    torch.testing.assert_close(pma(x[:, perm], mask=keep[..., perm]).output, out)
    assert out.shape == (2, 3, D)


@pytest.mark.parametrize(
    "block", [SAB(D, H), ISAB(D, H, 3), PMA(D, H, 2)], ids=["sab", "isab", "pma"]
)
def test_masking_an_element_removes_it(block):
    """Masked elements anywhere in the set (not only at the end) == the set without them."""
    block = block.double()
    x = _x(1, 7, D, seed=8)
    keep = torch.tensor([True, False, True, True, False, True, False])
    masked = block(x, mask=keep[None, None]).output
    removed = block(x[:, keep]).output
    if not isinstance(block, PMA):
        masked = masked[:, keep]  # rows of masked elements are padding
    torch.testing.assert_close(masked, removed)


def test_pma_and_isab_refuse_a_mask_over_queries():
    x = _x(2, 5, D)
    full = torch.ones(2, 5, 5, dtype=torch.bool)
    for block in (PMA(D, H).double(), ISAB(D, H, 2).double()):
        with pytest.raises(ValueError, match="key-padding mask"):
            block(x, mask=full)
    with pytest.raises(ValueError, match=r"\(B, …, n, 8\)"):
        SAB(D, H)(torch.randn(2, 5, 4))


def test_any_attention_part_plugs_in():
    sab = SAB(D, H, align="sparsemax").double()
    out = sab(_x(2, 5, D), need_weights=True)
    assert (out.weights == 0).any()  # sparsemax gives exact zeros
    isab = ISAB(D, H, 2, attention=ak.Attention("scaled_dot", "sparsemax"))
    assert isab.induce.attention.attention is not isab.broadcast.attention.attention


class _SetMax(nn.Module):
    """Embedding → SAB → PMA(1) → linear: the class of the largest element of the set."""

    def __init__(self, vocab, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.sab = SAB(d, 4, 64)
        self.pma = PMA(d, 4, 1, 64)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens, mask):
        h = self.sab(self.embed(tokens), mask=mask).output
        return self.out(self.pma(h, mask=mask).output[:, 0])


def _sets(n, vocab, gen):
    """Sets of 3-10 integers in [0, vocab), padded to 10; the answer is their maximum."""
    lengths = torch.randint(3, 11, (n,), generator=gen)
    tokens = torch.randint(0, vocab, (n, 10), generator=gen)
    keep = ak.masks.from_lengths(lengths, 10)
    answer = torch.where(keep[:, 0], tokens, -1).amax(-1)
    return tokens, keep, answer


def test_a_pma_set_model_learns_the_maximum():
    """Chance is ≤ 1/10 (the most common maximum, 9, is ~55% of the sets); the bar is 95%."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    vocab = 10
    model = _SetMax(vocab)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: one thread is faster
    try:
        for _ in range(100):
            tokens, keep, answer = _sets(64, vocab, gen)
            loss = F.cross_entropy(model(tokens, keep), answer)
            opt.zero_grad()
            loss.backward()
            opt.step()
        tokens, keep, answer = _sets(1000, vocab, torch.Generator().manual_seed(99))
        with torch.no_grad():
            accuracy = (model(tokens, keep).argmax(-1) == answer).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    majority = (answer == answer.mode().values).float().mean().item()
    assert accuracy > max(0.95, majority + 0.3), (accuracy, majority)
