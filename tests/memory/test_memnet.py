"""Memory networks against loops written from Weston et al. 2015, eqs. 2-8, and on a generated
single-supporting-fact task."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.memory import MemoryNetwork


def _dot(a, b) -> float:
    return sum(float(p) * float(q) for p, q in zip(a, b, strict=True))


def _embed(u, feats: list[list[float]]) -> list[float]:
    """U Φ(…) with Φ the concatenation of the role blocks ``feats``."""
    phi = [f for block in feats for f in block]
    return [_dot(u[r], phi) for r in range(u.shape[0])]


def _s_o(module, x, found, m) -> float:
    """s_O([x, found], m) = Φ_x([x, found])ᵀ U_Oᵀ U_O Φ_y(m), Φ into 3V (eq. 5)."""
    v = module.vocab_size
    zero = [0.0] * v
    return _dot(_embed(module.u_o, [x, found, zero]), _embed(module.u_o, [zero, zero, m]))


def _s_r(module, x, found, r) -> float:
    onehot = [1.0 if i == r else 0.0 for i in range(module.n_answers)]
    q = _embed(module.u_r, [x, found])
    return _dot(q, _embed(module.u_r_answer, [onehot]))


@torch.no_grad()
def test_two_hops_of_hard_max_addressing_match_a_loop():
    torch.manual_seed(0)
    module = MemoryNetwork(5, 4, hops=2, n_answers=3).double().eval()
    x = torch.rand(3, 5, dtype=torch.float64)
    memories = torch.rand(3, 6, 5, dtype=torch.float64)
    out = module(x, memories)
    for b in range(3):
        xs, ms = x[b].tolist(), memories[b].tolist()
        found = [0.0] * 5
        for hop in range(2):  # o_k = argmax_i s_O([x, m_o1, …], m_i), eqs. 2-3
            s = [_s_o(module, xs, found, m) for m in ms]
            torch.testing.assert_close(out.scores[b, hop], torch.tensor(s, dtype=torch.float64))
            o = max(range(6), key=lambda i, s=s: s[i])
            assert out.weights[b, hop].tolist() == [float(i == o) for i in range(6)]
            found = [f + m for f, m in zip(found, ms[o], strict=True)]
        r = [_s_r(module, xs, found, w) for w in range(3)]
        torch.testing.assert_close(out.logits[b], torch.tensor(r, dtype=torch.float64))


def test_margin_ranking_loss_matches_a_loop():
    torch.manual_seed(1)
    module = MemoryNetwork(4, 3, hops=2).double()
    x = torch.rand(2, 4, dtype=torch.float64)
    memories = torch.rand(2, 5, 4, dtype=torch.float64)
    supports, answer = torch.tensor([[1, 3], [4, 0]]), torch.tensor([2, 0])
    mask = torch.tensor([[True] * 5, [True] * 5])
    got = module.margin_ranking_loss(x, memories, supports, answer, mask=mask, margin=0.5)
    total = 0.0
    with torch.no_grad():
        for b in range(2):
            xs, ms = x[b].tolist(), memories[b].tolist()
            found = [0.0] * 4
            for hop in range(2):  # eqs. 6-7 with the gold facts
                f = int(supports[b, hop])
                gold = _s_o(module, xs, found, ms[f])
                other = [_s_o(module, xs, found, ms[i]) for i in range(5) if i != f]
                total += sum(max(0.0, 0.5 - gold + o) for o in other)
                found = [p + q for p, q in zip(found, ms[f], strict=True)]
            r = int(answer[b])
            gold = _s_r(module, xs, found, r)
            total += sum(
                max(0.0, 0.5 - gold + _s_r(module, xs, found, w)) for w in range(4) if w != r
            )  # eq. 8
    torch.testing.assert_close(got, torch.tensor(total / 2, dtype=torch.float64))


def _single_supporting_fact(n: int, seed: int, people=4, places=6, story=4):
    """ "p goes to l" stories, each person at most once; "where is p?" asks for l. The answer and
    the supporting fact are known. Words: people, places, then "where"."""
    rng = random.Random(seed)
    v = people + places + 1
    xs, mems, sup, ans = [], [], [], []
    for _ in range(n):
        who = rng.sample(range(people), story)
        where = [rng.randrange(places) for _ in range(story)]
        m = torch.zeros(story, v)
        for i, (p, l) in enumerate(zip(who, where, strict=True)):
            m[i, p] = m[i, people + l] = 1
        k = rng.randrange(story)
        q = torch.zeros(v)
        q[who[k]] = q[v - 1] = 1
        xs.append(q)
        mems.append(m)
        sup.append([k])
        ans.append(people + where[k])
    return torch.stack(xs), torch.stack(mems), torch.tensor(sup), torch.tensor(ans)


def test_learns_single_supporting_fact_with_strong_supervision():
    """Bar: ≥ 95 % answers and supporting facts on 300 held-out stories after 60 steps (chance:
    1/6 answers, 1/4 supporting facts)."""
    torch.manual_seed(0)
    x, m, sup, ans = _single_supporting_fact(500, seed=0)
    module = MemoryNetwork(x.shape[-1], 16, hops=1)
    opt = torch.optim.Adam(module.parameters(), lr=0.05)
    for step in range(60):
        i = torch.randint(0, 500, (32,), generator=torch.Generator().manual_seed(step))
        loss = module.margin_ranking_loss(x[i], m[i], sup[i], ans[i], margin=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    tx, tm, tsup, tans = _single_supporting_fact(300, seed=1)
    with torch.no_grad():
        out = module.eval()(tx, tm)
    accuracy = (out.logits.argmax(-1) == tans).float().mean()
    support_hits = (out.weights[:, 0].argmax(-1) == tsup[:, 0]).float().mean()
    assert accuracy >= 0.95 and support_hits >= 0.95, (accuracy, support_hits)


def test_bad_inputs_are_refused():
    module = MemoryNetwork(4, 3, hops=2)
    with pytest.raises(ValueError, match="vocab_size=4"):
        module(torch.rand(2, 5), torch.rand(2, 3, 4))
    with pytest.raises(ValueError, match="memories"):
        module(torch.rand(2, 4), torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="supports"):
        module.margin_ranking_loss(
            torch.rand(2, 4), torch.rand(2, 3, 4), torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
        )  # fmt: skip
