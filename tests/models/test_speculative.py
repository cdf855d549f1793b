"""Speculative decoding: the tokens equal the target's greedy decoding for a draft that always
agrees, one that never does and one in between; the counts of calls follow from the acceptance;
the caches are rolled back to the kept tokens; bad arguments are refused by name."""

import copy

import pytest
import torch

from attnkit.linear_family.base import recurrent_cache
from attnkit.models import speculative
from attnkit.models.decoder_lm import DecoderLM

V = 17
F64 = torch.float64


def _lm(seed, embed_dim=16, layers=2, **kw):
    torch.manual_seed(seed)
    kw.setdefault("position", "rope")
    return DecoderLM(V, embed_dim, 2, layers, max_len=40, dtype=F64, **kw).eval()


class _Contrary(DecoderLM):
    """A draft whose greedy token is never the target's: it puts all its mass on the token
    after the target's choice (it runs the target itself)."""

    def __init__(self, target):
        super().__init__(V, 4, 1, 1, max_len=40, dtype=F64)
        self.target = target

    def new_cache(self):
        return self.target.new_cache()

    def forward(self, tokens, *, cache=None, **kw):
        choice = self.target(tokens, cache=cache).argmax(-1)
        return torch.nn.functional.one_hot((choice + 1) % V, V).to(F64)


def _prompt(b=2, p=5, seed=1):
    return torch.randint(0, V, (b, p), generator=torch.Generator().manual_seed(seed))


def _near(target, scale=0.3):
    """The target with every parameter moved by ``scale`` of its spread: often agrees."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std() * scale)
    return draft


@pytest.mark.parametrize("k", [1, 3])
def test_tokens_equal_greedy_decoding_of_the_target(k):
    target, small = _lm(0), _lm(1, embed_dim=8, layers=1, position=None)
    prompt = _prompt()
    want = target.generate(prompt, 8)
    for draft in (small, _near(target)):
        got, stats = speculative.generate(target, draft, prompt, 8, k=k, return_stats=True)
        assert torch.equal(got, want)
        assert 1 <= stats.target_calls <= 8 and stats.accepted <= stats.proposed


def test_a_draft_that_often_agrees_saves_target_calls():
    target, prompt = _lm(0), _prompt(b=1)
    got, stats = speculative.generate(target, _near(target), prompt, 16, k=4, return_stats=True)
    assert torch.equal(got, target.generate(prompt, 16))
    # every call emits its accepted tokens and one of the target's own
    assert stats.target_calls - 1 + stats.accepted == 16 - 1
    assert 0 < stats.acceptance_rate < 1 and stats.target_calls < 16


def test_a_draft_identical_to_the_target_is_always_accepted():
    target, k, n = _lm(0), 4, 21
    prompt = _prompt(b=1)
    got, stats = speculative.generate(target, _lm(0), prompt, n, k=k, return_stats=True)
    assert torch.equal(got, target.generate(prompt, n))
    # the prompt's call gives 1 token, then every call k + 1: 1 + 4 * 5 = 21
    assert stats.target_calls == 1 + (n - 1) // (k + 1)
    assert stats.acceptance_rate == 1.0 and stats.accepted == stats.proposed == 16


def test_a_draft_that_always_disagrees_costs_one_target_call_per_token():
    target = _lm(0)
    prompt = _prompt()
    got, stats = speculative.generate(target, _Contrary(_lm(0)), prompt, 9, k=3, return_stats=True)
    assert torch.equal(got, target.generate(prompt, 9))
    assert stats.target_calls == 9 and stats.accepted == 0 and stats.acceptance_rate == 0.0
    # with g tokens out, a call proposes min(k, n - g - 1); two rows
    assert stats.proposed == 2 * sum(min(3, 9 - g - 1) for g in range(1, 9)) == 36


def test_the_caches_hold_the_kept_tokens_only():
    target, draft = _lm(0), _lm(2, embed_dim=8, layers=1)
    prompt = _prompt(b=1)
    caches = []
    original = DecoderLM.new_cache

    def spy(self):
        caches.append(original(self))
        return caches[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecoderLM, "new_cache", spy)
        out = speculative.generate(target, draft, prompt, 12, k=4)
    t_cache = caches[0]
    assert t_cache.length == out.shape[1] - 1  # every token but the last, which no call read
    with torch.no_grad():  # the target's cached keys are those of the tokens it output
        fresh = target.new_cache()
        target(out[:, :-1], cache=fresh)
    for mine, ref in zip(t_cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(mine.k, ref.k, atol=1e-12, rtol=1e-12)


def test_bad_arguments_are_refused_by_name():
    target, draft = _lm(0), _lm(1)
    prompt = _prompt()
    for kwargs, error, match in (
        ({"k": 0}, ValueError, "k must be a positive int"),
        ({"n": -1}, ValueError, "n must be an int >= 0"),
        ({"prompt": prompt.float()}, TypeError, "prompt must be a .* torch.long"),
        ({"prompt": prompt[:, :0]}, ValueError, "P >= 1"),
        ({"draft": torch.nn.Linear(2, 2)}, TypeError, "draft must be an attnkit"),
        ({"draft": DecoderLM(V + 1, 8, 2, 1, max_len=8)}, ValueError, "vocabulary of 18"),
    ):
        args = {"target": target, "draft": draft, "prompt": prompt, "n": 3, **kwargs}
        with pytest.raises(error, match=match):
            speculative.generate(**args)
    assert torch.equal(speculative.generate(target, draft, prompt, 0), prompt)


def test_a_cache_that_cannot_roll_back_is_refused_before_decoding():
    target, draft = _lm(0), _lm(1)
    draft.new_cache = lambda: recurrent_cache(1)
    with pytest.raises(ValueError, match=r"rolls back the draft's cache: RecurrentCache\.rollback"):
        speculative.generate(target, draft, _prompt(), 3)


def test_a_hybrid_target_with_a_mixer_layer_is_refused_by_its_cache_kind():
    """A token mixer's cache folds positions into states: refused by name before any call."""
    torch.manual_seed(0)
    target = DecoderLM(V, 16, 2, "1 mixer.gated_deltanet : 1 full", max_len=32)
    calls = []
    target.forward = lambda *a, **kw: calls.append(a)
    with pytest.raises(ValueError, match=r"rolls back the target's cache: MixerCache\.rollback"):
        speculative.generate(target, _lm(1), _prompt(), 3)
    assert not calls
