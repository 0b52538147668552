"""Turning per-replica failures into one exception that names the replica and device.

Used by the apply step: one failure becomes an exception of the original type (rebuilt with an
annotated message, the original chained as ``__cause__``), several become an
``ExceptionGroup`` (``BaseExceptionGroup`` when a ``BaseException`` is among them).
"""

from __future__ import annotations

import builtins
import re
import sys
from collections.abc import Sequence

import torch

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup, ExceptionGroup
else:  # pragma: no cover - the backport is a dependency on Python 3.10
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

__all__ = ["combine_failures", "annotate_failure"]

# A TorchScript ``raise ValueError(...)`` inside a forked task surfaces as a RuntimeError whose
# message ends with this line.
_SCRIPT_ORIGIN = re.compile(r"^builtins\.(\w+): ?(.*)$", re.MULTILINE)


def annotate_failure(exc: BaseException, index: int, device: torch.device | None) -> BaseException:
    """Rebuild ``exc`` with ``in replica {index} on device {device}: `` before its message.

    ``SystemExit``, ``KeyboardInterrupt`` (and other non-``Exception`` classes) come back as
    themselves. Otherwise the result has the original type where it can be rebuilt (else
    ``RuntimeError``), the original's attributes, and ``__cause__`` set to the original
    exception with its traceback.
    """
    where = f"in replica {index}" + (f" on device {device}" if device is not None else "")
    if not isinstance(exc, Exception):
        _add_note(exc, f"raised {where}")
        return exc
    cls: type[BaseException] = type(exc)
    text = str(exc)
    scripted = _scripted_origin(exc)
    if scripted is not None:
        cls, text = scripted
    message = f"{where}: {text}" if text else where
    new = _rebuild(cls, exc, message, keep_attributes=scripted is None)
    if new is not None and text not in str(new):
        new = None  # the rebuilt object would not show the original message
    if new is None:
        new = RuntimeError(f"{message} (original exception: {type(exc).__qualname__})")
    elif where not in str(new):
        _add_note(new, where)
    new.__cause__ = exc
    return new


def combine_failures(
    failures: list[tuple[int, torch.device | None, BaseException]],
    total: int,
    *,
    not_run: Sequence[int] = (),
) -> BaseException:
    """One exception for all failed replicas (``failures`` sorted by replica index).

    ``not_run``: replicas never started (after a ``KeyboardInterrupt`` or ``SystemExit``),
    named in a note.
    """
    annotated = [annotate_failure(e, i, d) for i, d, e in failures]
    if len(annotated) == 1:
        result = annotated[0]
    else:
        indices = ", ".join(str(i) for i, _, _ in failures)
        message = f"{len(failures)} of {total} replicas failed (replicas {indices})"
        if all(isinstance(e, Exception) for e in annotated):
            result = ExceptionGroup(message, annotated)  # type: ignore[type-var]
        else:
            result = BaseExceptionGroup(message, annotated)
    if not_run:
        index, _, stop = failures[-1]
        names = ", ".join(str(i) for i in not_run)
        were = f"replica {names} was" if len(not_run) == 1 else f"replicas {names} were"
        _add_note(
            result,
            f"{were} not run: the serial loop stopped at {type(stop).__name__} in replica {index}",
        )
    return result


def _scripted_origin(exc: BaseException) -> tuple[type[BaseException], str] | None:
    if not isinstance(exc, RuntimeError):
        return None
    matches = _SCRIPT_ORIGIN.findall(str(exc))
    if not matches:
        return None
    name, text = matches[-1]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls, text.strip()
    return None


def _rebuild(
    cls: type[BaseException], exc: BaseException, message: str, *, keep_attributes: bool
) -> BaseException | None:
    """An instance of ``cls`` carrying ``message``, or None where that cannot be done."""
    try:
        if len(exc.args) <= 1 or not keep_attributes:
            new = cls(message)
        else:
            # Several constructor arguments: build without calling __init__, keep the state.
            new = cls.__new__(cls, message)
            new.args = (message,)
    except Exception:
        try:
            new = cls.__new__(cls, message)
            new.args = (message,)
        except Exception:
            return None
    if type(new) is not cls:
        return None
    if keep_attributes:
        try:
            new.__dict__.update(exc.__dict__)
        except (AttributeError, TypeError):
            pass
        if isinstance(new, OSError) and isinstance(exc, OSError):
            new.errno = exc.errno  # C-level; strerror/filename would replace the message
    return new


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)
    if add is not None and note not in getattr(exc, "__notes__", ()):
        add(note)
