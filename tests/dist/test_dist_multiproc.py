"""Issue 23 on 4 gloo processes (and the same bodies on the simulated mesh): checked
replicas, printing without collectives."""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import collect, held, is_dist, scenario, shards_for

import shardfn as sf
from shardfn import P


def _rank(mesh: sf.Mesh) -> int:
    return torch.distributed.get_rank() if is_dist(mesh) else 0


# -- checked replicas ----------------------------------------------------------------------------


@scenario
def replicas_distribute(mesh: sf.Mesh) -> None:
    g = torch.Generator().manual_seed(100 + _rank(mesh))  # a different "replica" per rank
    bad = torch.randn(4, 2, generator=g)
    same = torch.arange(8.0).reshape(4, 2)
    with sf.debug.check_replicas():
        x = sf.distribute(same, P(mesh.axis_names[0]), mesh=mesh)  # agrees: fine
        assert torch.equal(x.full_tensor(), same)
        if is_dist(mesh):
            with pytest.raises(sf.ShardingError, match=r"sf\.distribute.*rank 1 differs from rank 0"):
                sf.distribute(bad, P(), mesh=mesh)
        with sf.debug.check_replicas(False):
            sf.distribute(bad, P(), mesh=mesh)  # off inside: trusted
    sf.distribute(bad, P(), mesh=mesh)  # off by default: trusted, as in JAX


@scenario
def replicas_env_and_plain_operands(mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.arange(8.0).reshape(4, 2), P(mesh.axis_names[0]), mesh=mesh)
    mine = torch.full((2,), float(_rank(mesh)))
    os.environ["SHARDFN_CHECK_REPLICAS"] = "1"
    try:
        y = x + torch.ones(2)  # the same everywhere: fine
        assert torch.equal(y.full_tensor(), torch.arange(8.0).reshape(4, 2) + 1)
        if is_dist(mesh):
            with pytest.raises(sf.ShardingError, match=r"aten\.add: argument 'other' \(position 1\), a plain tensor.*"
                                                       r"rank 3 differs from rank 0"):
                x + mine
    finally:
        del os.environ["SHARDFN_CHECK_REPLICAS"]
    x + mine  # unchecked


@scenario(meshes=("2x2",))
def replicas_from_local(mesh: sf.Mesh) -> None:
    full = torch.arange(12.0).reshape(4, 3)
    with sf.debug.check_replicas():
        ok = sf.ShardedArray.from_local(shards_for(full, P("x"), mesh), P("x"), mesh=mesh)  # replicas over y agree
        assert torch.equal(ok.full_tensor(), full)
        parts = sf.ShardedArray.from_local(
            shards_for([full * (d + 1) for d in range(4)], P(partial=("x", "y")), mesh), P(partial=("x", "y")), mesh=mesh,
        )  # pending sums: nothing is replicated, nothing to compare
        assert torch.equal(parts.full_tensor(), full * 10)
        if is_dist(mesh):
            local = shards_for(full, P("x"), mesh)
            if _rank(mesh) == 3:
                local = local + 1  # device 3 = (x=1, y=1): its y-replica is device 2
            with pytest.raises(sf.ShardingError, match=r"from_local.*over mesh axes \('y',\).*rank 3 differs from rank 2"):
                sf.ShardedArray.from_local(local, P("x"), mesh=mesh, run_check=False)


# -- printing --------------------------------------------------------------------------------------


@scenario
def printing_without_collectives(mesh: sf.Mesh) -> None:
    full = torch.arange(10.0).reshape(5, 2)
    x = sf.distribute(full, P(mesh.axis_names[0]), mesh=mesh)
    s = x.sum()
    with sf.debug.CommCounter() as c:
        if _rank(mesh) == 0:  # one rank prints: the others must not wait for it
            text, total = repr(x), repr(s)
        else:
            text, total = repr(x), None
    assert c.total == 0
    assert "f32[5,2]" in text and repr(x.spec)[2:-1] in text
    if is_dist(mesh):
        dev = held(mesh)[0]
        assert f"rank {dev} (" in text and repr(x.to_local().detach()).splitlines()[0] in text
    else:
        assert text.startswith("ShardedArray([[0., 1.],")
    assert torch.equal(s.full_tensor(), full.sum())  # everyone still in step
    if total is not None and not is_dist(mesh):
        assert total.startswith("ShardedArray(45.,")



# -- partial-manual shard_map on real sub-meshes ------------------------------------------------------


def _pm_data(rows: int):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(rows, 8, dtype=torch.float64, generator=g),
            torch.randn(8, 3, dtype=torch.float64, generator=g))


@scenario(meshes=("2x2",))
def partial_manual_submesh_values_counts_grads(mesh: sf.Mesh) -> None:
    for rows in (8, 7):  # even and uneven
        t, w = _pm_data(rows)
        x = sf.distribute(t, P("x", "y"), mesh=mesh)
        seen = []

        def ew(a):
            seen.append(a)
            return a * 2 + 1

        with sf.debug.CommCounter() as c:
            y = sf.shard_map(ew, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"), axis_names={"x"})(x)
        assert dict(c.counts) == {}, c.counts  # elementwise: nothing moves
        a = seen[0]
        assert isinstance(a, sf.ShardedArray) and a.mesh.axis_names == ("y",) and a.spec == P(None, "y")
        if is_dist(mesh):
            assert torch.equal(a.to_local(), x.to_local())  # this rank's piece
        assert torch.equal(y.full_tensor(), t * 2 + 1) and y.spec == P("x", "y")

        xg = sf.distribute(t, P("x", "y"), mesh=mesh).requires_grad_()
        wg = sf.distribute(w, P("y"), mesh=mesh).requires_grad_()
        for out_spec, kind in ((P("x", None), "all_reduce"), (P("x", "y"), "reduce_scatter")):
            with sf.debug.CommCounter() as c:
                z = sf.shard_map(lambda p, q: p @ q, mesh=mesh, in_specs=(P("x", "y"), P("y")), out_specs=out_spec,
                                 axis_names={"x"})(xg, wg)
            assert dict(c.counts) == {kind: 1}, (out_spec, c.counts)  # exactly what the out_spec needs
            torch.testing.assert_close(z.full_tensor(), t @ w)

        def loss(p, q):
            return sf.lax.psum((torch.tanh(p @ q) ** 2).sum(), "x")

        out = sf.shard_map(loss, mesh=mesh, in_specs=(P("x", "y"), P("y")), out_specs=P(), axis_names={"x"})(xg, wg)
        out.backward()
        tr, wr = t.clone().requires_grad_(), w.clone().requires_grad_()
        ref = (torch.tanh(tr @ wr) ** 2).sum()
        ref.backward()
        torch.testing.assert_close(out.full_tensor(), ref.detach())
        torch.testing.assert_close(xg.grad.full_tensor(), tr.grad)
        torch.testing.assert_close(wg.grad.full_tensor(), wr.grad)
        with pytest.raises(sf.ShardingError, match=r"varies over mesh axis 'x'"):
            sf.shard_map(lambda p: p.sum(0), mesh=mesh, in_specs=P("x", "y"), out_specs=P("y"), axis_names={"x"})(x)


@scenario(meshes=("2x2",))
def partial_manual_collectives_on_submesh_arrays(mesh: sf.Mesh) -> None:
    t, _ = _pm_data(8)
    x = sf.distribute(t, P("x", "y"), mesh=mesh).requires_grad_()

    def body(a):
        g = sf.lax.all_gather(a, "x", axis=0, tiled=True)  # rows over 'x' gathered, columns stay over 'y'
        s = sf.lax.psum(a.sum(0), "x")
        i = sf.lax.axis_index("x")
        return g, s, a + i

    g, s, shifted = sf.shard_map(body, mesh=mesh, in_specs=P("x", "y"), out_specs=(P(None, "y"), P("y"), P("x", "y")),
                                 axis_names={"x"})(x)
    torch.testing.assert_close(g.full_tensor(), t)
    torch.testing.assert_close(s.full_tensor(), t.sum(0))
    torch.testing.assert_close(shifted.full_tensor(), t + torch.arange(2.0, dtype=t.dtype).repeat_interleave(4)[:, None])
    (g.full_tensor().pow(2).sum() + s.full_tensor().sum()).backward()
    torch.testing.assert_close(x.grad.full_tensor(), 2 * t + 1)


test_local, test_dist = collect(globals())
