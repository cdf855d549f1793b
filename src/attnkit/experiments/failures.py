"""How a failure of the ``attnkit`` command reaches the user: one line on stderr and an exit
status, never a traceback.

- 2: the input or the machine's state: a refused configuration, a damaged run directory, a full
  disk or a file-size limit, memory running out, and a task of the user's own (``--task-module``,
  an entry point) that raised or returned a metric that is not a finite number. When the task
  raised, the line names its method and a log file holding the traceback.
- 1: training diverged (the line says what to change), or an internal error of attnkit: the
  line names a log file holding the traceback.

A failure inside a run that has a run directory says how to continue it (``--resume``): the
checkpoints are atomic, so the newest complete one is always kept.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

__all__ = ["TaskError", "as_os_error", "in_run", "mark_run_dir", "report", "write_failed"]

# the errors of a full disk or a size limit
_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# what torch and safetensors say (in errors that are not OSError) when a write fails
_WRITE_FAILED = ("No space left on device", "File too large", "Disk quota exceeded",
                 "file write failed", "Read-only file system")  # fmt: skip
_CODES = {"No space left": errno.ENOSPC, "File too large": errno.EFBIG,
          "Disk quota": errno.EDQUOT, "Read-only": errno.EROFS}  # fmt: skip
_OUT_OF_MEMORY = ("not enough memory", "out of memory", "Cannot allocate memory")
_RUN_DIR = "attnkit_run_dir"


class TaskError(RuntimeError):
    """A task broke its contract during a run (a metric that is not a finite number); the
    message names the task, the metric and where it was computed."""


def mark_run_dir(err: BaseException, run_dir: Path) -> None:
    """Record on ``err`` the run directory it interrupted (the line then says how to continue);
    an exception that takes no attributes is left as it is."""
    if getattr(err, _RUN_DIR, None) is None:
        with suppress(AttributeError, TypeError):
            setattr(err, _RUN_DIR, run_dir)


@contextmanager
def in_run(run_dir: Path) -> Iterator[None]:
    """Mark every exception that leaves the block with ``run_dir`` (:func:`mark_run_dir`)."""
    try:
        yield
    except Exception as err:
        mark_run_dir(err, run_dir)
        raise


def as_os_error(err: BaseException, path: Path) -> OSError:
    """``err``, a failed write of ``path`` (:func:`write_failed`), as an OSError naming the file:
    torch and safetensors raise their own types, with the reason only in the text."""
    if isinstance(err, OSError):
        return err if err.filename else OSError(err.errno, err.strerror, str(path))
    code = next((c for text, c in _CODES.items() if text in str(err)), errno.EIO)
    return OSError(code, _first_line(err), str(path))


def _continue(err: BaseException) -> str:
    run_dir = getattr(err, _RUN_DIR, None)
    if run_dir is None or not (Path(run_dir) / "config.json").is_file():
        return ""
    from attnkit.experiments.training import resume_command

    return (
        f"; the newest complete checkpoint in {run_dir} is kept; continue with: "
        f"{resume_command(Path(run_dir))}"
    )


def write_failed(err: BaseException) -> bool:
    """Whether ``err`` says a file could not be written for lack of room (a full disk, a quota,
    a file-size limit) or a read-only file system."""
    if isinstance(err, OSError):
        return err.errno in _NO_SPACE or err.errno == errno.EROFS
    return any(text in str(err) for text in _WRITE_FAILED)


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or (
        isinstance(err, RuntimeError) and any(t in str(err) for t in _OUT_OF_MEMORY)
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _user_task_frame(tb: TracebackType | None) -> tuple[str, str, str] | None:
    """(task name, the method the runner called, where the error was raised) when a frame of
    the traceback runs code of a task from outside attnkit; None otherwise."""
    from attnkit.tasks.base import REGISTRY
    from attnkit.tasks.user import is_builtin

    modules = {
        cls.__module__: name for name, cls in REGISTRY.snapshot().items() if not is_builtin(cls)
    }
    if not modules:
        return None
    frames = list(traceback.walk_tb(tb))
    ours = [f for f, _ in frames if f.f_globals.get("__name__") in modules]
    if not ours:
        return None
    first, last = ours[0], frames[-1][0]
    where = f"{last.f_code.co_filename}:{frames[-1][1]}"
    return modules[first.f_globals["__name__"]], first.f_code.co_name, where


def _log(err: BaseException) -> Path | None:
    """Write the traceback of ``err`` to a new file in the temporary directory; its path, or
    None when it cannot be written."""
    name = f"attnkit-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path = Path(tempfile.gettempdir()) / name
    try:
        path.write_text("".join(traceback.format_exception(err)), encoding="utf-8")
    except OSError:
        return None
    return path


def _traceback_at(err: BaseException) -> str:
    path = _log(err)
    return f"traceback in {path}" if path is not None else "the traceback could not be written"


def report(err: Exception, prog: str) -> int:
    """Print ``err`` as one line ``<prog>: error: ...`` on stderr; return the exit status."""
    from attnkit.experiments.checkpoints import CheckpointError
    from attnkit.experiments.config import ConfigError
    from attnkit.experiments.training import TrainingError

    status = 2
    if isinstance(err, ConfigError | CheckpointError):
        message = str(err)
    elif isinstance(err, TaskError):
        message = f"{err}{_continue(err)}"
    elif isinstance(err, TrainingError):
        message, status = str(err), 1
    elif write_failed(err):
        where = f"{err.filename}: " if isinstance(err, OSError) and err.filename else ""
        message = (
            f"cannot write {where}{_first_line(err)} (is the disk full, or a file-size limit "
            f"reached?){_continue(err)}"
        )
    elif isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        message = f"{where}{err.strerror or _first_line(err)}{_continue(err)}"
    elif _out_of_memory(err):
        message = (
            f"out of memory ({_first_line(err)}): try a smaller --batch-size, --d-model, "
            f"--seq-len or --n-train{_continue(err)}"
        )
    else:
        found = _user_task_frame(err.__traceback__)
        if found is not None:
            task, method, where = found
            message = (
                f"task {task!r} raised in {method} ({where}): {type(err).__name__}: "
                f"{_first_line(err)}; {_traceback_at(err)}{_continue(err)}"
            )
        else:
            status = 1
            message = (
                f"internal error (a bug in attnkit; please report it with the log): "
                f"{type(err).__name__}: {_first_line(err)}; {_traceback_at(err)}{_continue(err)}"
            )
    print(f"{prog}: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return status
