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


# -- moves between meshes over the same devices (fuzzing, issue 25) ---------------------------------

_VIEW_MESHES = [((2, 2), ("x", "y")), ((4,), ("x",)), ((4,), ("y",)), ((1, 4), ("x", "y")), ((4, 1), ("y", "x"))]


def _view_specs(names):
    ents = [None, *names, *[(a, b) for a in names for b in names if a != b]]
    return [P(a, b) for a in ents for b in ents if not ({a} & {b} - {None}) and not (
        isinstance(a, tuple) and set(a) & {b}) and not (isinstance(b, tuple) and set(b) & {a})
        and not (isinstance(a, tuple) and isinstance(b, tuple))]


@pytest.mark.parametrize("shape", [(4, 6), (3, 5)])
@pytest.mark.parametrize("src_mesh", _VIEW_MESHES, ids=str)
@pytest.mark.parametrize("dst_mesh", _VIEW_MESHES, ids=str)
def test_reshard_onto_a_mesh_of_the_same_devices_is_exact(shape, src_mesh, dst_mesh):
    """Meshes that share axis names (2x2 ``("x", "y")`` and 4 ``("x",)``) had one fine-axis map:
    the layouts were said wrongly (a reshard made an array whose shards did not fit it); and a dim
    split unevenly over a coarse axis is not its nested split over the fine axes (6 over 4 is
    2, 2, 2, 0; over 2 then 2 it is 2, 1, 2, 1)."""
    m1, m2 = sf.Mesh(*src_mesh), sf.Mesh(*dst_mesh)
    t = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    for s1 in _view_specs(m1.axis_names):
        x = sf.distribute(t, s1, mesh=m1)
        for s2 in _view_specs(m2.axis_names):
            z = sf.reshard(x, sf.NamedSharding(m2, s2))
            want = sf.distribute(t, s2, mesh=m2)
            assert z.mesh == m2 and z._layout == want._layout, (s1, s2)
            assert all(torch.equal(a, b) for a, b in zip(z.local_shards(), want.local_shards())), (s1, s2)


def test_reshard_across_meshes_keeps_gradients_and_pending_sums():
    m1, m2 = sf.Mesh((2, 2), ("x", "y")), sf.Mesh((4,), ("x",))
    t = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    z = sf.reshard(sf.distribute(t, P(None, ("x", "y")), mesh=m1), sf.NamedSharding(m2, P(None, "x")))
    (z.full_tensor() * torch.arange(18.0).reshape(3, 6)).sum().backward()
    torch.testing.assert_close(t.grad, torch.arange(18.0, dtype=torch.float64).reshape(3, 6))
    parts = [torch.full((3, 6), float(i)) for i in range(4)]  # pending over x: devices (i, j) hold i's part
    x = sf.ShardedArray.from_local([parts[i // 2] for i in range(4)], P(partial="x"), mesh=m1, shape=(3, 6))
    torch.testing.assert_close(sf.reshard(x, sf.NamedSharding(m2, P(None, "x"))).full_tensor(), torch.full((3, 6), 1.0))
