"""sf.debug.CommCounter().records: one record per collective with kind, axes, bytes, op, phase,
module and source line; the tree by module; nothing left installed when no counter is active."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as nn_module

import shardfn as sf
from shardfn import P
from shardfn.backends import hooks as _comm_hooks
from shardfn.plans.planner import plan_layouts
from shardfn.values.spec import to_layout

HERE = __file__


def _line_of(marker: str) -> int:
    with open(HERE) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line and "_line_of" not in line)


def test_reshard_record_kind_axes_bytes_op_location(mesh22) -> None:
    x = sf.distribute(torch.randn(4, 6), P("x", "y"), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        y = sf.reshard(x, P("x", None))  # marker:reshard
    assert dict(cc.counts) == {"all_gather": 1}
    (r,) = cc.records
    plan = plan_layouts(x._layout, to_layout(P("x", None), 2, mesh22), (4, 6), x.dtype)
    assert (r.kind, r.axes, r.bytes) == ("all_gather", ("y",), plan.bytes_per_device) and r.bytes == cc.bytes > 0
    assert r.op == "sf.reshard" and r.phase == "forward" and r.module is None
    assert r.location == f"{HERE}:{_line_of('marker:reshard')}"
    torch.testing.assert_close(y.full_tensor(), x.full_tensor())


def test_aten_op_forward_and_backward_phase(mesh22) -> None:
    x = sf.distribute(torch.randn(4, 6), P("x", "y"), mesh=mesh22).requires_grad_()
    w = sf.distribute(torch.randn(6, 5), P("y", None), mesh=mesh22).requires_grad_()
    with sf.debug.CommCounter() as cc:
        out = x @ w
        total = torch.relu(out).sum()  # marker:sum
        total.backward()  # marker:backward
    fwd = [r for r in cc.records if r.phase == "forward"]
    bwd = [r for r in cc.records if r.phase == "backward"]
    assert fwd and all(r.op.startswith("aten.") for r in fwd)
    assert all(r.location.startswith(HERE + ":") for r in cc.records)
    assert {r.location for r in bwd} <= {f"{HERE}:{_line_of('marker:backward')}"}
    assert sum(cc.counts.values()) == len(cc.records) and cc.bytes == sum(r.bytes for r in cc.records)
    assert all(set(r.axes) <= {"x", "y"} and r.axes for r in cc.records)


def test_phase_under_torch_func_grad(mesh22) -> None:
    w = sf.distribute(torch.randn(6, 4), P("x"), mesh=mesh22)

    def loss(w: torch.Tensor) -> torch.Tensor:
        return sf.reshard(w, P(None, "y")).pow(2).sum()  # (x, y) -> (y, x) in both passes

    with sf.debug.CommCounter() as cc:
        g = torch.func.grad(loss)(w)
    phases = {r.phase for r in cc.records}
    assert phases == {"forward", "backward"}, cc.records
    w0 = w.full_tensor().requires_grad_()
    w0.pow(2).sum().backward()
    torch.testing.assert_close(g.full_tensor(), w0.grad, rtol=1e-5, atol=1e-5)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_module_names_forward_backward_and_functional_call(mesh22) -> None:
    model = nn.Sequential(_Block(), _Block())
    params = sf.nn.shard_params(model, [(r"up\.weight", P("y", None)), (r"down\.weight", P(None, "y"))], mesh=mesh22)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    x = sf.distribute(torch.randn(4, 8), P("x"), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        out = torch.func.functional_call(model, params, (x,))
        sf.reshard(out, P()).pow(2).sum().backward()
    names = dict(model.named_modules())
    fwd = [r for r in cc.records if r.phase == "forward"]
    bwd = [r for r in cc.records if r.phase == "backward"]
    assert fwd and bwd
    for r in cc.records:
        assert r.module is None or r.module in names, r
    # a row-parallel layer's pending sum is reduced where it is first read: by the next
    # block's layer, or (the last block's) by the reshard outside the model
    assert {r.module for r in fwd} & {"0", "1", "0.down", "1.down", "1.up"}, fwd
    assert any(r.module is not None and r.module != "" for r in bwd), bwd
    text = str(cc)
    assert "FORWARD" in text and "BACKWARD" in text and "  0" in text and "1" in text
    # the same attribution under torch.func.grad
    plain = {k: v.detach() for k, v in params.items()}
    with sf.debug.CommCounter() as cc2:
        torch.func.grad(lambda p: sf.reshard(torch.func.functional_call(model, p, (x,)), P()).pow(2).sum())(plain)
    assert [(r.kind, r.phase, r.module) for r in cc2.records] == [(r.kind, r.phase, r.module) for r in cc.records]


def test_lax_collective_records_api_call(mesh22) -> None:
    x = sf.distribute(torch.randn(4, 6), P("x", "y"), mesh=mesh22)

    def body(b: torch.Tensor) -> torch.Tensor:
        return sf.lax.psum(b, "y")  # marker:psum

    f = sf.shard_map(body, mesh=mesh22, in_specs=P("x", "y"), out_specs=P("x", None))
    with sf.debug.CommCounter() as cc:
        f(x)
    (r,) = cc.records
    assert (r.kind, r.axes, r.op, r.phase) == ("all_reduce", ("y",), "sf.lax.psum", "forward")
    assert r.location == f"{HERE}:{_line_of('marker:psum')}" and r.bytes == cc.bytes > 0


def test_nothing_installed_outside_a_counter(mesh22) -> None:
    pre, post = dict(nn_module._global_forward_pre_hooks), dict(nn_module._global_forward_hooks)
    with sf.debug.CommCounter() as outer:
        with sf.debug.CommCounter() as inner:
            sf.reshard(sf.distribute(torch.randn(4, 4), P("y"), mesh=mesh22), P())
        assert _comm_hooks.OBSERVERS
    assert not _comm_hooks.OBSERVERS
    assert dict(nn_module._global_forward_pre_hooks) == pre and dict(nn_module._global_forward_hooks) == post
    assert len(outer.records) == len(inner.records) == 1
    with sf.debug.CommCounter() as after:
        pass
    assert after.records == [] and not after.counts


def test_meta_traces_are_not_counted(mesh22) -> None:
    with sf.debug.CommCounter() as cc, _comm_hooks.muted():
        sf.reshard(sf.distribute(torch.randn(4, 4), P("y"), mesh=mesh22), P())
    assert cc.records == [] and cc.total == 0


def test_compile_traces_are_not_counted(mesh22) -> None:
    x = sf.distribute(torch.randn(4, 6), P("x", "y"), mesh=mesh22)

    def f(x: torch.Tensor) -> torch.Tensor:
        return sf.reshard(x * 2, P("x", None)).sum()

    with sf.debug.CommCounter() as eager:
        want = f(x)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with sf.debug.CommCounter() as traced:
        got = compiled(x)
    assert len(eager.records) == 1 and len(traced.records) <= 1, traced.records
    torch.testing.assert_close(got.full_tensor(), want.full_tensor())
