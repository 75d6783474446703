"""Issue 14 on both backends: a pending sum reduced once however many ops read it,
grouped-query attention, coalesced pytree resharding (collectives counted)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_harness import check_against_twin_and_torch, collect, scenario

import shardfn as sf
from shardfn import P


@scenario
def partial_reduced_once(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    torch.manual_seed(0)
    for k in (8, 7):
        x, w = torch.randn(4, k), torch.randn(k, 5)
        p = sf.distribute(x, P(None, a), mesh=mesh) @ sf.distribute(w, P(a), mesh=mesh)
        with sf.debug.CommCounter() as cc:
            outs = [p.exp(), p.tanh(), p.pow(2)]
        assert dict(cc.counts) == {"all_reduce": 1}, cc
        ref = x @ w
        for o, r in zip(outs, (ref.exp(), ref.tanh(), ref.pow(2))):
            torch.testing.assert_close(o.full_tensor(), r, rtol=1e-4, atol=1e-4)


@scenario
def grouped_query_attention(mesh: sf.Mesh) -> None:
    a, b = mesh.axis_names[0], mesh.axis_names[-1]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    spec = P(None, b) if a == b else P(a, b)
    check_against_twin_and_torch(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                 mesh, [(q, spec), (k, spec), (v, spec)], grad=True, exact=False, what=str(spec))


@scenario
def coalesced_gradient_sync(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    torch.manual_seed(0)
    full = [torch.randn(s) for s in ((4, 3), (5,), (), (2, 3, 2), (7, 1))]
    tree = {f"p{i}": sf.distribute(t.unsqueeze(0).expand(n, *t.shape) / n, P(a), mesh=mesh).sum(0)
            for i, t in enumerate(full)}
    with sf.debug.CommCounter() as cc:
        out = sf.reshard(tree, P())
    assert dict(cc.counts) == {"all_reduce": 1}, cc
    for i, t in enumerate(full):
        torch.testing.assert_close(out[f"p{i}"].full_tensor(), t, rtol=1e-5, atol=1e-5)


@scenario
def batched_matmul_keeps_batch_dims(mesh: sf.Mesh) -> None:
    a, b = mesh.axis_names[0], mesh.axis_names[-1]
    spec = P(None, b) if a == b else P(a, b)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 3, 8)
    qs, ks = sf.distribute(q, spec, mesh=mesh), sf.distribute(k, spec, mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = torch.matmul(qs, ks.transpose(2, 3))
        e = torch.einsum("bhsd,bhtd->bhst", qs, ks)
    assert cc.total == 0 and out.spec == spec and e.spec == spec, (cc, out.spec, e.spec)
    check_against_twin_and_torch(lambda q, k: torch.matmul(q, k.transpose(2, 3)),
                                 mesh, [(q, spec), (k, spec)], grad=True, exact=False, what=str(spec))


test_local, test_dist = collect(globals())
