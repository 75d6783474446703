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


test_local, test_dist = collect(globals())
