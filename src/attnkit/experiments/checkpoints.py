"""Checkpoints that are atomic as a set and run no code when loaded.

A checkpoint is one directory ``<run>/checkpoints/<n>/`` holding ``model.safetensors``,
``optimizer.pt`` (plain tensors only, loaded with ``torch.load(weights_only=True)``),
``rng.safetensors``, for a run that keeps its best epoch (``best_metric``) that epoch's weights
``best.safetensors``, and, written last, ``state.json``: the progress plus the SHA-256 of every
other file, of the progress itself and of the run's ``config.json`` (when the run directory has
one), so an edit of any of them is named when the checkpoint is loaded. The files are written
into a hidden partial directory, which is then renamed to the next number in one step; only
then are older checkpoints removed. A process killed at any point
leaves either the previous checkpoint or the new one complete, and a damaged file is named
instead of loaded. A save that fails (a full disk, a file-size limit) removes its partial
directory and raises an OSError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attnkit.experiments import failures

__all__ = ["CheckpointError", "atomic_write", "latest", "load", "load_best", "save"]

FOLDER = "checkpoints"
PARTIAL = ".partial-"
MANIFEST = "state.json"
FILES = ("model.safetensors", "optimizer.pt", "rng.safetensors")
BEST = "best.safetensors"  # the best epoch's weights, in runs that keep them
CONFIG = "config.json"  # the run's configuration, beside the checkpoints folder


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged or unsafe to load; the message names the file."""


def _written(path: Path) -> None:
    """Called after each file of a checkpoint is complete and after the switch to it.

    Does nothing; tests replace it to stop a save at every boundary, as a kill would.
    """


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _state_sha256(state: Any) -> str:
    """The SHA-256 of ``state`` written as canonical JSON (sorted keys, no spaces): the same
    for the state saved and the state read back (JSON numbers and strings round-trip)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _manifest_of(run_dir: Path, state: dict[str, Any], hashes: dict[str, str]) -> dict:
    config = run_dir / CONFIG
    return {
        "state": state,
        "sha256": hashes,
        "state_sha256": _state_sha256(json.loads(json.dumps(state))),
        "config_sha256": _sha256(config) if config.is_file() else None,
    }


def _numbered(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    found = _numbered(run_dir / FOLDER)
    return found[-1] if found else None


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    best: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a new complete checkpoint of ``model``, ``optimizer``, the RNG and ``state``
    (JSON-serialisable progress), with ``best`` (the best epoch's weights, a state dict) when
    given; return its directory."""
    root = run_dir / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=root, prefix=PARTIAL))
    weights = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    writers = {
        "model.safetensors": lambda p: save_file(weights, str(p)),
        "optimizer.pt": lambda p: torch.save(optimizer.state_dict(), p),
        "rng.safetensors": lambda p: save_file({"torch": torch.get_rng_state()}, str(p)),
    }
    if best is not None:
        kept = {k: v.detach().contiguous().clone() for k, v in best.items()}
        writers[BEST] = lambda p: save_file(kept, str(p))
    hashes = {}
    try:
        for name in writers:
            writers[name](partial / name)
            _sync(partial / name)
            hashes[name] = _sha256(partial / name)
            _written(partial / name)
        name = MANIFEST
        manifest = partial / MANIFEST
        manifest.write_text(json.dumps(_manifest_of(run_dir, state, hashes), indent=2))
        _sync(manifest)
        _written(manifest)
    except Exception as err:  # a full disk, a size limit: the newest checkpoint stays
        shutil.rmtree(partial, ignore_errors=True)
        if failures.write_failed(err):
            raise failures.as_os_error(err, partial / name) from err
        raise
    previous = _numbered(root)
    final = root / str(int(previous[-1].name) + 1 if previous else 1)
    os.rename(partial, final)
    _sync(root)
    _written(final)
    _clean(root, keep=final)
    return final


def _clean(root: Path, keep: Path) -> None:
    """Remove older checkpoints and partial directories left by an interrupted save."""
    for p in root.iterdir():
        if p != keep and (p.name.isdigit() or p.name.startswith(PARTIAL)):
            shutil.rmtree(p, ignore_errors=True)


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"damaged checkpoint: {path}: {what}")


def _manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _damaged(path, "file missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(path, f"not valid JSON ({err})") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("state"), dict)
        or not isinstance(data.get("sha256"), dict)
        or set(data["sha256"]) - {BEST} != set(FILES)
    ):
        raise _damaged(path, "not a checkpoint manifest (expected keys 'state' and 'sha256')")
    if not isinstance(data.get("state_sha256"), str) or not isinstance(
        data.get("config_sha256", 0), str | None
    ):
        raise _damaged(
            path,
            "no checksums of the saved position and of config.json (keys 'state_sha256' and "
            "'config_sha256'; a checkpoint of an older attnkit cannot be resumed: start a new run)",
        )
    if _state_sha256(data["state"]) != data["state_sha256"]:
        raise _damaged(
            path,
            "the saved position differs from the checksum recorded when it was saved (edited "
            "or overwritten)",
        )
    config = directory.parent.parent / CONFIG
    if data["config_sha256"] is not None and (
        not config.is_file() or _sha256(config) != data["config_sha256"]
    ):
        what = "differs from" if config.is_file() else "is missing, unlike"
        raise CheckpointError(
            f"damaged run: {config} {what} the configuration the checkpoint {directory} was "
            "trained with (edited after the run started?); restore it, or start a new run"
        )
    return data


def _verified(directory: Path, name: str, hashes: dict[str, str]) -> Path:
    path = directory / name
    if not path.is_file():
        raise _damaged(path, "file missing")
    if _sha256(path) != hashes[name]:
        raise _damaged(
            path,
            "contents differ from the checksum recorded when it was saved (truncated "
            "or overwritten)",
        )
    return path


def load(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any] | None:
    """Restore model (and optimizer and, with ``restore_rng``, the global random state) from the
    run's newest checkpoint; return its saved state, or None when the run has no checkpoint yet.
    Partial directories left by a kill are removed. Raises CheckpointError naming the file that
    is missing, damaged or unsafe."""
    root = run_dir / FOLDER
    directory = latest(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(PARTIAL):
                shutil.rmtree(p, ignore_errors=True)
    if directory is None:
        if (run_dir / MANIFEST).exists():
            raise CheckpointError(
                f"{run_dir / MANIFEST}: a checkpoint in the older layout (files at the top of the "
                "run directory, not atomic as a set); it cannot be resumed, start a new run"
            )
        return None
    data = _manifest(directory)
    hashes = data["sha256"]
    path = _verified(directory, "model.safetensors", hashes)
    try:
        model.load_state_dict(load_file(str(path)))
    except Exception as err:  # safetensors and load_state_dict raise several types
        raise _damaged(path, f"not weights for this model ({str(err).splitlines()[0]})") from None
    path = _verified(directory, "optimizer.pt", hashes)
    if optimizer is not None:
        if not zipfile.is_zipfile(path):
            raise _damaged(path, "not a file written by torch.save (no zip archive)")
        try:
            optimizer.load_state_dict(torch.load(path, weights_only=True))
        except pickle.UnpicklingError as err:
            found = [line for line in str(err).splitlines() if "global" in line.lower()]
            if not found:
                raise _damaged(path, "not readable as plain tensors and containers") from None
            raise CheckpointError(
                f"refusing to load {path}: it holds more than plain tensors and could run code "
                f"when unpickled ({found[-1].strip()})"
            ) from None
        except Exception as err:
            raise _damaged(path, f"not an optimizer state ({str(err).splitlines()[0]})") from None
    if BEST in hashes:
        _verified(directory, BEST, hashes)
    path = _verified(directory, "rng.safetensors", hashes)
    if not restore_rng:
        return data["state"]
    try:
        torch.set_rng_state(load_file(str(path))["torch"])
    except Exception as err:
        raise _damaged(path, f"not a random-number state ({str(err).splitlines()[0]})") from None
    return data["state"]


def load_best(run_dir: Path) -> dict[str, torch.Tensor] | None:
    """The best epoch's weights kept in the run's newest checkpoint (a state dict), or None when
    it keeps none (no checkpoint, or a run without ``best_metric``). Raises CheckpointError
    naming the file that is missing or damaged."""
    directory = latest(run_dir)
    if directory is None:
        return None
    hashes = _manifest(directory)["sha256"]
    if BEST not in hashes:
        return None
    path = _verified(directory, BEST, hashes)
    try:
        return load_file(str(path))
    except Exception as err:
        raise _damaged(path, f"not weights ({str(err).splitlines()[0]})") from None
