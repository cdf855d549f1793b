"""A first look: one query, eight keys, several attention variants side by side.

Run with ``make demo`` or ``attnkit demo``. Prints each variant's weights as a table, with the
number of keys it attends to (support) and the entropy of its weights.
"""

from __future__ import annotations

import torch

import attnkit as ak
from attnkit import alignments as al
from attnkit import scores as sc

__all__ = ["main", "table", "variants"]


def variants(d: int) -> dict[str, ak.Attention]:
    return {
        "scaled_dot + softmax": ak.Attention("scaled_dot", "softmax"),
        "scaled_dot + softmax(τ=0.3)": ak.Attention("scaled_dot", al.Softmax(0.3)),
        "scaled_dot + sparsemax": ak.Attention("scaled_dot", "sparsemax"),
        "scaled_dot + entmax15": ak.Attention("scaled_dot", "entmax15"),
        "cosine + softmax(τ=0.1)": ak.Attention("cosine", al.Softmax(0.1)),
        "euclidean + softmax": ak.Attention("euclidean", "softmax"),
        "additive + softmax": ak.Attention(sc.Additive(d, d, 16), "softmax"),
        "general + sigmoid": ak.Attention(sc.General(d, d), "sigmoid"),
        "dot + local(D=1, p=3)": ak.Attention("dot", al.Local(1)),
        "dot + hard (eval: argmax)": ak.Attention("dot", "hard"),
    }


def table(rows: dict[str, tuple[torch.Tensor, bool]]) -> str:
    """Rows of (weights, normalized); entropy is shown for normalized weights only."""
    n = next(iter(rows.values()))[0].shape[-1]
    width = max(len(name) for name in rows)
    head = f"{'variant':<{width}} | " + " ".join(f"  k{j}" for j in range(n)) + " | supp | entropy"
    lines = [head, "-" * len(head)]
    for name, (w, normalized) in rows.items():
        cells = " ".join(f"{x:4.2f}" for x in w.tolist())
        p = w[w > 0]
        entropy = f"{abs(float(-(p * p.log()).sum())):7.3f}" if normalized else "      -"
        lines.append(f"{name:<{width}} | {cells} | {int((w > 0).sum()):4d} | {entropy}")
    return "\n".join(lines)


def main() -> None:
    torch.manual_seed(0)
    d, n = 8, 8
    keys = torch.randn(1, n, d)
    # A query close to key 3, so the variants have something to find.
    query = keys[:, 3:4] + 0.5 * torch.randn(1, 1, d)
    # Four query rows so that monotonic local attention centres row 3 on key 3.
    q = torch.cat([torch.randn(1, 3, d), query], dim=1)
    rows = {}
    with torch.no_grad():
        for name, module in variants(d).items():
            out = module.eval()(q, keys, need_weights=True)
            rows[name] = (out.weights[0, 3], module.align.normalized)
    print("attnkit demo: one query (close to key k3) over 8 random keys\n")
    print(table(rows))
    mha = ak.MultiHeadAttention(64, 8, score="general", align="entmax15")
    x = torch.randn(2, 10, 64)
    out = mha(x, mask=ak.masks.causal(10), need_weights=True)
    print(
        f"\nMultiHeadAttention(64, 8, score='general', align='entmax15'): context "
        f"{tuple(out.context.shape)}, weights {tuple(out.weights.shape)}, "
        f"{float((out.weights == 0).float().mean()):.0%} of the weights are exactly zero"
    )


if __name__ == "__main__":
    main()
