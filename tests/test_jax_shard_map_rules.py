"""JAX's tests/shard_map_test.py, continued: remat of shard_map, meshes taken from the
arguments, the replication (vma) rules through loops and branches, custom derivatives in
bodies, and the errors JAX raises, ported with plain torch as the oracle."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn import P, lax
from shardfn.values import torch_compat as _compat

from _custom_fns import scaled_foo


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def test_remat_scalar_residuals():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: torch.sin(torch.sin(torch.sin(x.sum())))[None], mesh=mesh, in_specs=P("x"),
                     out_specs=P("x"))
    x = torch.arange(8.0, dtype=torch.float64)

    def loss(v):
        return checkpoint(lambda t: sf.gather(f(t)), v, use_reentrant=False).sum()

    def ref(v):
        return torch.sin(torch.sin(torch.sin(v.reshape(4, 2).sum(1)))).sum()

    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(xr), xr, create_graph=True)
    torch.testing.assert_close(g, torch.func.grad(ref)(x))
    (gg,) = torch.autograd.grad((g * torch.linspace(0, 1, 8, dtype=torch.float64)).sum(), xr)
    want = torch.func.grad(lambda v: (torch.func.grad(ref)(v) * torch.linspace(0, 1, 8, dtype=torch.float64)).sum())(x)
    torch.testing.assert_close(gg, want)


def test_collectives_not_saved():
    mesh = _mesh((4,), ("x",))
    calls = []

    def body(x):
        calls.append(1)
        return lax.all_gather(x, "x") * lax.all_gather(x, "x")

    f = sf.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = torch.linspace(0.5, 2, 4, dtype=torch.float64).requires_grad_()
    out = checkpoint(lambda t: sf.gather(f(t)), x, use_reentrant=False)
    torch.testing.assert_close(out, (x.detach() ** 2).repeat(4).reshape(16, 1))  # every device holds all of x^2
    out.sum().backward()
    assert len(calls) == 2  # recomputed in backward
    # each device's output is the gathered square: d/dx_i of 4 * sum(x^2) = 8 x_i
    torch.testing.assert_close(x.grad, 8 * x.detach())


def test_check_vma_false_with_no_outputs():
    """JAX's test_check_rep_false_doesnt_hit_rep_rules: a body returning nothing, out_specs=None."""
    mesh = _mesh((4,), ("x",))
    for check in (True, False):
        assert sf.shard_map(lambda: None, mesh=mesh, in_specs=(), out_specs=None, check_vma=check)() is None


def test_multiple_result_primitive_with_none_sharding():
    xs = torch.arange(20.0).reshape(2, 10)
    mesh = _mesh((2,), ("i",))
    y = sf.shard_map(lambda x: list(torch.split(x.squeeze(), 1)), mesh=mesh, in_specs=(P(),), out_specs=P("i"))(xs)
    expected = torch.repeat_interleave(xs, 2, dim=0).reshape(2, 2, 10)
    assert torch.equal(torch.stack([t.full_tensor() for t in y]), expected)


def test_vmap_of_grad_unchecked():
    """JAX's test_vmap_of_grad_spmd_axis_name without spmd_axis_name: vmap(grad(f)) of a
    check_vma=False body equals grad(f) row by row."""
    mesh = _mesh((2, 2), ("x", "y"))
    f = sf.shard_map(lambda x: torch.sin(x.sum()), mesh=mesh, in_specs=P("y"), out_specs=P(), check_vma=False)
    x = torch.arange(16.0).reshape(4, 4)
    g = torch.func.grad(lambda v: sf.gather(f(v)))
    got = torch.func.vmap(g)(x)
    assert torch.equal(got, torch.stack([g(r) for r in x]))
    # JAX's transpose: the cotangent is shared by the 4 devices, and the 2 devices along 'x'
    # (where the input is replicated) sum theirs: each block gets cos(its own sum) / 2
    want = torch.stack([torch.cat([torch.cos(r[:2].sum()).expand(2), torch.cos(r[2:].sum()).expand(2)]) / 2 for r in x])
    torch.testing.assert_close(got, want)


def test_vmap_of_shard_map_over_sharded_array():
    """JAX's test_vmap_explicit_mesh_axis_single_axis: vmap over the rows of a ShardedArray."""
    mesh = _mesh((2, 2), ("data", "model"))
    full = torch.arange(16.0).reshape(4, 4)
    x = sf.distribute(full, P("data", "model"), mesh=mesh)
    out = torch.func.vmap(sf.shard_map(lambda v: v, in_specs=P("model"), out_specs=P("model")))(x)
    assert out.placements[1] == sf.Shard(1)
    assert torch.equal(sf.gather(out), full)


def test_mesh_from_the_arguments():
    """JAX's test_shard_map_abstract_mesh: no mesh= takes the arguments' mesh."""
    mesh = _mesh((2, 2), ("x", "y"))
    inp = torch.arange(16.0).reshape(8, 2)
    arr = sf.distribute(inp, P("x", "y"), mesh=mesh)
    out = sf.shard_map(lambda v: v, in_specs=P("x"), out_specs=P("x"))(arr)
    assert torch.equal(out.full_tensor(), inp)
    assert out.sharding == sf.NamedSharding(mesh, P("x"))
    out1, out2 = sf.shard_map(lambda a, b: (a, b), in_specs=P("x"), out_specs=P("x"))(inp, arr)
    for o in (out1, out2):
        assert torch.equal(o.full_tensor(), inp)
        assert o.sharding == sf.NamedSharding(mesh, P("x"))


def test_mesh_mismatch_errors():
    """JAX's test_shmap_abstract_mesh_errors: an argument on another mesh is named."""
    arr = sf.distribute(torch.arange(8.0), P("x"), mesh=_mesh((2,), ("x",)))
    with pytest.raises(sf.ShardingError, match=r"args\[0\] lives on Mesh\(x=2.*runs on Mesh\(y=2"):
        sf.shard_map(lambda x: x, mesh=_mesh((2,), ("y",)), in_specs=P("y"), out_specs=P("y"))(arr)
    arr2 = sf.distribute(torch.arange(8.0), P("y"), mesh=_mesh((2,), ("y",)))
    with pytest.raises(sf.ShardingError, match=r"args\[1\] lives on Mesh\(y=2.*args\[0\]'s mesh"):
        sf.shard_map(lambda x, y: (x, y), in_specs=P("x"), out_specs=P("x"))(arr, arr2)
    with pytest.raises(sf.ShardingError, match="needs a mesh"):
        sf.shard_map(lambda x: x, in_specs=P("x"), out_specs=P("x"))(torch.arange(8.0))


def test_print_in_body_sees_each_devices_values(capsys):
    """JAX's test_debug_print_eager: a body whose shards print (a per-device run)."""
    mesh = _mesh((4,), ("i",))

    def f(x):
        if x.sum() >= 0:  # data-dependent Python: runs on each device's own tensor
            print(f"x={x.tolist()}")
        return torch.cos(x)

    out = sf.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(torch.arange(8.0))
    torch.testing.assert_close(out.full_tensor(), torch.cos(torch.arange(8.0)))
    printed = capsys.readouterr().out
    for i in range(4):
        assert f"x=[{2 * i}.0, {2 * i + 1}.0]" in printed


def test_psum_transpose_non_zero_cts():
    mesh = _mesh((8,), ("x",))
    f1 = sf.shard_map(lambda b: (b, lax.psum(b, "x")), mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P()))
    x = torch.arange(16.0)
    y, s = f1(x)
    torch.testing.assert_close(s.full_tensor(), x.reshape(8, 2).sum(0))
    g = torch.func.grad(lambda v: sf.gather(f1(v)[0]).sum())(x)
    torch.testing.assert_close(g, torch.ones(16))


def test_vma_out_specs_error_check():
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    f = sf.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("x", "y", "z"), out_specs=P("x"))
    with pytest.raises(sf.ShardingError, match=r"out_spec P\('x'\) leaves 'y' and 'z' out \(it was inferred to vary over "
                                                r"'x', 'y', 'z'\).*psum\(y, \('y', 'z'\)\)"):
        f(torch.arange(16.0).reshape(4, 2, 2))


def test_functools_partial_rank_error():
    mesh = _mesh((4,), ("x",))
    g = sf.shard_map(functools.partial(lambda x: x), mesh=mesh, in_specs=(P("x", None),), out_specs=P("x"))
    with pytest.raises(sf.ShardingError, match="rank"):
        g(torch.arange(4.0))


@pytest.mark.parametrize("in_specs", [None, (None,), P()])
def test_in_specs_none_with_a_python_scalar(in_specs):
    mesh = _mesh((4,), ("x",))
    assert sf.shard_map(lambda x: x, mesh=mesh, in_specs=in_specs, out_specs=P())(3.0) == 3.0


# -- replication rules through control flow (JAX's scan / while / cond / switch rep rules) ---------
# torch has no traced loops in eager code: Python loops and branches run on the values, so the
# varying axes of each result are those of the value that flows there.

_LOOP_IN = (P(None), P("x"), P(("x", "y")))


def _rotate(x, y, z, steps, cast):
    x, y, z = x.sum(), y.sum(), z.sum()
    if cast:
        x = lax.pcast(x, ("x", "y"), to="varying")
        y = lax.pcast(y, "y", to="varying")
    c = (x, y, z)
    for _ in range(steps):
        c = (*c[1:], c[0])
    return [a[None] for a in c]


@pytest.mark.parametrize("steps", [3, 5])
def test_loop_rep_rule(steps):
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0)
    f = functools.partial(_rotate, steps=steps, cast=True)
    out = sf.shard_map(f, mesh=mesh, in_specs=_LOOP_IN, out_specs=P(("x", "y")))(x, x, x)
    assert [o.shape for o in out] == [(4,)] * 3
    for spec, left_out in ((P("x"), "'y'"), (P("y"), "'x'"), (P(None), "'x'")):
        with pytest.raises(sf.ShardingError, match=f"varies over mesh axis {left_out}"):
            sf.shard_map(f, mesh=mesh, in_specs=_LOOP_IN, out_specs=spec)(x, x, x)
    g = functools.partial(_rotate, steps=0, cast=False)
    out = sf.shard_map(g, mesh=mesh, in_specs=_LOOP_IN, out_specs=[P(None), P("x"), P(("x", "y"))])(x, x, x)
    assert torch.equal(out[0].full_tensor(), x.sum()[None])
    assert torch.equal(out[1].full_tensor(), x.reshape(2, 2).sum(1))
    assert torch.equal(out[2].full_tensor(), x)
    with pytest.raises(sf.ShardingError, match=r"output\[1\] varies over mesh axis 'x'"):
        sf.shard_map(g, mesh=mesh, in_specs=_LOOP_IN, out_specs=[P(None), P(None), P(("x", "y"))])(x, x, x)


def test_cond_rep_rule():
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0)

    def f(x, y):
        return x if True else x + 1

    def f_data(x, y):  # the predicate varies over 'x' like x: so does the result
        return x if bool(torch.any(x > 0)) else x + 1

    for fn, want in ((f, x), (f_data, x), (lambda x, y: f_data(x - 1, y) + 1, torch.tensor([1.0, 2.0, 2.0, 3.0]))):
        out = sf.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P("x"))(x, x)
        assert torch.equal(out.full_tensor(), want)
        with pytest.raises(sf.ShardingError, match="varies over mesh axis 'x'"):
            sf.shard_map(fn, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P(None))(x, x)

    def g(x, y):
        return lax.pcast(x, "y") if True else lax.pcast(y, "x")

    out = sf.shard_map(g, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P(("x", "y")))(x, x)
    assert out.shape == (8,)
    with pytest.raises(sf.ShardingError, match="varies over mesh axis 'y'"):
        sf.shard_map(g, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P("x"))(x, x)

    def h(x, y):  # the predicate varies over 'y': the result does too
        return x if bool(torch.any(y > 0)) else x + 1

    out = sf.shard_map(h, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P(("x", "y")))(x, x)
    # y blocks: [0, 1] (any > 0) and [2, 3]: both take x
    assert torch.equal(out.full_tensor(), torch.tensor([0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]))

    def k(a):  # jax issue 24418
        return torch.tensor(1 if bool(torch.any(a)) else 0).reshape(a.shape)

    out = sf.shard_map(k, mesh=_mesh((2,), ("x",)), in_specs=P("x"), out_specs=P("x"))(torch.tensor([True, False]))
    assert torch.equal(out.full_tensor(), torch.tensor([1, 0]))


def test_cond_with_varying_predicate_values():
    """A data-dependent branch on each device's own values: per-device results, as JAX's cond."""
    mesh = _mesh((4,), ("x",))
    x = torch.tensor([-1.0, -2.0, 3.0, 4.0, -5.0, 6.0, 7.0, -8.0])

    def f(v):
        return v * 10 if v.sum() > 0 else -v

    out = sf.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)
    want = torch.cat([f(b) for b in x.reshape(4, 2)])
    assert torch.equal(out.full_tensor(), want)
    g = torch.func.grad(lambda v: sf.gather(sf.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(v)).sum())(x)
    assert torch.equal(g, torch.cat([torch.full((2,), 10.0 if b.sum() > 0 else -1.0) for b in x.reshape(4, 2)]))


def test_switch_rep_rule():
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0)

    def f(n, x, y):
        return [lambda x, _: x, lambda x, _: x + 1, lambda x, _: x + 2][n](x, y)

    out = sf.shard_map(f, mesh=mesh, in_specs=(P(), P("x"), P("y")), out_specs=P("x"))(1, x, x)
    assert torch.equal(out.full_tensor(), x + 1)


# -- custom derivatives in a body ---------------------------------------------------------------


# JAX's custom_vjp foo (classic style, no vmap rule) and custom_jvp foo: 2x forward, 3 * tangent.
_FooVjp = scaled_foo(3.0, vmappable=False)
_FooJvp = scaled_foo(3.0)


@pytest.mark.parametrize("fn", [_FooVjp, _FooJvp], ids=["custom_vjp", "custom_jvp"])
def test_eager_custom_derivatives(fn):
    mesh = _mesh((4,), ("x",))
    g = sf.shard_map(fn.apply, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"))
    x = torch.arange(4.0)
    x_bar, y = torch.func.grad_and_value(lambda v: sf.gather(g(v)).sum())(x)
    torch.testing.assert_close(y, (2.0 * x).sum())
    torch.testing.assert_close(x_bar, 3.0 * torch.ones(4))
    xr = x.clone().requires_grad_()
    sf.gather(g(xr)).sum().backward()
    torch.testing.assert_close(xr.grad, 3.0 * torch.ones(4))
    if fn is _FooJvp:
        torch.testing.assert_close(torch.func.jvp(lambda v: sf.gather(g(v)), (x,), (torch.ones(4),))[1], 3.0 * torch.ones(4))


@pytest.mark.skipif(not _compat.CHECKPOINT_UNDER_VMAP,
                    reason="torch < 2.13: a checkpointing body runs per device, its collectives cannot recompute")
def test_custom_vjp_with_psum_under_remat():
    """JAX's test_optimize_remat: an autograd.Function whose forward runs a collective,
    checkpointed inside the body."""
    mesh = _mesh((4,), ("x",))

    class F(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return lax.psum(x, "x")

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return torch.cos(x) * g

    f = sf.shard_map(lambda x: checkpoint(F.apply, x, use_reentrant=False) ** 2, mesh=mesh, in_specs=P(), out_specs=P())
    x = torch.arange(4.0).requires_grad_()
    out = sf.gather(f(x))
    torch.testing.assert_close(out, (4 * x.detach()) ** 2)
    out.sum().backward()
    # as in JAX: x and the cotangent stay invariant (the custom backward inserts no psum), so the
    # replicated input gets the body's cotangent once: cos(x) * 2 * psum(x)
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) * 2 * (4 * x.detach()))


def test_checkpoint_in_a_per_device_body():
    """A body vmap cannot batch runs once per device: checkpointed regions recompute there
    (axis_index included), and a collective in one is a clear error, not a hang."""
    mesh = _mesh((4,), ("x",))

    def body(x, collective):
        def region(t):
            y = torch.sin(t) * (lax.axis_index("x") + 1)
            return torch.sin(lax.psum(y, "x")) if collective else y  # sin saves the psum's result

        y = checkpoint(region, x, use_reentrant=False)
        return y * 2 if x.sum() > -100 else y  # data-dependent on a varying value: per device

    x = torch.linspace(-1, 1, 8, dtype=torch.float64).requires_grad_()
    f = sf.shard_map(functools.partial(body, collective=False), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    sf.gather(f(x)).sum().backward()
    scale = torch.arange(1.0, 5.0, dtype=torch.float64).repeat_interleave(2)
    torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach()) * scale)
    g = sf.shard_map(functools.partial(body, collective=True), mesh=mesh, in_specs=P("x"), out_specs=P())
    out = sf.gather(g(x))
    with pytest.raises(sf.ShardingError, match=r"sf.lax.psum over \('x',\) in a checkpointed region recomputed"):
        out.sum().backward()
