"""Replicas kept across steps (issue 14): reused while valid, rebuilt on any change, never stale.

The reference is the non-reused path: the same calls with every cache cleared before each one
(``treegather.clear_caches()`` empties the kept replicas too).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import operator
import random
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from module_state import assert_unchanged, snapshot
from torch import nn

import treegather as tg
from treegather._caches import reference_only
from treegather._parallel.kept import kept_count


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(6, 3)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.lin(x))))) * self.scale


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _dp(model: nn.Module, x: torch.Tensor, k: int = 2, **kw: Any) -> torch.Tensor:
    return tg.data_parallel(model, x, ["cpu"] * k, backend="serial", **kw)  # type: ignore[no-any-return]


def test_replicas_are_kept_and_reused(builds: list[bool]) -> None:
    model = _net().eval()
    x = torch.randn(8, 4)
    seen: list[int] = []
    model.lin.register_forward_hook(lambda m, a, o: seen.append(id(m)))
    for _ in range(3):
        torch.testing.assert_close(_dp(model, x, 4), model(x))
    assert builds == [True, False, False]
    assert seen[:4] == seen[5:9] == seen[10:14]  # the same four replica shells, every step
    assert kept_count(model) == 1
    tg.clear_caches()
    _dp(model, x, 4)
    assert builds[-1] is True


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_five_training_steps_equal_the_non_reused_path(k: int) -> None:
    """BatchNorm (train mode), dropout with a fixed seed, SGD with momentum: bit for bit."""
    x = torch.randn(4 * k + 1, 4, generator=torch.Generator().manual_seed(1))
    target = torch.randn(4 * k + 1, 3, generator=torch.Generator().manual_seed(2))
    results = []
    for reuse in (True, False):
        model = _net().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trace = []
        for step in range(5):
            if not reuse:
                tg.clear_caches()
            torch.manual_seed(100 + step)
            out = _dp(model, x, k)
            loss = (out - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            opt.step()
            trace.append((out.detach(), loss.detach(), grads))
        results.append((trace, {k: v.clone() for k, v in model.state_dict().items()}))
    (kept, kept_state), (fresh, fresh_state) = results
    for (o1, l1, g1), (o2, l2, g2) in zip(kept, fresh):
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.equal(kept_state[name], fresh_state[name]) for name in kept_state)


def _load_state_dict(m: Net) -> None:
    other = Net()
    other.bn.running_mean.fill_(0.5)  # replicas other than 0 must see the new statistics
    m.load_state_dict(other.state_dict())


def _replace_layer(m: Net) -> None:
    m.head = nn.Linear(6, 3)


def _add_hook(m: Net) -> None:
    m.head.register_forward_hook(lambda mod, args, out: out * 10)


def _attribute(m: Net) -> None:
    m.scale = 3.0


def _new_attribute(m: Net) -> None:
    m.head.note = "new"


def _half(m: Net) -> None:
    m.half()


def _freeze(m: Net) -> None:
    m.lin.weight.requires_grad_(False)


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _swap_class(m: Net) -> None:
    m.head.__class__ = Doubled  # what some conversion utilities do


CHANGES: dict[str, tuple[Callable[[Net], None], bool]] = {
    # change, and whether the kept replicas stay valid (re-bound: every step refills them with
    # the module's attributes and hooks; a change to its tree rebuilds them)
    "load_state_dict_in_place": (_load_state_dict, True),
    "replace_a_layer": (_replace_layer, False),
    "add_a_hook": (_add_hook, True),
    "plain_attribute": (_attribute, True),
    "new_attribute": (_new_attribute, False),
    "half": (_half, False),  # buffers are replaced (parameters change dtype in place)
    "freeze_a_parameter": (_freeze, True),
    "swap_a_class": (_swap_class, False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_guards(change: str, builds: list[bool]) -> None:
    model = _net().eval()
    x = torch.randn(6, 4)
    _dp(model, x, 3).sum().backward()
    apply, stays_valid = CHANGES[change]
    apply(model)
    model.zero_grad()
    tol: dict[str, Any] = {}
    if change == "half":
        x = x.half()
        tol = {"atol": 1e-2, "rtol": 1e-2}  # float16: shards may round differently
    out = _dp(model, x, 3)
    torch.testing.assert_close(out, model(x), **tol)
    out.sum().backward()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name, **tol)
    assert builds[0] is True
    assert builds[1] is (not stays_valid)


def test_eval_mode_and_torch_compile_rebuild(builds: list[bool]) -> None:
    model = _net().train()
    x = torch.randn(6, 4)
    _dp(model, x)
    model.eval()
    torch.testing.assert_close(_dp(model, x), model(x))  # no dropout, running statistics
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(_dp(compiled, x), model(x))
    assert builds == [True, True, True]
    torch._dynamo.reset()


class Counting(nn.Module):
    """Stores an attribute on itself in forward: a replica's state must not reach the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return self.lin(x) * self.calls


def test_no_replica_state_leaks_into_the_next_step() -> None:
    model = Counting()
    x = torch.randn(4, 2)
    expected = model.lin(x)
    for _ in range(3):
        torch.testing.assert_close(_dp(model, x), expected)
    assert not hasattr(model, "calls")


class ForwardState(Net):
    """A forward that registers hooks on a child (one removed again, one left in place) and
    stores an attribute on itself: none of it may reach the module or the next step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        handle = self.head.register_forward_hook(lambda m, args, out: out * 2)
        out = super().forward(x) * self.calls
        handle.remove()
        self.head.register_forward_pre_hook(lambda m, args: (args[0] + 1,))  # never removed
        return out


class ForwardPlacesHooks(Net):
    """A forward that changes hook tables without ``register_*_hook``: it places a hook into a
    child's table (never taken out) and assigns a child a whole new table, after using it.
    Neither may reach the module or the next step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.head._forward_hooks[10**9] = lambda m, args, out: out * 2
        self.lin._forward_pre_hooks = OrderedDict({10**9 + 1: lambda m, args: (args[0] + 1,)})
        return out


def _tiny_bert_for_steps() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=20
    )
    torch.manual_seed(0)
    return transformers.BertModel(config)  # type: ignore[no-any-return]


def _source_hook(m: nn.Module) -> Any:
    target = m.encoder.layer[0] if hasattr(m, "encoder") else m.head
    return target.register_forward_hook(
        lambda mod, args, out: (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5
    )


# (mode, K, backend) steps; "hook+" / "hook-" register / remove a hook on the source between
# steps. Threads only in eval mode (dropout's random draws would interleave across threads).
SCHEDULE: list[tuple[str, int, str]] = [
    ("train", 2, "serial"),
    ("train", 3, "serial"),
    ("eval", 2, "threads"),
    ("eval", 3, "threads"),
    ("hook+", 0, ""),
    ("train", 2, "serial"),
    ("eval", 3, "threads"),
    ("hook-", 0, ""),
    ("train", 3, "serial"),
    ("train", 2, "serial"),
]


def _run_schedule(make: Callable[[], nn.Module], *, fresh: bool) -> list[Any]:
    model = make()
    bert = hasattr(model, "config")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batch = (
        {"input_ids": torch.randint(0, 100, (7, 5), generator=gen), "output_hidden_states": True}
        if bert
        else {"x": torch.randn(7, 4, generator=gen)}
    )
    trace: list[Any] = []
    handle = None
    for step, (mode, k, backend) in enumerate(SCHEDULE):
        if mode == "hook+":
            handle = _source_hook(model)
            continue
        if mode == "hook-":
            assert handle is not None
            handle.remove()
            continue
        model.train(mode == "train")
        if fresh:
            tg.clear_caches()
        torch.manual_seed(100 + step)
        out = tg.data_parallel(model, (), ["cpu"] * k, module_kwargs=batch, backend=backend)  # type: ignore[arg-type]
        tensors = [*out.hidden_states, out.last_hidden_state] if bert else [out]
        loss = sum(t.pow(2).mean() for t in tensors)
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        trace.append([t.detach() for t in tensors])
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        if backend == "threads":  # autograd sums the replicas' gradients in thread order
            trace.append(("close", grads))
        else:
            trace.append(grads)
            opt.step()  # (not after threads: later steps stay comparable bit for bit)
    trace.append({k: v.clone() for k, v in model.state_dict().items()})
    trace.append(sorted(vars(model)))
    trace.append([len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()])
    return trace


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


@pytest.mark.parametrize(
    "make",
    [_net, ForwardState, ForwardPlacesHooks, _tiny_bert_for_steps],
    ids=["net", "forward_state", "forward_places_hooks", "hf_bert"],
)
def test_kept_replicas_equal_fresh_ones_cold_warm_alternating_threads(
    make: Callable[[], nn.Module],
) -> None:
    """The differential test of kept replicas (issue 19): a cold model (its first call through
    treegather), K alternating between 2 and 3, train/eval switches, threads, a hook registered
    on and removed from the source between steps; forwards that register hooks and store
    attributes on themselves. Bit for bit equal to fresh replicas every step."""
    kept = _run_schedule(make, fresh=False)
    fresh = _run_schedule(make, fresh=True)
    assert len(kept) == len(fresh)
    for i, (a, b) in enumerate(zip(kept, fresh)):
        if isinstance(a, tuple):
            torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7, msg=str(i))
        else:
            assert _equal(a, b), i
    tg.clear_caches()


def _compiled_in_place() -> nn.Module:
    model = Counting()
    model.compile(backend="eager")
    return model


def _bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
    )
    return transformers.BertModel(config)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "make",
    [
        _net,
        _bert,
        lambda: torch.compile(_net(), backend="eager"),
        _compiled_in_place,  # its compiled forward is bound to the module
    ],
    ids=["plain", "hf_bert", "torch_compile", "compile_in_place"],
)
def test_a_deleted_model_frees_its_replicas(make: Callable[[], nn.Module]) -> None:
    model = make()
    if isinstance(model, Counting):
        _dp(model, torch.randn(6, 2))
    elif hasattr(model, "config"):
        tg.data_parallel(
            model, (), ["cpu"] * 2, module_kwargs={"input_ids": torch.ones(4, 3).long()}
        )
    else:
        _dp(model, torch.randn(6, 4))
    assert kept_count(model) == 1
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["threads", "fork"])
def test_backends_with_kept_replicas(backend: str) -> None:
    model = _net().eval()
    x = torch.randn(9, 4)
    for _ in range(3):
        out = tg.data_parallel(model, x, ["cpu"] * 3, backend=backend)  # type: ignore[arg-type]
        torch.testing.assert_close(out, model(x))


def test_concurrent_steps_on_one_model() -> None:
    model = _net().eval()
    xs = [torch.randn(8, 4) for _ in range(4)]
    errors: list[BaseException] = []

    def work(x: torch.Tensor) -> None:
        try:
            for _ in range(10):
                torch.testing.assert_close(_dp(model, x, 4), model(x))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_data_parallel_module_keeps_replicas_and_never_mutates(builds: list[bool]) -> None:
    model = _net().eval()
    before = snapshot(model)
    dp = tg.DataParallel(model, ["cpu"] * 3)
    x = torch.randn(7, 4)
    for _ in range(3):
        torch.testing.assert_close(dp(x), model(x))
    assert builds == [True, False, False]
    assert_unchanged(model, before)


def test_a_pytree_registration_between_steps_keeps_the_replicas(builds: list[bool]) -> None:
    # Registering any class with torch's pytree (transformers does, lazily, for every
    # ModelOutput) empties the caches of tree structures, not the kept replicas.
    import torch.utils._pytree as torch_pytree

    class Registered:
        def __init__(self, x: Any) -> None:
            self.x = x

    model = _net().eval()
    x = torch.randn(8, 4)
    _dp(model, x)
    torch_pytree.register_pytree_node(
        Registered, lambda r: ([r.x], None), lambda c, _: Registered(c[0])
    )
    _dp(model, x)
    assert builds == [True, False]


# ------------------------------------------------------------- coalesced broadcast (CUDA)


def _train(model: nn.Module, devices: list[Any], *, fresh: bool = False) -> list[Any]:
    """Five SGD steps and a detached eval step; ``fresh`` drops the kept replicas each step."""
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(1)).to(devices[0])
    target = torch.randn(9, 3, generator=torch.Generator().manual_seed(2)).to(devices[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trace = []
    for step in range(5):
        if fresh:
            tg.clear_caches()
        torch.manual_seed(100 + step)
        out = tg.data_parallel(model, x, devices, backend="serial")
        loss = (out - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        trace.append((out.detach().cpu(), [p.grad.cpu().clone() for p in model.parameters()]))  # type: ignore[union-attr]
        opt.step()
    if fresh:
        tg.clear_caches()
    with torch.no_grad():  # a detached step (eval under no_grad): buffers and parameters copied
        trace.append((tg.data_parallel(model.eval(), x, devices, backend="serial").cpu(), []))
    return trace


def test_kept_replicas_take_one_coalesced_broadcast_per_step(
    monkeypatch: pytest.MonkeyPatch, builds: list[bool]
) -> None:
    """On distinct CUDA devices kept replicas are re-bound each step to torch's coalesced,
    differentiable broadcast of the parameters (and one of the buffers), never rebuilt.

    Without CUDA the broadcast is stood in for by copies on repeated CPU devices (counted), so
    what is tested here is the binding: every step's copies reach the kept shells, gradients
    reach the source through them, and the results equal fresh replicas' bit for bit.
    """
    import treegather._parallel.shells as rep

    calls: list[tuple[int, bool]] = []

    def broadcast(tensors: list[torch.Tensor], devs: Any, detach: bool) -> list[list[torch.Tensor]]:
        calls.append((len(tensors), detach))
        src = [t.detach() if detach else t for t in tensors]
        return [src, *([t.clone() for t in src] for _ in devs[1:])]

    monkeypatch.setattr(rep, "_coalesced", lambda devs, tensors: len(devs) > 1)
    monkeypatch.setattr(rep, "_broadcast", broadcast)
    fresh = _train(_net().train(), ["cpu"] * 3, fresh=True)  # the same copies, rebuilt each step
    del builds[:], calls[:]
    model = _net().train()
    kept = _train(model, ["cpu"] * 3)
    n_params = len(list(model.parameters()))
    # Built once for training and once for the detached eval step; every step after a build
    # re-broadcasts the parameters (differentiably) and the buffers (detached), in one call each.
    assert builds == [True, False, False, False, False, True]
    assert calls[:2] == [(n_params, False), (3, True)]  # the build: parameters, buffers
    assert calls[2:10] == [(n_params, False), (3, True)] * 4  # steps 2-5 re-bind them
    assert calls[10:] == [(n_params, True), (3, True)]  # the detached step's build
    for (o1, g1), (o2, g2) in zip(kept, fresh, strict=True):
        assert torch.equal(o1, o2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kept_replicas_on_two_gpus_equal_fresh_ones() -> None:
    devices = ["cuda:0", "cuda:1"]
    kept = _train(_net().cuda(), devices)
    fresh = _train(_net().cuda(), devices, fresh=True)  # torch's replicate every step
    for (o1, g1), (o2, g2) in zip(kept, fresh, strict=True):
        torch.testing.assert_close(o1, o2)
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b)


# ------------------------------------------------- random edit sequences, kept against fresh


class Config:
    """A plain object a module holds (a config): not an atom, so written in every step."""

    def __init__(self, mult: float) -> None:
        self.mult = mult


class Editable(nn.Module):
    """A model whose forward reads what the edits change: plain attributes (numbers, a config
    object, optional ones) on itself and on a child; hooks on any module change the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)
        self.scale = 1.0
        self.cfg = Config(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.lin(x))) * getattr(self.lin, "gain", 1.0)
        out = self.head(h) * getattr(self, "scale", 1.0) * getattr(self, "factor", 1.0)
        cfg = getattr(self, "cfg", None) or getattr(self, "config", None)
        if cfg is not None:
            out = out * cfg.mult
        shift = getattr(self.head, "shift", None)
        out = out if shift is None else out + shift
        for m in (self, self.lin, self.head, self.bn):  # a buffer the edits register: None or not
            extra = getattr(m, "extra", None)
            if extra is not None:
                out = out + extra
        return out


TARGETS = ("", "lin", "head", "bn")  # the model and some of its submodules
TABLES = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)
# Every kind of change a step may meet, with its weight in the random sequences.
EDIT_KINDS = {
    "step": 6,
    "set_number": 1,  # model.scale = 1.5 (an atom replaced by another)
    "set_config": 1,  # model.cfg = Config(3.0) (an object replaced by another)
    "add": 1,  # model.factor = 3.0, lin.gain = 0.5, head.shift = 0.25 (a new attribute)
    "delete": 1,  # del model.factor (an attribute removed)
    "replace": 2,  # del model.scale; model.factor = 3.0 (one attribute for another)
    "rename_config": 1,  # del model.cfg; model.config = the same object
    "register": 2,  # register_forward_(pre_)hook(with_kwargs=...), on any module
    "remove": 1,  # a registered hook's handle removed
    "place": 2,  # m._forward_hooks[key] = hook: no register_*_hook, no handle
    "assign": 2,  # m._forward_hooks = OrderedDict(...): a whole table (as dynamo does)
    "clear": 1,  # m._forward_hooks.clear()
    "train_eval": 1,
    "in_place": 1,  # a parameter changed in place
    # register_buffer("extra", None / a tensor / None, persistent=False), or del m.extra: a
    # buffer table that holds None entries, tensors, or is empty again
    "buffer": 2,
    # model.bn = BatchNorm1d(6, track_running_stats=...): without statistics its buffers are
    # None, and with no "extra" tensor the model has None buffers and no tensor buffer
    "stats": 1,
}


def _edit_sequence(rng: random.Random, length: int) -> list[tuple[Any, ...]]:
    """One random sequence of steps and edits, as data (each run applies it to its own model)."""
    kinds, weights = list(EDIT_KINDS), list(EDIT_KINDS.values())
    out: list[tuple[Any, ...]] = [("step", rng.choice((2, 3)))]
    for _ in range(length):
        kind = rng.choices(kinds, weights)[0]
        target, table = rng.choice(TARGETS), rng.choice(TABLES)
        value = rng.choice((0.5, 1.5, 2.0, 3.0))
        if kind == "step":
            out.append(("step", rng.choice((2, 3))))
        else:
            out.append((kind, target, table, value, rng.randrange(4)))
    out.append(("step", rng.choice((2, 3))))
    return out


def _hook(table: str, value: float) -> Callable[..., Any]:
    if table == "_forward_hooks":
        return lambda m, args, out: out * value + 0.125
    if table == "_forward_hooks_with_kwargs":
        return lambda m, args, kwargs, out: out - value
    if table == "_forward_pre_hooks":
        return lambda m, args: (args[0] * value,)
    return lambda m, args, kwargs: ((args[0] + value,), kwargs)


def _apply_edit(
    model: Editable, edit: tuple[Any, ...], handles: list[Any], state: dict[str, Any]
) -> None:
    kind, target, table, value, pick = edit
    m: nn.Module = model.get_submodule(target)
    optional = [("", "factor"), ("lin", "gain"), ("head", "shift")][pick % 3]
    holder = model.get_submodule(optional[0])
    if kind == "set_number":
        if hasattr(model, "scale"):
            model.scale = value
    elif kind == "set_config":
        if hasattr(model, "cfg"):
            model.cfg = Config(value)
    elif kind == "add":
        setattr(holder, optional[1], value)
    elif kind == "delete":
        if optional[1] in vars(holder):
            delattr(holder, optional[1])
    elif kind == "replace":  # one attribute for another: the count of attributes unchanged
        if "scale" in vars(model):
            del model.scale
            model.factor = value
        elif "factor" in vars(model):
            del model.factor
            model.scale = value
    elif kind == "rename_config":
        for old, new in (("cfg", "config"), ("config", "cfg")):
            if old in vars(model):
                setattr(model, new, vars(model).pop(old))
                break
    elif kind == "register":
        kwargs = table.endswith("with_kwargs")
        if table.startswith("_forward_hooks"):
            hook = _hook(table, value)
            handles.append(m.register_forward_hook(hook, with_kwargs=kwargs))
        else:
            handles.append(m.register_forward_pre_hook(_hook(table, value), with_kwargs=kwargs))
    elif kind == "remove":
        if handles:
            handles.pop(pick % len(handles)).remove()
    elif kind == "place":  # as a library copying hooks from another module does
        state["key"] += 1
        key = state["key"]
        getattr(m, table)[key] = _hook(table, value)
        if table.endswith("with_kwargs"):  # the flag table says which hooks take kwargs
            flags = (
                "_forward_hooks_with_kwargs"
                if table.startswith("_forward_hooks")
                else ("_forward_pre_hooks_with_kwargs")
            )
            base = "_forward_hooks" if table.startswith("_forward_hooks") else "_forward_pre_hooks"
            del getattr(m, table)[key]
            getattr(m, base)[key] = _hook(table, value)
            getattr(m, flags)[key] = True
    elif kind == "assign":
        base = "_forward_hooks" if table.startswith("_forward_hooks") else "_forward_pre_hooks"
        plain = "_forward_hooks" if base == "_forward_hooks" else "_forward_pre_hooks"
        state["key"] += 1
        fresh = OrderedDict() if pick == 0 else OrderedDict({state["key"]: _hook(plain, value)})
        setattr(m, base, fresh)  # nn.Module.__setattr__: into the module's __dict__
    elif kind == "clear":  # a hook table, and the flags of the hooks it held
        base = "_forward_hooks" if table.startswith("_forward_hooks") else "_forward_pre_hooks"
        getattr(m, base).clear()
        if table.endswith("with_kwargs"):
            getattr(m, table).clear()
    elif kind == "train_eval":
        model.train(not model.training)
    elif kind == "in_place":
        with torch.no_grad():
            model.lin.weight.mul_(value / 2)
    elif kind == "buffer":
        if pick == 3:
            if "extra" in m._buffers:
                del m.extra
        else:
            tensor = torch.tensor(value) if pick == 1 else None
            m.register_buffer("extra", tensor, persistent=pick != 2)
    elif kind == "stats":
        model.bn = nn.BatchNorm1d(6, track_running_stats=pick % 2 == 0).train(model.training)


def _run_edits(sequence: list[tuple[Any, ...]], *, fresh: bool) -> list[Any]:
    torch.manual_seed(0)
    model = Editable()
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(1))
    handles: list[Any] = []
    state = {"key": 10**9}  # placed hooks' keys: never a handle's id
    trace: list[Any] = []
    context = reference_only if fresh else contextlib.nullcontext
    for edit in sequence:
        if edit[0] != "step":
            _apply_edit(model, edit, handles, state)
            continue
        with context():
            out = tg.data_parallel(model, x, ["cpu"] * edit[1], backend="serial")
        out.pow(2).sum().backward()
        trace.append(out.detach())
        trace.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    trace.append({k: v.clone() for k, v in model.state_dict().items()})
    trace.append([sorted(vars(m)) for m in model.modules()])
    trace.append([[len(getattr(m, t)) for t in TABLES] for m in model.modules()])
    trace.append(
        [[dict(m._buffers), sorted(m._non_persistent_buffers_set)] for m in model.modules()]
    )
    return trace


SEQUENCES = 200


def test_kept_replicas_equal_fresh_ones_over_random_edit_sequences(one_thread: None) -> None:
    """The differential test of kept replicas against fresh ones (``reference_only()``) over
    seeded random sequences of steps (2 or 3 replicas, train and eval) and edits of every kind
    the module's definition sees: attributes set, added, removed and replaced by others (the
    count unchanged), a config renamed, hooks registered, removed, placed into a table without
    ``register_*_hook``, whole tables assigned or cleared, parameters changed in place, buffers
    registered as None or tensors (persistent or not) and deleted, a BatchNorm without running
    statistics (None buffers: with no other buffer, a model with no tensor buffer, issue 41).
    Bit for bit equal every step: outputs, gradients, then the state, attributes, hook and
    buffer tables."""
    rng = random.Random(30)
    kinds: collections.Counter[str] = collections.Counter()
    for n in range(SEQUENCES):
        sequence = _edit_sequence(rng, rng.randrange(3, 9))
        kinds.update(edit[0] for edit in sequence)
        kept = _run_edits(sequence, fresh=False)
        fresh = _run_edits(sequence, fresh=True)
        assert len(kept) == len(fresh)
        for i, (a, b) in enumerate(zip(kept, fresh)):
            assert _equal(a, b), (n, i, sequence)
    assert set(kinds) == set(EDIT_KINDS)  # every kind of edit was tried
    tg.clear_caches()


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "requires_grad"])
@pytest.mark.parametrize("detach", [False, True], ids=["differentiable", "detached"])
def test_kept_buffer_copies_are_made_as_fresh_replicas_make_them(grad: bool, detach: bool) -> None:
    """Each replica's buffers, step after step, are what fresh replicas get: the first replica
    on the buffer's device shares its storage, the others hold copies of their own (a buffer
    that requires grad, in a differentiable step, copied differentiably), a buffer moved
    between steps (``.data`` replaced in place) is copied as it is now."""

    def layout(replicas: list[nn.Module], model: Net) -> list[list[Any]]:
        out = []
        for r in replicas:
            row = []
            for (name, b), src in zip(r.named_buffers(), model.buffers(), strict=True):
                shared = b.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                row.append((name, shared, b.requires_grad, b.grad_fn is not None, b.dtype))
                assert torch.equal(b, src)
            out.append(row)
        return out

    model = _net()
    if grad:
        model.bn.running_mean.requires_grad_(True)
    devices = ["cpu"] * 3
    held: list[nn.Module] = []  # (replicate(reuse=True) re-binds the replicas still held)
    for step in range(3):
        if step == 2:  # replaced in place (the same tensor object)
            model.bn.running_var.data = model.bn.running_var.data.double()
        fresh = layout(tg.replicate(model, devices, detach=detach), model)  # (built anew)
        replicas = tg.replicate(model, devices, detach=detach, reuse=True)
        assert not held or all(map(operator.is_, replicas, held))  # re-bound, not rebuilt
        held = replicas
        assert layout(replicas, model) == fresh
