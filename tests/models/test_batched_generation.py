"""Batched greedy generation through the paged cache: prompts of different lengths give, token
for token, what DecoderLM.generate gives for each prompt alone (float64, several position
schemes), sequences stop at their end-of-sequence token, and waiting prompts join as places
free up."""

import pytest
import torch

from attnkit.models.batched_generation import generate_batch
from attnkit.models.decoder_lm import DecoderLM
from attnkit.paged_cache import PagedKVCache

V = 11
SCHEMES = {
    "learned-absolute": {},
    "sinusoidal-absolute": {"position": "sinusoidal"},
    "rope": {"position": "rope"},
    "alibi": {"position": "alibi"},
    "t5-multi-query": {"position": "t5", "num_kv_heads": 1},
}


def _lm(**kw):
    """A tiny untied model with large random weights, so that its greedy tokens vary with the
    context and the positions (a small init repeats one token whatever the history)."""
    torch.manual_seed(0)
    lm = DecoderLM(V, 12, 3, 2, max_len=20, dtype=torch.float64, tie_embeddings=False, **kw)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() > 1 or "position" in name:
                p.normal_(0, 1.0)
    return lm.eval()


def _prompts(lengths=(1, 4, 2, 6)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("case", list(SCHEMES))
def test_each_prompt_is_continued_as_alone(case):
    lm = _lm(**SCHEMES[case])
    prompts = _prompts()
    alone = [lm.generate(p[None], 8)[0] for p in prompts]
    cache = PagedKVCache(2, page_size=3)
    batched = generate_batch(lm, prompts, 8, cache=cache)
    assert [t.tolist() for t in batched] == [t.tolist() for t in alone]
    assert len({tuple(t[len(p) :].tolist()) for t, p in zip(alone, prompts, strict=True)}) > 1
    assert cache.sequences == [] and cache.pages_in_use == 0 and cache.free_pages > 0
    # two at a time: the later prompts join as the first ones end
    joined = generate_batch(lm, prompts, 8, max_batch=2)
    assert [t.tolist() for t in joined] == [t.tolist() for t in alone]


def test_sequences_stop_at_their_end_token():
    lm = _lm(position="rope")
    prompts = _prompts((3, 1, 5))
    alone = [lm.generate(p[None], 9)[0] for p in prompts]
    eos = int(alone[0][len(prompts[0]) + 2])  # the first prompt's third new token

    def cut(t, p):  # the tokens up to and including the first eos after the prompt
        new = t[len(p) :].tolist()
        return t[: len(p) + (new.index(eos) + 1 if eos in new else len(new))].tolist()

    want = [cut(t, p) for t, p in zip(alone, prompts, strict=True)]
    assert len(want[0]) <= len(prompts[0]) + 3 < len(alone[0])
    cache = PagedKVCache(2, page_size=2)
    got = generate_batch(lm, prompts, 9, eos_token_id=eos, cache=cache)
    assert [t.tolist() for t in got] == want
    assert cache.pages_in_use == 0
    one_by_one = generate_batch(lm, prompts, 9, eos_token_id=eos, max_batch=1)
    assert [t.tolist() for t in one_by_one] == want


def test_a_capped_pool_serves_when_prompts_wait():
    lm = _lm()
    prompts = _prompts((2, 3, 2, 3))
    alone = [lm.generate(p[None], 5)[0].tolist() for p in prompts]
    cache = PagedKVCache(2, page_size=4, num_pages=4)  # two sequences of ≤ 8 tokens at a time
    got = generate_batch(lm, prompts, 5, max_batch=2, cache=cache)
    assert [t.tolist() for t in got] == alone and cache.capacity == 4
    with pytest.raises(ValueError, match="num_pages = 4"):
        generate_batch(lm, prompts, 5, cache=PagedKVCache(2, page_size=4, num_pages=4))


def test_arguments_are_checked():
    lm = _lm()
    p = torch.tensor([1, 2])
    assert [t.tolist() for t in generate_batch(lm, [p], 0)] == [[1, 2]]
    for args, kw, error, what in (
        ((torch.nn.Linear(2, 2), [p], 2), {}, TypeError, "DecoderLM"),
        ((lm, [p.float()], 2), {}, TypeError, r"prompts\[0\]"),
        ((lm, [p[None]], 2), {}, ValueError, "1-D"),
        ((lm, [torch.tensor([V])], 2), {}, ValueError, "token ids outside"),
        ((lm, [p], 20), {}, ValueError, "max_len = 20"),
        ((lm, [p], -1), {}, ValueError, "max_new_tokens"),
        ((lm, [p], 2), {"eos_token_id": V}, ValueError, "eos_token_id"),
        ((lm, [p], 2), {"max_batch": 0}, ValueError, "max_batch"),
        ((lm, [p], 2), {"cache": PagedKVCache(3)}, ValueError, "2 layers"),
    ):
        with pytest.raises(error, match=what):
            generate_batch(*args, **kw)
