"""What only the dist backend has: mesh/world checks, DTensor interop, collective timeouts.
The timeout scenario runs last in its world (it leaves groups unusable)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import assert_equal, collect, scenario, source

import shardfn as sf
from shardfn import P

DIST = ("dist",)


@scenario
def default_backend_follows_the_world(mesh: sf.Mesh) -> None:
    """backend=None picks dist exactly when the world size equals the mesh size."""
    assert sf.Mesh(mesh.shape, mesh.axis_names).backend == mesh.backend
    assert sf.Mesh((mesh.size * 2,), ("z",)).backend == "local"


@scenario(backends=DIST)
def mesh_size_must_equal_world_size(mesh: sf.Mesh) -> None:
    for shape in ((2,), (8,), (2, 4)):
        small = sf.Mesh(shape, ("a", "b")[: len(shape)], backend="dist")
        with pytest.raises(sf.ShardingError, match=r"world has 4 ranks.*must equal the world size"):
            sf.distribute(torch.ones(4), P(), mesh=small)


@scenario(backends=DIST)
def to_dtensor_and_back_copy_the_shard(mesh: sf.Mesh) -> None:
    from torch.distributed.tensor import DTensor

    names = mesh.axis_names
    specs = [P(), P(names[0]), P(None, names[-1]), P(partial=names[0]), P(None, partial={names[-1]: "max"})]
    if mesh.ndim == 2:
        specs += [P(("x", "y")), P("y", "x"), P("x", partial="y")]
    for shape in ((8, 4), (7, 5), (3, 2)):
        for spec in specs:
            x, full, _ = source(spec, mesh, shape)
            dt = x.to_dtensor()
            assert isinstance(dt, DTensor) and tuple(dt.shape) == shape
            # issue 13: a DTensor may be mutated, so it holds a copy of this rank's shard
            assert dt.to_local().data_ptr() != x._local.data_ptr() or x._local.numel() == 0
            assert_equal(dt.full_tensor(), full, f"{shape} {spec} as DTensor")
            y = sf.from_dtensor(dt)
            assert y.mesh == mesh and y._layout == x._layout, (y, x)
            assert y._local.data_ptr() != dt.to_local().data_ptr() or x._local.numel() == 0
            assert_equal(y.full_tensor(), full, f"{shape} {spec} round trip")
            dt.to_local().add_(1)
            assert_equal(x.full_tensor(), full, f"{shape} {spec} after mutating the DTensor")
            assert_equal(y.full_tensor(), full, f"{shape} {spec} after mutating the DTensor")


@scenario(backends=DIST)
def dtensor_ops_and_gradients_cross_over(mesh: sf.Mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    a = mesh.axis_names[0]
    t = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    dt = sf.distribute(t, P(a), mesh=mesh).to_dtensor()
    w = torch.randn(8, 6, dtype=torch.float64)
    (dt.full_tensor() * w).sum().backward()
    assert_equal(t.grad, w, "grad through to_dtensor")
    # a DTensor made by torch on the same DeviceMesh comes back as a ShardedArray
    dm = dt.device_mesh
    full = torch.arange(48.0).view(8, 6)
    torch_dt = distribute_tensor(full, dm, [Shard(1)] + [Shard(0)] * (mesh.ndim - 1))
    y = sf.from_dtensor(torch_dt * 2)
    assert_equal(y.full_tensor(), full * 2)
    assert_equal(sf.reshard(y, P()).full_tensor(), full * 2)


@scenario(backends=DIST, meshes=("2x2",))
def placements_dtensor_cannot_express_are_errors(mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.ones(8, 2), P(("y", "x")), mesh=mesh)
    with pytest.raises(sf.ShardingError, match="not in mesh order"):
        x.to_dtensor()
    local = sf.Mesh((4,), ("x",), backend="local")
    with pytest.raises(sf.ShardingError, match="backend='dist'"):
        sf.distribute(torch.ones(4), P("x"), mesh=local).to_dtensor()


@scenario(backends=DIST)
def from_local_shapes_differing_across_ranks_fail_on_every_rank(mesh: sf.Mesh) -> None:
    """Each rank's shard fits *its own* global shape, but the ranks disagree: a
    ShardingError on every rank (not an abort inside a later collective)."""
    rank = dist.get_rank()
    n = 3 if rank == 1 else 2
    with pytest.raises(sf.ShardingError, match=r"from_local: ranks disagree on the global shape/dtype"):
        sf.ShardedArray.from_local(torch.ones(n, 4), P(), mesh=mesh)
    dtype = torch.float32 if rank == 2 else torch.float64
    with pytest.raises(sf.ShardingError, match=r"ranks disagree.*torch.float32"):
        sf.ShardedArray.from_local(torch.ones(2, 4, dtype=dtype), P(mesh.axis_names[0]), mesh=mesh)
    x = sf.ShardedArray.from_local(torch.ones(2, 4), P(), mesh=mesh)  # the world still works
    assert_equal(x.full_tensor(), torch.ones(2, 4))


@scenario(backends=DIST)
def from_local_run_check_false_skips_the_metadata_exchange(mesh: sf.Mesh) -> None:
    """run_check=False builds the same array without the cross-rank all_gather; this rank's
    shard is still checked against the layout."""
    from shardfn.backends import dist as backend

    calls = []
    real = backend.check_same_meta
    backend.check_same_meta = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        x = sf.ShardedArray.from_local(torch.ones(2, 4), P(mesh.axis_names[0]), mesh=mesh, run_check=False)
        assert calls == []
        y = sf.ShardedArray.from_local(torch.ones(2, 4), P(mesh.axis_names[0]), mesh=mesh)
        assert len(calls) == 1
    finally:
        backend.check_same_meta = real
    assert_equal(x.full_tensor(), y.full_tensor())
    with pytest.raises(sf.ShardingError, match=r"local tensor of shape \(3, 4\)"):
        sf.ShardedArray.from_local(torch.ones(3, 4), P(mesh.axis_names[0]), mesh=mesh, shape=(2 * mesh.shape[0], 4),
                                   run_check=False)


@scenario(backends=DIST)
def a_bad_shard_on_one_rank_fails_on_every_rank(mesh: sf.Mesh) -> None:
    rank = dist.get_rank()
    local = torch.ones(5, 4) if rank == 3 else torch.ones(2, 4)
    match = r"rank 3 .*local tensor of shape \(5, 4\)" if rank == 3 else r"rank\(s\) \[3\] rejected their input"
    with pytest.raises(sf.ShardingError, match=match):
        sf.ShardedArray.from_local(local, P(mesh.axis_names[0]), mesh=mesh, shape=(2 * mesh.shape[0], 4))


@scenario(backends=DIST)
def distribute_shapes_differing_across_ranks_fail_on_every_rank(mesh: sf.Mesh) -> None:
    rank = dist.get_rank()
    with pytest.raises(sf.ShardingError, match=r"distribute: ranks disagree on the global shape/dtype"):
        sf.distribute(torch.ones(4 + (rank == 0), 2), P(mesh.axis_names[0]), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"distribute: ranks disagree"):
        sf.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P(), out_specs=P())(torch.ones(2, 2 + rank))
    assert_equal(sf.distribute(torch.ones(4, 2), P(mesh.axis_names[0]), mesh=mesh).full_tensor(), torch.ones(4, 2))


@scenario(backends=DIST, meshes=("4",))
def collective_timeout_is_a_clear_error(mesh: sf.Mesh) -> None:
    """Rank 0 skips a reshard: the others get a CollectiveError after the timeout (not a hang)."""
    from shardfn.backends import dist as backend

    backend.configure(timeout=1.0)
    try:
        fresh = sf.Mesh((4,), ("t",), backend="dist")  # its groups get the 1 s timeout
        x = sf.distribute(torch.ones(4, 2), P("t"), mesh=fresh)
        if dist.get_rank() == 0:
            time.sleep(2.5)  # stay alive so the others time out rather than see a closed peer
            return
        start = time.monotonic()
        with pytest.raises(backend.CollectiveError, match=r"(?s)all_gather over mesh axes \('t',\).*SHARDFN_DIST_TIMEOUT"):
            x.full_tensor()
        assert time.monotonic() - start < 2.5
    finally:
        backend.configure(timeout=float(__import__("os").environ.get("SHARDFN_DIST_TIMEOUT", 1800)))


test_local, test_dist = collect(globals())
