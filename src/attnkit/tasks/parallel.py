"""A user's file of source/target pairs for the ``seq2seq`` task: reading, word alignments in the
Pharaoh format, splits, vocabularies and tensors.

Formats:

- **TSV** (``.tsv``, ``.txt``): one pair per line, ``source<TAB>target`` or
  ``source<TAB>target<TAB>alignment``; no header.
- **JSONL** (``.jsonl``): one object per line with ``source`` and ``target`` strings and optional
  ``alignment`` (a string) and ``split`` (``train``, ``validation``, ``test``).

Sentences are split on whitespace: write them tokenised (one character per token for a
character-level task: ``2 0 2 1``). An alignment is the Pharaoh format of word aligners
(fast_align, GIZA++ and the Och & Ney test sets): space-separated links ``i-j`` (sure) and
``i?j`` (possible), i the source token and j the target token, counted from 0; an empty
alignment is a pair whose words are all unaligned. Without a ``split`` the pairs are shuffled
with the run's seed and cut 80 / 10 / 10.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "Example",
    "ParallelData",
    "make_parallel_data",
    "parse_alignment",
    "read_pairs",
]

SPLITS = ("train", "validation", "test")
PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
_LINK = re.compile(r"(\d+)([-?])(\d+)")


@dataclass(frozen=True)
class Example:
    """One pair: its ``source`` and ``target`` tokens, the gold ``sure`` and ``possible`` links
    (sets of (source index, target index); None when the file gives no alignment for it), its
    ``split`` (None: drawn) and its ``line`` in the file."""

    source: list[str]
    target: list[str]
    sure: frozenset[tuple[int, int]] | None
    possible: frozenset[tuple[int, int]] | None
    split: str | None
    line: int


def parse_alignment(
    text: str, n_source: int, n_target: int, where: str = "alignment"
) -> tuple[frozenset[tuple[int, int]], frozenset[tuple[int, int]]]:
    """(sure, possible) links of a Pharaoh alignment ``"0-0 1?2 ..."`` between ``n_source``
    source and ``n_target`` target tokens; possible includes the sure links (S ⊆ P, Och & Ney).

    Raises:
        ValueError: naming ``where``, for a link that is not ``i-j`` or ``i?j`` or an index
            outside the sentences.
    """
    sure, possible = set(), set()
    for link in text.split():
        m = _LINK.fullmatch(link)
        if m is None:
            raise ValueError(
                f"{where}: {link!r} is not a link i-j (sure) or i?j (possible) of the Pharaoh "
                "format"
            )
        i, kind, j = int(m[1]), m[2], int(m[3])
        if not (i < n_source and j < n_target):
            raise ValueError(
                f"{where}: link {link!r} is outside the pair ({n_source} source and {n_target} "
                "target tokens, counted from 0)"
            )
        (sure if kind == "-" else possible).add((i, j))
    return frozenset(sure), frozenset(possible | sure)


def _example(source: Any, target: Any, alignment: Any, split: Any, where: str, line: int):
    for name, value in (("source", source), ("target", target)):
        if not isinstance(value, str) or not value.split():
            raise ValueError(f"{where}: {name!r} must be a non-empty string, got {value!r:.60}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {split!r}")
    src, tgt = source.split(), target.split()
    sure = possible = None
    if alignment is not None:
        if not isinstance(alignment, str):
            raise ValueError(f"{where}: 'alignment' must be a string, got {alignment!r:.60}")
        sure, possible = parse_alignment(alignment, len(src), len(tgt), where)
    return Example(src, tgt, sure, possible, split, line)


def read_pairs(path: str | Path) -> list[Example]:
    """The pairs of a TSV or JSONL file (see the module docstring).

    Raises:
        ValueError: naming the file and line, for anything it cannot use.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {str(path)!r} is not a file")
    suffix = path.suffix.lower()
    if suffix not in (".tsv", ".txt", ".jsonl"):
        raise ValueError(f"data: {str(path)!r} must end in .tsv, .txt or .jsonl, got {suffix!r}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {path}: not UTF-8 text ({err.reason})") from None
    out = []
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"data: {path}:{i}"
        if suffix == ".jsonl":
            try:
                item = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected an object, got {item!r:.60}")
            fields = [item.get(k) for k in ("source", "target", "alignment")]
            out.append(_example(*fields, item.get("split") or None, where, i))
        else:
            cols = text.split("\t")
            if len(cols) not in (2, 3):
                raise ValueError(
                    f"{where}: {len(cols)} tab-separated fields; expected source<TAB>target or "
                    "source<TAB>target<TAB>alignment"
                )
            out.append(_example(cols[0], cols[1], cols[2] if len(cols) == 3 else None, None,
                                where, i))  # fmt: skip
    if not out:
        raise ValueError(f"data: {path} holds no pairs")
    return out


def split_examples(
    path: str | Path, examples: list[Example], *, n_train: int, n_test: int, seed: int
) -> dict[str, list[Example]]:
    """The examples of each split (their own ``split``, else shuffled with ``seed`` and cut
    80 / 10 / 10); ``n_train`` and ``n_test`` cap training and test. ValueError naming the file
    for an empty split, or a file where only some pairs name their split."""
    named = [e.split is not None for e in examples]
    if any(named):
        if not all(named):
            raise ValueError(f"data: {path}: either every pair names its split or none does")
        parts = {s: [e for e in examples if e.split == s] for s in SPLITS}
    else:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))
        shuffled = [examples[i] for i in order.tolist()]
        n = max(1, len(examples) // 10)
        parts = {
            "test": shuffled[:n],
            "validation": shuffled[n : 2 * n],
            "train": shuffled[2 * n :],
        }
    parts["train"], parts["test"] = parts["train"][:n_train], parts["test"][:n_test]
    for name in SPLITS:
        if not parts[name]:
            why = (
                f"no pair has split {name!r}"
                if any(named)
                else f"{len(examples)} pairs cannot be cut 80 / 10 / 10 into three non-empty splits"
            )
            raise ValueError(f"data: {path}: the {name} split is empty ({why})")
    return parts


@dataclass(frozen=True)
class ParallelData:
    """Vocabularies (id -> token; ids 0-3 are ``<pad>``, ``<unk>``, ``<s>``, ``</s>``) and, per
    split, its ``examples`` and tensors: ``src`` (B, N) and ``src_mask`` (B, N); ``tgt`` (B, T)
    the target tokens then ``</s>`` (padded), ``tgt_in`` (B, T) ``<s>`` then the target tokens,
    ``tgt_mask`` (B, T); ``sure`` and ``possible`` (B, T, N) gold links; ``gold_rows`` (B, T)
    the target tokens of pairs with a gold alignment (not ``</s>``)."""

    source_vocab: list[str]
    target_vocab: list[str]
    splits: dict[str, dict[str, Any]]

    def encode_source(self, sentences: list[list[str]]) -> tuple[Tensor, Tensor]:
        """Token ids (B, N) and mask (B, N) of tokenised source sentences (``<unk>`` for tokens
        not in the training vocabulary)."""
        ids = {w: i for i, w in enumerate(self.source_vocab)}
        n = max(len(s) for s in sentences)
        src = torch.full((len(sentences), n), PAD, dtype=torch.long)
        for b, s in enumerate(sentences):
            src[b, : len(s)] = torch.tensor([ids.get(w, UNK) for w in s])
        mask = torch.arange(n) < torch.tensor([len(s) for s in sentences]).unsqueeze(-1)
        return src, mask

    def decode_target(self, ids: list[int]) -> list[str]:
        """The target tokens of generated ids, up to the first ``</s>``."""
        out = []
        for i in ids:
            if i == EOS:
                break
            out.append(self.target_vocab[i])
        return out


def _tensors(data: ParallelData, examples: list[Example]) -> dict[str, Any]:
    ids = {w: i for i, w in enumerate(data.target_vocab)}
    src, src_mask = data.encode_source([e.source for e in examples])
    b, n, t = len(examples), src.shape[1], max(len(e.target) for e in examples) + 1
    tgt = torch.full((b, t), PAD, dtype=torch.long)
    tgt_in = torch.full((b, t), PAD, dtype=torch.long)
    sure = torch.zeros(b, t, n, dtype=torch.bool)
    possible = torch.zeros(b, t, n, dtype=torch.bool)
    gold_rows = torch.zeros(b, t, dtype=torch.bool)
    for k, e in enumerate(examples):
        words = [ids.get(w, UNK) for w in e.target]
        tgt[k, : len(words) + 1] = torch.tensor([*words, EOS])
        tgt_in[k, : len(words) + 1] = torch.tensor([BOS, *words])
        if e.sure is not None:
            gold_rows[k, : len(words)] = True
            for i, j in e.sure:
                sure[k, j, i] = True
            for i, j in e.possible:
                possible[k, j, i] = True
    return {
        "examples": examples,
        "src": src,
        "src_mask": src_mask,
        "tgt": tgt,
        "tgt_in": tgt_in,
        "tgt_mask": tgt != PAD,
        "sure": sure,
        "possible": possible,
        "gold_rows": gold_rows,
    }


def make_parallel_data(
    path: str | Path, *, n_train: int, n_test: int, seed: int = 0, max_len: int | None = None
) -> ParallelData:
    """Read, split and number the pairs of ``path``; the vocabularies are the training split's
    tokens. ValueError naming the file and line for a sentence longer than ``max_len`` tokens."""
    examples = read_pairs(path)
    if max_len is not None:
        for e in examples:
            longest = max(len(e.source), len(e.target))
            if longest > max_len:
                raise ValueError(
                    f"data: {path}:{e.line}: a sentence of {longest} tokens is longer than "
                    f"seq_len {max_len}; give a larger --seq-len"
                )
    parts = split_examples(path, examples, n_train=n_train, n_test=n_test, seed=seed)
    train = parts["train"]
    source_vocab = SPECIALS + sorted({w for e in train for w in e.source} - set(SPECIALS))
    target_vocab = SPECIALS + sorted({w for e in train for w in e.target} - set(SPECIALS))
    data = ParallelData(source_vocab, target_vocab, {})
    for name, split in parts.items():
        data.splits[name] = _tensors(data, split)
    return data
