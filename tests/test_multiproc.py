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


# -- printing ------------------------------------------------------------------------------------


def _body(t: torch.Tensor) -> str:
    """What torch prints inside ``tensor(...)``, re-indented for ``ShardedArray(``."""
    return repr(t)[len("tensor("):-1].replace("\n" + " " * 7, "\n" + " " * 13)


@pytest.mark.parametrize("spec", [P("x", "y"), P(None, "y"), P(), P(("y", "x"))])
def test_repr_shows_values_like_a_tensor(spec: P) -> None:
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    t = torch.arange(15.0).reshape(5, 3) / 3  # uneven over both axes
    x = sf.distribute(t, spec, mesh=mesh)
    with sf.debug.CommCounter() as c:
        text, plain = repr(x), str(x)
    assert c.total == 0
    assert text == plain
    assert text.startswith("ShardedArray(" + _body(t) + ", f32[5,3] ")
    assert repr(spec)[2:-1] in text and "backend='local'" in text


def test_repr_of_pending_sums_shows_the_reduced_value_and_autograd() -> None:
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    t = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x = sf.distribute(t, P("x", "y"), mesh=mesh)
    s = (x * 2).sum()
    assert s.spec.partial
    assert _body((t * 2).sum().detach()) in repr(s) and "grad_fn=<" in repr(s)
    m = sf.distribute(t.detach(), P("x"), mesh=mesh).amax(0)
    assert m.spec.partial and _body(t.detach().amax(0)) in repr(m)
    leaf = sf.distribute(t.detach(), P("x"), mesh=mesh).requires_grad_()
    assert repr(leaf).endswith("requires_grad=True)")


def test_repr_follows_print_options() -> None:
    mesh = sf.Mesh((4,), ("x",), backend="local")
    t = torch.randn(40, 40)
    x = sf.distribute(t, P("x"), mesh=mesh)
    try:
        torch.set_printoptions(precision=2, threshold=10)
        assert _body(t) in repr(x) and "..." in repr(x)
    finally:
        torch.set_printoptions(profile="default")
    assert _body(t) in repr(x)
    i = sf.distribute(torch.arange(6, dtype=torch.int32), P("x"), mesh=mesh)
    assert repr(i).startswith("ShardedArray([0, 1, 2, 3, 4, 5], dtype=torch.int32, i32[6]")
