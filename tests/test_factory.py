"""Factories: zeros/ones/empty/full/rand/randn with a sharding, and make_array_from_callback."""

from __future__ import annotations

import pytest
import torch
from _alloc import Allocations, assert_shard_sized
from conftest import meshes, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P
from shardfn.values.layout import local_shapes

FILLS = {
    "zeros": (lambda s, sh, m, dt: sf.zeros(s, sh, mesh=m, dtype=dt), lambda s, dt: torch.zeros(s, dtype=dt)),
    "ones": (lambda s, sh, m, dt: sf.ones(s, sh, mesh=m, dtype=dt), lambda s, dt: torch.ones(s, dtype=dt)),
    "full": (lambda s, sh, m, dt: sf.full(s, 3, sh, mesh=m, dtype=dt), lambda s, dt: torch.full(s, 3, dtype=dt)),
}


@given(st.data())
def test_fills_gather_to_the_torch_value(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    dtype = data.draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16]))
    # Partial("avg") needs a floating dtype, as torch.mean does (test_errors.py)
    ops = ("sum", "avg", "max", "min") if dtype.is_floating_point else ("sum", "max", "min")
    spec = data.draw(specs(mesh, len(shape), partial_ops=ops))
    kind = data.draw(st.sampled_from(sorted(FILLS)))
    make, ref = FILLS[kind]
    x = make(shape, spec, mesh, dtype)
    assert isinstance(x, sf.ShardedArray) and x.dtype == dtype and tuple(x.shape) == shape
    assert x._layout == sf.NamedSharding(mesh, spec).layout(len(shape))
    assert [tuple(s.shape) for s in x.local_shards()] == list(local_shapes(x._layout, shape))
    assert torch.equal(sf.gather(x), ref(shape, dtype))


@given(st.data())
def test_empty_has_the_layout(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    x = sf.empty(shape, spec, mesh=mesh, dtype=torch.float16)
    assert x.dtype == torch.float16 and tuple(x.shape) == shape
    assert [tuple(s.shape) for s in x.local_shards()] == list(local_shapes(x._layout, shape))


@given(st.data())
def test_factories_allocate_only_shards(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes(min_dims=1))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    kind = data.draw(st.sampled_from(["zeros", "ones", "empty", "rand", "randn"]))
    make = {"zeros": sf.zeros, "ones": sf.ones, "empty": sf.empty}.get(kind)
    with Allocations() as rec:
        if make is not None:
            x = make(shape, spec, mesh=mesh)
        else:
            x = getattr(sf, kind)(shape, spec, mesh=mesh, key=sf.random.key(0))
    assert_shard_sized(rec, x)


def test_replicated_factory_is_one_buffer(mesh24):
    with Allocations() as rec:
        x = sf.ones((64, 32), P("x"), mesh=mesh24)
    # two distinct shards (one per 'x' coordinate) stacked once, expanded over 'y'
    assert rec.storage == [("aten.stack.default", 2 * 32 * 32)]
    assert rec.largest_temp() == 32 * 32
    assert torch.equal(sf.gather(x), torch.ones(64, 32))


def test_rand_randn_match_sf_random(mesh24):
    k = sf.random.key(9)
    assert torch.equal(sf.gather(sf.rand((5, 6), P("x", "y"), mesh=mesh24, key=k)), sf.random.uniform(k, (5, 6)))
    assert torch.equal(sf.gather(sf.randn((5, 6), P("y"), mesh=mesh24, key=k)), sf.random.normal(k, (5, 6)))


def test_rand_without_key_follows_torch_seed(mesh24):
    torch.manual_seed(3)
    a = sf.gather(sf.randn((4, 4), P("x"), mesh=mesh24))
    torch.manual_seed(3)
    b = sf.gather(sf.randn((4, 4), P("y"), mesh=mesh24))
    assert torch.equal(a, b)
    assert not torch.equal(a, sf.gather(sf.randn((4, 4), P("y"), mesh=mesh24)))


def test_requires_grad_leaf(mesh24):
    w = sf.randn((8, 4), P("x"), mesh=mesh24, key=sf.random.key(0), requires_grad=True)
    z = sf.zeros((8, 4), P("x"), mesh=mesh24, requires_grad=True)
    assert w.requires_grad and w.is_leaf and z.requires_grad
    (w * 2).sum().backward()
    assert torch.equal(sf.gather(w.grad), torch.full((8, 4), 2.0))


def test_full_dtype_follows_torch_full(mesh24):
    assert sf.full((2,), 1, P("x"), mesh=mesh24).dtype == torch.int64
    assert sf.full((2,), True, P("x"), mesh=mesh24).dtype == torch.bool
    assert sf.full((2,), 1.5, P("x"), mesh=mesh24).dtype == torch.get_default_dtype()


def test_without_sharding_returns_plain_tensors():
    assert type(sf.zeros((2, 3))) is torch.Tensor
    assert type(sf.full(4, 2.0)) is torch.Tensor and sf.full(4, 2.0).shape == (4,)
    assert type(sf.rand((2,), key=sf.random.key(0))) is torch.Tensor


def test_current_mesh_and_placements(mesh24):
    with mesh24:
        a = sf.ones((4, 8), P(None, "y"))
    b = sf.ones((4, 8), (sf.Replicate(), sf.Shard(1)), mesh=mesh24)
    assert a._layout == b._layout


# -- make_array_from_callback -------------------------------------------------------------------


@given(st.data())
def test_make_array_from_callback(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    full = torch.arange(int(torch.tensor(shape).prod()) if shape else 1, dtype=torch.float32).reshape(shape)
    calls = []

    def cb(index):
        calls.append(index)
        return full[index]

    x = sf.make_array_from_callback(shape, spec, cb, mesh=mesh)
    assert torch.equal(sf.gather(x), full)
    assert x._layout == sf.NamedSharding(mesh, spec).layout(len(shape))
    assert all(isinstance(i, tuple) and all(isinstance(s, slice) for s in i) for i in calls)


def test_callback_wrong_shape_names_the_shard(mesh24):
    with pytest.raises(sf.ShardingError, match=r"shape \(2, 4\)"):
        sf.make_array_from_callback((4, 16), P("x", "y"), lambda idx: torch.zeros(3), mesh=mesh24)


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(-1, 2), (2.5,), "ab", None])
def test_bad_shape(shape, mesh24):
    with pytest.raises(sf.ShardingError, match="shape"):
        sf.zeros(shape, P("x"), mesh=mesh24)


def test_spec_does_not_fit(mesh24):
    with pytest.raises(sf.ShardingError, match="rank 1"):
        sf.zeros((4,), P("x", "y"), mesh=mesh24)
    with pytest.raises(sf.ShardingError, match="'z'"):
        sf.ones((4,), P("z"), mesh=mesh24)


def test_no_mesh():
    with pytest.raises(sf.ShardingError, match="needs a mesh"):
        sf.zeros((4,), P("x"))
