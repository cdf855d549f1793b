"""A call that one rank refuses, or that the ranks make differently, raises the same ValueError
on every rank at once, listing what each rank passed — never a refusal on one rank while the
others wait in the ring until the group's timeout.

Three gloo processes (forked, a FileStore in tmp_path, 127.0.0.1) make each bad call; each rank
records what it raised. The group's timeout (20 s) is the only way a waiting rank could end, and
then with a RingError, which the test tells apart; every process is bounded and killed at the
end if it still runs.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import attnkit as ak
from attnkit.distributed import RingAttention, RingError, RingLinearAttention, ring_attention

WORLD = 3
ODD = 1  # the rank that passes something the others do not
D = 2


def _x(n: int) -> torch.Tensor:
    return torch.randn(1, 2, n, D, dtype=torch.float64)


def _odd_zigzag(rank):
    x = _x(3 if rank == ODD else 4)
    ring_attention(x, x, x, layout="zigzag", causal=True)


def _no_queries(rank):
    kv = _x(4)
    ring_attention(_x(0 if rank == ODD else 4), kv, kv)


def _padding_not_bool(rank):
    x = _x(4)
    pad = torch.ones(1, 4, dtype=torch.float64 if rank == ODD else torch.bool)
    ring_attention(x, x, x, key_padding_mask=pad)


def _another_alignment(rank):
    x = _x(4)
    ring_attention(x, x, x, align="sparsemax" if rank == ODD else "softmax")


def _another_entmax(rank):  # the same class, another hyperparameter
    x = _x(4)
    ring_attention(x, x, x, align=ak.alignments.Entmax(1.3 if rank == ODD else 1.5))


def _mask_of_another_form(rank):
    x = _x(4)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    if rank == ODD:
        mask = mask & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)  # a window of 2
    RingAttention(causal=True)(x, x, x, mask=mask)


def _odd_part_with_rotary_positions(rank):
    x = _x(3 if rank == ODD else 4)
    RingAttention(causal=True, layout="zigzag", position="rope")(x, x, x)


def _part_without_keys(rank):  # refused by HeadAttention's template, before the ring's checks
    x, kv = _x(4), _x(0 if rank == ODD else 4)
    RingAttention(causal=True)(x, kv, kv)


def _part_mask_not_bool(rank):
    x = _x(4)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.float64 if rank == ODD else torch.bool)
    RingAttention()(x, x, x, mask=mask)


def _linear_part_with_a_bias(rank):
    x = _x(4)
    part = ak.head_registry.build("retention", head_dim=D, num_heads=2)
    bias = torch.zeros(4, 4, dtype=torch.float64) if rank == ODD else None
    RingLinearAttention(part)(x, x, x, bias=bias)


# name -> (the call, what the message must say besides the ranks' lines)
CASES = {
    "odd zigzag part": (_odd_zigzag, [f"refused on rank {ODD} of {WORLD}", "must be even"]),
    "no queries": (_no_queries, [f"refused on rank {ODD} of", "q has no queries"]),
    "padding not bool": (
        _padding_not_bool,
        [f"refused on rank {ODD} of", "TypeError: key_padding_mask must be a boolean"],
    ),
    "another alignment": (_another_alignment, ["differ in align", "Sparsemax", "Softmax"]),
    "another entmax": (_another_entmax, ["differ in align"]),
    "mask of another form": (
        _mask_of_another_form,
        [f"refused on rank {ODD} of", "varies over queries otherwise"],
    ),
    "odd part with rotary positions": (
        _odd_part_with_rotary_positions,
        [f"refused on rank {ODD} of", "even"],
    ),
    "part without keys": (_part_without_keys, [f"refused on rank {ODD} of", "key set is empty"]),
    "part's mask not bool": (
        _part_mask_not_bool,
        [f"refused on rank {ODD} of", "TypeError: mask must be boolean"],
    ),
    "linear part with a bias": (
        _linear_part_with_a_bias,
        [f"linear ring was refused on rank {ODD} of", "does not declare accepts_bias"],
    ),
}


def _rank(rank: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    report: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=20),
        )
        for name, (call, _) in CASES.items():
            torch.manual_seed(0)
            try:
                call(rank)
                report[name] = "accepted"
            except ValueError as err:
                report[name] = str(err)
            except RingError as err:
                report[name] = f"RingError (waited for a rank): {err}"
        x = _x(4)  # the group still works after the refused calls
        out_ = ring_attention(x, x, x, causal=True).context
        report["then"] = list(out_.shape)
    except Exception:
        report["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("agreement")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, str(out / "store"), str(out))) for r in range(3)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120.0
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_the_ranks_end(reports):
    for r, report in enumerate(reports):
        assert "crash" not in report, report["crash"]
        assert report["then"] == [1, 2, 4, D], f"rank {r}: the group is unusable afterwards"


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_value_error(reports, name):
    messages = [report[name] for report in reports]
    for r, message in enumerate(messages):
        assert message != "accepted", f"rank {r} accepted {name}"
        assert not message.startswith("RingError"), f"rank {r} waited: {message}"
    assert len(set(messages)) == 1, "\n".join(messages)
    message = messages[0]
    for said in CASES[name][1]:
        assert said in message, message
    for r in range(WORLD):  # what each rank passed
        assert f"rank {r}: " in message, message
