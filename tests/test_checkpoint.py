"""sf.checkpoint (torch.distributed.checkpoint), DCP's checkpointable-tensor protocol, and
pickling of ShardedArrays on the local backend. The dist backend: tests/dist/test_dist_checkpoint.py."""

from __future__ import annotations

import copy
import io
import multiprocessing
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import meshes, shapes, specs
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

# plain dcp.save/load calls below run in one process on purpose
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _distcp_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert torch.equal(got, want)


# -- round trips and resharding ----------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_round_trip_reshards_across_specs_and_meshes(tmp_path_factory, data) -> None:
    """Save on one mesh/spec (uneven and Partial too), load on another: exact values, the
    requested layout."""
    src_mesh = data.draw(meshes())
    shape = data.draw(shapes(max_dims=3))
    src_spec = data.draw(specs(src_mesh, len(shape)))
    dst_mesh = data.draw(meshes())
    dst_spec = data.draw(specs(dst_mesh, len(shape), partial_ops=()))
    full = torch.randn(shape)
    x = sf.distribute(full, P(*src_spec, partial=None), mesh=src_mesh)
    if src_spec.partial:
        x = sf.reshard(x, src_spec)
    path = tmp_path_factory.mktemp("ck")
    sf.checkpoint.save(path, {"x": x})
    like = sf.distribute(torch.zeros(shape), dst_spec, mesh=dst_mesh)
    out = sf.checkpoint.load(path, {"x": like})["x"]
    assert isinstance(out, sf.ShardedArray) and out.sharding == like.sharding and out.mesh == dst_mesh
    _exact(out.full_tensor(), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool])
def test_dtypes_round_trip(tmp_path, mesh24, dtype) -> None:
    full = (torch.randn(6, 9) * 100).to(dtype)
    x = sf.distribute(full, P("y", "x"), mesh=mesh24)
    sf.checkpoint.save(tmp_path, {"w": x})
    out = sf.checkpoint.load(tmp_path, {"w": x})["w"]
    _exact(out.full_tensor(), full)
    assert out.dtype == dtype and out.spec == x.spec


def test_tree_of_arrays_tensors_and_scalars(tmp_path, mesh24) -> None:
    """Nested dicts, lists and tuples; plain tensors load whole (like's dtype); scalars as saved;
    the result is new (like unchanged) and keeps like's structure."""
    w = torch.randn(8, 4)
    tree = {"model": {"w": sf.distribute(w, P("x", "y"), mesh=mesh24), "b": torch.arange(5)},
            "opt": [sf.distribute(w * 2, P(), mesh=mesh24), (3, 2.5, "adamw", True)], "step": 7}
    sf.checkpoint.save(tmp_path, tree)
    keys = set(dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata)
    assert keys == {"model.w", "model.b", "opt.0", "opt.1.0", "opt.1.1", "opt.1.2", "opt.1.3", "step"}
    zeros = sf.zeros((8, 4), sharding=P(None, "y"), mesh=mesh24)
    like = {"model": {"w": zeros, "b": torch.zeros(5, dtype=torch.int32)},
            "opt": [sf.zeros((8, 4), sharding=P("y"), mesh=mesh24), (0, 0.0, "", False)], "step": 0}
    out = sf.checkpoint.load(tmp_path, like)
    _exact(out["model"]["w"].full_tensor(), w)
    assert out["model"]["w"].spec == P(None, "y")
    _exact(out["model"]["b"], torch.arange(5, dtype=torch.int32))
    _exact(out["opt"][0].full_tensor(), w * 2)
    assert out["opt"][1] == (3, 2.5, "adamw", True) and out["step"] == 7 and isinstance(out["opt"][1], tuple)
    _exact(zeros.full_tensor(), torch.zeros(8, 4))  # like is not written


def test_like_as_shardings(tmp_path, mesh24, mesh22) -> None:
    """A NamedSharding or a P (current mesh) leaf: shape and dtype from the checkpoint."""
    full = torch.randn(7, 5, dtype=torch.float64)
    sf.checkpoint.save(tmp_path, {"a": sf.distribute(full, P("x", "y"), mesh=mesh24), "b": full})
    out = sf.checkpoint.load(tmp_path, {"a": sf.NamedSharding(mesh22, P("y"))})
    assert out["a"].mesh == mesh22 and out["a"].spec == P("y") and out["a"].dtype == torch.float64
    _exact(out["a"].full_tensor(), full)
    with mesh22:
        out = sf.checkpoint.load(tmp_path, {"a": P(None, ("x", "y")), "b": P("x", partial="y")})
    _exact(out["a"].full_tensor(), full)
    assert out["b"].spec == P("x", partial="y")
    _exact(out["b"].full_tensor(), full)
    with pytest.raises(sf.ShardingError, match="'a'.*no mesh"):
        sf.checkpoint.load(tmp_path, {"a": P("x")})


def test_like_partial_and_requires_grad(tmp_path, mesh22) -> None:
    full = torch.randn(4, 4)
    p = sf.distribute(full, P("x"), mesh=mesh22).requires_grad_()
    sf.checkpoint.save(tmp_path, {"p": p})
    out = sf.checkpoint.load(tmp_path, {"p": p})["p"]
    assert out.requires_grad and out.is_leaf and out is not p
    out.sum().backward()
    _exact(out.grad.full_tensor(), torch.ones(4, 4))


def test_bare_array_and_empty_and_scalar_tensors(tmp_path, mesh24) -> None:
    x = sf.distribute(torch.randn(3, 0), P("x"), mesh=mesh24)
    z = sf.distribute(torch.tensor(2.5), P(), mesh=mesh24)
    sf.checkpoint.save(tmp_path / "a", x)
    out = sf.checkpoint.load(tmp_path / "a", x)
    assert out.shape == (3, 0) and out.spec == P("x")
    sf.checkpoint.save(tmp_path / "b", [z])
    assert sf.checkpoint.load(tmp_path / "b", [z])[0].item() == 2.5


# -- each distinct shard once ------------------------------------------------------------------


def test_replicas_written_once(tmp_path, mesh24) -> None:
    """Bytes written are those of the distinct shards: a replicated array once, not 8 times;
    a P('x') array (replicated over 'y') its 2 halves once."""
    full = torch.randn(256, 64)  # 64 KiB
    one = full.numel() * 4
    sf.checkpoint.save(tmp_path / "rep", {"w": sf.distribute(full, P(), mesh=mesh24)})
    sf.checkpoint.save(tmp_path / "x", {"w": sf.distribute(full, P("x"), mesh=mesh24)})
    sf.checkpoint.save(tmp_path / "xy", {"w": sf.distribute(full, P(None, ("x", "y")), mesh=mesh24)})
    for name, chunks in (("rep", 1), ("x", 2), ("xy", 8)):
        written = _distcp_bytes(tmp_path / name)
        assert one <= written < one + 2048 * chunks, (name, written)  # torch.save's headers per chunk
    chunks = dcp.FileSystemReader(str(tmp_path / "x")).read_metadata().state_dict_metadata["w"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (128, 0)]


def test_load_reads_only_held_slices(tmp_path, mesh24, monkeypatch) -> None:
    """Loading P('x') reads each saved row-block once per distinct shard (2 reads), not once
    per device (8), and each read covers only the overlap."""
    full = torch.randn(16, 8)
    sf.checkpoint.save(tmp_path, {"w": sf.distribute(full, P(("x", "y")), mesh=mesh24)})
    seen = []
    orig = dcp.DefaultLoadPlanner.resolve_tensor

    def spy(self, read_item):
        seen.append((tuple(read_item.storage_offsets), tuple(read_item.lengths)))
        return orig(self, read_item)

    monkeypatch.setattr(dcp.DefaultLoadPlanner, "resolve_tensor", spy)
    out = sf.checkpoint.load(tmp_path, {"w": sf.NamedSharding(mesh24, P("x"))})
    _exact(out["w"].full_tensor(), full)
    assert sorted(seen) == [((0, 0), (2, 8))] * 8


# -- errors --------------------------------------------------------------------------------------


def test_bad_input_errors(tmp_path, mesh22) -> None:
    x = sf.distribute(torch.randn(4, 6), P("x"), mesh=mesh22)
    sf.checkpoint.save(tmp_path, {"model": {"w": x}, "n": 1})
    with pytest.raises(sf.ShardingError, match=r"no key 'model.v'.*'model.w'"):
        sf.checkpoint.load(tmp_path, {"model": {"v": x}})
    with pytest.raises(sf.ShardingError, match=r"'model.w'.*shape \(4, 6\).*\(6, 4\)"):
        sf.checkpoint.load(tmp_path, {"model": {"w": sf.zeros((6, 4), sharding=P("x"), mesh=mesh22)}})
    with pytest.raises(sf.ShardingError, match=r"'model.w'.*shape"):
        sf.checkpoint.load(tmp_path, {"model": {"w": torch.zeros(4)}})
    with pytest.raises(sf.ShardingError, match=r"'n' was saved as a Python object"):
        sf.checkpoint.load(tmp_path, {"n": torch.zeros(())})
    with pytest.raises(sf.ShardingError, match="not a checkpoint folder"):
        sf.checkpoint.load(tmp_path / "missing", {"n": 0})
    with pytest.raises(sf.ShardingError, match=r"'f' is a builtin_function_or_method"):
        sf.checkpoint.save(tmp_path / "bad", {"f": len})
    with pytest.raises(sf.ShardingError, match=r"'s' is a sharding"):
        sf.checkpoint.save(tmp_path / "bad", {"s": P("x")})
    with pytest.raises(sf.ShardingError, match=r"both name the checkpoint key 'a.b'"):
        sf.checkpoint.save(tmp_path / "bad", {"a.b": 1, "a": {"b": 2}})
    assert not (tmp_path / "bad").exists()


def test_unsavable_values_and_paths(tmp_path, mesh22) -> None:
    meta = sf.Mesh((2, 2), ("x", "y"), backend="local", device_type="meta")
    with pytest.raises(sf.ShardingError, match=r"'m' is an array on a meta mesh"):
        sf.checkpoint.save(tmp_path / "bad", {"m": sf.distribute(torch.randn(4), P("x"), mesh=meta)})
    assert not (tmp_path / "bad").exists()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(sf.ShardingError, match=r"path '.*file' is a file; a checkpoint is a folder"):
        sf.checkpoint.save(tmp_path / "file", {"n": 1})
    assert (tmp_path / "file").read_text() == "not a folder"


def test_io_errors_raise_as_themselves_in_one_process(tmp_path, mesh22) -> None:
    # DCP wraps every failure in a CheckpointException, a BaseException that ``except
    # Exception`` misses; with one process its one error is raised as itself
    from torch.distributed.checkpoint.api import CheckpointException

    sf.checkpoint.save(tmp_path, {"w": sf.distribute(torch.randn(4, 6), P("x"), mesh=mesh22)})
    for f in tmp_path.glob("*.distcp"):
        f.unlink()
    with pytest.raises(FileNotFoundError) as info:
        sf.checkpoint.load(tmp_path, {"w": sf.NamedSharding(mesh22, P())})
    assert isinstance(info.value.__cause__, CheckpointException)


# -- DCP interoperability ----------------------------------------------------------------------


def test_dcp_save_and_load_state_dicts_with_arrays(tmp_path, mesh24) -> None:
    """Plain dcp.save of a state dict holding arrays; sf.checkpoint.load reads it, and
    dcp.load loads in place into arrays (fresh shards: an array sharing storage is unchanged)."""
    w, b = torch.randn(8, 6), torch.randn(6)
    sd = {"layer": {"w": sf.distribute(w, P("x", "y"), mesh=mesh24), "b": sf.distribute(b, P(), mesh=mesh24)}}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    out = sf.checkpoint.load(tmp_path, {"layer": {"w": sf.NamedSharding(mesh24, P("y")), "b": b}})
    _exact(out["layer"]["w"].full_tensor(), w)
    _exact(out["layer"]["b"], b)
    target = sf.zeros((8, 6), sharding=P(None, "x"), mesh=mesh24)
    alias = target.detach()
    into = {"layer": {"w": target, "b": sf.zeros((6,), sharding=P("y"), mesh=mesh24)}}
    dcp.load(into, checkpoint_id=str(tmp_path), no_dist=True)
    assert into["layer"]["w"] is target and target.spec == P(None, "x")
    _exact(target.full_tensor(), w)
    _exact((target + 1).full_tensor(), w + 1)  # ops see the new value
    _exact(into["layer"]["b"].full_tensor(), b)
    _exact(alias.full_tensor(), torch.zeros(8, 6))


def test_sf_save_is_read_by_plain_dcp(tmp_path, mesh22) -> None:
    full = torch.randn(5, 3)
    sf.checkpoint.save(tmp_path, {"a": {"w": sf.distribute(full, P("x", "y"), mesh=mesh22)}})
    sd = {"a": {"w": torch.zeros(5, 3)}}
    dcp.load(sd, checkpoint_id=str(tmp_path), no_dist=True)
    _exact(sd["a"]["w"], full)


def test_dcp_load_into_partial_array_raises(tmp_path, mesh22) -> None:
    sf.checkpoint.save(tmp_path, {"w": torch.ones(2, 2)})
    target = sf.reshard(sf.zeros((2, 2), sharding=P(), mesh=mesh22), P(partial="x"))
    from shardfn.arrays.checkpointable import create_chunk_list

    with pytest.raises(sf.ShardingError, match="pending reductions"):
        create_chunk_list(target)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # DCP replaces the ShardingError (a ValueError) by its own
        dcp.load({"w": target}, checkpoint_id=str(tmp_path), no_dist=True)
    _exact(target.full_tensor(), torch.zeros(2, 2))


# -- Hugging Face safetensors ------------------------------------------------------------------


def test_hf_safetensors_file_into_sharded_arrays(tmp_path, mesh24) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    tensors = {"model.embed.weight": torch.randn(32, 8), "model.norm.weight": torch.randn(8),
               "lm_head.weight": torch.randn(32, 8).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    like = {"model": {"embed": {"weight": sf.NamedSharding(mesh24, P(("x", "y")))},
                      "norm": {"weight": sf.NamedSharding(mesh24, P())}},
            "lm_head.weight": sf.zeros((32, 8), sharding=P("y", "x"), mesh=mesh24)}
    out = sf.checkpoint.load(None, like, storage_reader=HuggingFaceStorageReader(str(tmp_path)))
    _exact(out["model"]["embed"]["weight"].full_tensor(), tensors["model.embed.weight"])
    assert out["model"]["embed"]["weight"].spec == P(("x", "y"))
    _exact(out["model"]["norm"]["weight"].full_tensor(), tensors["model.norm.weight"])
    _exact(out["lm_head.weight"].full_tensor(), tensors["lm_head.weight"].float())  # like's dtype


def test_hf_save_pretrained_model(tmp_path, mesh22) -> None:
    """A tiny transformers model saved with save_pretrained(safe_serialization=True) loads
    straight into sharded arrays (keys as in its state dict)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
    rules = {"q_proj.weight": P("y"), "o_proj.weight": P(None, "y"), "embed_tokens.weight": P(None, "x")}
    like = {k: sf.NamedSharding(mesh22, next((s for r, s in rules.items() if k.endswith(r)), P())) for k in sd}
    out = sf.checkpoint.load(tmp_path, like, storage_reader=HuggingFaceStorageReader(str(tmp_path)))
    for k, v in sd.items():
        _exact(out[k].full_tensor(), v)
    assert out["model.layers.0.self_attn.q_proj.weight"].spec == P("y")


# -- pickling ------------------------------------------------------------------------------------


def _arrays(mesh):
    full = torch.randn(5, 6)
    return full, [sf.distribute(full, P("x", "y"), mesh=mesh), sf.distribute(full, P(), mesh=mesh),
                  sf.distribute(full, P(None, ("y", "x")), mesh=mesh)]


def test_torch_save_load_keeps_mesh_sharding_values(mesh24) -> None:
    full, xs = _arrays(mesh24)
    partial = sf.reshard(xs[1], P(partial="x"))
    buf = io.BytesIO()
    torch.save({"xs": xs, "p": partial, "g": xs[0].detach().requires_grad_()}, buf)
    buf.seek(0)
    out = torch.load(buf)  # weights_only=True (torch's default) allows the rebuild
    for x, y in zip(xs, out["xs"]):
        assert type(y) is type(x) and y.sharding == x.sharding and y.mesh == mesh24
        _exact(y.full_tensor(), full)
    assert out["p"].spec == P(partial="x")
    _exact(out["p"].full_tensor(), full)
    _exact(out["p"].local_shards()[7], partial.local_shards()[7])
    assert out["g"].requires_grad and out["g"].is_leaf


def test_pickle_and_deepcopy(mesh22) -> None:
    full, xs = _arrays(mesh22)
    for x in xs:
        for y in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x), copy.copy(x)):
            assert y is not x and y.sharding == x.sharding
            _exact(y.full_tensor(), full)
    assert pickle.loads(pickle.dumps(mesh22)) == mesh22


def _in_child(x):
    return x.spec, x.mesh, x.full_tensor()


def test_multiprocessing_keeps_arrays(mesh22) -> None:
    full, xs = _arrays(mesh22)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        spec, mesh, got = pool.apply(_in_child, (xs[0],))
    assert spec == xs[0].spec and mesh == mesh22
    _exact(got, full)


def test_module_load_state_dict(mesh22) -> None:
    """load_state_dict of arrays into plain parameters raises (it would copy into a plain
    tensor); assign=True keeps the arrays, sharding included."""
    lin = torch.nn.Linear(4, 2)
    sd = {"weight": sf.distribute(torch.randn(2, 4), P("x"), mesh=mesh22),
          "bias": sf.distribute(torch.zeros(2), P(), mesh=mesh22)}
    with pytest.raises(RuntimeError, match="copy_"):
        lin.load_state_dict(sd)
    lin.load_state_dict(sd, assign=True)
    assert isinstance(lin.weight, sf.ShardedArray) and lin.weight.sharding == sd["weight"].sharding
    _exact(lin.weight.full_tensor(), sd["weight"].full_tensor())
