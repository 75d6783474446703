"""JAX's tests/shard_map_test.py (ShardMapTest, first part), ported test by test: the same
meshes, specs, inputs and expected blocks / values / errors, with plain torch as the oracle
for derivatives (jax.grad -> torch.func.grad, jvp -> torch.func.jvp, vmap -> torch.func.vmap)."""

from __future__ import annotations

import functools

import pytest
import torch

import shardfn as sf
from shardfn import P, lax


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def _create_inputs(a_spec, b_spec, dtype=torch.float32):
    """JAX's create_inputs: a (2, 2, 2) mesh ('x', 'y', 'z') and two 8x8 aranges laid out as given."""
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    a = sf.distribute(torch.arange(64, dtype=dtype).reshape(8, 8), P(*a_spec), mesh=mesh)
    b = sf.distribute(torch.arange(64, dtype=dtype).reshape(8, 8), P(*b_spec), mesh=mesh)
    return mesh, a, b


def _data(x, i):
    """JAX's addressable_data(i): device i's block."""
    return x.local_shards()[i]


def test_identity():
    mesh, a, _ = _create_inputs(("z", ("x", "y")), (None, None))
    assert _data(a, 0).shape == (4, 2)
    c = sf.shard_map(lambda x: x, mesh=mesh, in_specs=(P("z", ("x", "y")),), out_specs=P("z", ("x", "y")))(a)
    assert _data(c, 0).shape == (4, 2)
    assert torch.equal(c.full_tensor(), a.full_tensor())


def test_all_gather():
    mesh, a, _ = _create_inputs(("z", ("x", "y")), (None, None))

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("z", ("x", "y")),), out_specs=P("z", ("x", "y")))
    def fwd(a):
        return lax.all_gather(a, "z", axis=0, tiled=True), lax.all_gather(a, ("x", "y"), axis=-1, tiled=True)

    c, d = fwd(a)
    full = a.full_tensor()
    assert _data(c, 0).shape == (8, 2)
    for i, shard in enumerate(torch.split(full, 2, dim=1)):
        assert torch.equal(_data(c, 2 * i), shard)
    assert _data(d, 0).shape == (4, 8)
    for i, shard in enumerate(torch.split(full, 4, dim=0)):
        assert torch.equal(_data(d, i), shard)


def test_all_gather_invariant_basic():
    mesh = _mesh((4,), ("x",))
    arr = torch.arange(8.0, dtype=torch.float64)
    f = sf.shard_map(lambda a: lax.all_gather_invariant(a, "x", tiled=True), mesh=mesh, in_specs=P("x"), out_specs=P())
    assert torch.equal(sf.gather(f(arr)), arr)
    g = torch.func.grad(lambda x: sf.gather(f(x)).sum())(arr)
    assert g.shape == (8,)
    torch.testing.assert_close(g, torch.ones(8, dtype=torch.float64))
    t = torch.linspace(-1, 1, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jvp(lambda x: sf.gather(f(x)), (arr,), (t,))[1], t)
    # the gradient of a ShardedArray argument keeps its layout
    xs = sf.distribute(arr, P("x"), mesh=mesh).requires_grad_()
    sf.gather(f(xs)).sum().backward()
    assert xs.grad.spec == P("x")


def test_all_gather_invariant_complex():
    mesh, a, _ = _create_inputs(("z", ("x", "y")), (None, None))

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("z", ("x", "y")),), out_specs=(P(None, ("x", "y")), P("z")))
    def f(a):
        c = lax.all_gather_invariant(a, "z", axis=0, tiled=True)
        d = lax.all_gather_invariant(a, ("x", "y"), axis=-1, tiled=True)
        return c, d

    c, d = f(a)
    full = a.full_tensor()
    assert _data(c, 0).shape == (8, 2)
    for i, shard in enumerate(torch.split(full, 2, dim=1)):
        torch.testing.assert_close(_data(c, 2 * i), shard)
    assert _data(d, 0).shape == (4, 8)
    for i, shard in enumerate(torch.split(full, 4, dim=0)):
        torch.testing.assert_close(_data(d, i), shard)
    ar = a.detach().requires_grad_()
    sf.gather(f(ar)[0]).sum().backward()
    assert ar.grad.shape == (8, 8)
    assert ar.grad.spec == P("z", ("x", "y"))
    torch.testing.assert_close(ar.grad.full_tensor(), torch.ones(8, 8))
    g = torch.func.grad(lambda x: sf.gather(f(x)[0]).sum())(full)
    torch.testing.assert_close(g, torch.ones(8, 8))


def test_with_static_arg():
    mesh, a, _ = _create_inputs(("x", "y"), (None, None))
    assert _data(a, 0).shape == (4, 4)

    def add_one(x, static_shape):
        return x + torch.ones(static_shape, dtype=x.dtype)

    out = sf.shard_map(add_one, mesh=mesh, in_specs=(P("x", "y"), None), out_specs=P("x", "y"))(a, (4, 4))
    torch.testing.assert_close(out.full_tensor(), a.full_tensor() + 1)


def test_matmul_unreduced():
    """JAX's unreduced={'y'} out_spec is shardfn's partial='y': the blocks are the local products."""
    mesh = _mesh((2, 2), ("x", "y"))
    inp1 = torch.arange(8.0).reshape(2, 4)
    inp2 = torch.arange(8.0).reshape(4, 2)
    arr1 = sf.distribute(inp1, P("x", "y"), mesh=mesh)
    arr2 = sf.distribute(inp2, P("y", None), mesh=mesh)
    f = sf.shard_map(lambda a, b: torch.einsum("ab,bc->ac", a, b), mesh=mesh,
                     in_specs=(P("x", "y"), P("y", None)), out_specs=P("x", None, partial="y"))
    out = f(arr1, arr2)
    assert out.shape == (2, 2)
    assert out.placements == sf.NamedSharding(mesh, P("x", None, partial="y")).placements(2)
    expected = [[[2.0, 3.0]], [[26.0, 31.0]], [[10.0, 19.0]], [[66.0, 79.0]]]
    for s, es in zip(out.local_shards(), expected):
        assert s.shape == (1, 2)
        assert torch.equal(s, torch.tensor(es))
    assert torch.equal(sf.reshard(out, P("x", None)).full_tensor(), inp1 @ inp2)
    a1, a2 = arr1.detach().requires_grad_(), arr2.detach().requires_grad_()
    sf.reshard(f(a1, a2), P("x", None)).full_tensor().sum().backward()
    assert a1.grad.placements == arr1.placements and a2.grad.placements == arr2.placements
    want = torch.func.grad(lambda x, y: (x @ y).sum(), argnums=(0, 1))(inp1, inp2)
    torch.testing.assert_close(a1.grad.full_tensor(), want[0])
    torch.testing.assert_close(a2.grad.full_tensor(), want[1])


def test_matmul_full_unreduced_out():
    mesh = _mesh((2, 1), ("x", "y"))
    arr1 = sf.distribute(torch.ones(8, 4), P(None, "x"), mesh=mesh)
    arr2 = sf.distribute(torch.ones(4, 6), P("x", None), mesh=mesh)
    out = sf.shard_map(torch.matmul, mesh=mesh, in_specs=None, out_specs=P(partial="x"))(arr1, arr2)
    assert out.placements[0] == sf.Partial("sum")
    torch.testing.assert_close(out.full_tensor(), torch.full((8, 6), 4.0))


def test_matmul_unreduced_error():
    """An unreduced (partial) out_spec over an axis the value does not vary over is an error."""
    mesh = _mesh((2, 2), ("x", "y"))
    arr1 = sf.distribute(torch.arange(8.0).reshape(2, 4), P("x", None), mesh=mesh)
    arr2 = sf.distribute(torch.arange(8.0).reshape(4, 2), P(None, None), mesh=mesh)
    f = sf.shard_map(lambda a, b: torch.einsum("ab,bc->ac", a, b), mesh=mesh, in_specs=None,
                     out_specs=P("x", None, partial="y"))
    with pytest.raises(sf.ShardingError, match="'y'"):
        f(arr1, arr2)


def test_matmul_reduce_scatter():
    mesh, a, b = _create_inputs(("z", "y"), ("y", None))
    assert _data(a, 0).shape == (4, 4)

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("z", "y"), P("y", None)), out_specs=P(("z", "y"), None))
    def fwd(a, b):
        c = a @ b
        return (lax.psum_scatter(c, "y", scatter_dimension=0, tiled=True),
                lax.psum_scatter(c, ("z", "y"), scatter_dimension=0, tiled=True))

    expected = a.full_tensor() @ b.full_tensor()
    c, d = fwd(a, b)
    assert _data(c, 0).shape == (2, 8)
    torch.testing.assert_close(c.full_tensor(), expected)
    assert _data(d, 0).shape == (1, 8)
    torch.testing.assert_close(d.full_tensor(), expected[:4] + expected[4:])


def test_collective_permute():
    mesh = _mesh((8,), ("x",))
    a = sf.distribute(torch.arange(64.0).reshape(8, 8), P("x", None), mesh=mesh)

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("x", None),), out_specs=P("x", None))
    def fwd(a):
        n = lax.axis_size("x")
        return lax.ppermute(a, "x", perm=[(j, (j + 1) % n) for j in range(n)])

    c = fwd(a).full_tensor()
    assert torch.equal(c[1], a.full_tensor()[0])
    assert torch.equal(c, torch.roll(a.full_tensor(), 1, 0))


def test_collective_permute_to_nobody_gives_zeros():
    """JAX's psend/precv tests' dangling case: a device that receives nothing gets zeros."""
    mesh = _mesh((2,), ("x",))
    f = sf.shard_map(lambda a: lax.ppermute(a, "x", [(0, 1)]), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    assert torch.equal(f(torch.tensor([5.0, 7.0])).full_tensor(), torch.tensor([0.0, 5.0]))


def test_collective_permute_with_multiple_axis_names():
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    a = sf.distribute(torch.arange(64.0).reshape(4, 16), P("x", ("y", "z")), mesh=mesh)

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("x", ("y", "z")),), out_specs=P("x", ("y", "z")))
    def fwd(a):
        xy, yz = lax.axis_size(("x", "y")), lax.axis_size(("y", "z"))
        return (lax.ppermute(a, ("x", "y"), perm=[(j, (j + 1) % xy) for j in range(xy)]),
                lax.ppermute(a, ("y", "z"), perm=[(j, (j + 1) % yz) for j in range(yz)]))

    c, d = fwd(a)
    for i in range(8):
        assert torch.equal(_data(a, i), _data(c, (i + 2) % 8))
        assert torch.equal(_data(a, i), _data(d, 4 * (i // 4) + (i + 1) % 4))


@pytest.mark.parametrize("axis_name,mesh_axes", [("x", {"x": 8}), (("x", "y"), {"x": 4, "y": 2})])
def test_all_to_all(axis_name, mesh_axes):
    mesh = _mesh(tuple(mesh_axes.values()), tuple(mesh_axes))
    a = sf.distribute(torch.arange(64.0).reshape(8, 8), P(axis_name, None), mesh=mesh)
    f = sf.shard_map(lambda a: lax.all_to_all(a, axis_name, split_axis=1, concat_axis=1, tiled=True), mesh=mesh,
                     in_specs=(P(axis_name, None),), out_specs=P(None, axis_name))
    assert torch.equal(f(a).full_tensor(), a.full_tensor().T.reshape(1, 64))


def test_all_to_all_grad():
    mesh = _mesh((4,), ("x",))
    a = sf.distribute(torch.arange(64.0).reshape(8, 8), P("x", None), mesh=mesh)
    assert _data(a, 0).shape == (2, 8)
    fwd = sf.shard_map(lambda x: lax.all_to_all(x, "x", split_axis=1, concat_axis=0, tiled=True), mesh=mesh,
                       in_specs=(P("x", None),), out_specs=P(None, "x"))
    c = fwd(a)
    assert _data(c, 0).shape == (8, 2)
    torch.testing.assert_close(c.full_tensor(), a.full_tensor())

    def loss(x):
        out = sf.gather(fwd(x)).sum() * 2
        return out, out

    grad, value = torch.func.grad(loss, has_aux=True)(a.full_tensor())
    assert value == 2 * sum(range(64))
    torch.testing.assert_close(grad, 2 * torch.ones(8, 8))


def test_eager_repr():
    """The body sees plain per-device tensors that print."""
    mesh = _mesh((2, 2), ("x", "y"))
    seen = []

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
    def f(x):
        seen.append(str(x))
        return x

    f(torch.arange(64.0).reshape(8, 8))
    assert seen and all(isinstance(s, str) and "tensor" in s for s in seen)


def _sin_cos(x):
    return torch.sin(torch.cos(x))


def test_jvp_basic():
    mesh = _mesh((2, 2), ("x", "y"))
    g = sf.shard_map(_sin_cos, mesh=mesh, in_specs=(P("x", "y"),), out_specs=P("x", "y"))
    x = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)
    t = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)
    f = lambda v: sf.gather(g(v))  # noqa: E731
    y, y_dot = torch.func.jvp(f, (x,), (t,))
    want = torch.func.jvp(_sin_cos, (x,), (t,))
    torch.testing.assert_close(y, want[0])
    torch.testing.assert_close(y_dot, want[1])
    second = torch.func.jvp(lambda v: torch.func.jvp(f, (v,), (t,))[1], (x,), (t,))[1]
    torch.testing.assert_close(second, torch.func.jvp(lambda v: torch.func.jvp(_sin_cos, (v,), (t,))[1], (x,), (t,))[1])


@pytest.mark.parametrize("spec,shape", [(P("x", "y"), (4, 4)), (P("x"), (4,))])
def test_linearize_basic(spec, shape):
    mesh = _mesh((2, 2), ("x", "y"))
    g = sf.shard_map(_sin_cos, mesh=mesh, in_specs=(spec,), out_specs=spec)
    x = torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)
    f = lambda v: sf.gather(g(v))  # noqa: E731
    y, y_dot = torch.func.jvp(f, (x,), (x,))
    y_, lin = torch.func.linearize(f, x)
    torch.testing.assert_close(y, y_)
    torch.testing.assert_close(y_dot, lin(x))
    torch.testing.assert_close(y_dot, torch.func.jvp(_sin_cos, (x,), (x,))[1])


def test_replication_checker_eager():
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(64.0).reshape(8, 8)
    with pytest.raises(sf.ShardingError, match="'x'"):
        sf.shard_map(lambda v: 2 * v, mesh=mesh, in_specs=(P("x", "y"),), out_specs=P(None, "y"))(x)
    out = sf.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh, in_specs=(P("x", "y"),), out_specs=P(None, "y"))(x)
    torch.testing.assert_close(out.full_tensor(), x[:4] + x[4:])


def test_process_env_traces():
    """The body closes over a value computed from the differentiated input."""
    mesh = _mesh((4,), ("x",))
    x = torch.arange(8.0, dtype=torch.float64)

    def g(x):
        y = (3.0 * x).sum()
        return sf.gather(sf.shard_map(lambda v: 2 * v * y, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"))(
            torch.arange(8.0, dtype=torch.float64)))

    def ref(x):
        return 2 * torch.arange(8.0, dtype=torch.float64) * (3.0 * x).sum()

    t = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jvp(g, (x,), (t,))[1], torch.func.jvp(ref, (x,), (t,))[1])
    xr = x.clone().requires_grad_()
    g(xr).sum().backward()
    torch.testing.assert_close(xr.grad, torch.func.grad(lambda v: ref(v).sum())(x))


def test_eager_control_flow():
    """Python control flow on a psum result (the same on every device)."""
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0).reshape(2, 2)

    def f(x):
        y = lax.psum(x, ("x", "y"))
        return x if y < 0 else -x

    y = sf.shard_map(f, mesh=mesh, in_specs=(P("x", "y"),), out_specs=P("x", "y"))(x)
    torch.testing.assert_close(y.full_tensor(), -x)


def test_outer_compile_detects_shard_map_mesh():
    mesh = _mesh((2, 2), ("x", "y"))
    f = sf.shard_map(lambda x: x.reshape(1, *x.shape), mesh=mesh, in_specs=P(), out_specs=P("x"))
    out = f(torch.tensor(2.0))
    assert out.shape == (2,)
    torch.testing.assert_close(out.full_tensor(), torch.tensor([2.0, 2.0]))


def test_vmap_basic():
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(64.0).reshape(8, 8)
    g = lambda v: sf.gather(sf.shard_map(lambda t: 2.0 * t, mesh=mesh, in_specs=P("y"), out_specs=P("y"))(v))  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(g)(x), 2 * x)
    torch.testing.assert_close(torch.func.vmap(g, in_dims=1)(x), 2 * x.T)


def test_tree_prefix_error():
    mesh = _mesh((2, 2), ("x", "y"))
    f = sf.shard_map(lambda x: x, mesh=mesh, in_specs=([P("x", "y")],), out_specs=P("x", "y"))
    x = torch.arange(64.0).reshape(8, 8)
    with pytest.raises(sf.ShardingError, match=r"in_specs\[0\]"):
        f([x, x])


def test_rank_errors():
    mesh = _mesh((2, 2), ("x", "y"))

    def foo(*args):
        return {"hi": [torch.tensor(3.0)]}

    with pytest.raises(sf.ShardingError, match="rank 0"):
        sf.shard_map(foo, mesh=mesh, in_specs=(), out_specs={"hi": P("x")})()
    with pytest.raises(sf.ShardingError, match="rank 0"):
        sf.shard_map(foo, mesh=mesh, in_specs=({"hi": P("x")},), out_specs=())({"hi": [torch.tensor(3.0)]})
    with pytest.raises(ValueError, match=r"use P\(\)"):
        sf.shard_map(foo, mesh=mesh, in_specs=P(None), out_specs=())(3.0)


def test_reverse_mode_ad():
    mesh = _mesh((2, 2), ("x", "y"))

    def body(x, y):
        return torch.sin(x) + 3 + torch.tan(torch.tensor(2.0, dtype=x.dtype)) * torch.cos(x) + y

    f = sf.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None)), out_specs=P("x"))
    x = torch.arange(8.0, dtype=torch.float64) / 10
    y = torch.arange(4.0, dtype=torch.float64) / 10

    def ref(x, y):  # each 'x' block of 4 gets all of y
        return body(x, y.repeat(2))

    tx, ty = torch.full_like(x, 0.3), torch.full_like(y, -0.2)
    got = torch.func.jvp(lambda a, b: sf.gather(f(a, b)), (x, y), (tx, ty))
    want = torch.func.jvp(ref, (x, y), (tx, ty))
    torch.testing.assert_close(got, want)
    w = torch.linspace(1, 2, 8, dtype=torch.float64)
    loss = lambda fn: lambda a, b: (torch.sin(fn(a, b)) * w).sum()  # noqa: E731
    got = torch.func.grad(loss(lambda a, b: sf.gather(f(a, b))), argnums=(0, 1))(x, y)
    want = torch.func.grad(loss(ref), argnums=(0, 1))(x, y)
    torch.testing.assert_close(got, want)
    hess = lambda fn: torch.func.jacrev(torch.func.grad(loss(fn), argnums=0))(x, y)  # noqa: E731
    torch.testing.assert_close(hess(lambda a, b: sf.gather(f(a, b))), hess(ref))


def test_post_process():
    """linearize of a function whose shard_map body closes over a function of the input."""
    mesh = _mesh((2, 2), ("x", "y"))

    def f(x):
        g = sf.shard_map(lambda y: torch.sin(y) * torch.sin(x).sum(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return sf.gather(g(torch.arange(8.0, dtype=torch.float64)))

    x = torch.arange(8.0, dtype=torch.float64)
    want = torch.sin(torch.arange(8.0, dtype=torch.float64)) * (torch.cos(x) * x).sum()
    torch.testing.assert_close(torch.func.jvp(f, (x,), (x,))[1], want)


def test_axis_index():
    mesh = _mesh((4,), ("x",))
    f = sf.shard_map(lambda: lax.axis_index("x")[None], mesh=mesh, in_specs=(), out_specs=P("x"))
    assert torch.equal(f().full_tensor(), torch.arange(4))
