"""Mesh.flatten / Mesh.unflatten and resharding between a mesh and its views."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P
from shardfn import NamedSharding as NS


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def test_flatten_unflatten_shapes(mesh):
    flat = mesh.flatten(("dp", "tp"), "dptp")
    assert flat.shape == (4,) and flat.axis_names == ("dptp",)
    back = flat.unflatten("dptp", (2, 2), ("dp", "tp"))
    assert back == mesh
    m3 = sf.Mesh((2, 3, 2), ("a", "b", "c"), backend="local")
    assert m3.flatten(("b", "c"), "bc").shape == (2, 6)


def test_flatten_unflatten_errors(mesh):
    m3 = sf.Mesh((2, 3, 2), ("a", "b", "c"), backend="local")
    with pytest.raises(sf.ShardingError, match=r"\('a', 'c'\) must be adjacent"):
        m3.flatten(("a", "c"), "ac")
    with pytest.raises(sf.ShardingError, match=r"\('tp', 'dp'\) must be adjacent and in mesh order"):
        mesh.flatten(("tp", "dp"), "x")
    with pytest.raises(sf.ShardingError, match=r"shape \(3, 2\) has 6 devices but axis 'dp' has 2"):
        mesh.unflatten("dp", (3, 2), ("a", "b"))
    with pytest.raises(sf.ShardingError, match="name 'tp' is already an axis"):
        mesh.unflatten("dp", (2, 1), ("tp", "z"))


@pytest.mark.parametrize("n", [8, 7, 3])
def test_reshard_onto_flat_view_moves_no_data(mesh, n):
    flat = mesh.flatten(("dp", "tp"), "dptp")
    x = torch.randn(n, 3)
    xs = sf.distribute(x, P(("dp", "tp")), mesh=mesh).requires_grad_()
    with sf.debug.CommCounter() as c:
        y = sf.reshard(xs, NS(flat, P("dptp")))
        back = sf.reshard(y, NS(mesh, P(("dp", "tp"))))
    assert c.total == 0
    assert y.mesh == flat and y.spec == P("dptp")
    assert [tuple(s.shape) for s in y.local_shards()] == [tuple(s.shape) for s in xs.local_shards()]
    torch.testing.assert_close(y.full_tensor(), x)
    torch.testing.assert_close(back.full_tensor(), x)
    (y.full_tensor() * 3).sum().backward()
    assert xs.grad.mesh == mesh
    torch.testing.assert_close(xs.grad.full_tensor(), torch.full_like(x, 3.0))


def test_reshard_onto_view_with_other_layout(mesh):
    un = mesh.unflatten("tp", (2, 1), ("t0", "t1"))
    flat = mesh.flatten(("dp", "tp"), "dptp")
    x = torch.randn(8, 4)
    xs = sf.distribute(x, P("dp", "tp"), mesh=mesh)
    with sf.debug.CommCounter() as c:
        y = sf.reshard(xs, NS(un, P("dp", "t0")))
    assert c.total == 0 and y.spec == P("dp", "t0")
    z = sf.reshard(xs, NS(flat, P(None, "dptp")))  # layouts disagree: data moves on the shared devices
    torch.testing.assert_close(z.full_tensor(), x)
    p = sf.distribute(torch.ones(4), P(partial="dp"), mesh=mesh)
    q = sf.reshard(p, NS(flat, P()))
    torch.testing.assert_close(q.full_tensor(), p.full_tensor())
    assert q.spec == P()


def test_reshard_onto_a_mesh_that_is_not_a_view(mesh):
    xs = sf.distribute(torch.randn(6, 2), P("dp"), mesh=mesh)
    other = sf.Mesh((3,), ("x",), backend="local")
    with pytest.raises(sf.ShardingError, match="is not a view"):
        sf.reshard(xs, NS(other, P("x")))


def test_reshard_onto_view_forward_mode(mesh):
    import torch.autograd.forward_ad as fwAD

    flat = mesh.flatten(("dp", "tp"), "dptp")
    x, t = torch.randn(8, 3), torch.randn(8, 3)
    with fwAD.dual_level():
        xs = sf.distribute(fwAD.make_dual(x, t), P(("dp", "tp")), mesh=mesh)
        y = sf.reshard(xs, NS(flat, P("dptp")))
        tangent = fwAD.unpack_dual(sf.gather(y)).tangent
    torch.testing.assert_close(tangent, t)
