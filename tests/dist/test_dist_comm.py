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
def coalesced_mixed_tree_matches_twin_and_torch(mesh: sf.Mesh) -> None:
    """A mixed tree (dtypes, uneven shapes, Partial sum/avg/max, a leaf that needs no move,
    sharded dims, non-array leaves) resharded twice (the tree plan cached the second time):
    equal to the local twin bit for bit and to torch, values and gradients."""
    a, b = mesh.axis_names[0], mesh.axis_names[-1]

    def fn(*xs):
        if not isinstance(xs[0], sf.ShardedArray):  # plain torch: every reshard keeps the value
            return [o * o for o in [*xs[:6], *xs[6:]] * 2]
        sums = [sf.reshard(x, P(*([None] * x.ndim), partial=a)) for x in xs[:4]]
        avg = sf.reshard(xs[4], P(None, None, partial={b: "avg"}))
        mx = sf.reshard(xs[5], P(None, partial={a: "max"}))
        tree = {"s": sums[:2], "t": (sums[2], 3, None), "u": {"d": sums[3], "avg": avg, "max": mx}, "keep": xs[0]}
        specs = {"s": P(), "t": P(), "u": P(), "keep": P()}
        if a != b:  # a tp-split gradient pending over dp: all_reduce only, with the others
            tree["split"] = [sf.reshard(x, P(b, partial=a)) for x in xs[6:]]
            specs["split"] = P(b)
        outs = []
        for _ in range(2):
            out = sf.reshard(tree, specs)
            assert out["t"][1:] == (3, None) and out["keep"] is xs[0]
            outs += [*out["s"], out["t"][0], out["u"]["d"], out["u"]["avg"], out["u"]["max"], *out.get("split", [])]
        return [o * o for o in outs]

    torch.manual_seed(0)
    shapes = [((5, 3), torch.float32), ((7,), torch.float64), ((3, 1, 2), torch.float32), ((), torch.float64),
              ((4, 2), torch.float32), ((5,), torch.float32)]
    inputs = [(torch.randn(s, dtype=d), P()) for s, d in shapes]
    if a != b:
        inputs += [(torch.randn(8, 3), P(b)), (torch.randn(7, 2), P(b))]  # even and uneven rows
    check_against_twin_and_torch(fn, mesh, inputs, grad=True, what="coalesced tree")


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
