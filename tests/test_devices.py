"""The mesh owns the device: shards live on ``mesh.device_type`` (tested with meta meshes on CPU)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


def _devices(x: sf.ShardedArray) -> set[str]:
    return {s.device.type for s in x.local_shards()}


@pytest.fixture
def meta_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")


def test_distribute_moves_a_cpu_tensor_onto_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    assert _devices(x) == {"meta"} and x.device.type == "meta" and x.spec == P("dp", "tp")
    w = sf.distribute(torch.randn(6, 8), P("tp", None), mesh=meta_mesh)
    y = torch.relu(x @ w + 1)  # ops keep the shards there
    assert _devices(y) == {"meta"} and y.shape == (4, 8)


def test_from_local_moves_shards_onto_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    shards = [torch.randn(2, 3) for _ in range(4)]
    x = sf.ShardedArray.from_local(shards, P("dp", "tp"), mesh=meta_mesh)
    assert _devices(x) == {"meta"} and x.shape == (4, 6)


def test_factories_and_random_on_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    for x in (sf.zeros((4, 6), sharding=P("dp", "tp"), mesh=meta_mesh),
              sf.random.normal(sf.random.key(0), (4, 6), sharding=P("dp"), mesh=meta_mesh)):
        assert _devices(x) == {"meta"}


def test_cast_keeps_layout_and_device(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (x.to(torch.float64), x.to("meta", torch.bfloat16), x.double(), x.to(device="meta")):
        assert y.spec == P("dp", "tp") and _devices(y) == {"meta"} and isinstance(y, sf.ShardedArray)
    assert x.to(torch.float64).dtype == torch.float64


def test_cast_on_cpu_mesh_values_and_grad() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh).requires_grad_()
    y = x.to("cpu", torch.float64)
    assert y.spec == P("dp", "tp") and y.dtype == torch.float64
    torch.testing.assert_close(y.full_tensor(), t.double())
    (g,) = torch.autograd.grad((y * y).sum(), (x,))
    assert g.dtype == torch.float32 and g.spec == P("dp", "tp")
    torch.testing.assert_close(g.full_tensor(), 2 * t)


def test_move_to_another_device_type_is_a_sharding_error() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    x = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"_to_copy\(device='meta'\).*mesh's device type 'cpu'.*full_tensor"):
        x.to("meta")


def test_distribute_keeps_gradients_flowing_to_a_tensor_on_its_device() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    t = torch.randn(4, 4, requires_grad=True)
    (g,) = torch.autograd.grad((sf.distribute(t, P("x"), mesh=mesh) * 3).sum().full_tensor(), (t,))
    torch.testing.assert_close(g, torch.full((4, 4), 3.0))
