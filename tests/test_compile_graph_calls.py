"""shard_map / local_map functions made at run time under torch.compile: Dynamo records each
as one graph call and guards it by identity (values/graph_calls.py), so functions of one call
site with other bodies, specs or closed-over values never share a compiled graph (fuzzer seed
993: an axis_size body's graph ran for a later pmean), and equal ones share one (no recompile)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import shardfn as sf
from shardfn import P
from shardfn.values.graph_calls import value_key


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def mesh2():
    return sf.Mesh((2,), ("x",), backend="local")


def _smap(mesh, body, out_specs, in_specs=P("x")):  # noqa: B008
    """One call site making every shard_map (as a user's helper would)."""
    def run(v):
        v = sf.reshard(v, in_specs)
        return sf.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs)(v)
    return run


def _program(mesh):
    scale = _smap(mesh, lambda b: b * sf.lax.axis_size("x"), P("x"))
    mean = _smap(mesh, lambda b: sf.lax.pmean(b.mean(0, keepdim=True), "x"), P(None))

    def program(v):
        for step in (scale, mean):  # a loop: Dynamo compiles the helper's frame on its own
            v = step(v)
        return v.sin()
    return program


@pytest.mark.parametrize("dynamic", [None, True])
def test_two_bodies_of_one_call_site_keep_their_own_graphs(mesh2, dynamic):
    """Seed 993's program: the pmean step returned the axis_size step's (2,) result."""
    x = torch.tensor([0.5, -1.25, 2.0, 0.75], dtype=torch.float64, requires_grad=True)
    ref = (x * 2).mean(0, keepdim=True).sin()
    (gref,) = torch.autograd.grad(ref.sum(), x)
    f = _program(mesh2)
    for run in (f, torch.compile(f, backend="aot_eager", dynamic=dynamic)):
        xs = x.detach().clone().requires_grad_()
        got = run(sf.distribute(xs, P(None), mesh=mesh2))
        assert got.shape == (1,)
        torch.testing.assert_close(got.full_tensor(), ref)
        (g,) = torch.autograd.grad(got.sum(), xs)
        torch.testing.assert_close(g, gref)


def test_closed_over_value_changes_the_graph_equal_calls_reuse_it(mesh2):
    cnt = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=cnt)
    def step(v, k):
        y = sf.shard_map(lambda b: b * k, mesh=mesh2, in_specs=P("x"), out_specs=P("x"))(v)
        return sf.local_map(lambda b: b + k, P("x"), mesh=mesh2)(y)

    x = torch.arange(4.0)
    X = sf.distribute(x, P("x"), mesh=mesh2)
    seen = set()
    for k in (2, 2, 3, 3, 2, -0.0, 0.0, -0.0):
        before = cnt.frame_count
        torch.testing.assert_close(step(X, k).full_tensor(), x * k + k, rtol=0, atol=0)
        assert cnt.frame_count == before or repr(k) not in seen  # a value seen before compiles nothing new
        seen.add(repr(k))
    assert cnt.frame_count > 2


def test_premade_functions_of_one_code_are_told_apart(mesh2):
    def make(k):
        return sf.shard_map(lambda b: b * k, mesh=mesh2, in_specs=P("x"), out_specs=P("x"))

    @torch.compile(backend="aot_eager")
    def apply(v, fn):
        return fn(v) + 1

    x = torch.arange(4.0)
    X = sf.distribute(x, P("x"), mesh=mesh2)
    for k, fn in [(2, make(2)), (3, make(3)), (2, make(2)), (5, make(5))]:
        torch.testing.assert_close(apply(X, fn).full_tensor(), x * k + 1)
    lm = [sf.local_map(lambda b, k=k: b - k, P("x"), mesh=mesh2) for k in (1, 4)]
    for k, fn in zip((1, 4), lm):
        torch.testing.assert_close(apply(X, fn).full_tensor(), x - k + 1)


def test_equal_shard_maps_are_one_object(mesh2):
    body = lambda b: b * 2  # noqa: E731
    a = sf.shard_map(body, mesh=mesh2, in_specs=P("x"), out_specs=P("x"))
    assert sf.shard_map(body, mesh=mesh2, in_specs=P("x"), out_specs=P("x")) is a
    assert sf.shard_map(body, mesh=mesh2, in_specs=P("x"), out_specs=P(None)) is not a
    assert sf.shard_map(body, mesh=mesh2, in_specs=P("x"), out_specs=P("x"), check_vma=False) is not a
    assert a.__wrapped__ is body and a.__name__ == body.__name__


def _closing(k):
    return lambda b: b * k


def test_value_key_tells_apart_what_computes_differently():
    assert value_key(_closing(2)) == value_key(_closing(2))
    for a, b in [(2, 3), (2, 2.0), (0.0, -0.0), (True, 1), (torch.ones(1), torch.ones(1))]:
        assert value_key(_closing(a)) != value_key(_closing(b)), (a, b)
    t = torch.ones(1)
    assert value_key(_closing(t)) == value_key(_closing(t))  # the same tensor object
    assert value_key((P("x"), 1, "a")) == value_key((P("x"), 1, "a")) != value_key((P("x"), 1, "b"))
    lst = [P("x")]
    assert value_key(lst) == value_key(lst) != value_key([P("x")])  # mutable: by identity


def test_a_cell_changed_after_making_is_not_shared(mesh2):
    """An earlier function whose closed-over value has changed since is not handed out for a
    new body holding the value it had."""
    x = torch.arange(4.0)
    X = sf.distribute(x, P("x"), mesh=mesh2)

    def make(k):
        g = sf.shard_map(lambda b: b * k, mesh=mesh2, in_specs=P("x"), out_specs=P("x"))

        def rebind(new):
            nonlocal k
            k = new
        return g, rebind

    g2, rebind = make(2)
    rebind(7)
    h2, _ = make(2)
    assert h2 is not g2
    torch.testing.assert_close(h2(X).full_tensor(), x * 2)
    torch.testing.assert_close(g2(X).full_tensor(), x * 7)
    assert value_key(P("x")) != value_key(P("x", None))


@pytest.mark.parametrize("axis_names", [None, {"x"}])
def test_compiled_shard_map_raises_the_sharding_error_eager_raises(axis_names):
    """An out_spec claiming replication of a varying output, and an unknown axis: the
    ShardingError itself (Dynamo would wrap one raised in its fake run in a TorchRuntimeError)."""
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    X = sf.distribute(torch.arange(8.0).reshape(4, 2), P(), mesh=mesh)
    bad_rep = sf.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("x"), out_specs=P(), axis_names=axis_names)
    bad_axis = sf.shard_map(lambda b: b + sf.lax.axis_index("z"), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                            axis_names=axis_names)
    for f, match in [(bad_rep, "leaves 'x' out"), (bad_axis, "'z'")]:
        for run in (f, torch.compile(lambda v, f=f: f(v) + 1, backend="aot_eager")):
            with pytest.raises(sf.ShardingError, match=match):
                run(X)
