import math

from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P
from shardfn.values.layout import all_boxes, device_box, is_even, local_shapes
from shardfn.values.spec import to_layout

from conftest import meshes, shapes, specs


def _pieces(n: int, k: int) -> list[tuple[int, int]]:
    c = math.ceil(n / k)
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def test_contract_examples():
    m = sf.Mesh((4,), ("x",))
    L = to_layout(P("x"), 1, m)
    assert [device_box(L, (5,), d) for d in range(4)] == [((0, 2),), ((2, 4),), ((4, 5),), ((5, 5),)]
    assert [device_box(L, (2,), d) for d in range(4)] == [((0, 1),), ((1, 2),), ((2, 2),), ((2, 2),)]
    assert local_shapes(L, (0,)) == ((0,),) * 4
    assert is_even(L, (8,)) and not is_even(L, (7,))


def test_nested_split_over_two_axes():
    m = sf.Mesh((2, 3), ("x", "y"))
    L = to_layout(P(("x", "y")), 1, m)
    # 10 -> x: [0,5) [5,10); each -> y: ceil(5/3)=2 -> [0,2) [2,4) [4,5)
    assert [device_box(L, (10,), d)[0] for d in range(6)] == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10)]
    R = to_layout(P(("y", "x")), 1, m)
    # y first: ceil(10/3)=4 -> [0,4) [4,8) [8,10); then x halves; device (x, y) row-major
    assert [device_box(R, (10,), d)[0] for d in range(6)] == [(0, 2), (4, 6), (8, 9), (2, 4), (6, 8), (9, 10)]


@given(st.data())
def test_boxes_tile_the_tensor_exactly(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    layout = to_layout(spec, len(shape), mesh)
    boxes = all_boxes(layout, shape)
    # every element is held by exactly (number of devices replicating it) devices
    replication = math.prod(n for a, n in zip(mesh.axis_names, mesh.shape) if a not in layout.axis_dim)
    counts = {}
    for box in boxes:
        for idx in _indices(box):
            counts[idx] = counts.get(idx, 0) + 1
    assert len(counts) == math.prod(shape)
    assert set(counts.values()) <= {replication}
    # each dim follows the contract: nested ceil-splits in the spec's axis order
    for dev, box in enumerate(boxes):
        coords = mesh.coords(dev)
        for d, axes in enumerate(layout.dims):
            lo, hi = 0, shape[d]
            for a in axes:
                i = mesh.axis_names.index(a)
                plo, phi = _pieces(hi - lo, mesh.shape[i])[coords[i]]
                lo, hi = lo + plo, lo + phi
            assert box[d] == (lo, hi)


def _indices(box):
    import itertools

    return itertools.product(*(range(lo, hi) for lo, hi in box))
