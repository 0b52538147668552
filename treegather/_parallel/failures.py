"""Turning per-replica failures into one exception that names the replicas and devices.

Used by the apply step. Replicas failing with the same exception type and message are one
failure, reported once (``in replicas 0, 1, 2 (devices cpu, cpu, cpu): ...``); each failure
keeps its identity:

- an exception whose one argument is its message (``ValueError("bad value")``) is rebuilt with
  the same type and attributes and the location before the message
  (``in replica 1 on device cpu: bad value``);
- any other (``KeyError('x')``, ``FileNotFoundError(2, 'gone', 'f.txt')``,
  ``UnicodeDecodeError(...)``, several arguments, a custom ``__str__``) is copied with the same
  type, ``args`` and attributes, and the location goes into a note (``add_note``);
- ``SystemExit``, ``KeyboardInterrupt`` and other non-``Exception`` classes come back as
  themselves, with a note;
- one that can be neither rebuilt nor copied becomes a ``RuntimeError`` naming its type.

What is raised has the (first) replica's own exception, with its traceback, as ``__cause__``.
Several distinct failures make an ``ExceptionGroup`` with one entry each
(``BaseExceptionGroup`` when a ``BaseException`` is among them).
"""

from __future__ import annotations

import builtins
import copy
import re
import sys
from collections.abc import Sequence

import torch

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup, ExceptionGroup
else:  # pragma: no cover - the backport is a dependency on Python 3.10
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

__all__ = ["combine_failures", "annotate_failure", "location"]

Failure = tuple[int, "torch.device | None", BaseException]

# A TorchScript ``raise ValueError(...)`` inside a forked task surfaces as a RuntimeError whose
# message ends with this line.
_SCRIPT_ORIGIN = re.compile(r"^builtins\.(\w+): ?(.*)$", re.MULTILINE)

# C-level attributes that a rebuilt exception would otherwise lose (not in ``__dict__``).
_SLOT_ATTRIBUTES: tuple[tuple[type[BaseException], tuple[str, ...]], ...] = (
    (OSError, ("errno",)),  # strerror/filename would replace the message
    (AttributeError, ("name", "obj")),
    (NameError, ("name",)),
    (ImportError, ("name", "path")),
)


def combine_failures(
    failures: list[Failure], total: int, *, not_run: Sequence[int] = ()
) -> BaseException:
    """One exception for all failed replicas.

    Args:
        failures: ``(replica index, device, exception)``, sorted by replica index.
        total: the number of replicas.
        not_run: replicas never started (after a ``KeyboardInterrupt`` or ``SystemExit``);
            named in a note.

    Returns:
        The exception to raise (see the module docs).
    """
    annotated = [annotate_failure(group[0][2], location(group)) for group in _grouped(failures)]
    if len(annotated) == 1:
        result = annotated[0]
    else:
        indices = ", ".join(str(i) for i, _, _ in failures)
        message = f"{len(failures)} of {total} replicas failed (replicas {indices})"
        if len(annotated) < len(failures):
            message += f"; {len(annotated)} distinct errors"
        if all(isinstance(e, Exception) for e in annotated):
            result = ExceptionGroup(message, annotated)  # type: ignore[type-var]
        else:
            result = BaseExceptionGroup(message, annotated)
    if not_run:
        index, _, stop = failures[-1]
        were = "was" if len(not_run) == 1 else "were"
        _add_note(
            result,
            f"{_replicas(not_run)} {were} not run: the serial loop stopped at "
            f"{type(stop).__name__} in replica {index}",
        )
    return result


def location(failures: Sequence[Failure]) -> str:
    """Where the failures happened: ``in replica 1 on device cpu``, or for several replicas
    ``in replicas 0, 2 (devices cpu, cuda:1)`` (without devices when none is known)."""
    indices = [i for i, _, _ in failures]
    devices = [d for _, d, _ in failures]
    if len(failures) == 1:
        return f"in replica {indices[0]}" + (
            f" on device {devices[0]}" if devices[0] is not None else ""
        )
    where = f"in {_replicas(indices)}"
    if any(d is not None for d in devices):
        where += " (devices " + ", ".join(str(d) for d in devices) + ")"
    return where


def annotate_failure(exc: BaseException, where: str) -> BaseException:
    """``exc`` as it is raised from the caller, located by ``where`` (see the module docs)."""
    if not isinstance(exc, Exception):
        _add_note(exc, f"raised {where}")
        return exc
    text = _text(exc)
    scripted = _scripted_origin(exc)
    new: BaseException | None
    if scripted is not None:
        cls, text = scripted
        new = _with_message(cls, exc, _prefixed(where, text), text, keep_attributes=False)
    elif len(exc.args) == 1 and isinstance(exc.args[0], str) and exc.args[0] == text:
        new = _with_message(type(exc), exc, _prefixed(where, text), text, keep_attributes=True)
        new = new or _copy(exc)  # a class that rewrites its message: keep it, note the place
    else:
        new = _copy(exc)
    if new is None:
        original = type(exc).__qualname__
        new = RuntimeError(f"{_prefixed(where, text)} (original exception: {original})")
    elif where not in _text(new):
        _add_note(new, where)
    new.__cause__ = exc
    return new


def _grouped(failures: list[Failure]) -> list[list[Failure]]:
    """Failures with the same exception type and message, in order of their first replica."""
    groups: dict[object, list[Failure]] = {}
    for failure in failures:
        exc = failure[2]
        try:
            key: object = (type(exc), str(exc))
        except Exception:  # a broken __str__: never merged with another failure
            key = id(exc)
        groups.setdefault(key, []).append(failure)
    return list(groups.values())


def _replicas(indices: Sequence[int]) -> str:
    if len(indices) == 1:
        return f"replica {indices[0]}"
    return "replicas " + ", ".join(str(i) for i in indices)


def _prefixed(where: str, text: str) -> str:
    return f"{where}: {text}" if text else where


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__: report the rest
        return ""


def _scripted_origin(exc: BaseException) -> tuple[type[BaseException], str] | None:
    if not isinstance(exc, RuntimeError):
        return None
    matches = _SCRIPT_ORIGIN.findall(_text(exc))
    if not matches:
        return None
    name, text = matches[-1]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls, text.strip()
    return None


def _with_message(
    cls: type[BaseException], exc: BaseException, message: str, text: str, *, keep_attributes: bool
) -> BaseException | None:
    """An instance of ``cls`` carrying ``message`` (and ``exc``'s attributes), or None."""
    try:
        if not keep_attributes:
            new = cls(message)
        else:
            try:
                new = cls(message)
            except Exception:  # a constructor with more arguments: build without __init__
                new = cls.__new__(cls, message)
                new.args = (message,)
    except Exception:
        return None
    if type(new) is not cls:
        return None
    if keep_attributes:
        _carry_attributes(exc, new)
    if text not in _text(new):
        return None  # the rebuilt object would not show the original message
    return new


def _copy(exc: BaseException) -> BaseException | None:
    """A copy of ``exc`` with the same type, ``args`` and attributes, or None."""
    cls = type(exc)
    try:
        # BaseException.__reduce__: cls(*args), then __dict__ (OSError's adds the filename).
        new = copy.copy(exc)
    except Exception:
        try:
            new = cls.__new__(cls, *exc.args)
            new.args = exc.args
            _carry_attributes(exc, new)
        except Exception:
            return None
    same_args = len(new.args) == len(exc.args) and all(a is b for a, b in zip(new.args, exc.args))
    if type(new) is not cls or not same_args:
        return None
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        new.__notes__ = list(notes)  # never add our note to the original's list
    return new


def _carry_attributes(exc: BaseException, new: BaseException) -> None:
    try:
        new.__dict__.update(exc.__dict__)
    except (AttributeError, TypeError):
        pass
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        new.__notes__ = list(notes)
    for cls, names in _SLOT_ATTRIBUTES:
        if isinstance(new, cls) and isinstance(exc, cls):
            for name in names:
                try:
                    setattr(new, name, getattr(exc, name))
                except (AttributeError, TypeError):
                    pass


def _add_note(exc: BaseException, note: str) -> None:
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list) and note in notes:
        return
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:  # pragma: no cover - Python 3.10: the exceptiongroup backport prints __notes__ too
        exc.__notes__ = [*(notes or ()), note]
