"""A tiny random BERT checkpoint folder with its tokenizer, as ``save_pretrained`` writes them,
for tests of ``attnkit run text --pretrained FOLDER`` that need no download."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertConfig, BertModel, BertTokenizer

WORDS = ["the", "film", "was", "plot", "and", "bad", "poor", "good", "fine", ","]
HEADS, HEAD_DIM, LAYERS, POSITIONS = 2, 8, 2, 40


def tiny_bert(folder: Path, words=WORDS) -> Path:
    """Write a 2-layer BERT (2 heads of 8) and a WordPiece tokenizer knowing ``words`` into
    ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=HEADS * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=32,
        max_position_embeddings=POSITIONS,
        initializer_range=0.2,  # scores far from 0, so that alignments differ visibly
    )
    BertModel(config).save_pretrained(folder)
    return folder
