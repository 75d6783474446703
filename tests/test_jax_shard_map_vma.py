"""JAX's tests/shard_map_test.py, continued: in_specs=None entries for non-array
arguments, replication after reductions, collectives' values, torch.func inside bodies,
vmap of grad of shard_map, mesh context errors, ported with plain torch as the oracle."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn import P, lax


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def test_in_spec_none_passes_objects_through():
    mesh = _mesh((4, 2), ("i", "j"))
    x = torch.arange(8.0).reshape(4, 2)
    obj, obj2, obj3 = object(), (object(), object()), {"a": object()}

    def f(o, x):
        assert o is obj
        return torch.sin(x)

    assert torch.equal(sf.shard_map(f, mesh=mesh, in_specs=(None, P("i")), out_specs=P("i"))(obj, x).full_tensor(), torch.sin(x))

    def f_none(o, x):
        assert o is None
        return torch.sin(x)

    assert torch.equal(sf.shard_map(f_none, mesh=mesh, in_specs=(None, P("i")), out_specs=P("i"))(None, x).full_tensor(),
                       torch.sin(x))

    def f2(o, x):
        assert isinstance(o, dict) and o["a"] is obj3["a"]
        return torch.sin(x)

    assert torch.equal(sf.shard_map(f2, mesh=mesh, in_specs=({"a": None}, P("i")), out_specs=P("i"))(obj3, x).full_tensor(),
                       torch.sin(x))

    def f4(o1, o2, x, o3):
        assert o1 is obj and o2[0] is obj2[0] and o2[1] is obj2[1] and o3 is obj
        return torch.sin(x)

    out = sf.shard_map(f4, mesh=mesh, in_specs=(None, None, P("i"), None), out_specs=P("i"))(obj, obj2, x, obj)
    assert torch.equal(out.full_tensor(), torch.sin(x))


@pytest.mark.parametrize("in_specs,args", [
    ((None, P("i", "j")), lambda x: (object(), x)),
    ((P("i", "j"), None), lambda x: (x, object())),
    ((P("i", "j"), None), lambda x: (x, (object(), object()))),
    ((P("i", "j"), (None, None)), lambda x: (x, (object(), object()))),
    (((None, None), P("i", "j")), lambda x: ((object(), object()), x)),
])
def test_in_spec_none_rank_errors(in_specs, args):
    mesh = _mesh((4, 2), ("i", "j"))
    with pytest.raises(sf.ShardingError, match="rank"):
        sf.shard_map(lambda *_: None, mesh=mesh, in_specs=in_specs, out_specs=None)(*args(torch.arange(4.0)))


def test_in_spec_none_hashability():
    class A:
        def __hash__(self):
            raise Exception("unhashable")

    mesh = _mesh((2,), ("i",))
    assert sf.shard_map(lambda a: (), mesh=mesh, in_specs=(None,), out_specs=())(A()) == ()


@pytest.mark.parametrize("reduce_along", [("y",), ("x",), ("x", "y")])
def test_get_check_rep(reduce_along):
    mesh = _mesh((2, 2), ("x", "y"))
    out_spec = P(*(n for n in ("x", "y") if n not in reduce_along))
    x = torch.arange(64.0).reshape(8, 8)
    out = sf.shard_map(lambda v: lax.psum(v, reduce_along), mesh=mesh, in_specs=P("x", "y"), out_specs=out_spec)(x)
    blocks = [[x[4 * i:4 * i + 4, 4 * j:4 * j + 4] for j in range(2)] for i in range(2)]
    if reduce_along == ("x", "y"):
        want = sum(b for row in blocks for b in row)
    elif reduce_along == ("x",):  # out P('y'): the sums over 'x', tiled along dim 0 by 'y'
        want = torch.cat([blocks[0][j] + blocks[1][j] for j in range(2)])
    else:
        want = torch.cat([blocks[i][0] + blocks[i][1] for i in range(2)])
    assert torch.equal(out.full_tensor(), want)


def test_pmin_pmax():
    mesh = _mesh((4,), ("i",))
    x = torch.arange(8.0)
    assert torch.equal(sf.shard_map(lambda v: lax.pmin(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x).full_tensor(),
                       torch.tensor([0.0, 1.0]))
    assert torch.equal(sf.shard_map(lambda v: lax.pmax(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x).full_tensor(),
                       torch.tensor([6.0, 7.0]))
    # pmax of an invariant value is the value (JAX inserts a pvary first)
    assert torch.equal(sf.shard_map(lambda v: lax.pmax(v, "i"), mesh=mesh, in_specs=P(), out_specs=P())(x).full_tensor(), x)


def test_mul_and_all_gather_of_invariant():
    mesh = _mesh((2,), ("x",))
    x = torch.arange(8.0)
    assert torch.equal(sf.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x).full_tensor(), x * 2)
    out = sf.shard_map(lambda v: lax.all_gather(v, "x"), mesh=mesh, in_specs=P(), out_specs=P("x"))(x)
    assert torch.equal(out.full_tensor(), x.expand(4, 8))


def test_rep_none_canonicalization():
    """A complex invariant operand (matrix_exp) times a varying sum."""
    mesh = _mesh((2,), ("i",))
    n = 8
    xs = torch.ones(8, n, dtype=torch.int32)
    v = torch.randn(n, n, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)) / 4

    def fun(v, xs):
        return torch.linalg.matrix_exp(v).sum() * xs.sum(-1).to(v.dtype)

    out = sf.shard_map(fun, mesh=mesh, in_specs=(P(), P("i")), out_specs=P("i"))(v, xs)
    torch.testing.assert_close(out.full_tensor(), fun(v, xs))
    f = sf.shard_map(lambda x: torch.cat([torch.zeros(1), x])[None], mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    assert f(torch.zeros(100)).shape == (2, 51)


def test_custom_jvp_symbolic_zeros():
    """Only one operand has a tangent: the custom jvp sees None for the other."""
    mesh = _mesh((4,), ("i",))

    class F(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(a, b):
            return a + b

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def jvp(ctx, a_dot, b_dot):
            out = 0
            for t in (a_dot, b_dot):
                if t is not None:
                    out = out + t
            return out

    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(4, 20, generator=gen), torch.randn(4, 20, generator=gen)
    g = sf.shard_map(F.apply, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    y, y_dot = torch.func.jvp(lambda v: sf.gather(g(v, a)), (x,), (x,))
    torch.testing.assert_close(y, x + a)
    torch.testing.assert_close(y_dot, x)


def test_shmap_full_manual_context():
    """JAX's test_shmap_full_manual_context_explicit/_auto: the mesh from `with mesh:` and
    the arguments' own specs."""
    mesh = _mesh((2, 2), ("x", "y"))
    inp = torch.arange(16.0).reshape(8, 2)
    arr = sf.distribute(inp, P("x", "y"), mesh=mesh)
    with mesh:
        for in_specs in (None, P("x", "y")):
            out = sf.shard_map(lambda x: x * 2, in_specs=in_specs, out_specs=P("x", "y"))(arr)
            assert torch.equal(out.full_tensor(), inp * 2)
            assert out.sharding == sf.NamedSharding(mesh, P("x", "y"))
        out = sf.shard_map(lambda x: x * 2, in_specs=P("x", "y"), out_specs=P("x", "y"))(inp)
        assert torch.equal(out.full_tensor(), inp * 2)
    out = sf.shard_map(lambda x: x * 2, axis_names=frozenset("x"), out_specs=P("x"))(arr)
    assert torch.equal(out.full_tensor(), inp * 2)


def test_ppermute_over_axes_in_another_order():
    """JAX rejects ('y', 'x') where the mesh is ('x', 'y'); shardfn ranks a group row-major
    over the names as given, so the permutation follows the spec P(('y', 'x'))."""
    mesh = _mesh((2, 2), ("x", "y"))
    inp = sf.distribute(torch.arange(4.0), P(("y", "x")), mesh=mesh)
    f = sf.shard_map(lambda v: lax.ppermute(v, ("y", "x"), [(0, 1), (1, 2), (2, 3), (3, 0)]), mesh=mesh,
                     in_specs=P(("y", "x")), out_specs=P(("y", "x")))
    assert torch.equal(f(inp).full_tensor(), torch.tensor([3.0, 0.0, 1.0, 2.0]))


def test_no_mesh_context_error():
    with pytest.raises(sf.ShardingError, match="needs a mesh"):
        sf.shard_map(lambda x: x, in_specs=P(), out_specs=P())(torch.arange(8.0))


def test_value_and_grad_inside_body():
    """JAX's test_pvary_in_shmap_of_grad."""
    mesh = _mesh((2,), ("x",))

    def f(x):
        g, v = torch.func.grad_and_value(lambda t: (t ** 2).mean())(x)
        return torch.atleast_1d(v), torch.atleast_1d(g)

    val, grad = sf.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(torch.tensor([1.0, 3.0]))
    assert torch.equal(val.full_tensor(), torch.tensor([1.0, 9.0]))
    assert torch.equal(grad.full_tensor(), torch.tensor([2.0, 6.0]))


def test_histogram_under_vmap_in_a_body():
    """JAX's test_jnp_histogram: an op vmap cannot batch (histogram) inside the body."""
    mesh = _mesh((2,), ("data",))
    x = torch.arange(64.0).reshape(8, 4, 2)
    edges = torch.linspace(0, 63, 101)

    def f(x, e):
        return torch.stack([torch.histogram(q, bins=e).hist for q in x])

    def f_vmapped(x, e):
        return torch.func.vmap(lambda q: torch.histogram(q, bins=e).hist)(x)

    want = torch.stack([torch.histogram(q, bins=edges).hist for q in x])
    for fn in (f, f_vmapped):
        out = sf.shard_map(fn, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, edges)
        assert torch.equal(out.full_tensor(), want)


def test_linearize_inside_body():
    """JAX's test_shmap_linearize_and_linearize_transpose_error (torch has no linear_transpose:
    the linearized function's tangent output)."""
    mesh = _mesh((2,), ("x",))

    def m(p, t):
        _, fwd = torch.func.linearize(lambda v: (v ** 2).mean(), p)
        return fwd(t)[None]

    out = sf.shard_map(lambda t: m(torch.tensor([1.0, 2.0]), t), mesh=mesh, in_specs=P("x"), out_specs=P("x"))(
        torch.tensor([1.0, 1.0, 3.0, 5.0]))
    torch.testing.assert_close(out.full_tensor(), torch.tensor([3.0, 13.0]))  # t0 + 2 t1 per device


def test_argmax_in_body():
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    out = sf.shard_map(lambda v: v.argmax(-1, keepdim=True), mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))(x)
    assert torch.equal(out.full_tensor(), torch.cat([b.argmax(-1, keepdim=True) for b in x.split(4, 1)], 1))


@pytest.mark.parametrize("nested_axis_names", [True, False])
def test_vmap_grad_of_nested_shard_map(nested_axis_names):
    """JAX's test_explicit_vmap_grad_shmap: vmap(grad(g)) where g reshards and shard_maps."""
    mesh = _mesh((2, 2), ("x", "y"))
    inp = torch.arange(6 * 24, dtype=torch.float32).reshape(6, 24) / 100
    kw = {"axis_names": {"y"}} if nested_axis_names else {}

    def g(x):
        x = sf.distribute(x, P("y"), mesh=mesh)
        return sf.gather(sf.shard_map(torch.cos, in_specs=P("y"), out_specs=P("y"), **kw)(x)).sum()

    out = torch.func.vmap(torch.func.grad(g))(inp)
    torch.testing.assert_close(out, -torch.sin(inp))


def test_vmap_grad_of_shard_map_with_residuals():
    """JAX's test_vmap_grad(_remat)_shmap_spmd_axis_name_residuals without spmd_axis_name."""
    mesh = _mesh((4, 2), ("i", "j"))
    f = sf.shard_map(torch.sin, mesh=mesh, in_specs=P("j"), out_specs=P("j"))
    xs = torch.arange(4 * 16.0).reshape(4, 16) / 10
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(lambda x: sf.gather(f(x)).sum()))(xs), torch.cos(xs))
    xr = xs.clone().requires_grad_()
    checkpoint(lambda v: sf.gather(f(v)), xr, use_reentrant=False).sum().backward()
    torch.testing.assert_close(xr.grad, torch.cos(xs))


def test_grad_remat_on_a_size_one_mesh():
    mesh = _mesh((1, 1), ("i", "j"))
    x, y = torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(3, 2, 1)
    f = sf.shard_map(lambda a, b: torch.einsum("ij,kjl->ikl", a, b), mesh=mesh, in_specs=(P("j"), P("i")),
                     out_specs=P("i", "j"))
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    checkpoint(lambda a, b: sf.gather(f(a, b)), xr, yr, use_reentrant=False).sum().backward()
    want = torch.func.grad(lambda a, b: torch.einsum("ij,kjl->ikl", a, b).sum(), argnums=(0, 1))(x, y)
    torch.testing.assert_close(xr.grad, want[0])
    torch.testing.assert_close(yr.grad, want[1])


def test_dynamic_slice_transpose():
    mesh = _mesh((2,), ("x",))
    arr = torch.arange(16.0)
    f = sf.shard_map(lambda x: torch.narrow(x, 0, torch.tensor(1), 2), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    assert torch.equal(f(arr).full_tensor(), torch.tensor([1.0, 2.0, 9.0, 10.0]))
    g = torch.func.grad(lambda x: sf.gather(f(x)).sum())(arr)
    assert torch.equal(g, torch.zeros(16).index_fill(0, torch.tensor([1, 2, 9, 10]), 1.0))


@pytest.mark.parametrize("spec", [P(), P("x"), P(("x", "y"))])
def test_print_inside_shard_map(spec, capsys):
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0)

    def f(v):
        print(v)
        return 2 * v

    out = sf.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(x)
    assert torch.equal(out.full_tensor(), 2 * x)
    assert capsys.readouterr().out


def test_linalg_in_body():
    """JAX's test_custom_linear_solve_rep_rules and test_linalg_inv."""
    mesh = _mesh((1,), ("i",))
    out = sf.shard_map(torch.linalg.solve, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(
        torch.ones(1, 1), torch.ones(1))
    assert torch.equal(out.full_tensor(), torch.ones(1))
    m2 = _mesh((2,), ("x",))
    a = torch.eye(3).expand(4, 3, 3) * torch.arange(1.0, 5.0)[:, None, None]
    inv = sf.shard_map(torch.linalg.inv, mesh=m2, in_specs=P("x"), out_specs=P("x"))(a)
    torch.testing.assert_close(inv.full_tensor(), torch.linalg.inv(a))


def test_axis_index_explicit_mesh_eager_shmap():
    mesh = _mesh((2, 2), ("x", "y"))
    with mesh:
        out = sf.shard_map(lambda: torch.stack([lax.axis_index(n) for n in mesh.axis_names]), in_specs=(),
                           out_specs=P(mesh.axis_names))()
        assert torch.equal(out.full_tensor(), torch.tensor([0, 0, 0, 1, 1, 0, 1, 1]))
        out = sf.shard_map(lambda: torch.stack([lax.axis_index(n) for n in mesh.axis_names]), in_specs=(),
                           out_specs=P(), check_vma=False)()
        assert torch.equal(out.full_tensor(), torch.tensor([0, 0]))


def test_split_with_unused_result_in_shardmap():
    mesh = _mesh((2,), ("x",))
    f = sf.shard_map(lambda x: torch.split(x, 2)[0], mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    g = torch.func.grad(lambda x: (0.1 * sf.gather(f(x)).mean(0, keepdim=True)).squeeze(0))(torch.ones(8))
    torch.testing.assert_close(g, torch.tensor([0.025, 0.025, 0, 0, 0.025, 0.025, 0, 0]))


def test_zero_cotangent_sharding():
    """A custom backward returning None (no gradient) inside a body."""
    mesh = _mesh((2,), ("x",))

    class Inner(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return None

    f = sf.shard_map(Inner.apply, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    x = sf.distribute(torch.arange(8.0), P("x"), mesh=mesh)
    g = torch.func.grad(lambda v: sf.gather(f(v)).sum())(torch.arange(8.0))
    assert torch.equal(g, torch.zeros(8))
    xr = x.detach().requires_grad_()
    out = f(xr).full_tensor().sum()
    if out.requires_grad:
        (gr,) = torch.autograd.grad(out, xr, allow_unused=True)
        assert gr is None or torch.equal(gr.full_tensor(), torch.zeros(8))


def test_vmap_shmap_psum():
    mesh = _mesh((2, 2), ("x", "y"))
    full = torch.arange(16.0).reshape(2, 8)
    arr = sf.distribute(full, P("x", "y"), mesh=mesh)
    f = sf.shard_map(lambda x: lax.psum(x, "y"), in_specs=P("y"), out_specs=P(None))
    out = torch.func.vmap(f)(arr)
    assert torch.equal(sf.gather(out), full.reshape(2, 2, 4).sum(1))


def test_psum_reduced_input():
    mesh = _mesh((2, 2), ("x", "y"))
    arr = sf.distribute(torch.arange(32.0).reshape(8, 4), P("x", "y"), mesh=mesh)

    def f(x):
        seq_x = lax.all_gather_invariant(x, "y", axis=1, tiled=True)
        return lax.psum(seq_x.sum(), "x")

    g = sf.shard_map(f, out_specs=P())
    assert g(arr).full_tensor() == torch.arange(32.0).sum()
    ar = arr.detach().requires_grad_()
    g(ar).full_tensor().backward()
    assert ar.grad.sharding == arr.sharding and torch.equal(ar.grad.full_tensor(), torch.ones(8, 4))


def test_slice_oob_shmap():
    mesh = _mesh((2,), ("x",))
    arr = sf.distribute(torch.ones(32, 32), P(None, "x"), mesh=mesh)
    out = sf.shard_map(lambda x: x[:, 100:116], in_specs=P(None, "x"), out_specs=P(None, "x"))(arr)
    assert out.shape == (32, 0) and _same_spec(out, P(None, "x"))


def _same_spec(a, spec):
    return a.placements == sf.NamedSharding(a.mesh, spec).placements(a.ndim)


def test_nested_shmap_innermost_no_axis_names():
    mesh = _mesh((2, 2), ("x", "y"))
    arr = torch.ones(4)

    def h(x):
        return sf.shard_map(lambda y: y * 2, in_specs=P(), out_specs=P())(x)

    def g(x):
        return sf.shard_map(h, in_specs=P(), out_specs=P(), axis_names={"y"})(x)

    out = sf.shard_map(g, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"x"})(arr)
    assert torch.equal(out.full_tensor(), arr * 2)


def test_full_like_pvary_existing():
    mesh = _mesh((2,), ("x",))

    def f():
        res = lax.pcast(torch.tensor([10, 11]), "x", to="varying")
        fill = lax.pcast(torch.tensor(-1), "x", to="varying")
        return torch.full_like(res, 0) + fill

    assert torch.equal(sf.shard_map(f, mesh=mesh, in_specs=(), out_specs=P("x"))().full_tensor(), torch.full((4,), -1))


def test_empty_mesh_error():
    with pytest.raises(sf.ShardingError):
        sf.shard_map(lambda x: x, mesh=sf.Mesh((), ()), in_specs=P("x"), out_specs=P("x"))(torch.arange(8))
