"""The compiled call's per-call host work on arrays: rewrapping a compiled graph's outputs
(``__tensor_unflatten__`` with concrete sizes) builds the same array as the general path, and a
program loaded from torch's caches hands back arrays on the caller's mesh object."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

import shardfn as sf
from shardfn import P
from shardfn.arrays.array import ShardedArray, _BatchedArray
from shardfn.values.errors import ShardingError
from shardfn.values.layout import Layout

from conftest import meshes, shapes, specs


def _rewrapped(x: ShardedArray, ctx: tuple | None = None, size: tuple | None = None,
               stride: tuple | None = None) -> ShardedArray:
    names, own = x.__tensor_flatten__()
    return ShardedArray.__tensor_unflatten__({n: getattr(x, n) for n in names}, ctx or own,
                                             size or tuple(x.shape), stride or tuple(x.stride()))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rewrap_with_concrete_sizes_is_the_array(data):
    """Even (stacked) and uneven (per-device parts) layouts, pending sums, 0-3 dims: the rewrapped
    array has the type, shape, strides, offset, dtype, layout and shards of the original."""
    mesh = data.draw(meshes())
    shape = data.draw(shapes(max_dims=3))
    spec = data.draw(specs(mesh, len(shape)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.int64]))
    x = sf.distribute(torch.arange(float(torch.Size(shape).numel())).reshape(shape).to(dtype), spec, mesh=mesh)
    y = _rewrapped(x)
    assert type(y) is type(x) and (type(y) is _BatchedArray) == (len(shape) >= 3)
    assert (y.shape, y.stride(), y.storage_offset(), y.dtype) == (x.shape, x.stride(), x.storage_offset(), x.dtype)
    parts = (lambda v: v if isinstance(v, tuple) else (v,))
    assert y._layout == x._layout and all(a is b for a, b in zip(parts(y._local), parts(x._local), strict=True))
    assert not y.requires_grad
    assert torch.equal(y.full_tensor(), x.full_tensor())


def test_rewrap_keeps_strides_and_storage_offset(mesh22):
    x = sf.distribute(torch.arange(24.0).reshape(4, 6), P("x"), mesh=mesh22)
    layout, is_parts, _ = x.__tensor_flatten__()[1]
    y = _rewrapped(x, (layout, is_parts, 3), (4, 5), (6, 1))
    assert (tuple(y.shape), y.stride(), y.storage_offset()) == ((4, 5), (6, 1), 3)
    z = _rewrapped(x, (layout, is_parts), (4, 6), (6, 1))  # an older shardfn's context of two
    assert z.storage_offset() == 0 and z._layout == layout


@pytest.mark.parametrize("dtype, op", [(torch.int64, "avg"), (torch.complex64, "max")])
def test_rewrap_checks_the_pending_reduction_against_the_dtype(mesh22, dtype, op):
    """As building the array does: an average of integers or an order of complex numbers is refused."""
    x = sf.distribute(torch.ones(4, 6, dtype=dtype), P("x"), mesh=mesh22)
    layout = Layout(mesh22, x._layout.dims, (("y", op),))
    with pytest.raises(ShardingError, match=op):
        _rewrapped(x, (layout, False, 0))
    with pytest.raises(ShardingError, match=op):
        ShardedArray(x._local, layout, (4, 6), dtype)


def test_an_unpickled_mesh_is_the_live_equal_mesh():
    """Meshes are immutable values: unpickling one (as torch's compile caches do when they load a
    program) gives the live mesh of the same fields, or a new equal one when there is none."""
    mesh = sf.Mesh((2, 3), ("a", "b"), backend="local")
    assert pickle.loads(pickle.dumps(mesh)) is mesh
    other = sf.Mesh((3, 2), ("a", "b"), backend="local")
    assert pickle.loads(pickle.dumps(other)) is other and other is not mesh
    blob = pickle.dumps(sf.Mesh((5,), ("gone",), backend="local"))
    gc.collect()
    back = pickle.loads(blob)
    assert back == sf.Mesh((5,), ("gone",), backend="local") and back.shape == (5,)
