"""data_parallel and DataParallel: scatter, replicate, apply, gather, composed.

``data_parallel`` is the functional entry point; ``DataParallel`` is a small adapter: a
``torch.nn.DataParallel`` subclass whose four steps are treegather's; ``patch`` swaps the
scatter/gather steps of an existing ``nn.DataParallel``.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ._apply import Backend, parallel_apply
from ._caches import LRU
from ._devices import DeviceLike, as_device, as_devices
from ._gather import gather
from ._kept import Kept, give_back, reusable, take
from ._replicate import replicate
from ._scatter import Shards, scatter_kwargs

__all__ = ["data_parallel", "DataParallel", "patch"]

T = TypeVar("T", bound=nn.Module)
DP = TypeVar("DP", bound=nn.DataParallel)


def data_parallel(
    fn: Callable[..., Any],
    inputs: Any,
    devices: Sequence[DeviceLike] | None = None,
    *,
    output_device: DeviceLike | None = None,
    module_kwargs: Mapping[str, Any] | None = None,
    in_layout: Any = None,
    out_layout: Any = None,
    dim: int = 0,
    backend: Backend = "auto",
) -> Any:
    """Evaluate ``fn(*inputs, **module_kwargs)`` split over ``devices``: scatter, replicate, apply, gather.

    >>> import torch, treegather as tg
    >>> net = torch.nn.Linear(3, 2)
    >>> x = torch.randn(5, 3)
    >>> out = tg.data_parallel(net, x, ["cpu"] * 2)
    >>> out.shape, torch.allclose(out, net(x))
    (torch.Size([5, 2]), True)
    >>> loss = lambda x: {"loss": x.pow(2).mean(), "tag": "sq"}
    >>> r = tg.data_parallel(loss, torch.arange(5.0), ["cpu"] * 3,
    ...                      out_layout={"loss": tg.mean(), "tag": "first"})
    >>> r["loss"].item() == torch.arange(5.0).pow(2).mean().item(), r["tag"]
    (True, 'sq')

    Steps: :func:`scatter_kwargs` divides ``(args, module_kwargs)`` by ``in_layout`` (default:
    tensors split along ``dim``, everything else broadcast); an ``nn.Module`` is replicated
    onto the devices that received a shard (a plain callable is called as it is, on every
    shard); :func:`parallel_apply` runs the shards with ``backend``; :func:`gather` combines
    the outputs on ``output_device`` by ``out_layout``, with the shard sizes, so ``mean()``
    is exact for uneven splits. The output is always gathered, so one device gives the same
    output shapes as N devices (a 0-dim loss becomes a vector unless ``out_layout`` says
    ``mean()``, ``sum()`` or ``first()``). When nothing is split (no tensor input with a batch
    dim), ``fn`` runs once, on the first device.

    A module's replicas are kept from step to step (as with :func:`replicate`'s
    ``reuse=True``; a deleted module frees them): each step only re-binds buffers (and
    parameters on other devices), and any change to the module (a replaced layer, a new hook
    or attribute, ``.eval()``, ``.half()``, compiling it) rebuilds them. Results equal fresh
    replicas' exactly; concurrent steps on one module each get their own replicas.

    Under ``torch.compile``: a compiled model (``torch.compile(m)`` or ``m.compile()``) is
    replicated with its compiled code, which every replica shares. A compiled function that
    calls ``data_parallel`` works too, but ``data_parallel`` itself always runs eagerly there
    (a graph break, so ``fullgraph=True`` raises); compile the model for speed.

    Args:
        fn: an ``nn.Module`` (parameters and buffers on ``devices[0]``) or any callable.
        inputs: a tuple (not a namedtuple) is the positional arguments (``()`` = none);
            anything else is the single argument.
        devices: the devices (repeats allowed, e.g. ``["cpu"] * 4``); default: every
            visible CUDA device, else the CPU alone.
        output_device: where the result goes; default ``devices[0]``.
        module_kwargs: keyword arguments for ``fn``, scattered with the positional ones (a
            dict batch for ``model(**batch)``, as every Hugging Face model takes, goes here).
        in_layout: a layout of ``(args, kwargs)`` as in :func:`scatter_kwargs`.
        out_layout: a layout of ``fn``'s output as in :func:`gather`.
        dim: the default split/concatenation dim.
        backend: the :func:`parallel_apply` backend.

    Returns:
        The gathered output tree.

    Raises:
        RuntimeError: a module's parameters or buffers are not on ``devices[0]``.
    """
    if _compiler_active():
        return _outside_compiler(data_parallel)(
            fn,
            inputs,
            devices,
            output_device=output_device,
            module_kwargs=module_kwargs,
            in_layout=in_layout,
            out_layout=out_layout,
            dim=dim,
            backend=backend,
        )
    devs = _default_devices(devices)
    args = _as_args(inputs)
    args_shards, kwargs_shards = scatter_kwargs(args, module_kwargs, devs, in_layout, dim=dim)
    args_shards, kwargs_shards = _trim_unsplit(args_shards, kwargs_shards)
    used = args_shards.devices or devs[: len(args_shards)]
    kept: Kept | None = None
    if not isinstance(fn, nn.Module):
        fns: Any = fn
    elif len(used) == 1:
        _check_module_device(fn, devs[0])
        fns = [fn]
    else:
        fns, kept = _replicas_for_step(fn, used, devs[0])
    with _module_kwargs_hint(fn, inputs, module_kwargs):
        outputs = parallel_apply(fns, list(args_shards), list(kwargs_shards), used, backend=backend)
    if kept is not None:
        give_back(kept)  # not after a failed step: the next one builds new replicas
    target = devs[0] if output_device is None else as_device(output_device)
    return gather(outputs, target, out_layout, dim=dim, sizes=args_shards.sizes)


class DataParallel(nn.DataParallel):
    """``torch.nn.DataParallel`` whose scatter, replicate, parallel_apply and gather are treegather's.

    >>> import torch, treegather as tg
    >>> dp = tg.DataParallel(torch.nn.Linear(3, 2), device_ids=["cpu"] * 3)
    >>> isinstance(dp, torch.nn.DataParallel), list(dp.state_dict())
    (True, ['module.weight', 'module.bias'])
    >>> dp(torch.ones(4, 3)).shape
    torch.Size([4, 2])

    Inputs and outputs may be any registered pytree; ``in_layout`` (a layout of
    ``(args, kwargs)``) and ``out_layout`` say how each leaf is split and combined. Explicit
    device lists, CPU ones included (``["cpu"] * 4``), run the whole pipeline, even a single
    device (the output is still gathered, so shapes match N devices). ``device_ids=None``
    behaves like torch: every visible CUDA device, or on a machine without CUDA a plain call
    of the module. ``isinstance(dp, torch.nn.DataParallel)`` holds and ``state_dict()`` keys
    carry the usual ``module.`` prefix. Replicas are kept from call to call while the module
    is unchanged, as in :func:`data_parallel` (unless a subclass overrides ``replicate``).

    Args:
        module: the module to parallelise (parameters and buffers on ``device_ids[0]``).
        device_ids: devices in torch's conventions (CUDA indices, strings, ``torch.device``).
        output_device: where outputs are gathered; default ``device_ids[0]``.
        dim: the default split/concatenation dim.
        in_layout: layout of ``(args, kwargs)`` for scatter.
        out_layout: layout of the module's output for gather.
        backend: the :func:`parallel_apply` backend.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        in_layout: Any = None,
        out_layout: Any = None,
        backend: Backend = "auto",
    ) -> None:
        if device_ids is None:
            super().__init__(module, None, output_device, dim)  # type: ignore[arg-type]
            self.dim = dim
        else:
            nn.Module.__init__(self)  # torch's __init__ drops device_ids without CUDA
            devs = as_devices(device_ids)
            self.module = module
            self.dim = dim
            self.device_ids = [_torch_id(d) for d in devs]
            out = devs[0] if output_device is None else as_device(output_device)
            self.output_device = _torch_id(out)
            self.src_device_obj = devs[0]
            if len(devs) == 1:
                self.module.to(devs[0])
        self.in_layout = in_layout
        self.out_layout = out_layout
        self.backend = backend

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter ``(inputs, kwargs)``, replicate, apply, gather; a plain call without devices."""
        with torch.autograd.profiler.record_function("DataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            keep = type(self).replicate is DataParallel.replicate  # kept replicas (issue 14)
            if not keep:
                _check_module_device(self.module, self.src_device_obj)
            args_shards, kwargs_shards = _as_shards(
                *self.scatter(inputs, kwargs, self.device_ids), self.device_ids
            )
            devices = _shard_devices(args_shards, self.device_ids)
            kept: Kept | None = None
            if len(devices) == 1:
                if keep:
                    _check_module_device(self.module, self.src_device_obj)
                replicas: Any = [self.module]
            elif keep:
                replicas, kept = _replicas_for_step(self.module, devices, self.src_device_obj)
            else:
                replicas = self.replicate(self.module, devices)
            outputs = self.parallel_apply(replicas, args_shards, kwargs_shards)
            if kept is not None:
                give_back(kept)
            return self.gather(outputs, self.output_device)

    def replicate(self, module: T, device_ids: Sequence[DeviceLike]) -> list[T]:
        """:func:`treegather.replicate`, detached when grad mode is off (as torch does)."""
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> tuple[Shards, Shards]:
        """:func:`treegather.scatter_kwargs` with ``in_layout`` and ``dim``."""
        return scatter_kwargs(inputs, kwargs, device_ids, self.in_layout, dim=self.dim)

    def parallel_apply(
        self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        """:func:`treegather.parallel_apply`; the result carries the shard sizes for gather."""
        devices = _shard_devices(inputs, self.device_ids)[: len(replicas)]
        outputs = parallel_apply(list(replicas), inputs, kwargs, devices, backend=self.backend)
        return Shards(outputs, getattr(inputs, "sizes", None), tuple(devices))

    def gather(self, outputs: Any, output_device: DeviceLike) -> Any:
        """:func:`treegather.gather` with ``out_layout``, ``dim`` and the shard sizes."""
        sizes = getattr(outputs, "sizes", None)
        return gather(list(outputs), output_device, self.out_layout, dim=self.dim, sizes=sizes)


def patch(dp: DP, *, in_layout: Any = None, out_layout: Any = None) -> DP:
    """Make an existing ``nn.DataParallel`` scatter and gather pytrees with treegather.

    >>> import torch, treegather as tg
    >>> dp = tg.patch(torch.nn.DataParallel(torch.nn.Linear(3, 2)), out_layout={"a": tg.mean()})
    >>> a, kw = dp.scatter((torch.ones(4, 3),), {"tag": "x"}, ["cpu"] * 2)
    >>> [t[0].shape[0] for t in a], [k["tag"] for k in kw]
    ([2, 2], ['x', 'x'])
    >>> dp.gather([{"a": torch.tensor(1.0)}, {"a": torch.tensor(3.0)}], "cpu")
    {'a': tensor(2.)}

    ``dp.scatter`` and ``dp.gather`` become treegather's :func:`scatter_kwargs` and
    :func:`gather` with the given layouts and ``dp.dim``, also when ``dp`` has no devices
    (torch's own DataParallel still has both methods on a CPU-only machine, where its forward
    is a plain call). The shard sizes of the latest scatter are kept on ``dp`` so that
    ``mean()`` in ``out_layout`` is weighted exactly by torch's forward, which does not pass
    them along; do not run one patched module's forward concurrently from several threads.
    ``dp.replicate`` becomes :func:`treegather.replicate` (torch's own coalesced copies on
    distinct CUDA devices, as before), so that a compiled model (``torch.compile(m)``) is
    replicated without being changed; parallel_apply stays torch's.

    Args:
        dp: the ``nn.DataParallel`` to patch (modified in place).
        in_layout: layout of ``(args, kwargs)`` for scatter.
        out_layout: layout of the module's output for gather.

    Returns:
        ``dp`` itself.
    """
    if not isinstance(dp, nn.DataParallel):
        raise TypeError(f"patch expects a torch.nn.DataParallel, got {type(dp).__name__}")
    dim = getattr(dp, "dim", 0)

    def scatter(
        self: nn.DataParallel,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[DeviceLike],
    ) -> tuple[Shards, Shards]:
        shards = scatter_kwargs(inputs, kwargs, device_ids, in_layout, dim=dim)
        setattr(self, "_treegather_sizes", shards[0].sizes)  # noqa: B010 - nn.Module typing
        return shards

    def gather_(self: nn.DataParallel, outputs: Any, output_device: DeviceLike) -> Any:
        sizes = getattr(outputs, "sizes", None) or getattr(self, "_treegather_sizes", None)
        if sizes is not None and len(sizes) != len(outputs):
            sizes = None
        return gather(list(outputs), output_device, out_layout, dim=dim, sizes=sizes)

    def replicate_(
        self: nn.DataParallel, module: nn.Module, device_ids: Sequence[DeviceLike]
    ) -> list[nn.Module]:
        return replicate(module, device_ids, detach=not torch.is_grad_enabled())

    dp.scatter = types.MethodType(scatter, dp)  # type: ignore[method-assign]
    dp.gather = types.MethodType(gather_, dp)  # type: ignore[method-assign]
    dp.replicate = types.MethodType(replicate_, dp)  # type: ignore[method-assign]
    return dp


@contextlib.contextmanager
def _module_kwargs_hint(
    fn: Callable[..., Any], inputs: Any, module_kwargs: Mapping[str, Any] | None
) -> Iterator[None]:
    """On a failure, hint ``module_kwargs=batch`` when a dict batch whose keys name parameters of
    ``fn`` (``forward`` for a module: every Hugging Face model) was passed positionally."""
    try:
        yield
    except Exception as exc:
        names = _parameters_named_by(fn, inputs) if not module_kwargs else []
        if names:
            module = isinstance(fn, nn.Module)
            owner = type(fn).__name__ + ".forward" if module else "fn"
            hint = (
                f"Hint: inputs is a dict whose keys name parameters of {owner} "
                f"({', '.join(names)}) but it was passed as one positional argument; to call "
                f"{owner}(**batch), pass it as module_kwargs: "
                f"data_parallel({'model' if module else 'fn'}, (), devices, module_kwargs=batch)"
            )
            if hasattr(exc, "add_note"):
                exc.add_note(hint)
            else:  # pragma: no cover - Python 3.10
                exc.__notes__ = [*getattr(exc, "__notes__", ()), hint]
        raise


def _parameters_named_by(fn: Callable[..., Any], inputs: Any) -> list[str]:
    """The keys of a Mapping ``inputs`` that are parameter names of ``fn`` (or its forward)."""
    if not isinstance(inputs, Mapping):
        return []
    try:
        params = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn).parameters
    except (TypeError, ValueError):
        return []
    named = {
        name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return [k for k in inputs if isinstance(k, str) and k in named]


def _as_args(inputs: Any) -> tuple[Any, ...]:
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs
    return (inputs,)


def _default_devices(devices: Sequence[DeviceLike] | None) -> tuple[torch.device, ...]:
    if devices is not None:
        return as_devices(devices)
    if torch.cuda.is_available():
        return tuple(torch.device("cuda", i) for i in range(torch.cuda.device_count()))
    return (torch.device("cpu"),)


def _as_shards(
    args_shards: Sequence[Any], kwargs_shards: Sequence[Any], device_ids: Sequence[Any]
) -> tuple[Shards, Shards]:
    """Take what ``scatter`` gave: treegather's ``Shards``, or plain per-device sequences from an
    overridden ``scatter`` (torch's API), padded to the same length as torch does."""
    if isinstance(args_shards, Shards) and isinstance(kwargs_shards, Shards):
        return _trim_unsplit(args_shards, kwargs_shards)
    args_list, kwargs_list = list(args_shards), list(kwargs_shards or ())
    n = max(len(args_list), len(kwargs_list))
    args_list += [()] * (n - len(args_list))
    kwargs_list += [{}] * (n - len(kwargs_list))
    devs = tuple(as_device(d) for d in device_ids[:n])
    sizes = getattr(args_shards, "sizes", None)
    return Shards(args_list, sizes, devs), Shards(kwargs_list, sizes, devs)


def _trim_unsplit(args_shards: Shards, kwargs_shards: Shards) -> tuple[Shards, Shards]:
    """Nothing was split: run once, on the first device (as torch does without inputs)."""
    if args_shards.sizes is not None or len(args_shards) <= 1:
        return args_shards, kwargs_shards
    devs = tuple(args_shards.devices[:1])
    return Shards(args_shards[:1], None, devs), Shards(kwargs_shards[:1], None, devs)


def _shard_devices(shards: Any, device_ids: Sequence[Any]) -> list[torch.device]:
    devices = getattr(shards, "devices", None)
    if devices:
        return list(devices)
    return [as_device(d) for d in device_ids[: len(shards)]]


def _torch_id(device: torch.device) -> Any:
    """torch's ``device_ids`` convention: an int for CUDA devices, else the device."""
    return device.index if device.type == "cuda" and device.index is not None else device


def _replicas_for_step(
    module: nn.Module, devices: Sequence[torch.device], source: torch.device
) -> tuple[list[nn.Module], Kept | None]:
    """This step's replicas: the kept shells re-bound when the module is unchanged (issue 14)."""
    detach = not torch.is_grad_enabled()
    if not reusable(module, devices):
        _check_module_device(module, source)
        return replicate(module, devices, detach=detach), None
    replicas, kept, fresh = take(
        module, devices, detach, before_build=lambda: _check_module_device(module, source)
    )
    if not fresh and not kept.on(_concrete(source)):
        _check_module_device(module, source)  # raises, naming the tensor
    return replicas, kept


def _concrete(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_module_device(module: nn.Module, device: torch.device) -> None:
    device = _concrete(device)
    for kind, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, t in named:
            if t.device != device:
                raise RuntimeError(
                    f"module must have its parameters and buffers on device {device} "
                    f"(devices[0]) but {kind} {name!r} is on {t.device}; move the module with "
                    f"module.to({str(device)!r}) or list {t.device} first"
                )


def _compiler_active() -> bool:
    """``torch.compile`` is tracing or running the calling frame (treegather must not be traced)."""
    if torch.compiler.is_compiling():
        return True
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    get_callback = getattr(eval_frame, "get_eval_frame_callback", None)
    return get_callback is not None and get_callback() is not None


_OUTSIDE_COMPILER: LRU[Callable[..., Any], Callable[..., Any]] = LRU(
    "data_parallel.outside_compiler", maxsize=8, trees=False
)


def _outside_compiler(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped in ``torch.compiler.disable``: run eagerly, nothing inside it traced.

    Made on first use only: importing ``torch._dynamo`` costs about a second, and a process
    that reaches this point has imported it already.
    """
    wrapped = _OUTSIDE_COMPILER.get(fn)
    if wrapped is None:
        reason = (
            f"treegather.{fn.__name__} runs eagerly; to compile the model, "
            f"pass torch.compile(model) to {fn.__name__} instead"
        )
        try:
            wrapped = torch.compiler.disable(fn, reason=reason)
        except TypeError:  # torch < 2.8 takes no reason
            wrapped = torch.compiler.disable(fn)
        _OUTSIDE_COMPILER.put(fn, wrapped)
    return wrapped


# torch.compile never traces into data_parallel (a graph break at the call, whose message says
# what to do under fullgraph=True); the call then runs eagerly through _outside_compiler.
data_parallel._torchdynamo_disable = True  # type: ignore[attr-defined]
data_parallel._torchdynamo_disable_msg = (  # type: ignore[attr-defined]
    "treegather.data_parallel runs eagerly; to compile the model, "
    "pass torch.compile(model) to data_parallel instead"
)
