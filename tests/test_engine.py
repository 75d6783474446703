"""The execution engine: rules give layouts and declarative local-call facts, the local
backend runs each op once on the stacked values (``backends/_batching.py``) or once per
device. Values and gradients against plain torch; which path ran is checked too, so a
batched form that silently fell back per device shows up."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import shardfn as sf
from shardfn import P
from shardfn.arrays import dispatch as d
from shardfn.arrays.entries import _Entry
from shardfn.values.schema import op_name
from shardfn.backends.local_calls import PerDeviceCall, StackedCall

MESH = sf.Mesh((2, 2), ("x", "y"), backend="local")
F = torch.nn.functional


def _entries(op_names: set[str]) -> list:
    """The cached entries of these ops (each once: an entry is filed under two keys)."""
    found = {id(e): e for e in d._cache.values() if isinstance(e, _Entry) and op_name(e.func) in op_names}
    return list(found.values())


def _run(fn, inputs, grad=True):
    """``fn`` on distributed inputs vs on plain tensors: values and gradients."""
    leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t, _ in inputs]
    plain = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t, _ in inputs]
    got = fn(*[sf.distribute(t, s, mesh=MESH) for t, (_, s) in zip(leaves, inputs)])
    want = fn(*plain)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.full_tensor(), w, rtol=1e-5, atol=1e-6)
    if grad and any(o.requires_grad for o in got):
        sum(o.float().sum() for o in got if o.is_floating_point()).backward()
        sum(o.float().sum() for o in want if o.is_floating_point()).backward()
        for a, b in zip(leaves, plain):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


BATCHED = [
    ("aten.t", lambda x: x.t() * 2, [(torch.randn(4, 6), P("x", "y"))]),
    ("aten.permute", lambda x: x.permute(2, 0, 1), [(torch.randn(4, 2, 6), P("x", None, "y"))]),
    ("aten.repeat", lambda x: x.repeat(2, 1, 3), [(torch.randn(4, 6), P("x"))]),
    ("aten.expand", lambda x: x.unsqueeze(1).expand(4, 3, 6), [(torch.randn(4, 6), P("x", "y"))]),
    ("aten.view", lambda x: x.view(2, 2, 12), [(torch.randn(4, 12), P("x", "y"))]),
    ("aten.new_zeros", lambda x: x.new_zeros(3, 2) + 1, [(torch.randn(4, 6), P("x"))]),
    ("aten.argmax", lambda x: (x.argmax(), x.argmax(keepdim=True)), [(torch.randn(4, 6), P("x"))]),
    ("aten.sum", lambda x: x.sum() + x.sum(1).sum(), [(torch.randn(4, 6), P("x", "y"))]),
    ("aten.mean", lambda x: x.mean() * x.mean(0).sum(), [(torch.randn(4, 6), P("x", "y"))]),
    ("aten.var", lambda x: x.var(), [(torch.randn(4, 6), P(None, "y"))]),
    ("aten.prod", lambda x: x.prod(), [(torch.rand(4, 6) + 0.5, P("x"))]),
    ("aten.unsqueeze", lambda x: x.unsqueeze(2) * 3, [(torch.randn(4, 6), P("x", "y"))]),
    ("aten.stack", lambda x, y: torch.stack([x, y], 2), [(torch.randn(4, 6), P("x")), (torch.randn(4, 6), P("x"))]),
    ("aten.cat", lambda x, y: torch.cat([x, y], 1), [(torch.randn(4, 6), P("x")), (torch.randn(4, 2), P("x"))]),
    ("aten.mm", lambda x, w: x @ w, [(torch.randn(4, 6), P("x")), (torch.randn(6, 5), P())]),
    ("aten.addmm", lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
     [(torch.randn(5), P()), (torch.randn(4, 6), P("x")), (torch.randn(6, 5), P())]),
    ("aten.mv", lambda x, v: torch.mv(x, v), [(torch.randn(4, 6), P("x")), (torch.randn(6), P())]),
    ("aten.dot", lambda x, v: torch.dot(x, v), [(torch.randn(8), P("x")), (torch.randn(8), P("x"))]),
    ("aten.masked_fill", lambda x, v: x.masked_fill(x > 0, v), [(torch.randn(4, 6), P("x")), (torch.tensor(3.0), P())]),
    ("aten.fill", lambda x, v: torch.fill(x, v) * x, [(torch.randn(4, 6), P("x")), (torch.tensor(2.0), P())]),
    ("aten.add", lambda x, v: x + v, [(torch.randn(4, 6), P("x", "y")), (torch.randn(6), P("y"))]),
    ("aten.squeeze", lambda x: x.squeeze(1) + 1, [(torch.randn(4, 1, 6), P("x", None, "y"))]),
    ("aten._softmax", lambda x: torch.softmax(x, 0), [(torch.randn(4, 6), P(None, "y"))]),
    ("aten.select_backward", lambda x: x.select(1, 2) * 2, [(torch.randn(4, 6), P("x"))]),
    ("aten.native_layer_norm_backward", lambda x, w, b: F.layer_norm(x, (6,), w, b) ** 2,
     [(torch.randn(4, 2, 6), P("x", "y")), (torch.randn(6), P()), (torch.randn(6), P())]),
    ("aten.embedding", lambda w, i: F.embedding(i, w) * 2, [(torch.randn(7, 4), P()), (torch.randint(0, 7, (4, 3)), P("x"))]),
    # float64: the batched kernel sums the input gradient in another order than torch's
    # call, which in float32 can differ by more than the tolerance (1.4e-6 seen in CI)
    ("aten.convolution", lambda x, w, b: F.conv2d(x, w, b, padding=1),
     [(torch.randn(4, 3, 5, 5, dtype=torch.float64), P("x")), (torch.randn(2, 3, 3, 3, dtype=torch.float64), P()),
      (torch.randn(2, dtype=torch.float64), P())]),
    ("aten._scaled_dot_product_flash_attention_for_cpu", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     [(torch.randn(2, 4, 5, 8), P("x", "y")), (torch.randn(2, 4, 5, 8), P("x", "y")), (torch.randn(2, 4, 5, 8), P("x", "y"))]),
]


@pytest.mark.parametrize("name,fn,inputs", BATCHED, ids=[b[0] for b in BATCHED])
def test_batched_forms(name, fn, inputs):
    """Each op runs once for the whole mesh (a StackedCall that stayed batched) and
    equals torch, gradients included."""
    d._cache.clear()
    _run(fn, inputs)
    entries = _entries({name})
    assert entries, f"{name} was not dispatched"
    for e in entries:
        if any(l.ndim == 0 for l in e.cand.in_layouts):
            continue  # a 0-d value (the backward's seed) runs per device
        assert isinstance(e.local, StackedCall) and e.local.mode == "batched", (name, type(e.local), e.local.__dict__)


def test_cat_skips_legacy_empty_operands():
    x = torch.randn(4, 6)
    cache = sf.distribute(torch.tensor([]), P(), mesh=MESH)
    got = torch.cat([cache, sf.distribute(x, P("x"), mesh=MESH)], 0)
    torch.testing.assert_close(got.full_tensor(), x)


def test_per_device_for_ops_without_batched_form():
    """index_select has no batched form: it runs once per device, correctly."""
    d._cache.clear()
    x, i = torch.randn(4, 6), torch.tensor([0, 3, 1])
    got = torch.index_select(sf.distribute(x, P("x"), mesh=MESH), 1, sf.distribute(i, P(), mesh=MESH))
    torch.testing.assert_close(got.full_tensor(), torch.index_select(x, 1, i))
    (e,) = _entries({"aten.index_select"})
    assert isinstance(e.local, PerDeviceCall)


def test_uneven_mean_and_empty_shard_amax():
    """Uneven shards: mean sums x / n on each device, amax gives its identity on an empty shard."""
    _run(lambda x: (x.mean(0), x.mean()), [(torch.randn(3, 5), P("x"))])
    mesh4 = sf.Mesh((4,), ("x",), backend="local")
    x = torch.randn(3, 4)
    got = sf.distribute(x, P("x"), mesh=mesh4).amax(0)
    torch.testing.assert_close(got.full_tensor(), x.amax(0))


def test_even_mean_is_pending_average():
    x = torch.randn(4, 6)
    got = sf.distribute(x, P("x"), mesh=MESH).mean(0)
    assert got._layout.partial == (("x", "avg"),)
    torch.testing.assert_close(got.full_tensor(), x.mean(0))


def test_rules_have_no_execution_adapters():
    """Rules decide layouts only: nothing in rules/ names stacked/per-device adapters."""
    rules = pathlib.Path(sf.__file__).parent / "rules"
    for f in rules.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"stacked_args|device_args|stacked_fn|device_fn|mesh\.ndim", text), f.name
