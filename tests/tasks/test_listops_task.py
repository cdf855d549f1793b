"""listops: every label equals the value of its token sequence, computed by an independent
stack evaluator written from Nangia & Bowman's definition; lengths and padding as documented."""

import math

import pytest

from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.listops_task import NAMES, evaluate_listops, make_listops, tokens_of


def stack_value(tokens: list[str]) -> int:
    """Left to right with a stack of open lists (the reference)."""
    stack: list[tuple[str, list[int]]] = []
    result = None
    for t in tokens:
        if t.startswith("["):
            stack.append((t[1:], []))
        elif t == "]":
            op, args = stack.pop()
            if op == "MAX":
                v = max(args)
            elif op == "MIN":
                v = min(args)
            elif op == "SM":
                v = sum(args) % 10
            else:  # median; of an even count, floor of the mean of the middle two
                s = sorted(args)
                mid = len(s) / 2
                v = (
                    s[len(s) // 2]
                    if len(s) % 2
                    else math.floor((s[int(mid) - 1] + s[int(mid)]) / 2)
                )
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
        elif stack:
            stack[-1][1].append(int(t))
        else:
            result = int(t)
    assert not stack
    return result


def test_hand_examples():
    tree = ("MAX", [2, 9, ("MIN", [4, 7]), 0])
    assert tokens_of(tree) == ["[MAX", "2", "9", "[MIN", "4", "7", "]", "0", "]"]
    assert evaluate_listops(tree) == 9
    assert evaluate_listops(("MED", [1, 8, 3, 4])) == 3  # middle two 3, 4 -> 3
    assert evaluate_listops(("MED", [5, 1, 9])) == 5
    assert evaluate_listops(("SM", [9, 8, ("MIN", [7, 3])])) == 0


@pytest.mark.parametrize("seq_len", [16, 100])
def test_labels_lengths_and_padding(seq_len):
    tokens, labels = make_listops(200, seq_len, seed=5)
    assert tokens.shape == (200, seq_len, 1)
    for i in range(200):
        names = [NAMES[t] for t in tokens[i, :, 0].tolist()]
        assert names[0] == "cls"
        body = [t for t in names[1:] if t != "pad"]
        first_pad = names.index("pad") if "pad" in names else seq_len
        assert all(t == "pad" for t in names[first_pad:])  # padding only at the end
        assert len(body) <= seq_len - 1
        assert stack_value(body) == labels[i]
    assert len(set(labels.tolist())) == 10


def test_seq_len_is_checked():
    assert RunConfig(task="listops", quick=True).resolved().seq_len == 64
    with pytest.raises(ConfigError, match=r"seq_len must be in \[8"):
        RunConfig(task="listops", seq_len=4).resolved()
