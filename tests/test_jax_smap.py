"""JAX's smap tests (tests/shard_map_test.py: test_smap*, SmapSystematicTest) and its eager
reduced / unreduced tests, ported: sf.smap against a split-apply-concatenate reference."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import shardfn as sf
from shardfn import P, lax


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def _dot(a, b):
    """np.dot: contract a's last dim with b's second-to-last (or only) dim."""
    return torch.tensordot(a, b, dims=([a.dim() - 1], [b.dim() - 2 if b.dim() > 1 else 0]))


def _dot_ok(a, b):
    return a and b and a[-1] == b[-2 if len(b) > 1 else 0]


FUNS = [  # name, inputs, fun, replication of the output from the inputs' (JAX's FunSpec)
    ("id", 1, lambda x: x, lambda r: r, None),
    ("flip", 2, lambda x, y: (y, x), lambda rx, ry: (ry, rx), None),
    ("transpose", 1, lambda x: x.permute(*reversed(range(x.dim()))), lambda r: r, None),
    ("ravel", 1, lambda x: x.reshape(-1), lambda r: r, None),
    ("dot", 2, _dot, lambda r1, r2: r1 and r2, _dot_ok),
    ("sin_dot_sin", 2, lambda x, y: torch.sin(_dot(torch.sin(x), y)), lambda r1, r2: r1 and r2, _dot_ok),
    ("relu", 1, lambda x: torch.relu(x + 1) - 1, lambda r: r, None),
]
SHAPES = [s for k in range(1, 4) for s in itertools.permutations(range(1, 4), k) if len(set(s)) > 1 or len(s) == 1]
MESH_SHAPES = [(1,), (1, 1), (1, 2), (2, 2), (2, 4), (4, 2)]


def _sample(rng):
    name, nin, fun, out_rep, valid = rng.choice(FUNS)
    mesh_shape = rng.choice(MESH_SHAPES)
    names = ("i", "j", "k", "l")[:len(mesh_shape)]
    axis_name = rng.choice(names)
    size = dict(zip(names, mesh_shape))[axis_name]
    while True:
        shapes = [rng.choice(SHAPES) for _ in range(nin)]
        if not valid or valid(*shapes):
            break
    in_axes = tuple(rng.choice([None, *range(len(s))]) for s in shapes)
    out = fun(*[torch.zeros(s) for s in shapes])
    rep = out_rep(*[a is None for a in in_axes])
    if isinstance(out, tuple):
        out_axes = tuple(rng.choice([None] * r + list(range(o.dim()))) for o, r in zip(out, rep))
    else:
        out_axes = rng.choice([None] * rep + list(range(out.dim())))
    args = []
    for s, d in zip(shapes, in_axes):
        full = list(s)
        if d is not None:
            full[d] *= size
        n = torch.Size(full).numel()
        args.append(torch.arange(n, dtype=torch.float64).reshape(full) / n)
    return (f"{name}-{mesh_shape}-{axis_name}-{in_axes}-{out_axes}-{shapes}", fun, mesh_shape, names, axis_name,
            in_axes, out_axes, tuple(args), size)


def _smap_ref(f, in_axes, out_axes, size):
    def run(*args):
        split = [[x] * size if d is None else list(torch.chunk(x, size, d)) for x, d in zip(args, in_axes)]
        results = [f(*xs) for xs in zip(*split)]
        if not isinstance(results[0], tuple):
            return results[0] if out_axes is None else torch.cat(results, out_axes)
        return tuple(col[0] if d is None else torch.cat(col, d) for col, d in zip(zip(*results), out_axes))
    return run


def _cases(n, seed):
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        c = _sample(rng)
        if c[0] not in seen:
            seen.add(c[0])
            out.append(c)
    return out


CASES = _cases(40, 0)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_smap_against_ref(case):
    _, fun, mesh_shape, names, axis_name, in_axes, out_axes, args, size = case
    mesh = _mesh(mesh_shape, names)
    with mesh:
        f = sf.smap(fun, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)
        out = f(*args)
    want = _smap_ref(fun, in_axes, out_axes, size)(*args)
    outs, wants = (out, want) if isinstance(want, tuple) else ((out,), (want,))
    for o, w in zip(outs, wants):
        torch.testing.assert_close(sf.gather(o), w)


@pytest.mark.parametrize("case", CASES[:12], ids=[c[0] for c in CASES[:12]])
def test_smap_grads_against_ref(case):
    _, fun, mesh_shape, names, axis_name, in_axes, out_axes, args, size = case
    mesh = _mesh(mesh_shape, names)

    def loss(f):
        def run(*a):
            out = f(*a)
            outs = out if isinstance(out, tuple) else (out,)
            return sum((torch.sin(o) * (k + 1)).sum() for k, o in enumerate(outs))
        return run

    smapped = sf.smap(fun, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, mesh=mesh)

    def f(*a):
        out = smapped(*a)
        return tuple(sf.gather(o) for o in out) if isinstance(out, tuple) else sf.gather(out)

    argnums = tuple(range(len(args)))
    got = torch.func.grad(loss(f), argnums)(*args)
    want = torch.func.grad(loss(_smap_ref(fun, in_axes, out_axes, size)), argnums)(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_smap_nested():
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    v = torch.arange(32.0).reshape(4, 8)
    arr = sf.distribute(v, P("x", "y"), mesh=mesh)

    def h(x):
        return sf.smap(lambda t: t * t, in_axes=0, out_axes=0, axis_name="y")(x)

    with mesh:
        out = sf.smap(h, in_axes=0, out_axes=0, axis_name="x")(arr)
    assert torch.equal(out.full_tensor(), v * v)


def test_smap_replicated():
    mesh = _mesh((2,), ("x",))
    with mesh:
        out = sf.smap(lambda x: x * 2, in_axes=None, out_axes=None, axis_name="x")(torch.arange(8))
    assert torch.equal(out.full_tensor(), torch.arange(8) * 2)
    assert out.sharding == sf.NamedSharding(mesh, P())


def test_smap_replicated_sharded():
    mesh = _mesh((2,), ("data",))
    with mesh:
        out1, out2 = sf.smap(lambda x, y: (x * 2, y * 2), in_axes=(None, 0), out_axes=(None, 0), axis_name="data")(
            torch.arange(8), torch.arange(8))
        out = sf.smap(lambda x, y: x + y, in_axes=(None, 0), out_axes=0, axis_name="data")(torch.arange(4), torch.arange(8))
    assert torch.equal(out1.full_tensor(), torch.arange(8) * 2) and out1.sharding == sf.NamedSharding(mesh, P())
    assert torch.equal(out2.full_tensor(), torch.arange(8) * 2) and out2.sharding == sf.NamedSharding(mesh, P("data"))
    assert out.sharding == sf.NamedSharding(mesh, P("data"))
    assert torch.equal(out.full_tensor(), torch.arange(8) + torch.arange(4).repeat(2))


def test_smap_of_sharded_arrays_and_nesting():
    """JAX's test_smap_auto_explicit, test_smap_auto_explicit_nest(_inner_none, _mesh_call_time)."""
    mesh = _mesh((2, 2), ("x", "y"))
    with mesh:
        out = sf.smap(lambda x: x * 2, out_axes=0, axis_name="x")(sf.distribute(torch.arange(4), P("x")))
        assert torch.equal(out.full_tensor(), torch.arange(4) * 2) and out.sharding == sf.NamedSharding(mesh, P("x"))
        out = sf.smap(lambda x: x * 2, in_axes=0, out_axes=0, axis_name="y")(sf.distribute(torch.arange(4), P("y")))
        assert torch.equal(out.full_tensor(), torch.arange(4) * 2) and out.sharding == sf.NamedSharding(mesh, P("y"))
        v = torch.arange(16.0).reshape(8, 2)
        arr = sf.distribute(v, P("y"))
        g = sf.smap(torch.sin, in_axes=1, out_axes=1, axis_name="x")
        out = sf.smap(lambda a: g(a * 2), in_axes=0, out_axes=0, axis_name="y")(arr)
        torch.testing.assert_close(out.full_tensor(), torch.sin(v * 2))
        g_none = sf.smap(torch.sin, in_axes=None, out_axes=1, axis_name="x")
        out = sf.smap(lambda a: g_none(a * 2), in_axes=0, out_axes=0, axis_name="y")(arr)
        torch.testing.assert_close(out.full_tensor(), torch.sin(v * 2).repeat(1, 2))


def test_smap_nested_psum():
    mesh = _mesh((2, 2), ("x", "y"))

    def f(x):
        x = torch.sin(x)
        return sf.smap(lambda t: lax.psum(t, "y"), axis_name="y", in_axes=0, out_axes=None)(x)

    with mesh:
        out = sf.smap(f, axis_name="x", in_axes=0, out_axes=0)(torch.arange(4.0))
    s = torch.sin(torch.arange(4.0))
    torch.testing.assert_close(out.full_tensor(), torch.stack([s[0] + s[1], s[2] + s[3]]))


def test_eager_reduced_out():
    """JAX's all_gather(..., to='reduced'): sf.lax.all_gather_invariant."""
    mesh = _mesh((2,), ("x",))
    arr = sf.distribute(torch.arange(8.0), P("x"), mesh=mesh)
    f = sf.shard_map(lambda x: lax.all_gather_invariant(x, "x", tiled=True), out_specs=P())
    out = f(arr)
    assert out.sharding == sf.NamedSharding(mesh, P()) and torch.equal(out.full_tensor(), torch.arange(8.0))
    ar = arr.detach().requires_grad_()
    f(ar).full_tensor().sum().backward()
    assert ar.grad.sharding == arr.sharding and torch.equal(ar.grad.full_tensor(), torch.ones(8))


def test_eager_unreduced_out():
    """JAX's pcast(x, 'x', to='unreduced') with out_specs P(unreduced={'x'}): shardfn's
    partial out_spec over a varying value."""
    mesh = _mesh((2,), ("x",))
    arr = sf.distribute(torch.arange(8.0), P("x"), mesh=mesh)
    f = sf.shard_map(lambda x: x, out_specs=P(partial="x"))
    out = f(arr)
    assert out.placements == (sf.Partial("sum"),)
    assert torch.equal(sf.reshard(out, P()).full_tensor(), torch.arange(4.0) + torch.arange(4.0, 8.0))
    ar = arr.detach().requires_grad_()
    f(ar).full_tensor().sum().backward()
    assert ar.grad.sharding == arr.sharding and torch.equal(ar.grad.full_tensor(), torch.ones(8))


def test_eager_unreduced_in():
    mesh = _mesh((2,), ("x",))
    arr = sf.distribute(torch.arange(8.0), P(partial="x"), mesh=mesh)
    f = sf.shard_map(lambda x: lax.psum_scatter(x, "x", tiled=True), out_specs=P("x"))
    out = f(arr)
    assert out.sharding == sf.NamedSharding(mesh, P("x")) and torch.equal(out.full_tensor(), torch.arange(8.0))
    ar = arr.detach().requires_grad_()
    f(ar).full_tensor().sum().backward()
    assert torch.equal(ar.grad.full_tensor(), torch.ones(8))
