"""Reshard on both backends: every per-axis transition and exchange, uneven layouts,
Partial sources, autograd, and dist-vs-local bit identity."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_harness import (
    assert_equal,
    assert_shards,
    collect,
    held,
    is_dist,
    local_twin,
    scenario,
    shards_for,
    source,
)

import shardfn as sf
from shardfn import P
from shardfn.values.spec import to_layout

SHAPES_2D = [(8, 12), (7, 5), (3, 2)]


def layouts_2d(mesh: sf.Mesh, partial_ops: tuple[str, ...] = ("sum",)) -> list[P]:
    """Every spec of a 2-D value: each axis replicated, sharding dim 0 or 1 (both nesting
    orders when two axes share a dim), or a pending reduction."""
    choices = ["R", 0, 1, *(f"P:{op}" for op in partial_ops)]
    out = []
    for combo in itertools.product(choices, repeat=mesh.ndim):
        dims: list[list[str]] = [[], []]
        partial = {}
        for a, c in zip(mesh.axis_names, combo):
            if c in (0, 1):
                dims[c].append(a)
            elif c != "R":
                partial[a] = c[2:]
        orders = [list(itertools.permutations(d)) or [()] for d in dims]
        for d0, d1 in itertools.product(*orders):
            entry = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in (d0, d1)]
            out.append(P(*entry, partial=partial or None))
    return out


@scenario
def every_transition(mesh: sf.Mesh) -> None:
    """All pairs of 2-D layouts (per-axis collectives and multi-axis exchanges), even and uneven."""
    ops = ("sum", "avg", "max", "min") if mesh.ndim == 1 else ("sum",)
    specs = layouts_2d(mesh, ops)
    for shape in SHAPES_2D:
        for src in specs:
            x, full, _ = source(src, mesh, shape)
            for dst in specs:
                y = sf.reshard(x, dst)
                what = f"{shape} {src} -> {dst}"
                assert y._layout == to_layout(dst, 2, mesh), what
                if y._layout.partial:
                    assert_equal(y.full_tensor(), full, what)
                else:  # every shard checked here, no further communication
                    assert_shards(y, full, what)


@scenario
def three_dim_all_to_all(mesh: sf.Mesh) -> None:
    """all_to_all between inner dims (neither split nor gather dim is 0), uneven."""
    a = mesh.axis_names[-1]
    specs = [P(None, a), P(None, None, a), P(a), P(None, a, None), P()]
    if mesh.ndim == 2:
        specs += [P(None, "x", "y"), P("y", None, "x"), P(None, ("x", "y")), P(None, None, ("y", "x"))]
    for shape in [(2, 8, 4), (3, 5, 6), (1, 3, 2)]:
        for src in specs:
            x, full, _ = source(src, mesh, shape)
            for dst in specs:
                y = sf.reshard(x, dst)
                assert_shards(y, full, f"{shape} {src} -> {dst}")


@scenario
def partial_sources_all_ops_and_dtypes(mesh: sf.Mesh) -> None:
    """Pending reductions of every op resolved to replicated and sharded layouts, for
    float and integer dtypes (an integer Partial("avg") is an error, as torch.mean's)."""
    a = mesh.axis_names[0]
    for dtype in (torch.float32, torch.int64, torch.float16, torch.bfloat16):
        for op in ("sum", "avg", "max", "min"):
            src = P(None, partial={a: op})
            if op == "avg" and not dtype.is_floating_point:
                with pytest.raises(sf.ShardingError, match=r"Partial\('avg'\).*floating"):
                    source(src, mesh, (6, 5), dtype=dtype)
                continue
            for dst in (P(), P(a), P(None, a), P(partial={a: op})):
                x, full, _ = source(src, mesh, (6, 5), dtype=dtype)
                y = sf.reshard(x, dst)
                assert_equal(y.full_tensor(), full.to(dtype), f"{dtype} {op} -> {dst}")


@scenario
def other_dtypes_move_exactly(mesh: sf.Mesh) -> None:
    a, b = mesh.axis_names[0], mesh.axis_names[-1]
    samples = (torch.rand(7, 5) > 0.5, torch.randn(7, 5, dtype=torch.complex64), torch.randint(0, 9, (7, 5)).short())
    for t in samples:
        for src, dst in ((P(a), P(None, b)), (P(a), P()), (P(None, b), P(a)), (P(), P(b))):
            x = sf.reshard(sf.distribute(t, src, mesh=mesh), dst)
            assert_shards(x, t, f"{t.dtype} {src} -> {dst}")
            assert_equal(x.full_tensor(), t, f"{t.dtype} {src} -> {dst}")
    x, full, _ = source(P(partial=a), mesh, (6, 4), dtype=torch.complex64)
    assert_equal(sf.reshard(x, P(a)).full_tensor(), full, "complex partial sum")


@scenario
def complex_views_of_uneven_shards_through_collectives(mesh: sf.Mesh) -> None:
    # transposed/conj/neg complex shards whose last dim has size 1 on some ranks only: every
    # rank reaches the collective (a rank that raised alone left its peers waiting in it)
    a = mesh.axis_names
    g = torch.Generator().manual_seed(3)
    for shape, dtype in (((5, 3), torch.complex64), ((4, 6), torch.complex128), ((2, 1), torch.complex64)):
        t = torch.complex(torch.randint(-4, 4, shape, generator=g).float(),
                          torch.randint(-4, 4, shape, generator=g).float()).to(dtype)
        for spec in (P(a), P(a[0]), P(None, a[-1]), *((P(a[0], a[-1]),) if len(a) > 1 else ())):
            x = sf.distribute(t, spec, mesh=mesh)
            for name, view in (("t", lambda v: v.t()), ("conj", lambda v: v.conj()),
                               ("t_conj", lambda v: v.t().conj()), ("neg", lambda v: -v), ("rows", lambda v: v[1:])):
                what = f"{dtype} {shape} {spec} {name}"
                assert_equal(view(x).full_tensor().resolve_conj(), view(t).resolve_conj(), what)
                assert_equal(sf.reshard(view(x), P()).full_tensor().resolve_conj(), view(t).resolve_conj(), what)
                torch.testing.assert_close(view(x).sum(0).full_tensor(), view(t).sum(0), msg=what)
                torch.testing.assert_close((view(x) @ view(x).t().conj()).full_tensor(),
                                           view(t) @ view(t).t().conj(), msg=what)


@scenario
def distribute_and_gather_are_inverse(mesh: sf.Mesh) -> None:
    for shape in [(), (5,), (4, 6), (9, 3, 2), (0, 4)]:
        t = torch.randn(shape)
        for spec in (P(), P(mesh.axis_names[0]) if shape else P(), P(partial=mesh.axis_names[-1])):
            x = sf.distribute(t, spec, mesh=mesh)
            assert x.shape == t.shape
            assert_equal(x.full_tensor(), t, f"{shape} {spec}")


@scenario
def from_local_infers_even_shape_and_validates(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    full = torch.arange(48.0).view(8, 6)
    x = sf.ShardedArray.from_local(shards_for(full, P(a), mesh), P(a), mesh=mesh)
    assert tuple(x.shape) == (8, 6)
    assert_equal(x.full_tensor(), full)
    uneven = torch.arange(35.0).view(7, 5)
    y = sf.ShardedArray.from_local(shards_for(uneven, P(a), mesh), P(a), mesh=mesh, shape=(7, 5))
    assert_equal(y.full_tensor(), uneven)
    import pytest

    with pytest.raises(sf.ShardingError, match="shape"):
        sf.ShardedArray.from_local(shards_for(uneven, P(a), mesh), P(a), mesh=mesh, shape=(9, 5))


@scenario
def dist_is_bit_identical_to_local(mesh: sf.Mesh) -> None:
    """With ordered reductions, random float sums/averages over every axis give the same
    bits as the local backend; the default (native all_reduce) agrees up to rounding."""
    from shardfn.backends.dist import reductions

    twin = local_twin(mesh)
    for spec in (P(partial=mesh.axis_names), P(None, partial={a: "avg" for a in mesh.axis_names})):
        for dst in (P(), P(mesh.axis_names[0]), P(None, mesh.axis_names[-1])):
            torch.manual_seed(1)
            x, _, _ = source(spec, mesh, (33, 17), dtype=torch.float32, integral=False)
            torch.manual_seed(1)
            ref, _, _ = source(spec, twin, (33, 17), dtype=torch.float32, integral=False)
            want = sf.reshard(ref, dst).full_tensor()
            with reductions("ordered"):
                assert_equal(sf.reshard(x, dst).full_tensor(), want, f"{spec}->{dst}")
            for mode in ("auto", "native"):
                with reductions(mode):
                    torch.testing.assert_close(sf.reshard(x, dst).full_tensor(), want)


@scenario
def autograd_of_reshard_and_full_tensor(mesh: sf.Mesh) -> None:
    specs = layouts_2d(mesh)
    w = torch.randn(7, 5, dtype=torch.float64)
    for src in specs[:: 2 if mesh.ndim == 2 else 1]:
        for dst in specs:
            t = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
            y = sf.reshard(sf.distribute(t, src, mesh=mesh), dst)
            (y.full_tensor() * w).sum().backward()
            assert_equal(t.grad, w, f"grad {src} -> {dst}")


@scenario
def autograd_through_from_local_and_to_local(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    w = torch.randn(6, 5, dtype=torch.float64)
    x, _, local = source(P(a, partial=mesh.axis_names[0]) if mesh.ndim == 2 else P(partial=a), mesh, (6, 5),
                         requires_grad=True)
    (sf.reshard(x, P(None, a)).full_tensor() * w).sum().backward()
    want = shards_for(w, x.spec, mesh) if mesh.ndim == 2 else shards_for(w, P(), mesh)
    for g, e in zip([local] if is_dist(mesh) else local, [want] if is_dist(mesh) else want):
        assert_equal(g.grad, e)
    t = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    loc = sf.distribute(t, P(a), mesh=mesh).to_local()
    parts = [loc] if is_dist(mesh) else loc
    # weights depend on the coordinate along `a` only, so the replicas of the gradient agree
    sum(p.sum() * (mesh.coords(dev)[-1] + 1) for dev, p in zip(held(mesh), parts)).backward()
    rows = torch.arange(1.0, mesh.shape[-1] + 1, dtype=torch.float64).repeat_interleave(8 // mesh.shape[-1])
    assert_equal(t.grad, rows.view(8, 1).expand(8, 5).contiguous())

test_local, test_dist = collect(globals())
