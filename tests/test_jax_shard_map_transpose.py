"""JAX's tests/shard_map_test.py, continued: axis_index, transposes of fan-out / fan-in,
custom derivatives and torch.func transforms inside bodies, check_vma=False gradients and
JAX's unreduced (shardfn's partial) inputs and outputs, with plain torch as the oracle."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn import P, lax

from _custom_fns import scaled_foo


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def _g(f):
    """``f`` with its ShardedArray outputs gathered."""
    def run(*args):
        out = f(*args)
        return tuple(sf.gather(o) for o in out) if isinstance(out, (tuple, list)) else sf.gather(out)
    return run


def test_axis_index_basic():
    mesh = _mesh((4,), ("x",))
    ans = sf.shard_map(lambda: lax.axis_index("x")[None], mesh=mesh, in_specs=(), out_specs=P("x"))()
    assert torch.equal(ans.full_tensor(), torch.arange(4))


def test_axis_index_twoaxes():
    mesh = _mesh((4, 2), ("i", "j"))

    def foo():
        return (lax.axis_index("i")[None, None], lax.axis_index("j")[None, None], lax.axis_index(("i", "j"))[None, None])

    a1, a2, a3 = sf.shard_map(foo, mesh=mesh, in_specs=(), out_specs=P("i", "j"))()
    assert torch.equal(a1.full_tensor(), torch.arange(4)[:, None].expand(4, 2))
    assert torch.equal(a2.full_tensor(), torch.arange(2)[None, :].expand(4, 2))
    assert torch.equal(a3.full_tensor(), torch.arange(8).reshape(4, 2))


def test_axis_index_eager():
    mesh = _mesh((4,), ("x",))

    def foo():
        return 1.0 if lax.psum(lax.axis_index("x"), "x") > 0 else -1.0

    assert sf.shard_map(foo, mesh=mesh, in_specs=(), out_specs=P())() == 1.0


def test_body_creating_tensors():
    """JAX's test_jaxpr_shardings_with_no_outputs and test_device_put: factories in a body."""
    mesh = _mesh((4,), ("i",))
    out = sf.shard_map(lambda: torch.arange(4, dtype=torch.int32), mesh=mesh, in_specs=(), out_specs=P("i"))()
    assert torch.equal(out.full_tensor(), torch.arange(4, dtype=torch.int32).repeat(4))
    g = sf.shard_map(lambda a: torch.arange(a.shape[0]) + a, mesh=mesh, in_specs=(P("i"),), out_specs=P("i"))
    assert torch.equal(g(torch.arange(32)).full_tensor(), torch.arange(32) + torch.arange(8).repeat(4))
    h = sf.shard_map(lambda x: x + torch.tensor(1.0), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    assert torch.equal(h(torch.arange(32.0)).full_tensor(), torch.arange(32.0) + 1)


def test_returned_out_sharding():
    mesh = _mesh((1, 2), ("x", "y"))
    s = sf.NamedSharding(mesh, P("x", "y"))
    inp = sf.distribute(torch.zeros(2, 2), s)
    out = sf.shard_map(lambda x: x, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))(inp)
    assert out.sharding == s
    assert torch.equal(out.full_tensor(), inp.full_tensor())


def test_same_pspec_eager_shard_map():
    mesh = _mesh((1, 4, 1), ("data", "seq", "model"))
    spec = P("data", "seq", "model")
    x = sf.distribute(torch.ones(2, 16, 4), spec, mesh=mesh)
    y = sf.shard_map(lambda x: x * x + 2, mesh=mesh, in_specs=spec, out_specs=spec)(x)
    assert y.sharding.spec == spec
    assert torch.equal(y.full_tensor(), torch.full((2, 16, 4), 3.0))


def test_closure_over_a_scalar_with_no_inputs():
    """JAX's test_post_process_partial_eval_with_scalar_res."""
    mesh = _mesh((4, 2), ("i", "j"))
    x = torch.tensor(2.0, dtype=torch.float64)
    g = torch.func.grad(lambda x: sf.gather(sf.shard_map(lambda: torch.sin(x), mesh=mesh, in_specs=(), out_specs=P())()))(x)
    torch.testing.assert_close(g, torch.cos(x))


def test_dce_values_and_grads():
    """JAX's test_dce: a body with a closed-over value and unused outputs; derivatives
    of each output alone."""
    mesh = _mesh((4, 2), ("i", "j"))
    gen = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(s, s, dtype=torch.float64, generator=gen) for s in (4, 8, 16))

    def f(x, y, z):
        g = sf.shard_map(lambda y, z: (torch.sin(x), torch.cos(z), torch.tan(y)), mesh=mesh,
                         in_specs=(P("i", "j"), P(None, "i")), out_specs=(P(None, None), P(None, "i"), P("i", "j")))
        return _g(g)(y, z)

    outs = f(x, y, z)
    torch.testing.assert_close(outs[0], torch.sin(x))
    torch.testing.assert_close(outs[1], torch.cos(z))
    torch.testing.assert_close(outs[2], torch.tan(y))
    wants = ((torch.cos(x), 0 * y, 0 * z), (0 * x, 0 * y, -torch.sin(z)), (0 * x, 1 / torch.cos(y) ** 2, 0 * z))
    for k, want in enumerate(wants):
        got = torch.func.grad(lambda *a, k=k: f(*a)[k].sum(), argnums=(0, 1, 2))(x, y, z)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


# -- custom derivatives in bodies (JAX's test_rewrite_process_custom_*) ----------------------------


def test_rewrite_process_custom_jvp_call():
    mesh = _mesh((4,), ("x",))
    foo = scaled_foo(2.0)
    g = _g(sf.shard_map(lambda x: foo.apply(x) * x, mesh=mesh, in_specs=(P("x"),), out_specs=P("x")))
    x = torch.arange(4.0)
    torch.testing.assert_close(g(x), 2 * x * x)
    y2, y_dot = torch.func.jvp(g, (x,), (3 * x,))
    torch.testing.assert_close(y2, 2 * x * x)
    torch.testing.assert_close(y_dot, 2 * 2 * 3 * x * x)


@pytest.mark.parametrize("loop", [0, 1])
def test_rewrite_process_custom_vjp_call(loop):
    """loop=1 is JAX's test_rewrite_custom_vjp_call_jaxpr (the call inside a scan of length 1)."""
    mesh = _mesh((4,), ("x",))
    foo = scaled_foo(2.0)

    def body(x):
        y = x
        for _ in range(loop or 1):
            y = foo.apply(y)
        return y * x

    g = _g(sf.shard_map(body, mesh=mesh, in_specs=(P("x"),), out_specs=P("x")))
    x = torch.arange(4.0)
    torch.testing.assert_close(g(x), 2 * x * x)
    x_bar, y = torch.func.grad_and_value(lambda v: g(v).sum())(x)
    torch.testing.assert_close(y, (2 * x * x).sum())
    torch.testing.assert_close(x_bar, 2 * 2 * x)


def test_rewrite_process_custom_vjp_call_match_more_replicated():
    mesh = _mesh((4,), ("x",))
    foo = scaled_foo(2.0, bwd=torch.ones_like)
    g = _g(sf.shard_map(lambda x: foo.apply(x) * x, mesh=mesh, in_specs=(P("x"),), out_specs=P("x")))
    x = torch.arange(4.0)
    x_bar, y = torch.func.grad_and_value(lambda v: g(v).sum())(x)
    torch.testing.assert_close(y, (2 * x * x).sum())
    torch.testing.assert_close(x_bar, torch.ones_like(x) + 2 * x)


# -- transposes ------------------------------------------------------------------------------------


def _vjp(f, x, ct):
    return torch.func.vjp(_g(f), x)[1](ct)[0]


def test_transpose_identity():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P())
    one = torch.tensor(1.0)
    assert _vjp(f, one, torch.tensor(3.0)) == 3.0
    vjp_fn = lambda ct: torch.func.vjp(_g(f), one)[1](ct)[0]  # noqa: E731
    assert torch.func.vjp(vjp_fn, torch.tensor(1.0))[1](torch.tensor(5.0))[0] == 5.0


def test_fanout_specs_transpose_to_psum():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P("x"))
    assert torch.equal(_vjp(f, torch.arange(1.0), torch.arange(4.0)), torch.tensor([6.0]))


def test_fanin_psum_transposes_to_fanout():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: lax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    assert torch.equal(_vjp(f, torch.arange(4.0), torch.tensor([1.0])), torch.ones(4))


def test_psum_with_implicit_fanout_self_transposes():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: lax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    assert torch.equal(_g(f)(torch.arange(4.0)), torch.full((4,), 6.0))
    assert torch.equal(_vjp(f, torch.arange(4.0), torch.arange(4.0)), torch.full((4,), 6.0))


def test_pvary():
    mesh = _mesh((4,), ("x",))
    for cast in (lambda x: lax.pcast(x, "x", to="varying"), lambda x: lax.pvary(x, "x")):
        f = sf.shard_map(cast, mesh=mesh, in_specs=P(), out_specs=P("x"))
        x = torch.arange(8.0)
        assert torch.equal(sf.gather(f(x)), x.repeat(4))
        assert torch.equal(torch.func.grad(lambda v, f=f: sf.gather(f(v)).sum())(x), torch.full((8,), 4.0))


@pytest.mark.parametrize("bad", [{"x"}, frozenset({"x"})])
def test_pcast_axis_name_is_not_set(bad):
    mesh = _mesh((2,), ("x",))

    def f(x):
        with pytest.raises(TypeError, match="must be a mesh axis name or a non-empty tuple"):
            lax.pcast(x, bad, to="varying")

    sf.shard_map(f, mesh=mesh, in_specs=P(), out_specs=None)(torch.arange(8.0))


def test_rewrite_binops_and_loop():
    """JAX's test_rewrite_binops and test_rewrite_scan: values of an invariant times a
    varying operand, and of a loop re-casting a psum to varying."""
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x, y: x * y, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))
    assert torch.equal(f(torch.tensor([2.0]), torch.arange(4.0)).full_tensor(), 2 * torch.arange(4.0))

    def g(x):
        for _ in range(2):
            x = lax.pcast(lax.psum(x, "x"), "x", to="varying")
        return x

    h = sf.shard_map(g, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    assert torch.equal(h(torch.arange(4.0)).full_tensor(), torch.full((4,), 24.0))
    # transposes: pvary -> psum, psum -> pvary: d/dx_i sum_j out_j = 4 * 4
    assert torch.equal(torch.func.grad(lambda v: sf.gather(h(v)).sum())(torch.arange(4.0)), torch.full((4,), 16.0))


def test_check_rep_false_grads():
    mesh = _mesh((4,), ("heads",))
    q_spec, kv_spec = P("heads", None), P(None)

    def f(q, k, v):
        out = sf.shard_map(lambda q, k, v: q * k[None, :] + v[None, :], mesh=mesh, check_vma=False,
                           in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)(q, k, v)
        return torch.sin(sf.gather(out)).sum()

    def ref(q, k, v):
        return torch.sin(q * k[None, :] + v[None, :]).sum()

    args = (torch.arange(32.0, dtype=torch.float64).reshape(4, 8) / 10, torch.arange(8.0, dtype=torch.float64) / 10,
            torch.arange(8.0, dtype=torch.float64) / 10)
    got = torch.func.grad(f, argnums=(0, 1, 2))(*args)
    want = torch.func.grad(ref, argnums=(0, 1, 2))(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    qs = sf.distribute(args[0], q_spec, mesh=mesh).requires_grad_()
    f(qs, *args[1:]).backward()
    assert qs.grad.sharding == qs.sharding
    torch.testing.assert_close(qs.grad.full_tensor(), want[0])


def test_axis_env_extension_regression():
    """Checkpoint around a check_vma=False shard_map using axis_index."""
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda x: torch.exp(x) + lax.axis_index("x").to(x.dtype), mesh=mesh, in_specs=(P("x"),),
                     out_specs=P("x"), check_vma=False)
    x = torch.arange(8.0, dtype=torch.float64).requires_grad_()
    out = checkpoint(lambda v: sf.gather(f(v)), x, use_reentrant=False)
    torch.testing.assert_close(out.detach(), torch.exp(x.detach()) + torch.arange(4.0, dtype=torch.float64).repeat_interleave(2))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.exp(x.detach()))


@pytest.mark.parametrize("remat", [False, True])
def test_res_forwarding(remat):
    """JAX's test_res_forwarding_optimization(_2, _complex): values and gradients."""
    mesh = _mesh((4,), ("i",))
    f1 = sf.shard_map(torch.exp, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    f2 = sf.shard_map(lambda x: (torch.exp(x), torch.exp(x)), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    f3 = sf.shard_map(lambda x: (torch.exp(x.sum()) + x, torch.exp(x)), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = torch.arange(16.0, dtype=torch.float64) / 16
    wrap = (lambda fn: lambda v: checkpoint(fn, v, use_reentrant=False)) if remat else (lambda fn: fn)
    cases = [
        (lambda v: sf.gather(f1(v)).sum(), torch.exp(x)),
        (lambda v: sf.gather(f2(v)[1]).sum(), torch.exp(x)),
        (lambda v: sum(sf.gather(o) for o in f3(v)).sum(),
         1 + torch.exp(x) + 4 * torch.exp(x.reshape(4, 4).sum(1)).repeat_interleave(4)),
    ]
    for loss, want in cases:
        xr = x.clone().requires_grad_()
        wrap(loss)(xr).backward()
        torch.testing.assert_close(xr.grad, want)


def test_check_rep_failure_inside_rule():
    """The gradient of a scalar the body closes over."""
    mesh = _mesh((4,), ("i",))

    def loss(w, x):
        return sf.gather(sf.shard_map(lambda x: lax.psum(((w * x) ** 2).sum(), "i"), mesh=mesh, in_specs=P("i"),
                                      out_specs=P())(x))

    x = torch.arange(8.0, dtype=torch.float64)
    w = torch.tensor(3.0, dtype=torch.float64)
    torch.testing.assert_close(torch.func.grad(loss)(w, x), 2 * w * (x ** 2).sum())
    wr = w.clone().requires_grad_()
    loss(wr, x).backward()
    torch.testing.assert_close(wr.grad, 2 * w * (x ** 2).sum())


def test_ops_in_bodies():
    """JAX's test_conv_general_dilated, test_cumsum, test_custom_jvp_inside_jit (relu),
    test_erf_rules, test_approx_top_k: ops on local blocks."""
    mesh = _mesh((4,), ("i",))
    a, b = torch.ones(16, 32), torch.ones(32, 8)
    f = sf.shard_map(lambda x, y: lax.psum(torch.nn.functional.conv1d(x[..., None], y.T[..., None])[..., 0], "i"),
                     mesh=mesh, in_specs=(P(None, "i"), P("i", None)), out_specs=P(None, None))
    torch.testing.assert_close(f(a, b).full_tensor(), a @ b)
    x = torch.arange(8.0)
    for fn, want in ((torch.cumsum, lambda v: v.reshape(4, 2).cumsum(1).flatten()), (torch.relu, torch.relu),
                     (torch.special.erf, torch.special.erf)):
        body = functools.partial(fn, dim=0) if fn is torch.cumsum else fn
        torch.testing.assert_close(sf.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x).full_tensor(), want(x))
    m2 = _mesh((2,), ("i",))
    vals = sf.shard_map(lambda v: torch.topk(v, 2).values, mesh=m2, in_specs=P("i"), out_specs=P("i"))(
        torch.tensor([3.0, 1.0, 4.0, 2.0]))
    assert torch.equal(vals.full_tensor(), torch.tensor([3.0, 1.0, 4.0, 2.0]))


def test_error_for_variable_num_args():
    mesh = _mesh((2, 2), ("x", "y"))

    def f(*args):
        return args[0] @ args[1]

    g = sf.shard_map(f, mesh=mesh, in_specs=(P("x", "y", None), P("x", "y", None)), out_specs=P("x", "y"))
    with pytest.raises(sf.ShardingError, match=r"args\[0\].*rank 2"):
        g(torch.ones(8, 8), torch.ones(8, 8))


def test_repeated_psum_allowed():
    mesh = _mesh((4,), ("i",))
    g = sf.shard_map(lambda x: lax.psum(lax.psum(x, "i"), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    assert torch.equal(g(torch.arange(4.0)).full_tensor(), torch.arange(4.0).sum(0, keepdim=True) * 4)


def test_jacrev_inside_body():
    """JAX's test_jacrev_explicit(_complex): torch.func.jacrev inside a body."""
    mesh = _mesh((2, 2), ("x", "y"))
    bsz, n, h = 20, 6, 8
    w = torch.arange(n * h, dtype=torch.float32).reshape(n, h) / 10
    x = torch.arange(bsz * n, dtype=torch.float32).reshape(bsz, n) / 10

    def f(w, xs):
        return tuple((z @ w).sum(-1) for z in xs)

    def body(w, x, y):
        j = torch.func.jacrev(f, argnums=1)(w, (x, y))
        return j[0][0], j[0][1], j[1][0], j[1][1]

    outs = sf.shard_map(body, mesh=mesh, in_specs=(P(), P("x"), P("y")),
                        out_specs=(P("x"), P(("x", "y")), P(("y", "x")), P("y")))(w, x, x)
    blk = bsz // 2
    rows = torch.arange(bsz)
    for k, (o, rep) in enumerate(zip(outs, (False, True, True, False))):
        full = o.full_tensor()
        assert full.shape == ((2 * bsz if rep else bsz), blk, n), k
    d = outs[0].full_tensor()
    want = torch.zeros(bsz, blk, n)
    want[rows, rows % blk] = w.sum(1)
    torch.testing.assert_close(d, want)
    assert torch.count_nonzero(outs[1].full_tensor()) == 0


@pytest.mark.parametrize("seed,num_input_fwd,num_output_fwd", [(s, i, o) for s, i, o in
                                                                itertools.product(range(2), range(4), range(4))])
def test_forwarding_correctness(seed, num_input_fwd, num_output_fwd):
    num_args = 3
    rng = random.Random(seed)
    in_perm, out_perm = rng.sample(range(num_args), num_args), rng.sample(range(num_args), num_args)
    mesh = _mesh((1,), ("i",))

    def body(inputs):
        inputs = [inputs[i] for i in in_perm]
        outputs = inputs[:num_input_fwd] + [
            torch.exp(inputs[i]) if i < num_output_fwd else torch.sin(inputs[i]) for i in range(num_args - num_input_fwd)]
        return [outputs[i] for i in out_perm]

    f = sf.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    xs = [torch.tensor([float(i)], dtype=torch.float64) for i in range(num_args)]
    weights = [torch.tensor([1.0 + k], dtype=torch.float64) for k in range(num_args)]
    loss = lambda fn: lambda *a: sum((w * o).sum() for w, o in zip(weights, fn(list(a))))  # noqa: E731
    got = torch.func.grad(loss(lambda a: [sf.gather(o) for o in f(a)]), argnums=(0, 1, 2))(*xs)
    want = torch.func.grad(loss(body), argnums=(0, 1, 2))(*xs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_vjp_inside_body_per_row():
    """JAX's test_eval_shape_vma: a vjp per row inside the body."""
    mesh = _mesh((2,), ("x",))
    gen = torch.Generator().manual_seed(123)
    p, x = torch.rand(5, generator=gen), torch.rand(16, 5, generator=gen)

    def f(p, x):
        return torch.einsum("i,i->", x, p)

    def body(p, x):
        rows = []
        for r in x:
            y, vjp_fn = torch.func.vjp(f, p, r)
            rows.append(torch.stack(vjp_fn(torch.ones_like(y))))
        return torch.stack(rows)

    out = sf.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))(p, x).full_tensor()
    torch.testing.assert_close(out[:, 0], x)
    torch.testing.assert_close(out[:, 1], p.expand(16, 5))


# -- unreduced (JAX) = partial (shardfn) -----------------------------------------------------------


def _ab(mesh, sa, sb, a_shape=(2, 4), b_shape=(4, 6)):
    a = torch.arange(float(torch.Size(a_shape).numel())).reshape(a_shape)
    b = torch.arange(float(torch.Size(b_shape).numel())).reshape(b_shape)
    return a, b, sf.distribute(a, sa, mesh=mesh), sf.distribute(b, sb, mesh=mesh)


@pytest.mark.parametrize("which", ["psum", "psum_scatter"])
def test_unreduced_in_spec(which):
    """JAX's test_unreduced_psum_fwd_preduced_bwd and test_unreduced_psum_scatter_fwd_all_gather_reduced_bwd:
    the body sees each device's summand of a partial array."""
    mesh = _mesh((2,), ("x",))
    shapes = ((2, 4), (4, 6)) if which == "psum" else ((4, 2), (2, 6))
    a, b, arr1, arr2 = _ab(mesh, P(None, "x"), P("x", None), *shapes)
    body, out_spec = ((lambda t: lax.psum(t, "x"), P()) if which == "psum"
                      else (lambda t: lax.psum_scatter(t, "x", tiled=True), P("x", None)))
    seen = []

    def f(x, y):
        z = sf.matmul(x, y, out_sharding=P(partial="x"))
        return sf.gather(sf.shard_map(lambda t: (seen.append(t.shape), body(t))[1], mesh=mesh,
                                      in_specs=P(partial="x"), out_specs=out_spec)(z)).sum()

    assert f(arr1, arr2) == (a @ b).sum()
    assert seen[-1] == (a @ b).shape  # each device's whole summand
    x1, x2 = arr1.detach().requires_grad_(), arr2.detach().requires_grad_()
    f(x1, x2).backward()
    assert x1.grad.sharding == arr1.sharding and x2.grad.sharding == arr2.sharding
    want = torch.func.grad(lambda x, y: (x @ y).sum(), argnums=(0, 1))(a, b)
    torch.testing.assert_close(x1.grad.full_tensor(), want[0])
    torch.testing.assert_close(x2.grad.full_tensor(), want[1])
    got = torch.func.grad(lambda x: f(sf.distribute(x, P(None, "x"), mesh=mesh), arr2))(a)
    torch.testing.assert_close(got, want[0])


def test_unreduced_in_spec_needs_pending_sums():
    """JAX's test_sin_unreduced_error / test_shmap_auto_unreduced_error: the summands vary,
    so an elementwise op on them cannot be returned replicated; a plain tensor has no summands."""
    mesh = _mesh((2,), ("x",))
    a, b, arr1, arr2 = _ab(mesh, P(None, "x"), P("x", None), (4, 2), (2, 6))
    z = sf.matmul(arr1, arr2, out_sharding=P(partial="x"))
    with pytest.raises(sf.ShardingError, match="varies over mesh axis 'x'"):
        sf.shard_map(torch.sin, in_specs=None, out_specs=P())(z)
    with pytest.raises(sf.ShardingError, match=r"args\[0\] is a plain tensor.*partial in_spec"):
        sf.shard_map(lambda t: t, mesh=mesh, in_specs=P(partial="x"), out_specs=P())(torch.arange(8.0))


def test_unreduced_round_trip():
    """A partial array in and out unchanged: the same pending sums."""
    mesh = _mesh((2, 2), ("x", "y"))
    a, b, arr1, arr2 = _ab(mesh, P("x", "y"), P("y", None))
    z = sf.matmul(arr1, arr2, out_sharding=P("x", None, partial="y"))
    out = sf.shard_map(lambda t: t * 2, in_specs=None, out_specs=P("x", None, partial="y"))(z)
    assert out.placements == z.placements
    assert [torch.equal(o, 2 * s) for o, s in zip(out.local_shards(), z.local_shards())] == [True] * 4
    torch.testing.assert_close(out.full_tensor(), 2 * a @ b)


@pytest.mark.parametrize("rows", [4, 5], ids=["even", "uneven"])
@pytest.mark.parametrize("how", ["func_jvp", "forward_ad", "jacfwd"])
def test_jvp_of_outputs_summed_or_unchecked_over_an_axis(rows, how):
    """The tangent of a partial-sum output sums every part's tangent, and an unchecked
    (check_vma=False) replicated output's is its replicas' (here equal) tangent; the
    uneven per-device path took the first part's alone (1/3 of it for factors 1 and 2)."""
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.randn(rows, 6, dtype=torch.float64)
    t = torch.randn(rows, 6, dtype=torch.float64)
    summed = sf.shard_map(lambda u: u.sin() * (lax.axis_index("y") + 1) ** 2, mesh=mesh, in_specs=P("x"),
                          out_specs=P("x", partial="y"))
    unchecked = sf.shard_map(lambda u: u.sin() * 3, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                             check_vma=False)
    xs, ts = sf.distribute(x, P("x"), mesh=mesh), sf.distribute(t, P("x"), mesh=mesh)
    for f, factor in ((summed, 5.0), (unchecked, 3.0)):
        expected = x.cos() * t * factor
        if how == "func_jvp":
            _, tan = torch.func.jvp(f, (xs,), (ts,))
        elif how == "forward_ad":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                tan = fwAD.unpack_dual(f(fwAD.make_dual(xs, ts))).tangent
        else:
            jac = torch.func.jacfwd(lambda a: sf.gather(f(a))[1])(xs)  # (6, rows, 6), plain
            torch.testing.assert_close(jac[:, 1], torch.diag(x[1].cos()) * factor)
            torch.testing.assert_close(jac[:, 0], torch.zeros(6, 6, dtype=torch.float64))
            continue
        torch.testing.assert_close(sf.gather(tan), expected)
