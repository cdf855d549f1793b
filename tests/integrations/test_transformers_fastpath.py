"""The earlier module name of the swap's mask conversion and model score still gives their
names."""

from __future__ import annotations

from attnkit.integrations import transformers_fastpath as fastpath
from attnkit.integrations import transformers_masks, transformers_score


def test_the_earlier_module_gives_the_same_functions():
    assert fastpath.split_mask is transformers_masks.split_mask
    assert fastpath.eager_mask is transformers_masks.eager_mask
    assert fastpath.model_score is transformers_score.model_score
    assert fastpath.ModelScaledDot is transformers_score.ModelScaledDot
    assert not hasattr(fastpath, "SdpaPath")  # the swap's calls take the kernels' direct entry
