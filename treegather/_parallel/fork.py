"""The TorchScript fan-out of the ``"fork"`` backend: scripted replicas forked from TorchScript.

When every replica is a TorchScript module, one small scripted module (generated per call
signature, kept in a bounded cache) forks them all with ``torch.jit.fork`` inside TorchScript, so
they run in torch's inter-op pool without the GIL. ``None`` wherever that cannot be done: the
caller then runs the replicas inline.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import linecache
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._caches import LRU, typed_key

__all__ = ["Call", "is_script_module", "quiet_jit", "scripted_fanout"]

# One replica's call: (function, positional args, keyword args, device).
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], "torch.device | None"]


def is_script_module(fn: Any) -> bool:
    return isinstance(fn, torch.jit.ScriptModule) and hasattr(fn, "forward")


# Generated fan-out classes by signature (every annotation a str from torch's schema; the key is
# typed all the same). Each class's source lives in linecache for as long as the class does.
_FANOUT_CLASSES: LRU[Hashable, type[torch.nn.Module]] = LRU(
    "apply.fanout_classes", maxsize=64, trees=False
)
_FANOUT_COUNT = itertools.count()
_ANNOTATION_NAMES = "from typing import Any, Dict, List, Optional, Tuple, Union\n"


def scripted_fanout(calls: list[Call]) -> list[torch.futures.Future[Any]] | None:
    """Fork every TorchScript module from inside TorchScript; None where that cannot be done."""
    try:
        bound = [_bind(call) for call in calls]
    except (TypeError, RuntimeError, AttributeError):
        return None
    signature = tuple((tuple(b[1]), b[2]) for b in bound)
    key = typed_key(signature)
    try:
        with quiet_jit():
            cls = _FANOUT_CLASSES.get(key)
            if cls is None:
                cls = _fanout_class(signature)
                _FANOUT_CLASSES.put(key, cls)
            fanout = torch.jit.script(cls([_scriptable(c[0]) for c in calls]))
    except Exception:
        return None
    flat = [v for b in bound for v in b[0]]
    try:
        with quiet_jit():
            futures = list(fanout(*flat))
    except Exception:
        # Arguments that do not fit the scripted signature fail here, before anything is
        # forked (the forked calls' own errors land in their futures): call each replica
        # inline instead, so every replica reports its own error.
        return None
    # Keep the latest batch (futures and fan-out module) referenced until the next fork call or
    # interpreter teardown. Dropping them right after the wait lets an inter-op thread, still
    # finishing the task, release the last reference; if the script exits at that moment the
    # process aborts ("terminate called without an active exception"; torch 2.13, CPU).
    _LATEST_FORK[:] = [fanout, futures]
    return futures


_LATEST_FORK: list[Any] = []


def _scriptable(module: Any) -> Any:
    """``module``, or where it lacks the concrete type scripting the fan-out needs (a replica
    made by torch's ``_replicate_for_data_parallel``), a shallow copy of it that has one: the
    same C++ module's tensors, a wrapper of its own. Nothing is written on the caller's module."""
    if hasattr(module, "_concrete_type"):
        return module
    return copy.copy(module)  # (wrap_cpp_module gives the copy its concrete type)


def _bind(call: Call) -> tuple[list[Any], list[str], str]:
    """Positional values for every schema argument, their annotations, the return annotation."""
    fn: Any = call[0]
    _, a, kw, _ = call
    schema = fn.forward.schema
    params = schema.arguments[1:]
    if len(a) > len(params):
        raise TypeError("too many positional arguments")
    values: list[Any] = []
    for k, p in enumerate(params):
        if k < len(a):
            values.append(a[k])
        elif p.name in kw:
            values.append(kw[p.name])
        elif p.has_default_value():
            values.append(p.default_value)
        else:
            raise TypeError(f"missing argument {p.name}")
    if set(kw) - {p.name for p in params}:
        raise TypeError("unexpected keyword argument")
    annotations = [p.type.annotation_str for p in params]
    returns = schema.returns
    ret = returns[0].type.annotation_str if len(returns) == 1 else "Tuple[()]"
    if any("__torch__" in s for s in [*annotations, ret]):
        raise TypeError("class-typed arguments are not supported by the fan-out")
    return values, annotations, ret


def _fanout_class(signature: tuple[tuple[tuple[str, ...], str], ...]) -> type[torch.nn.Module]:
    """A module class whose ``forward`` forks ``self.m{i}`` on each replica's arguments."""
    n = len(signature)
    params, forks = [], []
    for i, (anns, _) in enumerate(signature):
        names = [f"a{i}_{k}" for k in range(len(anns))]
        params += [f"{name}: {ann}" for name, ann in zip(names, anns)]
        forks.append(f"torch.jit.fork(self.m{i}{''.join(', ' + x for x in names)})")
    ret = ", ".join(f"torch.jit.Future[{r}]" for _, r in signature)
    assigns = "".join(f"        self.m{i} = fns[{i}]\n" for i in range(n))
    source = (
        "import torch\nfrom torch import Tensor\n"
        + _ANNOTATION_NAMES
        + "Device = torch.device\nNoneType = type(None)\n\n"
        + "class FanOut(torch.nn.Module):\n"
        + "    def __init__(self, fns):\n        super().__init__()\n"
        + assigns
        + f"    def forward(self, {', '.join(params)}) -> Tuple[{ret}]:\n"
        + f"        return ({', '.join(forks)},)\n"
    )
    number = next(_FANOUT_COUNT)
    filename = f"<treegather-fanout-{number}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"treegather._fanout{number}"}
    exec(compile(source, filename, "exec"), namespace)
    cls: type[torch.nn.Module] = namespace["FanOut"]
    weakref.finalize(cls, linecache.cache.pop, filename, None)
    return cls


@contextlib.contextmanager
def quiet_jit() -> Any:
    """torch.jit.script/fork/wait emit DeprecationWarning from torch 2.13 on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        yield
