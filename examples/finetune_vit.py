"""Train a small ViT-config model of `transformers` (random initialisation: nothing is downloaded)
with any attnkit alignment swapped into its attention, on attnkit's cluttered digits: a 16 × 16
digit placed anywhere on a 48 × 48 canvas among pieces of other digits; name the digit.

    python examples/finetune_vit.py --align sparsemax
    python examples/finetune_vit.py --align softmax      # the original attention

Prints the test accuracy (chance: 1/10), the share of attention weights that are exactly zero,
and how much of the [CLS] token's attention (last layer, mean over heads) falls on the patches
that overlap the digit, beside the share those patches have of the image (what uniform
attention would give).
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import ViTConfig, ViTForImageClassification

from attnkit.integrations.transformers import swap_attention
from attnkit.tasks.digits import box_region, make_digits

PATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--align", default="sparsemax", help="a registered attnkit alignment")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak of the one-cycle schedule")
    parser.add_argument("--n-train", type=int, default=6000)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    data = make_digits(args.n_train, args.n_test, seed=args.seed)
    train, test = data.splits["train"], data.splits["test"]
    grid = data.canvas // PATCH
    on_digit = box_region(test["boxes"], data.canvas, grid)  # (n, patches), row-major
    config = ViTConfig(
        image_size=data.canvas,
        patch_size=PATCH,
        num_channels=1,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
    )
    model = ViTForImageClassification(config)
    swap_attention(model, align=args.align)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * -(-args.n_train // 64)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(args.n_train)
        for start in range(0, len(order), 64):
            idx = order[start : start + 64]
            loss = model(train["images"][idx], labels=train["labels"][idx]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
        model.eval()
        with torch.no_grad():
            out = model(test["images"], output_attentions=True)
        accuracy = (out.logits.argmax(-1) == test["labels"]).float().mean().item()
        last = out.attentions[-1]  # (n, H, 1 + patches, 1 + patches)
        zeros = (last == 0).float().mean().item()
        cls = last[:, :, 0, 1:].mean(1)  # [CLS] → patches, mean over heads
        on = (cls * on_digit).sum(-1).mean().item()
        share = on_digit.float().mean().item()
        print(
            f"epoch {epoch + 1}: loss {loss.item():.3f}  test accuracy {accuracy:.3f}  "
            f"zero weights {zeros:.2f}  [CLS] attention on the digit {on:.2f} "
            f"(its share of the patches {share:.2f})"
        )


if __name__ == "__main__":
    main()
