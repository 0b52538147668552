"""What "the caller's module is unchanged" means, as one snapshot to compare before and after.

Used by the mutation checks (issue 12): identity and values of parameters and buffers,
``named_modules()``, ``state_dict()`` keys and values, hooks and every module's ``__dict__``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _contents(value: Any) -> Any:
    """Identity of a ``__dict__`` value, and of what a table (hooks, submodules) holds."""
    if isinstance(value, dict):
        return id(value), tuple((k, id(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return id(value), tuple(id(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return id(value), tuple(sorted(map(repr, value)))
    return id(value)


def snapshot(module: nn.Module) -> dict[str, Any]:
    """Everything a replication or a data-parallel call must leave as it was."""
    mods = list(module.named_modules(remove_duplicate=False))
    return {
        "modules": [(name, id(m), type(m)) for name, m in mods],
        "dicts": [(name, {k: _contents(v) for k, v in vars(m).items()}) for name, m in mods],
        "tables": [
            (name, table, [(k, id(v)) for k, v in getattr(m, table).items()])
            for name, m in mods
            for table in ("_parameters", "_buffers", "_modules")
        ],
        "parameters": [
            (name, id(p), p.detach().clone(), p.requires_grad, p.grad)
            for name, p in module.named_parameters()
        ],
        "buffers": [(name, id(b), b.detach().clone()) for name, b in module.named_buffers()],
        "state_dict": [(k, v.detach().clone()) for k, v in module.state_dict().items()],
    }


def _bn_stat_names(module: nn.Module) -> set[str]:
    """Buffers a training BatchNorm updates through replica 0 (the documented exception)."""
    return {
        f"{name}.{stat}".lstrip(".")
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and m.training
        for stat in BN_STATS
    }


def assert_unchanged(
    module: nn.Module, before: dict[str, Any], *, allow_bn_update: bool = False, values: bool = True
) -> None:
    """Compare ``module`` with ``before``; BatchNorm statistics may move if ``allow_bn_update``.

    ``values=False``: after training steps, where the optimizer moved the parameters and the
    step the buffers (their values are compared with a reference elsewhere): everything else,
    the tree, every ``__dict__`` entry and the identity of every parameter and buffer."""
    after = snapshot(module)
    for key in ("modules", "dicts", "tables"):
        assert after[key] == before[key], f"{key} changed"
    if not values:
        same = [(n, i, rg) for n, i, _, rg, _ in after["parameters"]]
        assert same == [(n, i, rg) for n, i, _, rg, _ in before["parameters"]], (
            "parameters replaced"
        )
        same = [(n, i) for n, i, _ in after["buffers"]]
        assert same == [(n, i) for n, i, _ in before["buffers"]], "buffers replaced"
        assert [k for k, _ in after["state_dict"]] == [k for k, _ in before["state_dict"]]
        return
    skip = _bn_stat_names(module) if allow_bn_update else set()
    for (n1, i1, v1, rg1, g1), (n2, i2, v2, rg2, g2) in zip(
        before["parameters"], after["parameters"], strict=True
    ):
        assert (n1, i1, rg1) == (n2, i2, rg2), f"parameter {n1} replaced"
        assert g1 is g2, f"parameter {n1}'s grad changed"
        assert torch.equal(v1, v2), f"parameter {n1}'s value changed"
    for (n1, i1, v1), (n2, i2, v2) in zip(before["buffers"], after["buffers"], strict=True):
        assert (n1, i1) == (n2, i2), f"buffer {n1} replaced"
        assert n1 in skip or torch.equal(v1, v2), f"buffer {n1}'s value changed"
    names = [k for k, _ in before["state_dict"]]
    assert [k for k, _ in after["state_dict"]] == names, "state_dict keys changed"
    for (k, v1), (_, v2) in zip(before["state_dict"], after["state_dict"]):
        short = k.replace("_orig_mod.", "")
        assert short in skip or k in skip or torch.equal(v1, v2), f"state_dict[{k!r}] changed"
