"""The cluttered digits task."""

import torch

from attnkit.tasks.digits import box_region, make_digits


def test_digit_inside_its_box():
    d = make_digits(20, 5, seed=0)
    s = d.splits["train"]
    assert s["images"].shape == (20, 1, 48, 48) and s["labels"].shape == (20,)
    for i in range(20):
        top, left, h, w = s["boxes"][i].tolist()
        inside = s["images"][i, 0, top : top + h, left : left + w]
        assert inside.sum() > 0
        assert 0 <= top <= 48 - h and 0 <= left <= 48 - w


def test_box_region_cells():
    boxes = torch.tensor([[0, 0, 16, 16], [4, 4, 4, 4]])
    r = box_region(boxes, 48, 12).reshape(2, 12, 12)
    assert int(r[0].sum()) == 16 and r[0, :4, :4].all()
    assert int(r[1].sum()) == 1 and r[1, 1, 1]
