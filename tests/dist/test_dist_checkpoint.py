"""sf.checkpoint across backends: save on 4 gloo processes, load in one simulated process
and back; replicas written once across processes; pickling refuses on dist."""

from __future__ import annotations

import io
import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import assert_equal, collect, is_dist, local_twin, scenario

import shardfn as sf
from shardfn import P
from shardfn.values.spec import to_layout

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _shared_dir(mesh: sf.Mesh) -> str:
    """A fresh folder every process of the world names the same."""
    if not is_dist(mesh):
        return tempfile.mkdtemp(prefix="sf-ck-")
    box = [tempfile.mkdtemp(prefix="sf-ck-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _values() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(7, 6, generator=g), "b": torch.randn(6, generator=g), "e": torch.randn(8, 4, generator=g)}


def _tree(mesh: sf.Mesh, v: dict) -> dict:
    specs = {"w": P("x", None), "b": P(), "e": P(None, "x")} if mesh.ndim == 1 else \
        {"w": P(("x", "y")), "b": P("y"), "e": P("y", "x")}
    return {"model": {k: sf.distribute(t, specs[k], mesh=mesh) for k, t in v.items()}, "step": 3}


@scenario
def save_here_load_simulated_and_back(mesh: sf.Mesh) -> None:
    """Save on this backend; load in one simulated process on another mesh shape; save that
    and load it back here on other specs. Exact values everywhere."""
    v = _values()
    a, b = _shared_dir(mesh), _shared_dir(mesh)
    sf.checkpoint.save(a, _tree(mesh, v))
    other = sf.Mesh((2, 4), ("p", "q"), backend="local")
    if is_dist(mesh):
        dist.barrier()
    if not is_dist(mesh) or dist.get_rank() == 0:  # one process holds the simulated mesh
        like = {"model": {"w": sf.NamedSharding(other, P("q", "p")), "b": sf.NamedSharding(other, P()),
                          "e": sf.NamedSharding(other, P(None, "q"))}, "step": 0}
        got = sf.checkpoint.load(a, like)
        assert got["step"] == 3
        for k, t in v.items():
            assert_equal(got["model"][k].full_tensor(), t, f"simulated {k}")
        sf.checkpoint.save(b, got)
    if is_dist(mesh):
        dist.barrier()
    axes = mesh.axis_names
    like = {"model": {"w": sf.NamedSharding(mesh, P(None, axes[-1])), "b": sf.NamedSharding(mesh, P(axes[0])),
                      "e": sf.zeros((8, 4), sharding=P(axes), mesh=mesh)}, "step": 0}
    back = sf.checkpoint.load(b, like)
    for k, t in v.items():
        assert_equal(back["model"][k].full_tensor(), t, f"back {k}")
    assert back["model"]["e"]._layout == to_layout(P(axes), 2, mesh) and back["step"] == 3


@scenario
def replicas_written_once(mesh: sf.Mesh) -> None:
    """A replicated array's bytes are written once over all processes (DCP dedups the
    chunk every process holds); a sharded one, each shard once."""
    full = torch.randn(128, 64)
    one = full.numel() * 4
    for spec, chunks in ((P(), 1), (P(mesh.axis_names), mesh.size)):
        path = _shared_dir(mesh)
        sf.checkpoint.save(path, {"w": sf.distribute(full, spec, mesh=mesh)})
        written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
        assert one <= written < one + 2048 * chunks, (spec, written)
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["w"]
        assert len(md.chunks) == chunks


@scenario
def dcp_state_dict_interop(mesh: sf.Mesh) -> None:
    """Plain dcp.save / dcp.load of a state dict of arrays on every process."""
    v = _values()
    path = _shared_dir(mesh)
    sd = _tree(mesh, v)["model"]
    dcp.save(sd, checkpoint_id=path, no_dist=not is_dist(mesh))
    into = {k: sf.zeros(tuple(t.shape), sharding=P(), mesh=mesh) for k, t in v.items()}
    dcp.load(into, checkpoint_id=path, no_dist=not is_dist(mesh))
    for k, t in v.items():
        assert_equal(into[k].full_tensor(), t, k)


@scenario(backends=("dist",))
def pickling_refuses_on_dist(mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 4), P(mesh.axis_names[0]), mesh=mesh)
    with pytest.raises(TypeError, match="sf.checkpoint.save"):
        pickle.dumps(x)
    with pytest.raises(TypeError, match="sf.checkpoint.save"):
        torch.save({"x": x}, io.BytesIO())
    twin = local_twin(mesh)
    assert pickle.loads(pickle.dumps(twin)) == twin


test_local, test_dist = collect(globals())
