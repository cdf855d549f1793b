"""Fine-tune a small BERT-config model (random initialisation: nothing is downloaded) with any
attnkit alignment swapped into its attention, on a task attnkit generates: read a date written
in one of five languages ("3 mars 2014", "March 3, 2014", "03.03.2014", ...) and name its month.

    python examples/finetune_transformers.py --align sparsemax
    python examples/finetune_transformers.py --align softmax      # the original attention

Prints the test accuracy (chance: 1/12), the share of attention weights that are exactly zero,
and how much of the [CLS] token's attention falls on the month field of the text.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification

from attnkit.integrations.transformers import swap_attention
from attnkit.tasks.dates import make_dates


def encode(
    split: dict, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[CLS] + characters; labels = month − 1; the month field's character positions."""
    n = split["src"].shape[0]
    ids = torch.zeros(n, width + 1, dtype=torch.long)
    ids[:, 1:] = split["src"] + 2  # 0 = padding, 1 = [CLS]
    ids[:, 0] = 1
    mask = torch.zeros(n, width + 1, dtype=torch.long)
    mask[:, 0] = 1
    mask[:, 1:] = split["mask"].long()
    ids[mask == 0] = 0
    labels = torch.tensor([int(e.target[5:7]) - 1 for e in split["examples"]])
    field = torch.zeros(n, width + 1, dtype=torch.bool)
    for i, e in enumerate(split["examples"]):
        start, stop = e.spans["M"]
        field[i, 1 + start : 1 + stop] = True
    return ids, mask, labels, field


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--align", default="sparsemax", help="a registered attnkit alignment")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    data = make_dates(args.n_train, 500, seed=args.seed)
    width = max(data.splits[s]["src"].shape[1] for s in ("train", "test"))

    def pad(split: dict) -> dict:
        extra = width - split["src"].shape[1]
        return {
            **split,
            "src": torch.nn.functional.pad(split["src"], (0, extra)),
            "mask": torch.nn.functional.pad(split["mask"], (0, extra)),
        }

    train = encode(pad(data.splits["train"]), width)
    test = encode(pad(data.splits["test"]), width)
    config = BertConfig(
        vocab_size=len(data.src_vocab) + 2,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    swap_attention(model, align=args.align)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(train[0].shape[0])
        for start in range(0, len(order), 64):
            idx = order[start : start + 64]
            loss = model(train[0][idx], attention_mask=train[1][idx], labels=train[2][idx]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            out = model(test[0], attention_mask=test[1], output_attentions=True)
        accuracy = (out.logits.argmax(-1) == test[2]).float().mean().item()
        last = out.attentions[-1]  # (n, H, L, L)
        zeros = (last[test[1][:, None, None, :].expand_as(last) == 1] == 0).float().mean().item()
        on_month = (last[:, :, 0] * test[3][:, None]).sum(-1).mean().item()
        print(
            f"epoch {epoch + 1}: loss {loss.item():.3f}  test accuracy {accuracy:.3f}  "
            f"zero weights {zeros:.2f}  [CLS] attention on the month field {on_month:.2f}"
        )


if __name__ == "__main__":
    main()
