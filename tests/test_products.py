"""sf.matmul / sf.einsum with out_sharding=: exact layouts, cheapest plans, gradients."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P, Replicate, Shard


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _grads(fn_sharded, fn_plain, fulls, specs, mesh):
    xs = [sf.distribute(t, s, mesh=mesh).requires_grad_() for t, s in zip(fulls, specs)]
    out = fn_sharded(*xs)
    ct = torch.randn(out.shape, dtype=out.dtype)
    (out * sf.distribute(ct, out.spec.__class__(*([None] * out.ndim)), mesh=mesh)).sum().backward()
    refs = [t.clone().requires_grad_() for t in fulls]
    want = fn_plain(*refs)
    (want * ct).sum().backward()
    torch.testing.assert_close(out.full_tensor(), want.detach(), rtol=1e-5, atol=1e-5)
    for x, r in zip(xs, refs):
        torch.testing.assert_close(x.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("m,k,n", [(8, 6, 4), (7, 5, 3)])
def test_contraction_to_sharded_output_is_one_reduce_scatter(mesh, m, k, n):
    h, w = torch.randn(m, k), torch.randn(k, n)
    hs = sf.distribute(h, P("dp", "tp"), mesh=mesh)
    ws = sf.distribute(w, P("tp", None), mesh=mesh)
    with sf.explicit(), sf.debug.CommCounter() as c:
        y = sf.matmul(hs, ws, out_sharding=P("dp", "tp"))
    assert y.spec == P("dp", "tp")
    assert dict(c.counts) == {"reduce_scatter": 1}
    torch.testing.assert_close(y.full_tensor(), h @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n", [(8, 6, 4), (7, 5, 3)])
@pytest.mark.parametrize("out", [P("dp", "tp"), P(), P(None, "dp"), (Shard(0), Replicate())])
def test_matmul_values_and_grads(mesh, m, k, n, out):
    h, w = torch.randn(m, k), torch.randn(k, n)
    with sf.explicit():
        y = _grads(lambda a, b: sf.matmul(a, b, out_sharding=out), torch.matmul, [h, w],
                   [P("dp", "tp"), P("tp", None)], mesh)
    want = out if isinstance(out, P) else sf.NamedSharding(mesh, P("dp")).spec
    assert y.spec == want


@pytest.mark.parametrize("b,s,d", [(4, 6, 8), (3, 5, 7)])
def test_einsum_batched_values_and_grads(mesh, b, s, d):
    x, w = torch.randn(b, s, d), torch.randn(d, d)
    with sf.explicit():  # the whole forward and backward, with no implicit move
        y = _grads(lambda a, v: sf.einsum("bsd,de->bse", a, v, out_sharding=P("dp", None, "tp")),
                   lambda a, v: torch.einsum("bsd,de->bse", a, v), [x, w],
                   [P("dp", None, "tp"), P("tp", None)], mesh)
    assert y.spec == P("dp", None, "tp")


def test_einsum_named_sharding_and_operand_list(mesh):
    a, b = torch.randn(4, 6), torch.randn(6, 2)
    ns = sf.NamedSharding(mesh, P(None, None))
    y = sf.einsum("ij,jk->ik", [sf.distribute(a, P("dp", "tp"), mesh=mesh), b], out_sharding=ns)
    assert y.spec == P()
    torch.testing.assert_close(y.full_tensor(), a @ b)


def test_out_sharding_none_is_propagation(mesh):
    h, w = torch.randn(8, 6), torch.randn(6, 4)
    hs, ws = sf.distribute(h, P("dp", "tp"), mesh=mesh), sf.distribute(w, P("tp", None), mesh=mesh)
    assert sf.matmul(hs, ws).spec == (hs @ ws).spec


def test_bad_out_sharding_names_it(mesh):
    hs = sf.distribute(torch.randn(8, 6), P("dp", "tp"), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"sf\.matmul out_sharding: .*'pp'"):
        sf.matmul(hs, hs.T, out_sharding=P("pp"))
    with pytest.raises(sf.ShardingError, match=r"sf\.einsum\('ij,kj->ik'\).*out_sharding"):
        sf.einsum("ij,kj->ik", hs, hs, out_sharding=P(None, None, None))
