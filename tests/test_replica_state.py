"""Each replica's state is its own (issue 19), and kept replicas never keep a model alive (issue 20).

- hook tables: what a replica's forward registers or removes (every hook kind) is seen by that
  replica only, never by the source, a sibling or the next step's kept replica; hooks the user
  registers on the source between steps run from the next step on;
- anything else a forward assigns on itself (attributes, submodules, parameters, buffers);
- replicas have parameters (``replica.parameters()``, ``next(self.parameters())``);
- a bound method of a module (``model.generate``) is run on each replica;
- lazy modules are refused before anything runs;
- a deleted model frees its kept replicas, even when it holds methods bound to itself.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from module_state import assert_unchanged, snapshot
from torch import nn

import treegather as tg
from treegather._parallel.kept import _KEPT, kept_count

CPU3 = ["cpu"] * 3


def _stripped(model: nn.Module) -> list[bool]:
    """Per kept device list of ``model``: whether its shells were stripped after the last step."""
    entries = _KEPT.get(model) or {}
    return [kept.stripped for kept in entries.values()]


# ------------------------------------------------------------------ hooks registered in forward


def _noop_hook(*args: Any, **kwargs: Any) -> None:
    return None


# How a forward registers each kind of hook on a module, and the table it lands in.
REGISTER: dict[str, tuple[Callable[[nn.Module], Any], str]] = {
    "forward": (lambda m: m.register_forward_hook(_noop_hook), "_forward_hooks"),
    "forward_with_kwargs": (
        lambda m: m.register_forward_hook(_noop_hook, with_kwargs=True),
        "_forward_hooks_with_kwargs",
    ),
    "forward_always_call": (
        lambda m: m.register_forward_hook(_noop_hook, always_call=True),
        "_forward_hooks_always_called",
    ),
    "forward_pre": (lambda m: m.register_forward_pre_hook(_noop_hook), "_forward_pre_hooks"),
    "forward_pre_with_kwargs": (
        lambda m: m.register_forward_pre_hook(_noop_hook, with_kwargs=True),
        "_forward_pre_hooks_with_kwargs",
    ),
    "full_backward": (lambda m: m.register_full_backward_hook(_noop_hook), "_backward_hooks"),
    "full_backward_pre": (
        lambda m: m.register_full_backward_pre_hook(_noop_hook),
        "_backward_pre_hooks",
    ),
    "state_dict_post": (
        lambda m: m.register_state_dict_post_hook(_noop_hook),
        "_state_dict_hooks",
    ),
    "state_dict_pre": (
        lambda m: m.register_state_dict_pre_hook(_noop_hook),
        "_state_dict_pre_hooks",
    ),
    "load_state_dict_pre": (
        lambda m: m.register_load_state_dict_pre_hook(_noop_hook),
        "_load_state_dict_pre_hooks",
    ),
    "load_state_dict_post": (
        lambda m: m.register_load_state_dict_post_hook(_noop_hook),
        "_load_state_dict_post_hooks",
    ),
    "non_persistent_buffer": (
        lambda m: m.register_buffer(f"tmp{time.perf_counter_ns()}", None, persistent=False),
        "_non_persistent_buffers_set",
    ),
}


SEEN: list[Any] = []  # what the forwards below record (outside the modules: snapshots compare)


class Registering(nn.Module):
    """Registers a hook on its child in every forward (never removed) and records how many
    entries the child's table then holds: 1 in every replica, every step, if tables are own."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.child = nn.Linear(3, 2)
        self.kind = kind
        SEEN.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        register, table = REGISTER[self.kind]
        register(self.child)
        SEEN.append(len(getattr(self.child, table)))
        return self.child(x)


@pytest.mark.parametrize("kind", list(REGISTER))
def test_a_hook_registered_in_forward_stays_in_its_replica(kind: str) -> None:
    model = Registering(kind)
    before = snapshot(model)
    x = torch.randn(6, 3, requires_grad=True)  # full backward hooks want an input with grad
    expected = model.child(x)
    for _ in range(3):
        out = tg.data_parallel(model, x, CPU3)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
    # One entry per replica per step: never a sibling's, never the previous step's.
    assert SEEN == [1] * 9
    model.zero_grad(set_to_none=True)
    before["parameters"] = [(n, i, v, rg, None) for n, i, v, rg, _ in before["parameters"]]
    assert_unchanged(model, before)
    # Between steps the kept shells hold nothing of the model, unless the autograd graph of
    # ``out`` still holds them (a full backward hook's wrapper references its module).
    assert _stripped(model) == [not kind.startswith("full_backward")]


def test_the_same_through_data_parallel_module() -> None:
    model = Registering("forward")
    before = snapshot(model)
    dp = tg.DataParallel(model, CPU3)
    x = torch.randn(6, 3)
    for _ in range(3):
        torch.testing.assert_close(dp(x), model.child(x))
    assert SEEN == [1] * 9
    assert_unchanged(model, before)


class RegisterRemove(nn.Module):
    """torch PR 128272's case: a forward that registers a hook on a child and removes it again;
    the sleep lets threads interleave between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(3, 3)
        self.calls: dict[int, int] = {}
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        replica = int(x[0, 0].item())

        def hook(m: nn.Module, args: Any, out: torch.Tensor) -> None:
            with self.lock:
                self.calls[replica] = self.calls.get(replica, 0) + 1

        handle = self.child.register_forward_hook(hook)
        time.sleep(0.02)
        out = self.child(x)
        handle.remove()
        return out


def test_register_and_remove_in_forward_under_threads() -> None:
    model = RegisterRemove()
    x = torch.arange(4.0).repeat_interleave(2).unsqueeze(1).expand(8, 3).contiguous()
    for step in range(3):
        model.calls.clear()
        out = tg.data_parallel(model, x, ["cpu"] * 4, backend="threads")
        torch.testing.assert_close(out, model.child(x))
        assert model.calls == {0: 1, 1: 1, 2: 1, 3: 1}, step
    assert len(model.child._forward_hooks) == 0


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_hooks_registered_on_the_source_between_steps_run_from_the_next_step() -> None:
    model = Counted()
    x = torch.randn(6, 3)
    calls: list[int] = []
    tg.data_parallel(model, x, CPU3)
    handle = model.lin.register_forward_hook(lambda m, a, out: calls.append(id(m)) or out * 2)
    out = tg.data_parallel(model, x, CPU3)
    torch.testing.assert_close(out, model.lin(x))  # the hook doubled every shard
    assert len(calls) == 3 + 1 and len(set(calls[:3])) == 3 and id(model.lin) not in calls[:3]
    handle.remove()
    calls.clear()
    torch.testing.assert_close(tg.data_parallel(model, x, CPU3), model.lin(x))
    assert calls == []
    pre = model.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    torch.testing.assert_close(tg.data_parallel(model, x, CPU3), model.lin(x * 0))
    pre.remove()
    assert kept_count(model) == 1


# ----------------------------------------------------------- anything a forward assigns on itself


class Assigning(nn.Module):
    """Assigns an attribute, a submodule, a parameter and buffers on itself in every forward,
    and records whether any of them was there already."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.note = "the source's"
        SEEN.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = ("tag", "extra", "p", "b", "nb")
        SEEN.append([n for n in names if hasattr(self, n)] + [self.note])
        del self.note  # an attribute of the source's, deleted on the replica only
        self.tag = "replica"
        self.extra = nn.Identity()
        self.p = nn.Parameter(torch.zeros(2))
        self.register_buffer("b", torch.ones(2))
        self.register_buffer("nb", torch.ones(2), persistent=False)
        self.lin.weight_note = "set on a child"
        return self.extra(self.lin(x)) + self.p + self.b - self.nb


@pytest.mark.parametrize("backend", ["serial", "threads"])
def test_what_a_forward_assigns_stays_in_its_replica(backend: str) -> None:
    model = Assigning()
    before = snapshot(model)
    x = torch.randn(6, 3)
    for _ in range(3):
        out = tg.data_parallel(model, x, CPU3, backend=backend)  # type: ignore[arg-type]
        torch.testing.assert_close(out, model.lin(x))
    assert SEEN == [["the source's"]] * 9
    assert_unchanged(model, before)
    assert not hasattr(model.lin, "weight_note")
    assert "nb" not in model._non_persistent_buffers_set


# ------------------------------------------------------------------------ replicas have parameters


class UsesItsParameters(nn.Module):
    """Reads ``next(self.parameters())`` (what transformers' ``.device`` / ``.dtype`` do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.full((2,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = next(self.parameters())
        names = [n for n, _ in self.named_parameters()]
        assert names == ["lin.weight", "lin.bias"] and len(list(self.buffers())) == 1
        return self.lin(x.to(first.device, first.dtype)) * self.scale


def test_replicas_have_their_own_parameters() -> None:
    model = UsesItsParameters()
    x = torch.randn(6, 3)
    ref = copy.deepcopy(model)
    (ref(x) ** 2).sum().backward()
    for run in (
        lambda: tg.data_parallel(model, x, CPU3),
        lambda: tg.DataParallel(model, CPU3)(x),
        lambda: tg.data_parallel(model, x, CPU3, backend="threads"),
    ):
        model.zero_grad()
        out = run()
        torch.testing.assert_close(out, ref(x))
        (out**2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    for r in tg.replicate(model, ["cpu"] * 2, detach=True):
        params = list(r.parameters())
        assert len(params) == 2 and not any(p.requires_grad for p in params)
        assert params[0] is r.lin.weight and params[0] is not model.lin.weight
        assert dict(r.named_buffers()).keys() == {"scale"}


# ------------------------------------------------------------------- a bound method as fn


class Generator(nn.Module):
    """``generate`` returns rows of a length that depends on the shard (its first value)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.callers: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor, *, steps: int = 2) -> torch.Tensor:
        self.callers.append(id(self))
        n = steps + int(x[0, 0].item())
        return self.lin(x).expand(x.shape[0], n) + torch.arange(n)


def test_a_bound_method_runs_on_each_replica() -> None:
    model = Generator()
    x = torch.tensor([[0.0], [0.0], [1.0], [2.0]])
    direct = [model.generate(x[i : i + 1]) for i in range(4)]
    model.callers.clear()
    out = tg.data_parallel(
        model.generate, (x,), ["cpu"] * 4, module_kwargs={"steps": 2}, out_layout=tg.pad(0, fill=-1)
    )
    assert out.shape == (4, 4)
    for i, row in enumerate(direct):
        torch.testing.assert_close(out[i, : row.shape[1]], row[0])
        assert (out[i, row.shape[1] :] == -1).all()
    assert len(set(model.callers)) == 4 and id(model) not in model.callers
    out.sum().backward()  # gradients reach the source through the replicas
    assert model.lin.weight.grad is not None
    model.callers.clear()
    tg.data_parallel(model.generate, x[:1], ["cpu"] * 4)  # one shard: the method itself
    assert model.callers == [id(model)]


def test_generate_with_uneven_lengths_equals_one_device() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=32, pad_token_id=0
    )
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).eval()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # cold: first called through treegather
    ids = torch.randint(1, 50, (3, 4), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    first = ref.generate(ids[:1], attention_mask=batch["attention_mask"][:1], **kwargs)
    kwargs["eos_token_id"] = int(first[0, 5])  # row 0 stops after two new tokens, others later
    expected = ref.generate(**batch, **kwargs)
    before = snapshot(model)
    out = tg.data_parallel(
        model.generate, (), CPU3, module_kwargs={**batch, **kwargs}, out_layout=tg.pad(0, fill=0)
    )
    assert_unchanged(model, before)
    lengths = {len(ref.generate(ids[i : i + 1], **kwargs)[0]) for i in range(3)}
    assert len(lengths) > 1  # the shards really stopped at different lengths
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)


# ----------------------------------------------------------------------------- lazy modules


def _lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2))


LAZY_MESSAGE = (
    "cannot replicate a module with uninitialized (lazy) parameters onto 2 devices: "
    "model.0 (LazyLinear: weight, bias). Run one forward on one device first"
)


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel", "replicate"])
def test_a_lazy_module_is_refused_before_anything_runs(entry: str) -> None:
    from torch.nn.parameter import is_lazy

    model = _lazy()
    x = torch.randn(4, 5)
    runs: dict[str, Callable[[], Any]] = {
        "data_parallel": lambda: tg.data_parallel(model, x, ["cpu"] * 2),
        "DataParallel": lambda: tg.DataParallel(model, ["cpu"] * 2)(x),
        "replicate": lambda: tg.replicate(model, ["cpu"] * 2),
    }
    with pytest.raises(tg.UninitializedModuleError) as info:
        runs[entry]()
    assert str(info.value).startswith(LAZY_MESSAGE)
    assert isinstance(info.value, RuntimeError)
    assert is_lazy(model[0].weight) and type(model[0]) is nn.LazyLinear  # left lazy
    assert kept_count(model) == 0


def test_a_lazy_module_on_one_device_initializes_then_replicates() -> None:
    model = _lazy()
    x = torch.randn(4, 5)
    out = tg.data_parallel(model, x, ["cpu"] * 2, in_layout=tg.broadcast())  # one shard
    assert out.shape == (4, 2) and type(model[0]) is nn.Linear
    torch.testing.assert_close(tg.data_parallel(model, x, ["cpu"] * 2), model(x))
    model = _lazy()
    tg.DataParallel(model, ["cpu"])(x)  # a single device calls the module itself
    assert type(model[0]) is nn.Linear


# ------------------------------------------------------------ a deleted model frees its replicas


class SelfBound(nn.Module):
    """Holds a hook and attributes bound to itself, and a child holding one of its methods."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.register_buffer("big", torch.zeros(64, 1024))  # 256 KiB: a leak shows in memory
        self.lin.register_forward_pre_hook(self.on_input)
        self.fn = self.helper
        self.head.callback = self.helper
        if compiled:
            self.compile(backend="eager")
        else:  # dynamo (torch 2.13) warns tracing a forward hook: reads its output's .grad
            self.register_forward_hook(self.on_output)

    def on_output(self, m: nn.Module, args: Any, out: torch.Tensor) -> None:
        return None

    def on_input(self, m: nn.Module, args: Any) -> None:
        return None

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fn(torch.relu(self.lin(x))))


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel", "replicate", "threads"])
def test_deleted_models_holding_methods_bound_to_themselves_are_freed(entry: str) -> None:
    x = torch.randn(6, 8)
    refs = []
    for i in range(10):
        model = SelfBound(compiled=(i % 5 == 4))
        for _ in range(2):
            if entry == "DataParallel":
                out = tg.DataParallel(model, CPU3)(x)
            elif entry == "replicate":
                out = sum(r(x) for r in tg.replicate(model, CPU3, reuse=True))
            else:
                backend = "threads" if entry == "threads" else "serial"
                out = tg.data_parallel(model, x, CPU3, backend=backend)  # type: ignore[arg-type]
            out.sum().backward()
        assert kept_count(model) == 1
        refs.append(weakref.ref(model))
        del model, out
    gc.collect()
    assert [r() is None for r in refs] == [True] * 10
    torch._dynamo.reset()


# -------------------------------------------- shells used after the step (autograd holds them)


class Checkpointed(nn.Module):
    """Gradient checkpointing: the replica's block runs again during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._block, x, use_reentrant=False) * self.scale

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class BackwardHooked(Counted):
    """A full backward hook that reads the module during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.lin.register_full_backward_hook(
            lambda m, gin, gout: self.seen.append(m.weight.shape[0])
        )


@pytest.mark.parametrize("make", [Checkpointed, BackwardHooked], ids=["checkpoint", "hook"])
def test_replicas_still_work_during_backward_after_the_step(
    make: Callable[[], nn.Module],
) -> None:
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    width = 3 if isinstance(model, BackwardHooked) else 4
    xs = [torch.randn(6, width, requires_grad=True) for _ in range(2)]
    for x in xs:  # one step at a time, then two forwards before one backward
        model.zero_grad()
        ref.zero_grad()
        tg.data_parallel(model, x, CPU3).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    model.zero_grad()
    ref.zero_grad()
    total = sum(tg.data_parallel(model, x, CPU3).pow(2).sum() for x in xs)
    total.backward()  # type: ignore[union-attr]
    sum(ref(x).pow(2).sum() for x in xs).backward()  # type: ignore[union-attr]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    if isinstance(model, BackwardHooked):
        # 3 replicas per data_parallel call, 1 per direct call (the copy shares the hook):
        # 2 x (3 + 1) one step at a time, then 2 x 3 + 2.
        assert model.seen == [2] * 16
    ref_model = weakref.ref(model)
    del model, total, ref  # (the copy shares the hook, which holds the model)
    gc.collect()
    assert ref_model() is None


# ------------------------------------------------ a cold transformers model with hidden states


def _cold_bert(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=100,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return transformers.BertModel(config)  # type: ignore[no-any-return]


@pytest.mark.parametrize("entry", ["data_parallel", "DataParallel"])
def test_a_cold_bert_with_hidden_states_equals_one_device(entry: str) -> None:
    model, ref = _cold_bert(), _cold_bert()
    before = snapshot(model)
    ids = torch.randint(0, 100, (7, 5), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "output_hidden_states": True}
    dp = tg.DataParallel(model, CPU3)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if entry == "DataParallel":
            out = dp(**batch)
        else:
            out = tg.data_parallel(model, (), CPU3, module_kwargs=batch)
        expected = ref(**batch)
        assert len(out.hidden_states) == len(expected.hidden_states) == 3, step
        for a, b in zip(out.hidden_states, expected.hidden_states):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state)
        sum(h.pow(2).mean() for h in out.hidden_states).backward()
        sum(h.pow(2).mean() for h in expected.hidden_states).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
    model.zero_grad(set_to_none=True)
    before["parameters"] = [(n, i, v, rg, None) for n, i, v, rg, _ in before["parameters"]]
    assert_unchanged(model, before)  # no output-capture hooks, no flag: the model is as it was
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    assert len(model(**batch).hidden_states) == 3  # and called directly afterwards


def test_a_bert_with_gradient_checkpointing_equals_one_device() -> None:
    """transformers' gradient checkpointing runs each layer of a replica again during backward,
    after data_parallel returned: the replica must still be whole then."""
    model, ref = _cold_bert(), _cold_bert()
    for m in (model, ref):
        m.activation_checkpointing_enable()
        m.train()
    ids = torch.randint(0, 100, (7, 5), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = tg.data_parallel(model, (), CPU3, module_kwargs={"input_ids": ids})
        out.last_hidden_state.pow(2).mean().backward()
        ref(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_replicate_reuse_hands_back_the_replicas_you_hold() -> None:
    model = Counted()
    a = tg.replicate(model, CPU3, reuse=True)
    a[1].note = "set on a replica"
    b = tg.replicate(model, CPU3, reuse=True)
    assert all(x is y for x, y in zip(a, b))  # the same objects, re-bound
    assert not hasattr(b[1], "note")
    del a, b
    c = tg.replicate(model, CPU3, reuse=True)  # the previous ones are gone: new ones
    x = torch.randn(2, 3)
    for r in c:
        torch.testing.assert_close(r(x), model(x))
    ref = weakref.ref(model)
    del model, c
    gc.collect()
    assert ref() is None


class Rescaling(nn.Module):
    """Reads an attribute of the source's and overwrites it on itself in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale: Any = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale() if callable(self.scale) else self.scale
        self.scale = 100.0  # on the replica only: the next step sees the source's again
        return self.lin(x) * scale


def test_attribute_values_follow_the_source_and_not_the_last_forward() -> None:
    model = Rescaling()
    x = torch.randn(6, 3)
    for scale in (2.0, 2.0, 3.0, 3.0):  # changed on the source between steps: re-bound
        model.scale = scale
        torch.testing.assert_close(tg.data_parallel(model, x, CPU3), model.lin(x) * scale)
    assert model.scale == 3.0
    model.scale = lambda: 5.0  # a function now (no value a replica may keep between steps)
    torch.testing.assert_close(tg.data_parallel(model, x, CPU3), model.lin(x) * 5.0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


class ReplacingChild(nn.Module):
    """Replaces its child on itself after using it: the next step uses the source's again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.lin = nn.Linear(3, 2)
        return out


def test_a_child_replaced_in_forward_is_back_the_next_step() -> None:
    model = ReplacingChild()
    lin = model.lin
    x = torch.randn(6, 3)
    for _ in range(3):
        torch.testing.assert_close(tg.data_parallel(model, x, CPU3), lin(x))
    assert model.lin is lin
