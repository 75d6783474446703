"""The mesh owns the device, adversarially: casts, moves, factories and random draws on CPU and
meta meshes, every local shard's device and dtype against plain torch (a meta mesh stands in
for an accelerator's)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


def _shards(x: sf.ShardedArray) -> set[tuple[str, torch.dtype]]:
    return {(s.device.type, s.dtype) for s in x.local_shards()}


@pytest.fixture
def meta_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")


@pytest.fixture
def cpu_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


# -- random draws whose probabilities are tensors -----------------------------------------------


def test_bernoulli_of_tensor_probabilities_on_a_meta_mesh(meta_mesh: sf.Mesh) -> None:
    """The [0, 1] check of a tensor p read a meta shard's values (``Tensor.item() cannot be
    called on meta tensors``): torch.bernoulli / sf.random.bernoulli of an array's values
    crashed on a meta mesh. A meta p has no values to check, as in torch's meta kernels."""
    k = sf.random.key(0)
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (torch.bernoulli(x.sigmoid()), sf.random.bernoulli(k, x.sigmoid()),
              sf.random.bernoulli(k, torch.full((4, 6), 0.3), None, P("tp"), mesh=meta_mesh),
              sf.random.bernoulli(k, torch.full((4, 6), 0.3, device="meta"), None, P("dp"), mesh=meta_mesh)):
        assert y.shape == (4, 6) and _shards(y) in ({("meta", torch.float32)}, {("meta", torch.bool)})
    # unsharded, the draws are made where p lives, as torch.bernoulli(p) makes them
    y = sf.random.bernoulli(k, torch.full((4, 6), 0.3, device="meta"))
    assert type(y) is torch.Tensor and y.device.type == "meta" and y.dtype == torch.bool


def test_bernoulli_of_tensor_probabilities_on_a_cpu_mesh_equals_the_unsharded_draw(cpu_mesh: sf.Mesh) -> None:
    k = sf.random.key(7)
    p = torch.rand(5, 3)
    want = sf.random.bernoulli(k, p)
    for spec in (P("dp"), P(None, "tp"), P(("dp", "tp"))):
        y = sf.random.bernoulli(k, p, None, spec, mesh=cpu_mesh)
        assert _shards(y) == {("cpu", torch.bool)} and torch.equal(y.full_tensor(), want)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # the check still runs where p has values
        sf.random.bernoulli(k, p + 1, None, P("dp"), mesh=cpu_mesh)


def test_bernoulli_of_a_meta_p_onto_a_data_mesh_is_a_sharding_error(cpu_mesh: sf.Mesh) -> None:
    """Was torch's NotImplementedError ('Cannot copy out of meta tensor') from a shard's copy."""
    with pytest.raises(sf.ShardingError, match=r"bernoulli: p is a meta tensor.*no values.*'cpu'"):
        sf.random.bernoulli(sf.random.key(0), torch.full((4, 6), 0.3, device="meta"), None, P("dp"), mesh=cpu_mesh)
