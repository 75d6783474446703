"""JAX's shard_map_test.py / pmap_test.py collective cases not ported elsewhere (pmax, pmin,
cumsum, rgv3 values, ppermute over axes out of mesh order, bool psum), and the adversarial
arguments of the same calls: each bad one raises a ShardingError naming the argument and
what is valid. Plain torch is the oracle."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P, lax


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


def test_pmax_pmin():
    mesh = _mesh((4,), ("i",))
    x = torch.arange(8.0)
    y = sf.shard_map(lambda a: lax.pmax(a, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    assert torch.equal(y.full_tensor(), torch.tensor([6.0, 7.0]))
    y = sf.shard_map(lambda a: lax.pmin(a, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())(x)
    assert torch.equal(y.full_tensor(), torch.tensor([0.0, 1.0]))


def test_cumsum_in_body():
    mesh = _mesh((4,), ("i",))
    x = torch.arange(8.0)
    y = sf.shard_map(lambda a: torch.cumsum(a, 0), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)
    assert torch.equal(y.full_tensor(), torch.cat([c.cumsum(0) for c in x.chunk(4)]))


def test_rgv3_values():
    """JAX's test_{all_gather,all_to_all,reduce_scatter,all_reduce}_rgv3, values only."""
    mesh = _mesh((2, 2), ("x", "y"))
    out = sf.shard_map(lambda a: lax.all_gather(a, "x", tiled=True), mesh=mesh, in_specs=P("x", "y"),
                       out_specs=P(None, "y"))(torch.ones(2, 2))
    assert torch.equal(out.full_tensor(), torch.ones(2, 2))
    out = sf.shard_map(lambda a: lax.psum(a, "x"), mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))(torch.ones(2, 2))
    assert torch.equal(out.full_tensor(), 2 * torch.ones(2, 2))
    for axis, dim, shape, out_shape in (("x", 0, (4, 4), (2, 4)), ("y", 1, (4, 4), (4, 2))):
        out = sf.shard_map(lambda a: lax.psum_scatter(a, axis, scatter_dimension=dim, tiled=True), mesh=mesh,
                           in_specs=P("x", "y"), out_specs=P("x", "y"))(torch.ones(shape))
        assert torch.equal(out.full_tensor(), 2 * torch.ones(out_shape))
    mesh1 = _mesh((2,), ("x",))
    out = sf.shard_map(lambda a: lax.all_to_all(a, "x", 1, 1, tiled=True), mesh=mesh1, in_specs=P("x", None),
                       out_specs=P(None, "x"))(torch.ones(4, 4))
    assert out.shape == (2, 8) and torch.equal(out.full_tensor(), torch.ones(2, 8))


def test_ppermute_over_axes_out_of_mesh_order():
    """JAX's test_ppermute_different_axis_order_error, where XLA rejects it: the index over
    ('y', 'x') is y-major, so block k of P(('y', 'x')) moves to k + 1."""
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.arange(4.0)
    perm = [(0, 1), (1, 2), (2, 3), (3, 0)]
    y = sf.shard_map(lambda a: lax.ppermute(a, ("y", "x"), perm), mesh=mesh, in_specs=P(("y", "x")),
                     out_specs=P(("y", "x")))(x)
    assert torch.equal(y.full_tensor(), x.roll(1))


@pytest.mark.parametrize("uneven", [False, True])
def test_psum_of_bool_counts(uneven):
    """JAX's testPsumOnBooleanDtype: psum of bools counts the Trues (an integer, as torch.sum
    promotes), pmean is the fraction (a bool sum saturated at True: pmean gave 1/2 for two Trues)."""
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.tensor([True, False, True, True] + ([False] if uneven else []))
    parts = [x[:3], x[3:]] if uneven else [x[:2], x[2:]]
    count = parts[0].long()
    count[: parts[1].numel()] += parts[1].long()

    def body(a):
        a = a[:1]  # each device's first element: one shape everywhere, even when the shards differ
        return lax.psum(a, "x"), lax.pmean(a, "x"), lax.psum(a, ("x", "y"))

    s, m, s2 = sf.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(x)
    first = parts[0][:1].long() + parts[1][:1].long()
    assert s.dtype == torch.int64 and torch.equal(s.full_tensor(), first)
    assert torch.equal(m.full_tensor(), first / 2)
    assert torch.equal(s2.full_tensor(), 2 * first)
    scattered = sf.shard_map(lambda a: lax.psum_scatter(a, "x", tiled=True), mesh=mesh, in_specs=P(),
                             out_specs=P("x"))(torch.tensor([True, False, False, True]))
    assert torch.equal(scattered.full_tensor(), torch.tensor([2, 0, 0, 2]))


@pytest.mark.parametrize("fn", [lax.pmax, lax.pmin])
def test_pmax_of_complex_names_the_dtype(fn):
    mesh = _mesh((2,), ("x",))
    z = torch.complex(torch.arange(4.0), torch.ones(4))
    with pytest.raises(sf.ShardingError, match=rf"sf\.lax\.{fn.__name__}: torch\.complex64 has no order") as info:
        sf.shard_map(lambda a: fn(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())(z)
    assert isinstance(info.value, RuntimeError)  # as torch.maximum of complex tensors
    # the order-free reductions of complex values are fine
    out = sf.shard_map(lambda a: lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())(z)
    assert torch.equal(out.full_tensor(), z[:2] + z[2:])


_T = torch.arange(24.0).reshape(4, 6)


def _sm(body, ins, outs, x=_T):
    return sf.shard_map(body, mesh=_mesh((2,), ("x",)), in_specs=ins, out_specs=outs)(x)


BAD_DIMS = {  # a non-int dim of a collective, and the argument the error names
    "all_gather axis float": (lambda: _sm(lambda a: lax.all_gather(a, "x", axis=1.0), P("x"), P()), "axis=1.0"),
    "all_gather axis bool": (lambda: _sm(lambda a: lax.all_gather(a, "x", axis=True, tiled=True), P("x"), P()),
                             "axis=True"),
    "psum_scatter dim float": (lambda: _sm(lambda a: lax.psum_scatter(a, "x", scatter_dimension=0.0, tiled=True),
                                           P(), P("x")), "scatter_dimension=0.0"),
    "all_to_all split str": (lambda: _sm(lambda a: lax.all_to_all(a, "x", "0", 1, tiled=True), P("x"), P(None, "x")),
                             "split_axis='0'"),
    "ppermute half index": (lambda: _sm(lambda a: lax.ppermute(a, "x", [(0.5, 1), (1, 0)]), P("x"), P("x")),
                            "(0.5, 1)"),
    "ppermute bool index": (lambda: _sm(lambda a: lax.ppermute(a, "x", [(True, 0), (0, 1)]), P("x"), P("x")),
                            "True"),
    "pbroadcast bool source": (lambda: _sm(lambda a: lax.pbroadcast(a, "x", source=True), P("x"), P("x")),
                               "source=True"),
}


@pytest.mark.parametrize("name", sorted(BAD_DIMS))
def test_collective_dims_must_be_ints(name):
    """A float dim or device index was truncated (ppermute's (0.5, 1) sent from device 0) or
    reached torch's unsqueeze, whose TypeError named neither the collective nor the argument."""
    call, word = BAD_DIMS[name]
    with pytest.raises(sf.ShardingError) as info:
        call()
    assert word in str(info.value), str(info.value)


def test_ppermute_takes_integer_like_indices():
    import numpy as np

    perm = [(np.int64(0), torch.tensor(1)), (1, 0)]
    y = _sm(lambda a: lax.ppermute(a, "x", perm), P("x"), P("x"))
    assert torch.equal(y.full_tensor(), _T.roll(2, 0))


@pytest.mark.parametrize("make", [
    lambda m: sf.shard_map(3, mesh=m, in_specs=P(), out_specs=P()),
    lambda m: sf.shard_map(mesh=m, in_specs=P(), out_specs=P())("f"),
    lambda m: sf.smap(3, axis_name="x", mesh=m),
    lambda m: sf.local_map(3, P(), mesh=m),
], ids=["shard_map", "shard_map decorator", "smap", "local_map"])
def test_transforms_check_that_f_is_callable(make):
    """JAX's shard_map raises a TypeError for a non-callable at once; shardfn returned a
    wrapper that failed (or did nothing) at the first call."""
    with pytest.raises(sf.ShardingError, match="not callable") as info:
        make(_mesh((2,), ("x",)))
    assert isinstance(info.value, TypeError)


def test_smap_as_a_decorator():
    mesh = _mesh((2,), ("x",))

    @sf.smap(in_axes=0, out_axes=0, axis_name="x", mesh=mesh)
    def f(a):
        return a * (lax.axis_index("x") + 1)

    assert torch.equal(f(_T).full_tensor(), _T * torch.tensor([1.0, 1, 2, 2])[:, None])
    with pytest.raises(sf.ShardingError, match="axis_name") as info:
        sf.smap(lambda a: a, axis_name=("x",), mesh=mesh)
    assert isinstance(info.value, TypeError)  # as JAX's


@pytest.mark.parametrize("shape", [(4.0, 6), (4, 6.5), ("4", 6), [True, 6]])
def test_factory_shapes_are_ints(shape):
    """sf.zeros((4.0, 6)) built an array where torch.zeros raises: a float is not a size."""
    mesh = _mesh((2,), ("x",))
    with pytest.raises(sf.ShardingError, match="shape="):
        sf.zeros(shape, P("x"), mesh=mesh)
    assert sf.zeros((torch.tensor(4), 6), P("x"), mesh=mesh).shape == (4, 6)


@pytest.mark.parametrize("ndim,word", [(-1, "ndim=-1"), (1.0, "ndim=1.0"), (True, "ndim=True")])
def test_named_sharding_ndim_is_a_rank(ndim, word):
    """A negative ndim gave 'valid dims are 1..-2' / 'give at most -1 entries'."""
    mesh = _mesh((2, 2), ("x", "y"))
    for call in (lambda: sf.NamedSharding(mesh, P()).placements(ndim),
                 lambda: sf.NamedSharding.from_placements(mesh, (sf.Replicate(), sf.Replicate()), ndim)):
        with pytest.raises(sf.ShardingError, match=word):
            call()
    assert sf.NamedSharding(mesh, P()).placements(0) == (sf.Replicate(), sf.Replicate())


_REDUCE = {"avg": lambda a, b: (a + b) / 2, "max": torch.maximum, "min": torch.minimum, "sum": torch.add}


@pytest.mark.parametrize("rows", [4, 5], ids=["even", "uneven"])
@pytest.mark.parametrize("op", sorted(_REDUCE))
def test_pending_avg_max_min_outputs_differentiate_as_their_reduction(op, rows):
    """A shard_map / local_map output with out_specs P(..., partial={'y': op}) differentiated
    every part as a sum's: avg's gradient was 2x, max's reached the losing part too."""
    mesh = _mesh((2, 2), ("x", "y"))
    x = torch.randn(rows, 6, dtype=torch.float64)
    w = torch.randn(rows, 6, dtype=torch.float64)
    spec = P("x", partial={"y": op})

    def body(u):  # the parts differ along 'y': sin(u) and 2 sin(u)
        return u.sin() * (lax.axis_index("y") + 1)

    def ref(u):
        return _REDUCE[op](u.sin(), 2 * u.sin())

    expect = torch.func.grad(lambda u: (ref(u) * w).sum())(x)
    sm = sf.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=spec)
    xs = x.clone().requires_grad_()
    out = sm(xs)
    assert torch.allclose(out.full_tensor(), ref(x))
    assert torch.allclose(torch.autograd.grad((out * w).sum(), xs)[0], expect)
    g = torch.func.grad(lambda u: (sm(u) * w).sum())(x)
    assert torch.allclose(g.full_tensor() if isinstance(g, sf.ShardedArray) else g, expect)
    if rows == 4:  # (uneven: the body's jvp misses axis_index's factor for every pending op, sum too)
        t = torch.randn_like(x)
        _, tangent = torch.func.jvp(lambda u: sf.gather(sm(u)), (x,), (t,))
        assert torch.allclose(tangent, torch.func.jvp(ref, (x,), (t,))[1])

    def local(u):  # local_map: each device's block, times (its 'y' coordinate + 1)
        return u.sin() * torch.tensor([1.0, 2.0, 1.0, 2.0], dtype=u.dtype)[devices.pop(0)]

    devices = [0, 1, 2, 3]
    xd = sf.distribute(x, P("x"), mesh=mesh).requires_grad_()
    out = sf.local_map(local, spec, mesh=mesh)(xd)
    assert torch.allclose(out.full_tensor(), ref(x))
    assert torch.allclose(torch.autograd.grad((out * w).sum(), xd)[0].full_tensor(), expect)


def test_from_local_pending_max_splits_ties_as_torch_amax():
    """Tied parts of a pending max each got the whole cotangent (2x in total); torch.amax
    splits it among them."""
    mesh = _mesh((2,), ("y",))
    a = torch.tensor([1.0, 3.0, 2.0], requires_grad=True)
    b = torch.tensor([1.0, 2.0, 5.0], requires_grad=True)
    x = sf.ShardedArray.from_local([a, b], P(partial={"y": "max"}), mesh=mesh)
    ga, gb = torch.autograd.grad(x.full_tensor().sum(), [a, b])
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ra, rb = torch.autograd.grad(torch.stack([a2, b2]).amax(0).sum(), [a2, b2])
    assert torch.equal(ga, ra) and torch.equal(gb, rb)
