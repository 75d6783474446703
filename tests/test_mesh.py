import pytest

import shardfn as sf
from shardfn import ShardingError


def test_mesh_is_an_immutable_hashable_value():
    a = sf.Mesh((2, 4), ("x", "y"), backend="local")
    b = sf.Mesh([2, 4], ["x", "y"], backend="local")
    assert a == b and hash(a) == hash(b)
    assert a.shape == (2, 4) and a.axis_names == ("x", "y") and a.size == 8
    assert a.axis_size("y") == 4 and a.backend == "local" and a.device_type == "cpu"
    with pytest.raises(AttributeError):
        a.shape = (8,)


def test_default_backend_is_local_without_torch_distributed():
    assert sf.Mesh((4,), ("x",)).backend == "local"


def test_devices_are_numbered_row_major():
    m = sf.Mesh((2, 3), ("x", "y"))
    assert [m.coords(d) for d in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_nested_mesh_contexts_restore_on_exit():
    a, b = sf.Mesh((2,), ("x",)), sf.Mesh((4,), ("y",))
    assert sf.current_mesh() is None
    with a:
        assert sf.current_mesh() is a
        with b:
            assert sf.current_mesh() is b
        assert sf.current_mesh() is a
    assert sf.current_mesh() is None


@pytest.mark.parametrize(
    "shape, names, match",
    [
        ((2, 2.5), ("x", "y"), "entry 1 is 2.5"),
        ((2, -1), ("x", "y"), "entry 1 is -1"),
        ((0,), ("x",), "entry 0 is 0"),
        ((2, 2), ("x", "x"), "repeat 'x'"),
        ((2, 2), ("x",), "2 dims but 1 axis_names"),
        ((2,), ("x",), None),
    ],
)
def test_bad_mesh_shapes_and_names(shape, names, match):
    if match is None:
        sf.Mesh(shape, names)
        return
    with pytest.raises(ShardingError, match=match):
        sf.Mesh(shape, names)


def test_unknown_axis_and_backend():
    m = sf.Mesh((2,), ("x",))
    with pytest.raises(ShardingError, match="axis 'q' is not in the mesh.*'x'"):
        m.axis_size("q")
    with pytest.raises(ShardingError, match="backend 'mpi' is unknown"):
        sf.Mesh((2,), ("x",), backend="mpi")


def test_repr_names_axes_backend_and_a_non_cpu_device_type():
    """Errors about arrays on meshes of different devices quote the meshes: their repr says the
    device type wherever it is not the default 'cpu'."""
    assert repr(sf.Mesh((2, 2), ("dp", "tp"))) == "Mesh(dp=2, tp=2, backend='local')"
    assert repr(sf.Mesh((2, 2), ("dp", "tp"), device_type="meta")) == (
        "Mesh(dp=2, tp=2, device_type='meta', backend='local')")
