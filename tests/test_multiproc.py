"""Issue 23 on the simulated mesh: no silent simulation, printing, checked replicas."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import P

# -- no silent simulation ------------------------------------------------------------------------


def test_torchrun_env_without_process_group_warns_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not dist.is_initialized()
    for _ in range(2):  # every time, not once per call site
        with pytest.warns(sf.SimulationWarning, match=r"init_process_group") as rec:
            mesh = sf.Mesh((2, 2), ("x", "y"))
        assert mesh.backend == "local"
        assert "rank 1 of 4" in str(rec[0].message)
        assert rec[0].filename == __file__  # points at the code that built the mesh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sf.Mesh((2, 2), ("x", "y"), backend="local").backend == "local"  # on purpose: silent


def test_no_torchrun_env_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sf.Mesh((4,), ("x",)).backend == "local"


def test_world_of_another_size_warns_naming_sizes(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.warns(sf.SimulationWarning, match=r"initialised with 1 rank .*not 4"):
            assert sf.Mesh((2, 2), ("x", "y")).backend == "local"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sf.Mesh((1,), ("x",)).backend == "dist"
            assert sf.Mesh((2, 2), ("x", "y"), backend="local").backend == "local"
    finally:
        dist.destroy_process_group()
