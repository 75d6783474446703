"""Plans run by their compiled runners (``backends/registry.execute`` -> the local backend's
``compile_plan``): the same values as the step-by-step run, the same collectives reported,
and the host work a training step repeats (its gradients' all-reduces, its batch's split)
done once per plan, not once per step."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from _shard_ops import TorchCalls
from shardfn import P
from shardfn.backends import local_steps, registry
from shardfn.backends.local import LocalBackend
from shardfn.plans.planner import plan_layouts
from shardfn.values.layout import Layout
from shardfn.values.spec import to_layout

aten = torch.ops.aten


def _pending(mesh: sf.Mesh, axes: tuple[str, ...], op: str, dtype: torch.dtype = torch.float32) -> sf.ShardedArray:
    """A (4, 8) array pending ``op`` over ``axes``, every device holding its own part."""
    g = torch.Generator().manual_seed(len(axes))
    parts = torch.randn(*mesh.shape, 4, 8, generator=g)
    parts = parts.to(dtype) if dtype.is_floating_point else (parts * 10).to(dtype)
    x = sf.distribute(parts, P(*mesh.axis_names), mesh=mesh)
    # each device's (1, .., 1, 4, 8) block, reduced over the leading dims by ``op``: pending over every axis
    summed = {"sum": lambda v: v.sum((0, 1)[:mesh.ndim]), "max": lambda v: v.amax((0, 1)[:mesh.ndim])}[op](x)
    assert summed._layout.partial, summed._layout
    return summed


CASES = [
    ((8,), ("dp",), P(None, None)),
    ((2, 4), ("dp", "tp"), P(None, None)),
    ((2, 4), ("dp", "tp"), P("dp", None)),
    ((2, 4), ("dp", "tp"), P(None, "tp")),
]


@pytest.mark.parametrize("mesh_shape, names, dst", CASES)
@pytest.mark.parametrize("op, dtype", [("sum", torch.float32), ("sum", torch.int64), ("max", torch.float32)])
def test_compiled_all_reduces_match_the_step_by_step_run(mesh_shape, names, dst, op, dtype):
    mesh = sf.Mesh(mesh_shape, names, backend="local")
    x = _pending(mesh, names, op, dtype)
    layout = to_layout(dst, 2, mesh)
    plan = plan_layouts(x._layout, layout, tuple(x.shape), x.dtype)
    assert plan.steps
    run = LocalBackend.compile_plan(plan.steps, plan.shape)
    by_steps = LocalBackend.run_steps(plan.steps, x._local, plan.shape, plan.dtype)
    if all(s.kind == "all_reduce" or s.kind in local_steps._REGRID_KINDS for s in plan.steps):
        assert run is not None, plan
    got = registry.execute(plan, x._local)
    assert got.shape == by_steps.shape and got.dtype == by_steps.dtype
    assert torch.equal(got, by_steps)
    # and the global value: the parts reduced by torch (a float sum in another order: within rounding)
    parts = x._local.expand(*mesh.shape, 4, 8).reshape(-1, 4, 8)
    whole = parts.sum(0) if op == "sum" else parts.amax(0)
    got_whole = sf.ShardedArray(got, layout, tuple(x.shape), x.dtype).full_tensor()
    torch.testing.assert_close(got_whole, whole, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("src, dst", [
    (P(), P("dp")), (P("dp"), P()), (P("dp", "tp"), P("tp", "dp")), (P("tp"), P(("dp", "tp"))), (P(None, "dp"), P("dp")),
])
def test_compiled_regrids_match_the_step_by_step_run(src, dst):
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    t = torch.randn(8, 16)
    x = sf.distribute(t, src, mesh=mesh)
    layout = to_layout(dst, 2, mesh)
    plan = plan_layouts(x._layout, layout, tuple(x.shape), x.dtype)
    by_steps = LocalBackend.run_steps(plan.steps, x._local, plan.shape, plan.dtype)
    got = registry.execute(plan, x._local)
    assert got.shape == by_steps.shape and got.stride() == by_steps.stride()
    assert torch.equal(got, by_steps)
    assert torch.equal(sf.ShardedArray(got, layout, (8, 16), t.dtype).full_tensor(), t)


def test_uneven_and_per_device_values_take_the_step_by_step_run():
    """No runner for uneven layouts; a runner given per-device shards hands them back."""
    mesh = sf.Mesh((4,), ("dp",), backend="local")
    t = torch.randn(6, 3)
    x = sf.distribute(t, P("dp"), mesh=mesh)  # 6 over 4: uneven
    plan = plan_layouts(x._layout, to_layout(P(), 2, mesh), (6, 3), t.dtype)
    assert LocalBackend.compile_plan(plan.steps, plan.shape) is None
    assert torch.equal(sf.reshard(x, P()).full_tensor(), t)
    even = plan_layouts(to_layout(P(None, partial="dp"), 2, mesh), to_layout(P(), 2, mesh), (4, 3), t.dtype)
    run = LocalBackend.compile_plan(even.steps, even.shape)
    assert run is not None and run(tuple(torch.ones(4, 3) for _ in range(4))) is None


def test_a_gradient_all_reduce_runs_by_its_runner_and_is_reported(monkeypatch):
    """``sf.reshard(grad, param.sharding)`` (a pending sum over 'dp' made replicated) runs the
    compiled runner, not the step walk; with a CommCounter looking on it is the one all_reduce
    it always was."""
    mesh = sf.Mesh((8,), ("dp",), backend="local")
    w = sf.distribute(torch.randn(6, 5), P(), mesh=mesh).requires_grad_()
    xb = sf.distribute(torch.randn(16, 6), P("dp"), mesh=mesh)
    (g,) = torch.autograd.grad((xb @ w).pow(2).sum(), [w])
    g2 = g.detach() * 1.0  # the same pending layout, reduced afresh below
    assert g._layout.partial
    want = sf.reshard(g, w.sharding).full_tensor()

    def walked(*a, **k):
        raise AssertionError("the plan was walked step by step")

    with monkeypatch.context() as m:
        m.setattr(LocalBackend, "run_steps", staticmethod(walked))
        got = sf.reshard(g2, w.sharding)
    assert torch.equal(got.full_tensor(), want * 1.0)
    (g3,) = torch.autograd.grad((xb @ w).pow(2).sum(), [w])  # a new pending gradient, nothing reduced yet
    with sf.debug.CommCounter() as counter:
        got = sf.reshard(g3, w.sharding)
    assert dict(counter.counts) == {"all_reduce": 1}
    assert torch.equal(got.full_tensor(), want)


def test_distribute_of_a_batch_runs_its_plan_once():
    """A batch split over 'dp' is one contiguous block per device: copied as it is (the copy
    the last op), not redone from a copy of the tensor; no storage shared with the tensor."""
    mesh = sf.Mesh((8,), ("dp",), backend="local")
    t = torch.randn(16, 4, 8)
    sf.distribute(t, P("dp"), mesh=mesh)
    with TorchCalls() as mode:
        x = sf.distribute(t, P("dp"), mesh=mesh)
    assert mode.calls.count(aten.clone.default) == 1 and mode.calls[-1] is aten.clone.default, mode.calls
    assert x._local.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert torch.equal(x.full_tensor(), t)
    before = t.clone()
    t.add_(1)  # the caller's tensor changes; the array does not
    assert torch.equal(x.full_tensor(), before)


def test_layout_equality_with_identity_shortcuts():
    mesh, other = sf.Mesh((2, 4), ("dp", "tp"), backend="local"), sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    a = Layout(mesh, (("dp",), ()), ())
    assert a == a and a == Layout(other, (("dp",), ()), ()) and hash(a) == hash(Layout(other, (("dp",), ()), ()))
    assert a != Layout(mesh, ((), ("dp",)), ()) and a != Layout(mesh, (("dp",), ()), (("tp", "sum"),))
    assert a != Layout(sf.Mesh((2, 4), ("x", "tp"), backend="local"), (("dp",), ()), ())
    assert (a == 3) is False and (a != "x") is True
