"""The Backend protocol: one class per backend, each implementing every method with the
protocol's parameters; no code outside shardfn/backends/ tests which backend a mesh has."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import shardfn as sf
from shardfn.backends import Backend, backend_for, backend_named
from shardfn.backends.dist import DistBackend
from shardfn.backends.local import LocalBackend

P = sf.P
ROOT = Path(sf.__file__).parent
PROTOCOL = sorted(n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_"))


def test_protocol_methods_are_documented() -> None:
    """Every protocol method says what it is for."""
    assert len(PROTOCOL) >= 20
    for name in PROTOCOL:
        assert (getattr(Backend, name).__doc__ or "").strip(), name


@pytest.mark.parametrize("cls", [LocalBackend, DistBackend])
def test_each_backend_implements_the_protocol(cls: type) -> None:
    """Each class has every protocol method, taking the protocol's parameters."""
    for name in PROTOCOL:
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(Backend, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(cls(), name)).parameters]
        assert got == want, f"{cls.__name__}.{name}{got} != Backend.{name}{want}"


def test_backend_for_returns_one_instance_per_backend() -> None:
    a, b = sf.Mesh((2,), ("x",), backend="local"), sf.Mesh((2, 2), ("x", "y"), backend="local")
    assert isinstance(backend_for(a), LocalBackend)
    assert backend_for(a) is backend_for(b) is backend_named("local")
    assert isinstance(backend_named("dist"), DistBackend)
    assert backend_named("dist") is backend_named("dist")


def test_local_backend_holds_every_device() -> None:
    """The held-device view of a value: every device, shards in row-major order."""
    mesh = sf.Mesh((2, 3), ("x", "y"), backend="local")
    t = torch.arange(24.0).view(4, 6)
    x = sf.distribute(t, P("x", "y"), mesh=mesh)
    be = backend_for(mesh)
    assert list(be.devices(mesh)) == list(range(6))
    shards = be.shard_list(x._local, mesh)
    for d in range(6):
        cx, cy = mesh.coords(d)
        want = t[2 * cx:2 * cx + 2, 2 * cy:2 * cy + 2]
        assert torch.equal(shards[d], want) and torch.equal(be.shard(x._local, mesh, d), want)
    assert be.pack_local(list(shards), mesh) == list(shards)
    assert len(be.unpack_local(torch.zeros(6, 2), mesh)) == 6


def test_local_build_calls_make_once_per_distinct_shard() -> None:
    """Replicas share one computed shard; the value is stored in its compact form."""
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    layout = sf.values.spec.to_layout(P("dp", None), 2, mesh)
    calls = []

    def make(dev: int) -> torch.Tensor:
        calls.append(dev)
        return torch.full((3, 5), float(mesh.coords(dev)[0]))

    value = backend_for(mesh).build(layout, (6, 5), make)
    assert calls == [0, 4]  # coordinate 0 on 'tp', which the layout does not vary over
    assert tuple(value.shape) == (2, 1, 3, 5)
    x = sf.ShardedArray(value, layout, (6, 5), torch.float32)
    assert torch.equal(x.full_tensor(), torch.cat([torch.zeros(3, 5), torch.ones(3, 5)]))


def test_no_backend_branches_outside_backends() -> None:
    """Code outside shardfn/backends/ asks the backend instead of testing which it is
    (dispatch.py included: the backend's compile_call runs an op's local call)."""
    pattern = re.compile(r"backend\s*[!=]=|\bis\s+_?local_backend\b|backend_for\([^)]*\)\s+is\s+(?!not\s+backend_for)")
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("backends/"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_per_device_outputs_stack_only_over_the_axes_they_vary_on():
    """Per-device results are stacked only over the mesh axes their layout varies over; a
    replicated output is a view of device 0's (per-call constants such as a fused kernel's
    RNG state, which CUDA returns on the CPU, never meet in a stacking kernel)."""
    from shardfn.backends import local_values as local
    from shardfn.values.spec import to_layout

    mesh = sf.Mesh((2, 3), ("dp", "tp"))
    shards = [torch.full((2,), float(d)) for d in range(mesh.size)]
    rep = local.from_parts(shards, to_layout(sf.P(), 1, mesh), (2,))
    assert rep.shape == (1, 1, 2) and rep.untyped_storage().data_ptr() == shards[0].untyped_storage().data_ptr()
    by_tp = local.from_parts(shards, to_layout(sf.P("tp"), 1, mesh), (6,))
    assert by_tp.shape == (1, 3, 2) and by_tp[0, :, 0].tolist() == [0.0, 1.0, 2.0]
    both = local.from_parts(shards, to_layout(sf.P(("dp", "tp")), 1, mesh), (12,))
    assert both.shape == (2, 3, 2) and both[:, :, 0].flatten().tolist() == [float(d) for d in range(6)]
