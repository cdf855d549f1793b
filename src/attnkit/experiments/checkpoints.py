"""Checkpoints that lose nothing and run no code: weights in safetensors, optimizer state loaded
with ``torch.load(weights_only=True)``, progress in JSON; each file written atomically
(temporary file, then rename)."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = ["CheckpointError", "atomic_write", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or unsafe to load."""


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``: readers see the old or new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Write model.safetensors, optimizer.pt, rng.safetensors, then state.json (last, so a
    state.json always describes complete files)."""
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    atomic_write(directory / "model.safetensors", lambda p: save_file(weights, str(p)))
    atomic_write(directory / "optimizer.pt", lambda p: torch.save(optimizer.state_dict(), p))
    rng = {"torch": torch.get_rng_state()}
    atomic_write(directory / "rng.safetensors", lambda p: save_file(rng, str(p)))
    text = json.dumps(state, indent=2)
    atomic_write(directory / "state.json", lambda p: p.write_text(text))


def load(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore model (and optimizer and RNG); returns the saved state. Nothing is unpickled
    beyond plain tensors and containers: a file that would run code is refused."""
    state_file = directory / "state.json"
    if not state_file.exists():
        raise CheckpointError(f"no checkpoint in {str(directory)!r} (state.json missing)")
    try:
        model.load_state_dict(load_file(str(directory / "model.safetensors")))
    except Exception as err:  # safetensors raises several types
        raise CheckpointError(
            f"cannot read {str(directory / 'model.safetensors')!r}: {err}"
        ) from err
    if optimizer is not None:
        path = directory / "optimizer.pt"
        try:
            optimizer.load_state_dict(torch.load(path, weights_only=True))
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"refusing to load {str(path)!r}: it holds more than plain tensors and could run "
                f"code when unpickled ({str(err).splitlines()[0]})"
            ) from err
    rng = load_file(str(directory / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    return json.loads(state_file.read_text())
