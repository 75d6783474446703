"""``aten._assert_tensor_metadata`` (export and torch.compile graphs check a cast's input with
it) on arrays: torch's check of the global metadata, passing or raising as on the plain tensor,
without a replicate fallback (it replicated the array to check its sizes)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P

from _no_fallback import NoFallback

aten = torch.ops.aten


def _outcome(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[-1]
    return "ok"


_EXPECTED = [dict(size=[4, 6]), dict(size=[6, 4]), dict(size=[4, 6], stride=[6, 1]), dict(size=[4, 6], stride=[1, 4]),
             dict(dtype=torch.float32), dict(dtype=torch.float64), dict(device=torch.device("cpu")),
             dict(device=torch.device("meta")), dict(layout=torch.strided), dict(layout=torch.sparse_coo),
             dict(size=[4, 6], stride=[6, 1], dtype=torch.float32, device=torch.device("cpu"), layout=torch.strided)]


@pytest.mark.parametrize("view", ["plain", "transposed", "pending"])
@pytest.mark.parametrize("spec", [P(), P("x"), P(None, "y"), P("y", "x")])
def test_assert_tensor_metadata_checks_the_global_metadata(spec, view):
    """Sizes, strides (a transposed view's, as torch reports them), dtype, device and layout:
    each expectation passes or raises torch's error as on the plain tensor."""
    mesh = sf.Mesh((2, 2), ("x", "y"))
    base = torch.randn(4, 6) if view != "transposed" else torch.randn(6, 4)
    X = sf.distribute(base, spec, mesh=mesh)
    if view == "transposed":
        base, X = base.t(), X.t()
    elif view == "pending":
        X = X * 1 + sf.distribute(torch.zeros(4, 6), P(), mesh=mesh)
    for want in _EXPECTED:
        kw = dict(want)
        args = (kw.pop("size", None), kw.pop("stride", None), kw.pop("dtype", None))
        with NoFallback():
            got = _outcome(lambda: aten._assert_tensor_metadata(X, *args, **kw))
        assert got == _outcome(lambda: aten._assert_tensor_metadata(base, *args, **kw)), want


@pytest.mark.parametrize("spec", [P("x"), P(None, "x")])
def test_exported_cast_runs_on_arrays(spec):
    """An exported module's ``.to(dtype)`` asserts its input's metadata first: it runs on the
    shards, eagerly and under torch.compile with dynamic sizes, values and gradients as torch's."""

    class Cast(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float64).sin() * 2

    gm = torch.export.export(Cast(), (torch.randn(4, 6),)).module()
    assert aten._assert_tensor_metadata.default in [n.target for n in gm.graph.nodes]
    mesh = sf.Mesh((2,), ("x",))
    x = torch.randn(4, 6)
    torch._dynamo.reset()
    for fn in (gm, torch.compile(lambda v: aten._assert_tensor_metadata(v, None, None, torch.float32) or v.sin(),
                                 backend="aot_eager", dynamic=True)):
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        with NoFallback():
            got = fn(sf.distribute(xs, spec, mesh=mesh))
            (g,) = torch.autograd.grad(got.sum(), xs)
        want = fn(xr)
        (gw,) = torch.autograd.grad(want.sum(), xr)
        torch.testing.assert_close(got.full_tensor(), want)
        torch.testing.assert_close(g.full_tensor() if isinstance(g, sf.ShardedArray) else g, gw)


@pytest.mark.parametrize("view", ["plain", "transposed"])
@pytest.mark.parametrize("spec", [P(), P("x"), P("y", "x")])
def test_metadata_ops_called_as_ops_report_the_global_metadata(spec, view):
    """``aten.size`` / ``stride`` / ``numel`` / ``dim`` and their sym_ forms called as ops (a
    compiled backward's trace asks ``aten.size.default``; it raised 'operator aten::size does
    not exist' looking for a decomposition): the global answers, as the plain tensor's."""
    mesh = sf.Mesh((2, 2), ("x", "y"))
    base = torch.randn(5, 6)
    X = sf.distribute(base, spec, mesh=mesh)
    x = base
    if view == "transposed":
        X, x = X.t(), x.t()
    for op in (aten.size.default, aten.stride.default, aten.sym_size.default, aten.sym_stride.default):
        assert op(X) == op(x), op
    for op in (aten.size.int, aten.stride.int, aten.sym_size.int, aten.sym_stride.int):
        assert [op(X, d) for d in (0, 1, -1)] == [op(x, d) for d in (0, 1, -1)], op
    assert aten.numel.default(X) == aten.sym_numel.default(X) == 30
    assert aten.dim.default(X) == 2
