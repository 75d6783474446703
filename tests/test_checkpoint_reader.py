"""sf.checkpoint.load's default reader (checkpoint/_reader.py) reads chunks straight into the
new shards without torch.load, reads a chunk once when several shards overlap it, and falls
back to DCP's own path for anything else, with the same values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardfn as sf
from shardfn import P
from shardfn.checkpoint import _reader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _no_torch_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called")
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.complex64])
def test_direct_reads_without_torch_load(tmp_path, mesh24, monkeypatch, dtype) -> None:
    full = (torch.randn(8, 12) * 10).to(dtype)
    x = sf.distribute(full, P("x", "y"), mesh=mesh24)
    sf.checkpoint.save(tmp_path, {"w": x, "t": full[:3]})
    _no_torch_load(monkeypatch)
    out = sf.checkpoint.load(tmp_path, {"w": x, "t": full[:3]})
    assert torch.equal(out["w"].full_tensor(), full) and out["w"].spec == x.spec
    assert torch.equal(out["t"], full[:3])


def test_resharding_reads_each_chunk_once(tmp_path, mesh24, monkeypatch) -> None:
    """Saved in 4 row blocks, loaded as 8 blocks of columns x rows and as 2 row blocks:
    several shards overlap one saved chunk; each chunk's bytes are read once."""
    full = torch.randn(16, 8)
    sf.checkpoint.save(tmp_path, {"w": sf.distribute(full, P("y"), mesh=mesh24)})
    reads = []
    orig = _reader._read_exact

    def spy(stream, start, into):
        reads.append((start, into.numel()))
        return orig(stream, start, into)

    monkeypatch.setattr(_reader, "_read_exact", spy)
    for spec in (P(None, ("x", "y")), P("x"), P(("y", "x")), P()):
        reads.clear()
        out = sf.checkpoint.load(tmp_path, {"w": sf.NamedSharding(mesh24, spec)})["w"]
        assert torch.equal(out.full_tensor(), full) and out.spec == spec
        assert sorted(n for _, n in reads) == [32] * 4, (spec, reads)  # each saved 4 x 8 block once


def test_dtype_conversion_and_plain_dcp_files(tmp_path, mesh22) -> None:
    """A destination of another dtype; tensors DCP saved from a transposed view and from a
    slice of a larger storage (read by DCP's own path where the archive is not just the values)."""
    full = torch.randn(6, 10)
    big = torch.randn(40)
    dcp.save({"t": full.t(), "s": big[5:25].view(4, 5), "w": full}, checkpoint_id=tmp_path, no_dist=True)
    out = sf.checkpoint.load(tmp_path, {"t": sf.NamedSharding(mesh22, P("x")), "s": torch.empty(4, 5),
                                        "w": sf.distribute(torch.zeros(6, 10, dtype=torch.float64), P("y"), mesh=mesh22)})
    assert torch.equal(out["t"].full_tensor(), full.t())
    assert torch.equal(out["s"], big[5:25].view(4, 5))
    assert out["w"].dtype == torch.float64 and torch.equal(out["w"].full_tensor(), full.double())


def test_python_objects_and_empty_tensors(tmp_path, mesh24) -> None:
    tree = {"step": 7, "name": "run", "e": sf.distribute(torch.empty(0, 4), P("x"), mesh=mesh24),
            "z": torch.zeros(())}
    sf.checkpoint.save(tmp_path, tree)
    out = sf.checkpoint.load(tmp_path, tree)
    assert out["step"] == 7 and out["name"] == "run" and out["e"].shape == (0, 4) and torch.equal(out["z"], tree["z"])
