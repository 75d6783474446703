import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import NamedSharding, P, Partial, Replicate, Shard, ShardingError
from shardfn.values.spec import to_layout

from conftest import meshes, specs


def test_p_is_a_tuple_keeping_entries_as_given():
    p = P("x", None)
    assert isinstance(p, tuple) and tuple(p) == ("x", None)
    assert p != P("x") and hash(p) == hash(P("x", None))
    assert P("x", partial="y").partial == {"y": "sum"}
    assert P(partial=("x", "y")).partial == {"x": "sum", "y": "sum"}
    assert P(partial={"x": "max"}) != P(partial={"x": "min"})
    assert repr(P("dp", None)) == "P('dp', None)"
    assert repr(P(("x", "y"), partial={"z": "avg"})) == "P(('x', 'y'), partial={'z': 'avg'})"


def test_placements_have_exact_repr_and_short_str():
    assert repr(Shard(0)) == "Shard(dim=0)" and str(Shard(0)) == "S(0)"
    assert str(Replicate()) == "R" and str(Partial("max")) == "P(max)"
    assert Partial() == Partial("sum") and hash(Shard(1)) == hash(Shard(1))


def test_negative_shard_dims_are_normalised(mesh22):
    a = NamedSharding.from_placements(mesh22, (Shard(-1), Replicate()), 2)
    b = NamedSharding.from_placements(mesh22, (Shard(1), Replicate()), 2)
    assert a == b and a.spec == P(None, "x")


def test_both_spellings_mean_the_same_layout(mesh24):
    s1 = to_layout(P("x", None), 2, mesh24)
    s2 = to_layout(P("x"), 2, mesh24)
    s3 = to_layout((Shard(0), Replicate()), 2, mesh24)
    s4 = to_layout(NamedSharding(mesh24, P("x")), 2)
    assert s1 == s2 == s3 == s4


def test_multi_axis_dims_and_partial_round_trip(mesh24):
    ns = NamedSharding(mesh24, P(("x", "y"), partial=None))
    assert ns.placements(2) == (Shard(0), Shard(0))
    ns = NamedSharding(mesh24, P(None, partial={"x": "max", "y": "sum"}))
    assert ns.placements(1) == (Partial("max"), Partial("sum"))


def test_placements_cannot_express_reverse_axis_order(mesh24):
    with pytest.raises(ShardingError, match="not in mesh order"):
        NamedSharding(mesh24, P(("y", "x"))).placements(1)


@given(st.data())
def test_conversions_are_exact_both_ways(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, ndim, partial_ops=("sum", "avg", "max", "min")))
    layout = to_layout(spec, ndim, mesh)
    try:
        placements = NamedSharding(mesh, spec).placements(ndim)
    except ShardingError:
        assert any(list(d) != sorted(d, key=mesh.axis_names.index) for d in layout.dims)
        return
    back = NamedSharding.from_placements(mesh, placements, ndim)
    assert to_layout(back, ndim) == layout
    assert back.placements(ndim) == placements


# -- bad specs -----------------------------------------------------------------------------


def test_axis_used_twice():
    with pytest.raises(ShardingError, match="axis 'x' is used twice in P\\('x', 'x'\\)"):
        P("x", "x")
    with pytest.raises(ShardingError, match="axis 'x' is used twice"):
        P("x", partial="x")


def test_unknown_axis_name(mesh24):
    with pytest.raises(ShardingError, match="names axis 'dp', which the mesh lacks; its axes are \\('x', 'y'\\)"):
        to_layout(P("dp"), 2, mesh24)


def test_more_entries_than_dims(mesh24):
    with pytest.raises(ShardingError, match="has 3 entries but the tensor has rank 2"):
        to_layout(P("x", None, "y"), 2, mesh24)


def test_shard_dim_out_of_range(mesh24):
    with pytest.raises(ShardingError, match="Shard\\(2\\) on mesh axis 'x' is out of range.*rank 2; valid dims are -2..1"):
        to_layout((Shard(2), Replicate()), 2, mesh24)


def test_wrong_number_of_placements(mesh24):
    with pytest.raises(ShardingError, match="got 1 placements for a mesh with 2 axes"):
        to_layout((Shard(0),), 2, mesh24)


def test_bad_entries_and_ops():
    with pytest.raises(ShardingError, match="P entry 0 is 3"):
        P(3)
    with pytest.raises(ShardingError, match="reduce op 'prod' is unknown"):
        Partial("prod")


def test_bare_spec_without_mesh():
    with pytest.raises(ShardingError, match="needs a mesh"):
        to_layout(P("x"), 1, None)


def test_mixing_two_meshes():
    a = sf.Mesh((2,), ("x",))
    b = sf.Mesh((4,), ("x",))
    import torch

    x = sf.distribute(torch.ones(4), P("x"), mesh=a)
    with pytest.raises(ShardingError, match="different mesh"):
        sf.reshard(x, NamedSharding(b, P("x")))
    y = sf.distribute(torch.ones(4), P("x"), mesh=b)
    with pytest.raises(ShardingError, match="different meshes"):
        x + y
