"""JAX's collective tests from tests/pmap_test.py, ported to shard_map over a 1-D mesh
(pmap(f) = a shard_map whose body sees one row): all_gather, psum_scatter, pytrees of
dtypes, complex psum, pmax/pmin, pbroadcast, ppermute / pshuffle and their gradients."""

from __future__ import annotations

import functools
import math

import optree
import pytest
import torch

import shardfn as sf
from shardfn import P, lax

N = 4
MESH = sf.Mesh((N,), ("i",), backend="local")


def pmap(f):
    """JAX's pmap(f, axis_name='i') over dim 0 (of size N) of each argument."""
    def run(*args):
        def body(*blocks):
            out = f(*[optree.tree_map(lambda b: b[0], a) for a in blocks])
            return optree.tree_map(lambda o: o[None], out)
        return optree.tree_map(sf.gather, sf.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=P("i"))(*args))
    return run


def _x(*shape, dtype=torch.float32):
    return torch.arange(math.prod(shape), dtype=dtype).reshape(shape)


def test_gather():
    x = _x(N, 4)
    assert torch.equal(pmap(lambda v: lax.all_gather(v, "i"))(x), x.expand(N, N, 4))
    b = (x % 2).bool()
    assert torch.equal(pmap(lambda v: lax.all_gather(v, "i"))(b), b.expand(N, N, 4))
    assert torch.equal(pmap(lambda v: lax.all_gather(v, "i", axis=-1))(x), x.T.expand(N, 4, N))
    assert torch.equal(pmap(lambda v: lax.all_gather(v, "i", tiled=True))(x), x.reshape(-1).expand(N, 4 * N))
    y = _x(N, 4, 3)
    want = y.permute(1, 0, 2).reshape(4, -1).expand(N, 4, 3 * N)
    assert torch.equal(pmap(lambda v: lax.all_gather(v, "i", tiled=True, axis=-1))(y), want)


@pytest.mark.parametrize("prim", ["all_gather", "psum_scatter"])
def test_vmap_of(prim):
    f = pmap(functools.partial(getattr(lax, prim), axis_name="i"))
    x = _x(4, N, N)
    assert torch.equal(torch.func.vmap(f)(x), torch.stack([f(xs) for xs in x]))


def test_reduce_scatter():
    x = _x(N, N)
    assert torch.equal(pmap(lambda v: lax.psum_scatter(v, "i"))(x), x.sum(0))
    x = _x(N, 4 * N)
    assert torch.equal(pmap(lambda v: lax.psum_scatter(v, "i", tiled=True))(x), x.sum(0).reshape(N, 4))
    x = _x(N, N, 4 * N)
    pos = pmap(lambda v: lax.psum_scatter(v, "i", scatter_dimension=1, tiled=True))(x)
    neg = pmap(lambda v: lax.psum_scatter(v, "i", scatter_dimension=-1, tiled=True))(x)
    assert torch.equal(pos, neg)


def _np_f(op):
    return lambda t: optree.tree_map(lambda x: op(x).expand(x.shape), t)


def test_trees():
    n = N
    x = {k: torch.arange(lo * n * n, (lo + 1) * n * n).reshape(n, n).double() for k, lo in (("a", 1), ("b", 2), ("c", 4))}

    def protate(v):
        return lax.ppermute(v, "i", [(k, (k + 1) % n) for k in range(n)])

    cases = [
        (lambda v: lax.pmax(v, "i"), lambda t: t.amax(0)), (lambda v: lax.pmin(v, "i"), lambda t: t.amin(0)),
        (lambda v: lax.psum(v, "i"), lambda t: t.sum(0)), (lambda v: lax.pmean(v, "i"), lambda t: t.mean(0)),
    ]
    for jf, nf in cases:
        got = pmap(lambda t, jf=jf: optree.tree_map(jf, t))(x)
        for k in x:
            torch.testing.assert_close(got[k], nf(x[k]).expand(n, n))
    got = pmap(lambda t: optree.tree_map(lambda v: lax.all_to_all(v, "i", 0, 0), t))(x)
    for k in x:
        assert torch.equal(got[k], x[k].T)
    got = pmap(lambda t: optree.tree_map(protate, t))(x)
    for k in x:
        assert torch.equal(got[k], torch.roll(x[k], 1, 0))


def test_collectives_with_trees_of_different_dtypes():
    n = N
    x = {"a": _x(n, n), "b": _x(n, n, dtype=torch.int32) + 7, "c": _x(n, n) * 3, "d": _x(n, n, dtype=torch.int64) - 5}
    for jf, nf in ((lax.pmax, lambda t: t.amax(0)), (lax.pmin, lambda t: t.amin(0)), (lax.psum, lambda t: t.sum(0))):
        got = pmap(lambda t, jf=jf: jf(t, "i"))(x)
        for k in x:
            assert got[k].dtype == x[k].dtype
            assert torch.equal(got[k], nf(x[k]).to(x[k].dtype).expand(n, n))
    got = pmap(lambda t: lax.pmean(t, "i"))({k: v for k, v in x.items() if v.is_floating_point()})
    for k in ("a", "c"):
        torch.testing.assert_close(got[k], x[k].mean(0).expand(n, n))


def test_complex_psum():
    x = _x(N, 4 * 2).view(torch.complex64)
    torch.testing.assert_close(pmap(lambda v: v - lax.psum(v, "i"))(x), x - x.sum(0))


def test_psum_of_python_scalar_and_dtype():
    """JAX's testPmapDtype and testCollectiveConstant: psum of a constant is size * it."""
    for dt in (torch.float32, torch.int32):
        out = pmap(lambda v, dt=dt: lax.psum(torch.zeros((), dtype=dt) + 1, "i") + 0 * v.to(dt))(torch.arange(N))
        assert out.dtype == dt and torch.equal(out, torch.full((N,), N, dtype=dt))
    assert torch.equal(pmap(lambda v: v * 0 + lax.psum(1, "i"))(torch.arange(N)), torch.full((N,), N))


def test_reduce_max_min():
    x = _x(N, 4)
    assert torch.equal(pmap(lambda v: v - lax.pmax(v, "i"))(x), x - x.amax(0))
    assert torch.equal(pmap(lambda v: v - lax.pmin(v, "i"))(x), x - x.amin(0))


def test_collective_broadcast():
    x = _x(N, 4)
    assert torch.equal(pmap(lambda v: lax.pbroadcast(v, "i", source=0))(x), x[:1].expand(N, 4))
    # the transpose sums every device's cotangent into the source's (JAX's testCollectiveBroadcastGrad)
    g = torch.func.grad(lambda v: pmap(lambda t: lax.pbroadcast(t, "i", source=0))(v).sum())(torch.arange(float(N)))
    assert torch.equal(g, torch.tensor([float(N)] + [0.0] * (N - 1)))
    with pytest.raises(sf.ShardingError, match="source=7 must be an index along"):
        pmap(lambda v: lax.pbroadcast(v, "i", source=7))(x)


def test_collective_permute_and_grads():
    x = _x(N, 4)
    rot = [(k, (k + 1) % N) for k in range(N)]
    assert torch.equal(pmap(lambda v: lax.ppermute(v, "i", perm=rot))(x), torch.roll(x, 1, 0))
    y = torch.pi + torch.arange(float(N), dtype=torch.float64)
    xs = torch.arange(float(N), dtype=torch.float64)
    shift_right = [(k, k + 1) for k in range(N - 1)]
    g = torch.func.grad(lambda v: (y * pmap(lambda t: lax.ppermute(t, "i", shift_right))(v)).sum())(xs)
    want = torch.cat([torch.pi + torch.arange(1.0, N, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(g, want)
    cyc = lambda v: (y * pmap(lambda t: lax.ppermute(t, "i", rot))(v)).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(cyc)(xs), torch.roll(y, -1))
    torch.testing.assert_close(torch.func.jvp(cyc, (xs,), (torch.ones_like(xs),))[1], y.sum())


def test_pshuffle():
    values = torch.arange(float(N))
    shift_right = [(k - 1) % N for k in range(N)]
    assert torch.equal(pmap(lambda v: lax.pshuffle(v, "i", perm=shift_right))(values), torch.roll(values, 1))
    bad = list(range(N))
    bad[0] = 1
    with pytest.raises(sf.ShardingError, match=r"`perm` does not represent a permutation: \[1"):
        pmap(lambda v: lax.pshuffle(v, "i", perm=bad))(values)


def test_ppermute_with_zip_object():
    perm = [N - 1] + list(range(N - 1))
    out = pmap(lambda v: lax.ppermute(v, "i", list(zip(perm, range(N)))))(torch.arange(float(N)))
    assert torch.equal(out, torch.tensor(perm, dtype=torch.float32))


@pytest.mark.parametrize("argfn,bulk", [("argmax", torch.argmax), ("argmin", torch.argmin)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_arg_all_reduce(argfn, bulk, dtype):
    """JAX's testArgAllReduce (pargmax/pargmin) written with collectives: the index of the
    extreme element along the mapped dim."""
    x = torch.tensor([3, 9, 1, 9], dtype=dtype)

    def body(v):
        best = (lax.pmax if argfn == "argmax" else lax.pmin)(v, "i")
        idx = torch.where(v == best, lax.axis_index("i"), N)
        return lax.pmin(idx, "i")

    assert torch.equal(pmap(body)(x), bulk(x).expand(N))


def test_grad_of_psum_and_gather():
    """JAX's testGradOfPsum / testGradOf(all_gather, psum_scatter): against plain torch."""
    x = torch.linspace(-1, 1, N * 4, dtype=torch.float64).reshape(N, 4)
    w = torch.linspace(0.5, 2, N * 4, dtype=torch.float64).reshape(N, 4)
    got = torch.func.grad(lambda v: (w * pmap(lambda t: torch.sin(lax.psum(t, "i")))(v)).sum())(x)
    want = torch.func.grad(lambda v: (w * torch.sin(v.sum(0)).expand(N, 4)).sum())(x)
    torch.testing.assert_close(got, want)
    got = torch.func.grad(lambda v: (pmap(lambda t: torch.sin(lax.all_gather(t, "i", tiled=True)))(v) ** 2).sum())(x)
    want = torch.func.grad(lambda v: (torch.sin(v.reshape(-1)).expand(N, N * 4) ** 2).sum())(x)
    torch.testing.assert_close(got, want)
    y = torch.linspace(-1, 1, N * N * 4, dtype=torch.float64).reshape(N, N * 4)
    got = torch.func.grad(lambda v: (pmap(lambda t: torch.sin(lax.psum_scatter(t, "i", tiled=True)))(v) ** 2).sum())(y)
    want = torch.func.grad(lambda v: (torch.sin(v.sum(0).reshape(N, 4)) ** 2).sum())(y)
    torch.testing.assert_close(got, want)
