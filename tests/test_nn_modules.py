"""Every public module class of ``torch.nn`` through kept replicas (issue 41, point 1).

The classes are enumerated from torch itself (``torch.nn``, each public module of
``torch.nn.modules``, ``torch.nn.parallel.__all__``), and so are the wrappers people apply to a
module (``torch.nn.utils.parametrizations``, ``torch.nn.utils.prune``, plus ``weight_norm``,
``spectral_norm`` and ``register_parametrization``): a class or wrapper the table below does not
cover fails :func:`test_every_public_module_class_has_a_case` (a new torch cannot slip past). The
table gives each one small constructor arguments and an input maker, or a typed reason why it is
excluded; loss modules are held by a small model as ``self.loss_fn``, as users hold them.

Each case runs in train and in eval mode, from the same freshly seeded model each time: three
SGD steps on 2 devices (``data_parallel``) and three on 3 (``DataParallel``), repeated CPU
devices, the two alternating (each device count's kept replicas are re-bound after a step on the
other), then in eval two forwards on each under ``no_grad`` (detached replicas). It compares:

- kept replicas with fresh ones (``reference_only()``), bit for bit: outputs, the inputs' and
  parameters' gradients, buffers after every step, the final ``state_dict``; and that the kept
  shells were re-bound every step after the first, not rebuilt;
- with ``torch.nn.DataParallel``'s semantics: torch's own ``replicate`` (its broadcast stood in
  for by copies on the CPU: replica 0 holds the module's own buffers), the module run on each
  shard, outputs concatenated (0-dim ones stacked), gradients summed into the parameters;
- with one device where rows do not interact and nothing is drawn at random (``Case.rows``);
- the user's model: its tree, every ``__dict__`` entry and every parameter and buffer object are
  the ones it had (only the optimizer and the buffers' own updates move values).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from module_state import assert_unchanged, snapshot
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

import treegather as tg
from treegather._caches import reference_only

pytestmark = pytest.mark.usefixtures("one_thread")  # (tiny ops: a busy pool only waits)

torch_replicate = importlib.import_module("torch.nn.parallel.replicate")  # (the name is a function)

B = 7  # rows: 4 + 3 on 2 devices, 3 + 2 + 2 on 3
MODES = ("train", "eval")
DEVICE_COUNTS = (2, 3)
STEPS = 3
SCHEDULE = DEVICE_COUNTS * STEPS  # each run's training steps: device counts alternating
NO_GRAD = DEVICE_COUNTS * 2  # eval: then forwards under no_grad
KEPT_OR_FRESH = ("kept", "fresh")  # the runs through treegather
BOTH = frozenset(MODES)
EVAL = frozenset({"eval"})
NEVER: frozenset[str] = frozenset()

Leaf = Callable[[torch.Generator], torch.Tensor]
Inputs = Callable[[torch.Generator], tuple[Any, ...]]


# --------------------------------------------------------------------------- input makers


def x(*shape: int) -> Leaf:
    """B rows of standard normal floats that require grad (their gradients are compared)."""
    return lambda g: torch.randn(B, *shape, generator=g).requires_grad_()


def t(*shape: int, kind: str = "normal") -> Leaf:
    """B rows of floats without grad (a loss's target): normal, unit (in [0, 1)), sign (±1),
    positive, counts (small integers), probs (rows summing to 1)."""

    def make(g: torch.Generator) -> torch.Tensor:
        v = torch.randn(B, *shape, generator=g)
        if kind == "unit":
            return torch.rand(B, *shape, generator=g)
        if kind == "sign":
            return v.sign() + (v == 0).float()
        if kind == "positive":
            return v.abs() + 0.5
        if kind == "counts":
            return torch.randint(0, 4, (B, *shape), generator=g).float()
        if kind == "probs":
            return v.softmax(-1)
        return v

    return make


def i(high: int, *shape: int, low: int = 0) -> Leaf:
    """B rows of int64 in ``[low, high)``."""
    return lambda g: torch.randint(low, high, (B, *shape), generator=g)


def full(value: int, *shape: int) -> Leaf:
    return lambda g: torch.full((B, *shape), value, dtype=torch.long)


def labels_padded(classes: int) -> Leaf:
    """MultiLabelMarginLoss targets: one class per row, then -1 (the end of the row's list)."""

    def make(g: torch.Generator) -> torch.Tensor:
        out = torch.full((B, classes), -1, dtype=torch.long)
        out[:, 0] = torch.randint(0, classes, (B,), generator=g)
        return out

    return make


def args(*leaves: Leaf) -> Inputs:
    return lambda g: tuple(leaf(g) for leaf in leaves)


def unpooling(pool: nn.Module, *shape: int) -> Inputs:
    """A MaxUnpool's inputs: a max pool's values (requiring grad) and its indices."""

    def make(g: torch.Generator) -> tuple[Any, ...]:
        values, indices = pool(torch.randn(B, *shape, generator=g))
        return values.detach().requires_grad_(), indices

    return make


# ------------------------------------------------------------------ models around a module


class HoldsLoss(nn.Module):
    """A model holding its loss module as an attribute (``self.loss_fn = nn.CrossEntropyLoss()``):
    its head's output, shaped by ``prepare``, and the targets go to the loss."""

    def __init__(
        self,
        loss_fn: nn.Module,
        width: int,
        prepare: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    ) -> None:
        super().__init__()
        self.head = nn.Linear(4, width)
        self.loss_fn = loss_fn
        self.prepare = prepare

    def forward(self, inputs: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.loss_fn(*self.prepare(self.head(inputs)), *targets)
        return out


def _whole(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h,)


def _sigmoid(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h.sigmoid(),)


def _log_softmax(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h.log_softmax(-1),)


def _pair(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return h[:, :2], h[:, 2:]


def _columns(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return h[:, 0], h[:, 1]


def _triplet(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return h[:, :2], h[:, 2:4], h[:, 4:]


def _time_major(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h.log_softmax(-1).transpose(0, 1),)  # CTC: (T, N, C)


def _image(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h.permute(0, 3, 1, 2).log_softmax(1),)  # (N, C, H, W)


class Select(nn.Module):
    """A model returning one item of its layer's tuple output (an RNN's output, not its hidden
    state, whose batch is dim 1)."""

    def __init__(self, layer: nn.Module, index: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.index = index

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(*inputs)[self.index]
        return out


class UsesList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h


class UsesDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 3)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers["b"](torch.tanh(self.layers["a"](h)))
        return out


class UsesParameterList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weights[0] + self.weights[1]


class UsesParameterDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterDict(
            {"w": nn.Parameter(torch.randn(4, 3)), "b": nn.Parameter(torch.randn(3))}
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weights["w"] + self.weights["b"]


class UsesContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Container(lin=nn.Linear(4, 3))  # (deprecated: its children are used)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body.lin(h)
        return out


class Plain(nn.Module):
    """A user's own ``nn.Module`` with a ``None`` buffer (``register_buffer(name, None)``) and no
    tensor buffer: the buffer is read as ``None`` by every replica, every step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("mask", None)
        self.register_buffer("scratch", None, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        assert self.mask is None and self.scratch is None
        return h @ self.weight


class Symmetric(nn.Module):
    """A parametrization (torch's tutorial's): the weight is its upper triangle mirrored."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def _pruned(prune_it: Callable[[nn.Module], Any]) -> nn.Module:
    layer = nn.Linear(4, 3)
    prune_it(layer)
    return layer


def _weight_norm_old() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still used
        return nn.utils.weight_norm(nn.Linear(4, 3))


def _globally_pruned() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    prune.global_unstructured(
        [(model[0], "weight"), (model[2], "weight")],
        pruning_method=prune.L1Unstructured,
        amount=0.3,
    )
    return model


def _pruned_then_removed() -> nn.Module:
    layer = _pruned(lambda m: prune.l1_unstructured(m, "weight", amount=0.3))
    return prune.remove(layer, "weight")


def _cpu_data_parallel() -> nn.Module:
    if torch.cuda.is_available():  # torch's DataParallel would move to, and run on, the GPUs
        pytest.skip("torch.nn.DataParallel runs its module itself only without an accelerator")
    return nn.DataParallel(nn.Linear(4, 3))


# -------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    """How to build a module (under a fixed seed) and one batch of ``B`` rows for it.

    ``rows``: the modes in which its rows do not interact and nothing is drawn at random, so
    that one device gives what the replicas give. ``lazy``: one forward on one device first (a
    lazy module infers its shapes; replicating one that has not is refused, with a typed error).
    A ``deprecated`` class warns whenever an object of it is made, replicas included (as with
    torch's ``replicate``): that warning is let through.
    """

    make: Callable[[], nn.Module]
    inputs: Inputs
    rows: frozenset[str] = BOTH
    lazy: bool = False
    deprecated: str = ""  # the FutureWarning a deprecated class gives for every new object


def loss(
    make: Callable[[], nn.Module],
    *targets: Leaf,
    width: int = 3,
    prepare: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _whole,
    inputs: Leaf | None = None,
    deprecated: str = "",
) -> Case:
    """A loss module held by a model (:class:`HoldsLoss`): one loss per replica, so rows interact."""
    return Case(
        lambda: HoldsLoss(make(), width, prepare),
        args(inputs or x(4), *targets),
        rows=NEVER,
        deprecated=deprecated,
    )


def one(make: Callable[[], nn.Module], *leaves: Leaf, **kw: Any) -> dict[str, Case]:
    return {"": Case(make, args(*leaves), **kw)}


# Modules of one float tensor that take no arguments: (B, 4) rows.
ELEMENTWISE = (
    nn.CELU, nn.ELU, nn.GELU, nn.GLU, nn.Hardshrink, nn.Hardsigmoid, nn.Hardswish, nn.Hardtanh,
    nn.LeakyReLU, nn.LogSigmoid, nn.Mish, nn.PReLU, nn.ReLU, nn.ReLU6, nn.SELU, nn.SiLU,
    nn.Sigmoid, nn.Softplus, nn.Softshrink, nn.Softsign, nn.Tanh, nn.Tanhshrink, nn.Identity,
)  # fmt: skip

CASES: dict[type[nn.Module], dict[str, Case]] = {
    # activations
    **{cls: one(cls, x(4)) for cls in ELEMENTWISE},
    nn.RReLU: one(nn.RReLU, x(4), rows=EVAL),  # (train: a random slope per element)
    nn.Threshold: one(lambda: nn.Threshold(0.1, 20.0), x(4)),
    nn.Softmax: one(lambda: nn.Softmax(dim=1), x(4)),
    nn.Softmin: one(lambda: nn.Softmin(dim=1), x(4)),
    nn.LogSoftmax: one(lambda: nn.LogSoftmax(dim=1), x(4)),
    nn.Softmax2d: one(nn.Softmax2d, x(2, 2, 2)),
    nn.MultiheadAttention: one(
        lambda: nn.MultiheadAttention(4, 2, batch_first=True), x(3, 4), x(3, 4), x(3, 4)
    ),
    # linear, shapes, containers
    nn.Linear: one(lambda: nn.Linear(4, 3), x(4)),
    nn.modules.linear.NonDynamicallyQuantizableLinear: one(
        lambda: nn.modules.linear.NonDynamicallyQuantizableLinear(4, 3), x(4)
    ),
    nn.LazyLinear: one(lambda: nn.LazyLinear(3), x(4), lazy=True),
    nn.Bilinear: one(lambda: nn.Bilinear(4, 4, 3), x(4), x(4)),
    nn.Flatten: one(nn.Flatten, x(2, 2)),
    nn.Unflatten: one(lambda: nn.Unflatten(1, (2, 2)), x(4)),
    nn.Sequential: one(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)), x(4)),
    nn.ModuleList: one(UsesList, x(4)),
    nn.ModuleDict: one(UsesDict, x(4)),
    nn.ParameterList: one(UsesParameterList, x(4)),
    nn.ParameterDict: one(UsesParameterDict, x(4)),
    nn.Container: one(UsesContainer, x(4), deprecated="`nn.Container` is deprecated"),
    nn.Module: {
        "none_buffers": Case(Plain, args(x(4))),
        "no_buffers": Case(lambda: nn.Sequential(nn.Linear(4, 3)), args(x(4))),
    },
    nn.DataParallel: one(_cpu_data_parallel, x(4)),
    nn.Embedding: one(lambda: nn.Embedding(10, 3), i(10, 2)),
    nn.EmbeddingBag: one(lambda: nn.EmbeddingBag(10, 3), i(10, 3)),
    nn.CosineSimilarity: one(nn.CosineSimilarity, x(4), x(4)),
    nn.PairwiseDistance: one(nn.PairwiseDistance, x(4), x(4)),
    nn.Fold: one(lambda: nn.Fold(output_size=(3, 3), kernel_size=2), x(4, 4)),
    nn.Unfold: one(lambda: nn.Unfold(kernel_size=2), x(1, 3, 3)),
    nn.PixelShuffle: one(lambda: nn.PixelShuffle(2), x(4, 2, 2)),
    nn.PixelUnshuffle: one(lambda: nn.PixelUnshuffle(2), x(1, 4, 4)),
    nn.ChannelShuffle: one(lambda: nn.ChannelShuffle(2), x(4, 2, 2)),
    nn.Upsample: one(lambda: nn.Upsample(scale_factor=2), x(1, 3)),
    nn.UpsamplingNearest2d: one(lambda: nn.UpsamplingNearest2d(scale_factor=2), x(1, 2, 2)),
    nn.UpsamplingBilinear2d: one(lambda: nn.UpsamplingBilinear2d(scale_factor=2), x(1, 2, 2)),
    # convolutions
    nn.Conv1d: one(lambda: nn.Conv1d(2, 3, 2), x(2, 5)),
    nn.Conv2d: one(lambda: nn.Conv2d(2, 3, 2), x(2, 4, 4)),
    nn.Conv3d: one(lambda: nn.Conv3d(2, 3, 2), x(2, 3, 3, 3)),
    nn.ConvTranspose1d: one(lambda: nn.ConvTranspose1d(2, 3, 2), x(2, 5)),
    nn.ConvTranspose2d: one(lambda: nn.ConvTranspose2d(2, 3, 2), x(2, 3, 3)),
    nn.ConvTranspose3d: one(lambda: nn.ConvTranspose3d(2, 3, 2), x(2, 2, 2, 2)),
    nn.LazyConv1d: one(lambda: nn.LazyConv1d(3, 2), x(2, 5), lazy=True),
    nn.LazyConv2d: one(lambda: nn.LazyConv2d(3, 2), x(2, 4, 4), lazy=True),
    nn.LazyConv3d: one(lambda: nn.LazyConv3d(3, 2), x(2, 3, 3, 3), lazy=True),
    nn.LazyConvTranspose1d: one(lambda: nn.LazyConvTranspose1d(3, 2), x(2, 5), lazy=True),
    nn.LazyConvTranspose2d: one(lambda: nn.LazyConvTranspose2d(3, 2), x(2, 3, 3), lazy=True),
    nn.LazyConvTranspose3d: one(lambda: nn.LazyConvTranspose3d(3, 2), x(2, 2, 2, 2), lazy=True),
    # pooling
    nn.AvgPool1d: one(lambda: nn.AvgPool1d(2), x(2, 4)),
    nn.AvgPool2d: one(lambda: nn.AvgPool2d(2), x(2, 4, 4)),
    nn.AvgPool3d: one(lambda: nn.AvgPool3d(2), x(2, 2, 2, 2)),
    nn.MaxPool1d: one(lambda: nn.MaxPool1d(2), x(2, 4)),
    nn.MaxPool2d: {
        "": Case(lambda: nn.MaxPool2d(2), args(x(2, 4, 4))),
        "return_indices": Case(lambda: nn.MaxPool2d(2, return_indices=True), args(x(2, 4, 4))),
    },
    nn.MaxPool3d: one(lambda: nn.MaxPool3d(2), x(2, 2, 2, 2)),
    nn.AdaptiveAvgPool1d: one(lambda: nn.AdaptiveAvgPool1d(2), x(2, 5)),
    nn.AdaptiveAvgPool2d: one(lambda: nn.AdaptiveAvgPool2d(2), x(2, 4, 4)),
    nn.AdaptiveAvgPool3d: one(lambda: nn.AdaptiveAvgPool3d(2), x(2, 3, 3, 3)),
    nn.AdaptiveMaxPool1d: one(lambda: nn.AdaptiveMaxPool1d(2), x(2, 5)),
    nn.AdaptiveMaxPool2d: one(lambda: nn.AdaptiveMaxPool2d(2), x(2, 4, 4)),
    nn.AdaptiveMaxPool3d: one(lambda: nn.AdaptiveMaxPool3d(2), x(2, 3, 3, 3)),
    nn.LPPool1d: one(lambda: nn.LPPool1d(2, 2), x(2, 4)),
    nn.LPPool2d: one(lambda: nn.LPPool2d(2, 2), x(2, 4, 4)),
    nn.LPPool3d: one(lambda: nn.LPPool3d(2, 2), x(2, 2, 2, 2)),
    # (random pooling regions, drawn per call: in eval too)
    nn.FractionalMaxPool2d: one(
        lambda: nn.FractionalMaxPool2d(2, output_size=2), x(1, 4, 4), rows=NEVER
    ),
    nn.FractionalMaxPool3d: one(
        lambda: nn.FractionalMaxPool3d(2, output_size=2), x(1, 4, 4, 4), rows=NEVER
    ),
    nn.MaxUnpool1d: {
        "": Case(lambda: nn.MaxUnpool1d(2), unpooling(nn.MaxPool1d(2, return_indices=True), 2, 4))
    },
    nn.MaxUnpool2d: {
        "": Case(
            lambda: nn.MaxUnpool2d(2), unpooling(nn.MaxPool2d(2, return_indices=True), 1, 4, 4)
        )
    },
    nn.MaxUnpool3d: {
        "": Case(
            lambda: nn.MaxUnpool3d(2),
            unpooling(nn.MaxPool3d(2, return_indices=True), 1, 2, 2, 2),
        )
    },
    # padding
    nn.CircularPad1d: one(lambda: nn.CircularPad1d(1), x(2, 3)),
    nn.CircularPad2d: one(lambda: nn.CircularPad2d(1), x(2, 3, 3)),
    nn.CircularPad3d: one(lambda: nn.CircularPad3d(1), x(1, 2, 2, 2)),
    nn.ConstantPad1d: one(lambda: nn.ConstantPad1d(1, 0.5), x(2, 3)),
    nn.ConstantPad2d: one(lambda: nn.ConstantPad2d(1, 0.5), x(2, 3, 3)),
    nn.ConstantPad3d: one(lambda: nn.ConstantPad3d(1, 0.5), x(1, 2, 2, 2)),
    nn.ReflectionPad1d: one(lambda: nn.ReflectionPad1d(1), x(2, 3)),
    nn.ReflectionPad2d: one(lambda: nn.ReflectionPad2d(1), x(2, 3, 3)),
    nn.ReflectionPad3d: one(lambda: nn.ReflectionPad3d(1), x(1, 2, 2, 2)),
    nn.ReplicationPad1d: one(lambda: nn.ReplicationPad1d(1), x(2, 3)),
    nn.ReplicationPad2d: one(lambda: nn.ReplicationPad2d(1), x(2, 3, 3)),
    nn.ReplicationPad3d: one(lambda: nn.ReplicationPad3d(1), x(1, 2, 2, 2)),
    nn.ZeroPad1d: one(lambda: nn.ZeroPad1d(1), x(2, 3)),
    nn.ZeroPad2d: one(lambda: nn.ZeroPad2d(1), x(2, 3, 3)),
    nn.ZeroPad3d: one(lambda: nn.ZeroPad3d(1), x(1, 2, 2, 2)),
    # normalization (train: BatchNorm's rows share the batch's statistics)
    nn.BatchNorm1d: {
        "": Case(lambda: nn.BatchNorm1d(4), args(x(4)), rows=EVAL),
        "no_running_stats": Case(
            lambda: nn.BatchNorm1d(4, track_running_stats=False), args(x(4)), rows=NEVER
        ),
    },
    nn.BatchNorm2d: one(lambda: nn.BatchNorm2d(2), x(2, 2, 2), rows=EVAL),
    nn.BatchNorm3d: {
        "": Case(lambda: nn.BatchNorm3d(2), args(x(2, 2, 2, 2)), rows=EVAL),
        "no_running_stats": Case(
            lambda: nn.BatchNorm3d(2, affine=False, track_running_stats=False),
            args(x(2, 2, 2, 2)),
            rows=NEVER,
        ),
    },
    nn.LazyBatchNorm1d: one(nn.LazyBatchNorm1d, x(4), rows=EVAL, lazy=True),
    nn.LazyBatchNorm2d: one(nn.LazyBatchNorm2d, x(2, 2, 2), rows=EVAL, lazy=True),
    nn.LazyBatchNorm3d: one(nn.LazyBatchNorm3d, x(2, 2, 2, 2), rows=EVAL, lazy=True),
    nn.SyncBatchNorm: one(lambda: nn.SyncBatchNorm(4), x(4), rows=EVAL),
    nn.InstanceNorm1d: {
        "": Case(lambda: nn.InstanceNorm1d(2), args(x(2, 4))),
        # (train: the running statistics average the batch's rows)
        "affine_running_stats": Case(
            lambda: nn.InstanceNorm1d(2, affine=True, track_running_stats=True),
            args(x(2, 4)),
            rows=EVAL,
        ),
    },
    nn.InstanceNorm2d: one(lambda: nn.InstanceNorm2d(2), x(2, 3, 3)),
    nn.InstanceNorm3d: one(lambda: nn.InstanceNorm3d(2), x(2, 2, 2, 2)),
    # (lazy ones: affine, with running statistics, by default)
    nn.LazyInstanceNorm1d: one(nn.LazyInstanceNorm1d, x(2, 4), rows=EVAL, lazy=True),
    nn.LazyInstanceNorm2d: one(nn.LazyInstanceNorm2d, x(2, 3, 3), rows=EVAL, lazy=True),
    nn.LazyInstanceNorm3d: one(nn.LazyInstanceNorm3d, x(2, 2, 2, 2), rows=EVAL, lazy=True),
    nn.GroupNorm: one(lambda: nn.GroupNorm(2, 4), x(4)),
    nn.LayerNorm: one(lambda: nn.LayerNorm(4), x(4)),
    nn.RMSNorm: one(lambda: nn.RMSNorm(4), x(4)),
    nn.LocalResponseNorm: one(lambda: nn.LocalResponseNorm(2), x(3, 2, 2)),
    nn.CrossMapLRN2d: one(lambda: nn.CrossMapLRN2d(3), x(3, 2, 2)),
    # dropout (train: drawn at random)
    nn.Dropout: one(nn.Dropout, x(4), rows=EVAL),
    nn.Dropout1d: one(nn.Dropout1d, x(2, 3), rows=EVAL),
    nn.Dropout2d: one(nn.Dropout2d, x(2, 2, 2), rows=EVAL),
    nn.Dropout3d: one(nn.Dropout3d, x(2, 2, 2, 2), rows=EVAL),
    nn.AlphaDropout: one(nn.AlphaDropout, x(4), rows=EVAL),
    nn.FeatureAlphaDropout: one(nn.FeatureAlphaDropout, x(2, 3), rows=EVAL),
    # recurrent (the hidden state's batch is dim 1: a model returns the output)
    nn.RNN: one(lambda: Select(nn.RNN(4, 3, batch_first=True)), x(3, 4)),
    nn.LSTM: one(lambda: Select(nn.LSTM(4, 3, num_layers=2, batch_first=True)), x(3, 4)),
    nn.GRU: one(lambda: Select(nn.GRU(4, 3, batch_first=True, bidirectional=True)), x(3, 4)),
    nn.RNNCell: one(lambda: nn.RNNCell(4, 3), x(4)),
    nn.LSTMCell: one(lambda: nn.LSTMCell(4, 3), x(4)),
    nn.GRUCell: one(lambda: nn.GRUCell(4, 3), x(4)),
    # transformers (no dropout: one device then gives the same)
    nn.Transformer: one(
        lambda: nn.Transformer(4, 2, 1, 1, 8, dropout=0.0, batch_first=True), x(3, 4), x(2, 4)
    ),
    nn.TransformerEncoderLayer: one(
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), x(3, 4)
    ),
    nn.TransformerDecoderLayer: one(
        lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        x(3, 4),
        x(2, 4),
    ),
    nn.TransformerEncoder: one(
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 1
        ),
        x(3, 4),
    ),
    nn.TransformerDecoder: one(
        lambda: nn.TransformerDecoder(
            nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 1
        ),
        x(3, 4),
        x(2, 4),
    ),
    # losses, held by a model as self.loss_fn (one loss per replica: rows interact)
    nn.AdaptiveLogSoftmaxWithLoss: one(
        lambda: nn.AdaptiveLogSoftmaxWithLoss(4, 6, [2]), x(4), i(6), rows=NEVER
    ),
    nn.BCELoss: {"": loss(nn.BCELoss, t(3, kind="unit"), prepare=_sigmoid)},
    nn.BCEWithLogitsLoss: {
        "": loss(nn.BCEWithLogitsLoss, t(3, kind="unit")),
        "pos_weight": loss(
            lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 0.5])),
            t(3, kind="unit"),
        ),
    },
    nn.CTCLoss: {
        "": loss(
            nn.CTCLoss,
            i(4, 2, low=1),
            full(5),
            full(2),
            width=4,
            prepare=_time_major,
            inputs=x(5, 4),
        )
    },
    nn.CosineEmbeddingLoss: {
        "": loss(nn.CosineEmbeddingLoss, t(kind="sign"), width=4, prepare=_pair)
    },
    nn.CrossEntropyLoss: {
        "": loss(nn.CrossEntropyLoss, i(3)),
        "weight": loss(lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5])), i(3)),
        "label_smoothing": loss(lambda: nn.CrossEntropyLoss(label_smoothing=0.1), i(3)),
    },
    nn.GaussianNLLLoss: {"": loss(nn.GaussianNLLLoss, t(3), t(3, kind="positive"))},
    nn.HingeEmbeddingLoss: {"": loss(nn.HingeEmbeddingLoss, t(3, kind="sign"))},
    nn.HuberLoss: {"": loss(nn.HuberLoss, t(3))},
    nn.KLDivLoss: {
        "": loss(
            lambda: nn.KLDivLoss(reduction="batchmean"), t(3, kind="probs"), prepare=_log_softmax
        )
    },
    nn.L1Loss: {"": loss(nn.L1Loss, t(3))},
    nn.MSELoss: {"": loss(nn.MSELoss, t(3))},
    nn.MarginRankingLoss: {
        "": loss(nn.MarginRankingLoss, t(kind="sign"), width=2, prepare=_columns)
    },
    nn.MultiLabelMarginLoss: {"": loss(nn.MultiLabelMarginLoss, labels_padded(3))},
    nn.MultiLabelSoftMarginLoss: {"": loss(nn.MultiLabelSoftMarginLoss, t(3, kind="counts"))},
    nn.MultiMarginLoss: {"": loss(nn.MultiMarginLoss, i(3))},
    nn.NLLLoss: {"": loss(nn.NLLLoss, i(3), prepare=_log_softmax)},
    nn.NLLLoss2d: {
        "": loss(
            nn.NLLLoss2d,
            i(3, 2, 2),
            prepare=_image,
            inputs=x(2, 2, 4),
            deprecated="`NLLLoss2d` has been deprecated",
        )
    },
    nn.PoissonNLLLoss: {"": loss(nn.PoissonNLLLoss, t(3, kind="counts"))},
    nn.SmoothL1Loss: {"": loss(nn.SmoothL1Loss, t(3))},
    nn.SoftMarginLoss: {"": loss(nn.SoftMarginLoss, t(3, kind="sign"))},
    nn.TripletMarginLoss: {"": loss(nn.TripletMarginLoss, width=6, prepare=_triplet)},
    nn.TripletMarginWithDistanceLoss: {
        "": loss(nn.TripletMarginWithDistanceLoss, width=6, prepare=_triplet)
    },
    nn.LinearCrossEntropyLoss: {"": loss(lambda: nn.LinearCrossEntropyLoss(4, 3), i(3), width=4)},
}


class Why(enum.Enum):
    """Why a public class has no case of its own."""

    ABSTRACT = "an abstract base: its forward is not implemented (its subclasses are covered)"
    PROCESS_GROUP = (
        "one module per process by design: it needs a process group, and its reducer takes "
        "each parameter's gradient once per step, so no replication within a process (torch "
        "removed single-process multi-device DDP); treegather.distributed is the counterpart"
    )


# class -> (why, the covered classes that stand for it)
EXCLUDED: dict[type[nn.Module], tuple[Why, tuple[type[nn.Module], ...]]] = {
    nn.RNNBase: (Why.ABSTRACT, (nn.RNN, nn.LSTM, nn.GRU)),
    nn.RNNCellBase: (Why.ABSTRACT, (nn.RNNCell, nn.LSTMCell, nn.GRUCell)),
    nn.parallel.DistributedDataParallel: (Why.PROCESS_GROUP, ()),
}

# The wrappers people apply to a module: name -> case.
WRAPPERS: dict[str, Case] = {
    "weight_norm": Case(_weight_norm_old, args(x(4))),
    "spectral_norm": Case(lambda: nn.utils.spectral_norm(nn.Linear(4, 3)), args(x(4))),
    "parametrize.register_parametrization": Case(
        lambda: parametrize.register_parametrization(nn.Linear(4, 4), "weight", Symmetric()),
        args(x(4)),
    ),
    "parametrizations.weight_norm": Case(
        lambda: parametrizations.weight_norm(nn.Linear(4, 3)), args(x(4))
    ),
    "parametrizations.spectral_norm": Case(
        lambda: parametrizations.spectral_norm(nn.Linear(4, 3)), args(x(4))
    ),
    "parametrizations.orthogonal": Case(
        lambda: parametrizations.orthogonal(nn.Linear(4, 4)), args(x(4))
    ),
    "prune.identity": Case(lambda: _pruned(lambda m: prune.identity(m, "weight")), args(x(4))),
    "prune.random_unstructured": Case(
        lambda: _pruned(lambda m: prune.random_unstructured(m, "weight", amount=0.3)), args(x(4))
    ),
    "prune.l1_unstructured": Case(
        lambda: _pruned(lambda m: prune.l1_unstructured(m, "weight", amount=0.3)), args(x(4))
    ),
    "prune.random_structured": Case(
        lambda: _pruned(lambda m: prune.random_structured(m, "weight", amount=1, dim=0)),
        args(x(4)),
    ),
    "prune.ln_structured": Case(
        lambda: _pruned(lambda m: prune.ln_structured(m, "weight", amount=1, n=2, dim=0)),
        args(x(4)),
    ),
    "prune.global_unstructured": Case(_globally_pruned, args(x(4))),
    "prune.custom_from_mask": Case(
        lambda: _pruned(
            lambda m: prune.custom_from_mask(m, "weight", torch.tensor([[1.0, 0, 1, 1]] * 3))
        ),
        args(x(4)),
    ),
    "prune.remove": Case(_pruned_then_removed, args(x(4))),
}
NOT_WRAPPERS = {"prune.is_pruned": "a question about a module, not a change to it"}


def public_module_classes() -> set[type[nn.Module]]:
    """Every public ``nn.Module`` subclass of ``torch.nn``: its namespace, each public module of
    ``torch.nn.modules`` and ``torch.nn.parallel.__all__``."""

    def modules_in(namespace: dict[str, Any], names: Any = None) -> set[type[nn.Module]]:
        return {
            value
            for name, value in namespace.items()
            if (name in names if names is not None else not name.startswith("_"))
            and inspect.isclass(value)
            and issubclass(value, nn.Module)
            and value.__module__.startswith("torch.nn")
        }

    found = modules_in(vars(nn))
    for info in pkgutil.iter_modules(nn.modules.__path__):
        if not info.name.startswith("_"):
            found |= modules_in(vars(importlib.import_module(f"torch.nn.modules.{info.name}")))
    return found | modules_in(vars(nn.parallel), nn.parallel.__all__)


def public_wrappers() -> set[str]:
    """The wrappers people apply to a module, enumerated where torch has a list of them."""
    pruning = {
        f"prune.{name}"
        for name, value in vars(prune).items()
        if inspect.isfunction(value)
        and not name.startswith("_")
        and value.__module__ == prune.__name__
    }
    return {
        "weight_norm",
        "spectral_norm",
        "parametrize.register_parametrization",
        *(f"parametrizations.{name}" for name in parametrizations.__all__),
        *pruning,
    }


ALL_CASES: dict[str, Case] = {
    **{
        cls.__name__ + (f"[{label}]" if label else ""): case
        for cls, cases in CASES.items()
        for label, case in cases.items()
    },
    **{f"wrapper:{name}": case for name, case in WRAPPERS.items()},
}


def test_every_public_module_class_has_a_case() -> None:
    """A class torch adds (or a wrapper function) fails here until the table covers it."""
    classes = public_module_classes()
    names = lambda found: sorted(f"{c.__module__}.{c.__qualname__}" for c in found)  # noqa: E731
    missing = names(c for c in classes if c not in CASES and c not in EXCLUDED)
    assert not missing, f"torch.nn has module classes the table does not cover: {missing}"
    assert not names(set(CASES) - classes), "the table names classes torch does not list"
    assert not set(CASES) & set(EXCLUDED)
    for why, standing_in in EXCLUDED.values():
        assert isinstance(why, Why) and all(c in CASES for c in standing_in)
    wrappers = public_wrappers()
    assert not sorted(wrappers - set(WRAPPERS) - set(NOT_WRAPPERS)), "wrappers without a case"
    assert set(WRAPPERS) | set(NOT_WRAPPERS) == wrappers


# ------------------------------------------------------------------------------ one run


def _model(case: Case) -> nn.Module:
    torch.default_generator.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated classes: Container, NLLLoss2d
        model = case.make()
    if case.lazy:  # one forward on one device: the shapes inferred
        with torch.no_grad():
            model.eval()(*case.inputs(torch.Generator().manual_seed(99)))
    return model


def _broadcast_on_cpu(
    tensors: list[torch.Tensor], devices: list[int], detach: bool = False
) -> list[list[torch.Tensor]]:
    """torch's ``_broadcast_coalesced_reshape`` on repeated CPU devices: replica 0 aliases the
    module's own tensors (its buffers are the module's, as on the first GPU), the others get
    copies; differentiable unless ``detach``."""
    if not tensors:
        return []
    first = [t.detach() if detach else t.view_as(t) for t in tensors]
    copies = [[t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices[1:]]
    return [first, *copies]


def _join(*values: Any) -> Any:
    """torch's gather: tensors concatenated along dim 0, 0-dim ones stacked."""
    if values[0].dim() == 0:
        return torch.stack(values)
    return torch.cat(values)


def torch_data_parallel(model: nn.Module, inputs: tuple[Any, ...], k: int) -> Any:
    """``torch.nn.DataParallel``'s step on ``k`` repeated CPU devices: torch's ``replicate``,
    the module run on each shard (``tensor_split``: the shard sizes treegather uses), gathered."""
    with mock.patch.object(torch_replicate, "_broadcast_coalesced_reshape", _broadcast_on_cpu):
        replicas = torch_replicate.replicate(model, [0] * k, not torch.is_grad_enabled())
    shards = zip(*(torch.tensor_split(a, k) for a in inputs))
    outputs = [replica(*shard) for replica, shard in zip(replicas, shards, strict=True)]
    return pytree.tree_map(_join, outputs[0], *outputs[1:])


def _call(model: nn.Module, dp: nn.Module | None, inputs: tuple[Any, ...], how: str, k: int) -> Any:
    if how == "one":
        return model(*inputs)
    if how == "torch":
        return torch_data_parallel(model, inputs, k)
    with reference_only() if how == "fresh" else contextlib.nullcontext():
        if dp is not None:
            return dp(*inputs)
        return tg.data_parallel(model, inputs, ["cpu"] * k, backend="serial")


def _floats(tree: Any) -> list[torch.Tensor]:
    return [
        v for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]


def run(case: Case, mode: str, how: str) -> list[Any]:
    """A fresh model in ``mode``: :data:`STEPS` SGD steps on each device count, alternating
    (:data:`SCHEDULE`), then in eval two forwards on each under ``no_grad``; ``how``: ``kept``,
    ``fresh`` (``reference_only()``), ``torch`` (:func:`torch_data_parallel`) or ``one`` (one
    device, every step). What every step gave."""
    with warnings.catch_warnings():
        if case.deprecated:
            warnings.filterwarnings("ignore", case.deprecated, FutureWarning)
        return _run(case, mode, how)


def _run(case: Case, mode: str, how: str) -> list[Any]:
    model = _model(case).train(mode == "train")
    before = snapshot(model) if how == "kept" else None
    # 2 devices through data_parallel, 3 through DataParallel (both take kept replicas)
    wrapped = (
        tg.DataParallel(model, ["cpu"] * 3, backend="serial") if how in KEPT_OR_FRESH else None
    )
    dp = {2: None, 3: wrapped}
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05) if params else None
    schedule = SCHEDULE + (NO_GRAD if mode == "eval" else ())
    trace: list[Any] = []
    for step, k in enumerate(schedule):
        grad = step < len(SCHEDULE)
        inputs = case.inputs(torch.Generator().manual_seed(step))
        torch.default_generator.manual_seed(100 + step)  # (dropout's draws; the CPU's only)
        with torch.set_grad_enabled(grad):
            out = _call(model, dp[k], inputs, how, k)
        trace.append(
            pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
        )
        if grad:
            loss = sum((v.pow(2).mean() for v in _floats(out)), torch.zeros(()))
            if loss.requires_grad:
                loss.backward()
            trace.append([a.grad for a in inputs if a.requires_grad])
            trace.append({n: p.grad for n, p in model.named_parameters()})
            if opt is not None:
                opt.step()
                opt.zero_grad()  # (the grads, set to None: the trace keeps the step's)
        trace.append({n: b.clone() for n, b in model.named_buffers()})
    trace.append({n: v.clone() for n, v in model.state_dict().items()})
    if before is not None:
        assert_unchanged(model, before, values=False)
    return trace


def assert_same(a: Any, b: Any, where: str, **tolerance: Any) -> None:
    """Equal structure, equal tensors (bit for bit unless ``tolerance``), equal other values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            return  # (the usual case, at a fraction of assert_close's cost)
        torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m: f"{where}: {m}", **tolerance)
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]", **tolerance)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for n, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{where}[{n}]", **tolerance)
    else:
        assert a == b, where


EXACT = {"rtol": 0.0, "atol": 0.0}
CLOSE = {"rtol": 1e-5, "atol": 1e-5}  # (the replicas' gradients summed in another order)
# One device: another batch size takes other kernels (a convolution's sums in another order),
# and three SGD steps carry the difference on.
ONE_DEVICE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_kept_replicas_equal_fresh_ones_torch_and_one_device(name: str, builds: list[bool]) -> None:
    case = ALL_CASES[name]
    for mode in MODES:
        del builds[:]
        kept = run(case, mode, "kept")
        # built once per device count, then re-bound (eval: the same for the no_grad forwards)
        once = [True] * len(DEVICE_COUNTS)
        expected = once + [False] * (len(SCHEDULE) - len(once))
        if mode == "eval":
            expected += once + [False] * (len(NO_GRAD) - len(once))
        assert builds == expected
        where = f"{name} in {mode}"
        assert_same(kept, run(case, mode, "fresh"), f"{where}, kept vs fresh", **EXACT)
        assert_same(kept, run(case, mode, "torch"), f"{where}, vs torch", **CLOSE)
        if mode in case.rows:
            assert_same(kept, run(case, mode, "one"), f"{where}, vs one device", **ONE_DEVICE)


# ---------------------------------------------------------------------------- lazy modules

# Lazy modules with nothing to infer but their first forward (no uninitialized tensor).
NOTHING_TO_INFER = {
    f"{cls.__name__}[no_tensors]": Case(
        lambda cls=cls: cls(affine=False, track_running_stats=False), args(x(*shape))
    )
    for cls, shape in (
        (nn.LazyInstanceNorm1d, (2, 4)),
        (nn.LazyInstanceNorm2d, (2, 3, 3)),
        (nn.LazyInstanceNorm3d, (2, 2, 2, 2)),
    )
}
LAZY_CASES = {
    **{
        cls.__name__: cases[""]
        for cls, cases in CASES.items()
        if issubclass(cls, nn.modules.lazy.LazyModuleMixin)
    },
    **NOTHING_TO_INFER,
}


# (torch's: with nothing to infer, num_features stays 0, and every forward says so)
@pytest.mark.filterwarnings("ignore:input's size at dim=1 does not match num_features")
@pytest.mark.parametrize("name", sorted(LAZY_CASES))
def test_a_lazy_module_is_refused_until_its_first_forward(name: str) -> None:
    """Every lazy class, before its first forward: refused with a typed error naming it, the
    caller's module untouched (a replica's initialization would remove the source's own hook);
    after one forward on one device, replicated like any module."""
    case = LAZY_CASES[name]
    assert all(c.lazy for c in LAZY_CASES.values() if c not in NOTHING_TO_INFER.values())
    torch.default_generator.manual_seed(0)
    model = case.make()
    state = lambda: (type(model), [*model._forward_pre_hooks.items()], {**vars(model)})  # noqa: E731
    before = state()
    batch = case.inputs(torch.Generator().manual_seed(0))
    with pytest.raises(tg.UninitializedModuleError, match=f"model \\({type(model).__name__}: "):
        tg.data_parallel(model, batch, ["cpu"] * 2)
    assert state() == before  # (the snapshot reads values: an uninitialized one cannot be)
    with torch.no_grad():
        model.eval()(*batch)  # one device: the shapes inferred
    assert not isinstance(model, nn.modules.lazy.LazyModuleMixin)
    with torch.no_grad():
        torch.testing.assert_close(tg.data_parallel(model, batch, ["cpu"] * 2), model(*batch))


# --------------------------------------------------------------------------- even shards

# Rows per device count whose shards are even (4 + 4, 2 + 2 + 2): the gather then checks,
# before combining, that no output has its rows in another dim than dim 0 (issue 47).
EVEN_ROWS = {2: 8, 3: 6}


@pytest.mark.parametrize("k", sorted(EVEN_ROWS))
@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_outputs_on_even_shards_are_gathered_as_torch_gathers_them(
    name: str, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every module's output, gathered with even shard sizes (under which a leaf whose rows
    are visibly in another dim is refused): none is, and each is what torch's DataParallel
    gathers (eval, one forward without grad)."""
    monkeypatch.setitem(globals(), "B", EVEN_ROWS[k])  # (the input makers read B when called)
    case = ALL_CASES[name]
    with warnings.catch_warnings():
        if case.deprecated:
            warnings.filterwarnings("ignore", case.deprecated, FutureWarning)
        model = _model(case).eval()
        inputs = case.inputs(torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = tg.data_parallel(model, inputs, ["cpu"] * k, backend="serial")
            theirs = torch_data_parallel(model, inputs, k)
    assert_same(ours, theirs, f"{name} on {k} devices", **CLOSE)
