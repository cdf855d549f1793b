"""Rules on attention: the product t-norm penalties against loops over their groundings, the
hard-alignment rates against loops, and an aligner on sentences with repeated words whose
alignments keep the monotone and one-to-one rules only when trained with the penalties."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.training.attention_rules import (
    monotone_rate,
    monotonicity_violation,
    one_to_one_rate,
    one_to_one_violation,
    rule_bias,
)


def test_penalties_against_their_groundings():
    torch.manual_seed(0)
    w = torch.randn(2, 4, 5, dtype=torch.float64).softmax(-1)
    rows = torch.tensor([[True, True, True, False], [True, True, True, True]])
    for b in range(2):
        m = int(rows[b].sum())
        crossing = sum(
            float(w[b, i, j] * w[b, i + 1, k])
            for i in range(m - 1)
            for j in range(5)
            for k in range(j)
        )
        shared = sum(
            float(w[b, i, j] * w[b, k, j])
            for j in range(5)
            for i in range(m)
            for k in range(i + 1, m)
        )
        assert float(monotonicity_violation(w, rows)[b]) == pytest.approx(crossing / (m - 1))
        assert float(one_to_one_violation(w, rows)[b]) == pytest.approx(shared / m)


def test_an_identity_alignment_keeps_both_rules_and_a_crossing_breaks_them():
    eye = torch.eye(4).unsqueeze(0)
    assert float(monotonicity_violation(eye)) == 0 and float(one_to_one_violation(eye)) == 0
    swapped = eye[:, [1, 0, 2, 3]]  # rows 0 and 1 cross
    assert float(monotonicity_violation(swapped)) == pytest.approx(1 / 3)
    assert float(one_to_one_violation(swapped)) == 0
    shared = eye[:, [0, 0, 2, 3]]
    assert float(one_to_one_violation(shared)) == pytest.approx(1 / 4)
    assert monotone_rate(swapped) == pytest.approx(2 / 3)
    assert one_to_one_rate(shared) == pytest.approx(2 / 4)


def test_rates_against_loops():
    torch.manual_seed(1)
    w = torch.rand(3, 6, 4)
    hard = w.argmax(-1).tolist()
    pairs = [hard[b][i + 1] >= hard[b][i] for b in range(3) for i in range(5)]
    alone = [sum(h == row[i] for h in row) == 1 for row in hard for i in range(6)]
    assert monotone_rate(w) == pytest.approx(sum(pairs) / len(pairs))
    assert one_to_one_rate(w) == pytest.approx(sum(alone) / len(alone))


def test_rule_bias():
    linked = torch.tensor([[True, False], [False, True]])
    torch.testing.assert_close(rule_bias(linked, 2.0), 2.0 * linked.float())
    with pytest.raises(ValueError, match=r"truth values in \[0, 1\]"):
        rule_bias(torch.tensor([[1.5, 0.0]]))
    with pytest.raises(TypeError, match="antecedent must be a tensor"):
        rule_bias([[1.0]])


class _Aligner(nn.Module):
    """Attention from each target word to the source words; the target word is predicted from
    the attended source words (a word-for-word lexicon), so any source copy of the right word
    will do for the task."""

    def __init__(self, vocab: int, n: int, d: int = 16) -> None:
        super().__init__()
        self.source, self.target = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.position, self.value = nn.Embedding(n, d), nn.Embedding(vocab, d)
        self.attention = ak.Attention(score=ak.scores.General(d, d), align=ak.alignments.Softmax())
        self.out = nn.Linear(d, vocab)
        nn.init.normal_(self.position.weight, std=0.1)  # the words matter first

    def forward(self, src, tgt):
        q = self.target(tgt) + self.position.weight
        k = self.source(src) + self.position.weight
        out = self.attention(q, k, self.value(src), need_weights=True)
        return self.out(out.context), out.weights


@pytest.mark.parametrize("constrained", [False, True])
def test_rules_make_alignments_monotone_and_one_to_one(constrained):
    vocab, n = 4, 6  # few words: most sentences repeat some
    g = torch.Generator().manual_seed(0)
    src, test_src = (
        torch.randint(0, vocab, (512, n), generator=g),
        torch.randint(0, vocab, (256, n), generator=g),
    )
    tgt, test_tgt = (src + 1) % vocab, (test_src + 1) % vocab  # the lexicon; word order kept
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _Aligner(vocab, n)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):
        i = torch.randint(0, 512, (32,), generator=g)
        logits, w = model(src[i], tgt[i])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt[i].flatten())
        if constrained:
            loss = loss + (monotonicity_violation(w) + one_to_one_violation(w)).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        logits, w = model(test_src, test_tgt)
    if constrained:
        assert float((logits.argmax(-1) == test_tgt).float().mean()) > 0.95
        assert monotone_rate(w) > 0.95 and one_to_one_rate(w) > 0.95
    else:  # the task alone is indifferent to which copy of a repeated word is attended
        assert monotone_rate(w) < 0.8 and one_to_one_rate(w) < 0.5
