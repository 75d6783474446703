"""JAX's explicit-sharding tests (tests/pjit_test.py ShardingInTypesTest), ported where
shardfn's explicit API covers them: layouts of elementwise ops, matmuls and reductions,
einsum/matmul with out_sharding (unreduced = partial), reshard, gradients' layouts, and
the errors for incompatible layouts under sf.explicit(). shardfn keeps contractions over a
sharded dim as pending sums (JAX's unreduced) instead of JAX's errors or all-gathers."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P

MESH = sf.Mesh((2, 2), ("x", "y"), backend="local")
INP = torch.arange(16.0).reshape(8, 2)


def _put(x, spec, mesh=MESH):
    return sf.distribute(x, spec, mesh=mesh)


def _same(a, spec):
    """``a``'s layout is ``spec``'s (trailing None entries do not matter)."""
    return a.placements == sf.NamedSharding(a.mesh, spec).placements(a.ndim)


def _grad_layouts(leaves, arrays):
    """JAX gives each gradient its argument's sharding; shardfn leaves a leaf's gradient as
    the backward pass produced it (a pending sum, say): over the same mesh, resharding it to
    the argument's layout gives the same values."""
    for leaf, arr in zip(leaves, arrays):
        assert leaf.grad.mesh == arr.mesh and leaf.grad.shape == arr.shape
        moved = sf.reshard(leaf.grad, arr.sharding)
        assert moved.sharding == arr.sharding
        torch.testing.assert_close(moved.full_tensor(), leaf.grad.full_tensor())


def test_basic_mul():
    s = sf.NamedSharding(MESH, P("x", "y"))
    arr = _put(INP, s.spec)

    def f(x):
        x = x * 2
        assert _same(x, s.spec)
        x = x * x
        assert _same(x, s.spec)
        return x

    with sf.explicit():
        out = f(arr)
    assert out.sharding == s
    assert torch.equal(out.full_tensor(), (INP * 2) * (INP * 2))
    ar = arr.detach().requires_grad_()
    with sf.explicit():
        f(ar).sum().backward()
    assert ar.grad.sharding == s
    assert torch.equal(ar.grad.full_tensor(), 8 * INP)


def test_fully_replicated_array_mul():
    s = P("x", "y")
    arr1 = _put(INP, s)
    small = torch.arange(2.0).reshape(1, 2)
    with sf.explicit():
        for other, want in ((_put(small, P(None, None)), INP * small), (_put(INP, P(("x",), ("y",))), INP * INP),
                            (_put(small, P()), INP * small)):
            out = arr1 * other
            assert _same(out, s) and torch.equal(out.full_tensor(), want)
        for bad in (P("y", "x"), P(("x", "y"))):
            with pytest.raises(sf.ImplicitReshardError, match="mul"):
                arr1 * _put(INP, bad)


@pytest.mark.parametrize("spec1,spec2,out_spec", [
    (P("x", None), P(None, "y"), P("x", "y")),
    (P("x", None), P(None, None), P("x", None)),
    (P("x", "y"), P(None, None), P("x", None, partial="y")),  # JAX: all-gathers to P('x', None)
    (P("x", None), P("x", None), P("x", None)),
    (P(None, "y"), P(None, "y"), P(None, "y")),
], ids=["x_y", "x_None", "contracting2", "fsdp", "half_tp"])
def test_dot_general(spec1, spec2, out_spec):
    arr1, arr2 = _put(INP, spec1), _put(INP.T.contiguous(), spec2)
    out = arr1 @ arr2
    assert torch.equal(out.full_tensor(), INP @ INP.T)
    if spec1[1] is None and spec2[0] is None:  # no contraction over a sharded dim: JAX's layout
        assert _same(out, out_spec)
    elif out_spec.partial:
        assert _same(out, out_spec)
    a1, a2 = arr1.detach().requires_grad_(), arr2.detach().requires_grad_()
    (a1 @ a2).full_tensor().sum().backward()
    _grad_layouts((a1, a2), (arr1, arr2))
    want = torch.func.grad(lambda x, y: (x @ y).sum(), argnums=(0, 1))(INP, INP.T)
    torch.testing.assert_close(a1.grad.full_tensor(), want[0])
    torch.testing.assert_close(a2.grad.full_tensor(), want[1])


@pytest.mark.parametrize("spec1,spec2", [(P("x", None), P(None, "x")), (P("x", "y"), P("x", "y"))], ids=["fail1", "fail2"])
def test_dot_general_error(spec1, spec2):
    """JAX: an illegally sharded result / sharded contracting dims. shardfn under explicit:
    the matmul would move data, so it raises naming the op and the reshard to make."""
    arr1, arr2 = _put(INP, spec1), _put(INP.T.contiguous(), spec2)
    with sf.explicit(), pytest.raises(sf.ImplicitReshardError, match=r"sf\.reshard"):
        arr1 @ arr2
    assert torch.equal((arr1 @ arr2).full_tensor(), INP @ INP.T)


@pytest.mark.parametrize("spec1,spec2", [(P("x", "y"), P("y", None)), (P(None, "y"), P("y", None))],
                         ids=["contracting1", "other_half_tp"])
def test_contracting_sharded_dims_are_pending_sums(spec1, spec2):
    arr1, arr2 = _put(INP, spec1), _put(INP.T.contiguous(), spec2)
    with sf.explicit():
        out = arr1 @ arr2
    assert "y" in out.spec.partial
    assert torch.equal(out.full_tensor(), INP @ INP.T)


@pytest.mark.parametrize("use_compile", [False])
def test_dot_general_out_sharding(use_compile):
    mesh = sf.Mesh((4,), ("x",), backend="local")
    arr1, arr2 = _put(INP, P("x", None), mesh), _put(INP.T.contiguous(), P(None, "x"), mesh)

    def f(x, y):
        out = sf.einsum("xy,yz->xz", x, y, out_sharding=P("x", None))
        assert _same(out, P("x", None))
        return out.sum()

    out = f(arr1, arr2)
    assert out.full_tensor() == (INP @ INP.T).sum()
    assert out.shape == () and set(out.spec.partial) <= {"x"}  # replicated, or pending over 'x' until read
    a1, a2 = arr1.detach().requires_grad_(), arr2.detach().requires_grad_()
    f(a1, a2).backward()
    _grad_layouts((a1, a2), (arr1, arr2))


def test_einsum_with_out_sharding():
    arr1, arr2 = _put(INP, P("x", "y")), _put(INP.T.contiguous(), P("y", "x"))
    out = sf.einsum("xy,yz->xz", arr1, arr2, out_sharding=sf.NamedSharding(MESH, P("x", None)))
    assert torch.equal(out.full_tensor(), INP @ INP.T) and _same(out, P("x", None))
    arr3, arr4 = _put(INP, P("x", "y")), _put(INP.T.contiguous(), P("x", "y"))
    with sf.explicit():
        out2 = sf.einsum("xy,yz->xz", arr3, arr4, out_sharding=P("x", None))
    assert torch.equal(out2.full_tensor(), INP @ INP.T) and _same(out2, P("x", None))
    a3, a4 = arr3.detach().requires_grad_(), arr4.detach().requires_grad_()
    sf.einsum("xy,yz->xz", a3, a4, out_sharding=P("x", None)).full_tensor().sum().backward()
    _grad_layouts((a3, a4), (arr3, arr4))


@pytest.mark.parametrize("axis,in_spec,out_spec", [
    (None, P("x", "y"), P()), (0, P("x", "y"), P("y")), (1, P("x", "y"), P("x")),
    (0, P(("x", "y"), None), P(None)), (1, P(("x", "y"), None), P(("x", "y"))),
], ids=["all", "first", "second", "first2", "second2"])
@pytest.mark.parametrize("op", ["sum", "amax"])
def test_reduce(axis, in_spec, out_spec, op):
    """JAX's test_reduce_sum / test_reduce_max: the result's values; shardfn leaves a sum
    over a sharded dim as a pending sum (partial) until it is read."""
    arr = _put(INP, in_spec)
    fn = (lambda t: t.sum() if axis is None else t.sum(axis)) if op == "sum" else (
        lambda t: t.amax() if axis is None else t.amax(axis))
    out = fn(arr)
    assert torch.equal(out.full_tensor(), fn(INP))
    resolved = sf.reshard(out, out_spec)
    assert _same(resolved, out_spec) and torch.equal(resolved.full_tensor(), fn(INP))
    if out_spec == P(("x", "y")):  # a reduction over an unsharded dim moves nothing
        assert _same(out, out_spec)


def test_reshard_api():
    s = sf.NamedSharding(MESH, P("x", "y"))
    arr = _put(INP, s.spec)
    with sf.explicit():
        out = sf.reshard(arr, P("x", None))
    assert _same(out, P("x", None))
    ar = arr.detach().requires_grad_()
    sf.reshard(ar, P("x", None)).full_tensor().sum().backward()
    assert ar.grad.sharding == arr.sharding
    assert torch.equal(ar.grad.full_tensor(), torch.ones(8, 2))
    out = torch.func.vmap(lambda x: sf.reshard(x, P(None)))(arr)
    assert torch.equal(sf.gather(out), INP)


def test_unreduced_einsum_basic():
    mesh = sf.Mesh((2,), ("x",), backend="local")
    inp = torch.arange(4.0).reshape(2, 2)
    x, y = _put(inp, P(None, "x"), mesh), _put(inp, P("x", None), mesh)
    out = sf.einsum("ab,bc->ac", x, y, out_sharding=P(None, None, partial="x"))
    assert out.shape == (2, 2) and out.placements == (sf.Partial("sum"),)
    for s, es in zip(out.local_shards(), ([[0.0, 0.0], [0.0, 2.0]], [[2.0, 3.0], [6.0, 9.0]])):
        assert torch.equal(s, torch.tensor(es))
    assert torch.equal(sf.reshard(out, P(None, None)).full_tensor(), inp @ inp)


def test_unreduced_einsum_add_basic():
    x, y = _put(INP, P("x", "y")), _put(INP.T.contiguous(), P("y", None))
    a, b = _put(INP, P("x", "y")), _put(INP.T.contiguous(), P("y", None))
    with sf.explicit():
        m1 = sf.einsum("xy,yz->xz", x, y, out_sharding=P("x", partial="y"))
        m2 = sf.einsum("xy,yz->xz", a, b, out_sharding=P("x", partial="y"))
        s = m1 + m2  # still pending: adding pending sums moves nothing
        assert _same(s, P("x", None, partial="y"))
        out = sf.reshard(s, P("x"))
    assert torch.equal(out.full_tensor(), 2 * INP @ INP.T)
