"""shard_map, local_map and with_sharding_constraint against plain single-device torch."""

from __future__ import annotations

import functools

import pytest
import torch

import shardfn as sf
from shardfn import P, Partial, Replicate, ShardingError, lax

MESHES = {
    (4,): sf.Mesh((4,), ("i",)),
    (2, 2): sf.Mesh((2, 2), ("x", "y")),
    (2, 4): sf.Mesh((2, 4), ("x", "y")),
}
M4 = MESHES[(4,)]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- a tensor-parallel MLP, the same computation sharded and unsharded ---------------------------------


def _mlp_case(mesh_shape, even):
    """(mesh, in_specs, out_spec, tp axis, reduce axes, (x, w1, w2)). With ``even`` every
    shard has one shape; otherwise batch and hidden dims split unevenly (some devices
    get empty hidden shards)."""
    mesh = MESHES[mesh_shape]
    g = torch.Generator().manual_seed(sum(mesh_shape) + even)
    if len(mesh_shape) == 1:
        tp, dp, batch = "i", None, 5
    else:
        tp, dp, batch = "y", "x", 8 if even else 7
    hidden = 4 * mesh.axis_size(tp) if even else 2 * mesh.axis_size(tp) - 2
    x = torch.randn(batch, 6, generator=g)
    w1 = torch.randn(6, hidden, generator=g)
    w2 = torch.randn(hidden, 3, generator=g)
    specs = (P(dp, None), P(None, tp), P(tp, None))
    return mesh, specs, P(dp, None), tp, (x, w1, w2)


def _mlp_ref(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("mesh_shape", list(MESHES))
def test_shard_map_mlp_values_and_autograd(mesh_shape, even):
    mesh, specs, out_spec, tp, args = _mlp_case(mesh_shape, even)

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=specs, out_specs=out_spec)
    def mlp(x, w1, w2):
        return lax.psum(torch.tanh(x @ w1) @ w2, tp)

    xs = [a.clone().requires_grad_() for a in args]
    rs = [a.clone().requires_grad_() for a in args]
    out, ref = mlp(*xs), _mlp_ref(*rs)
    assert out.placements == sf.NamedSharding(mesh, out_spec).placements(2)
    assert tuple(out.shape) == tuple(ref.shape)
    _close(out.full_tensor(), ref)
    ct = torch.randn(ref.shape)
    for a, b in zip(torch.autograd.grad((out.full_tensor() * ct).sum(), xs), torch.autograd.grad((ref * ct).sum(), rs)):
        _close(a, b)


@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("mesh_shape", list(MESHES))
def test_shard_map_mlp_func_grad(mesh_shape, even):
    mesh, specs, _, tp, args = _mlp_case(mesh_shape, even)
    every = mesh.axis_names

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=specs, out_specs=P())
    def loss(x, w1, w2):
        y = lax.psum(torch.tanh(x @ w1) @ w2, tp)
        return lax.psum((y ** 2).sum(), tuple(a for a in every if a != tp)) if len(every) > 1 else (y ** 2).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(*args)
    want = torch.func.grad(lambda *a: (_mlp_ref(*a) ** 2).sum(), argnums=(0, 1, 2))(*args)
    for a, b in zip(grads, want):
        _close(a, b)


@pytest.mark.parametrize("rows", [8, 6], ids=["even", "uneven"])
def test_shard_map_sharded_array_inputs_are_resharded(rows):
    mesh = MESHES[(2, 2)]
    x = torch.randn(rows, 4)
    xa = sf.distribute(x, P(None, ("x", "y")), mesh=mesh).requires_grad_()
    f = sf.shard_map(lambda b: lax.all_gather(b.exp(), "y", tiled=True), mesh=mesh,
                     in_specs=P(("x", "y")), out_specs=P("x"))
    out = f(xa)
    assert out.spec == P("x")
    _close(out.full_tensor(), x.exp())
    ct = torch.randn(rows, 4)
    (out.full_tensor() * ct).sum().backward()
    assert isinstance(xa.grad, sf.ShardedArray)
    _close(xa.grad.full_tensor(), x.exp() * ct)


def test_shard_map_body_runs_once_when_even():
    calls = []
    f = sf.shard_map(lambda b: calls.append(b.shape) or b * 2, mesh=MESHES[(2, 4)], in_specs=P("x", "y"), out_specs=P("x", "y"))
    _close(f(torch.ones(4, 8)).full_tensor(), torch.full((4, 8), 2.0))
    assert calls == [torch.Size([2, 2])]


def test_shard_map_uneven_body_sees_true_local_shapes():
    shapes = []
    f = sf.shard_map(lambda b: shapes.append(tuple(b.shape)) or b + 1, mesh=M4, in_specs=P("i"), out_specs=P("i"))
    out = f(torch.zeros(7, 2))
    assert sorted(shapes) == [(1, 2), (2, 2), (2, 2), (2, 2)]
    assert tuple(out.shape) == (7, 2)
    _close(out.full_tensor(), torch.ones(7, 2))


def test_shard_map_pytrees_and_passthrough():
    params = {"w": torch.randn(4, 8), "b": torch.randn(8)}
    x = torch.randn(6, 4)

    @functools.partial(sf.shard_map, mesh=M4, in_specs=({"w": P(None, "i"), "b": P("i")}, P(), None),
                       out_specs=(P(None, "i"), P()))
    def layer(p, x, scale):
        y = (x @ p["w"] + p["b"]) * scale
        return y, lax.psum(y.sum(), "i")

    y, total = layer(params, x, 0.5)
    ref = (x @ params["w"] + params["b"]) * 0.5
    _close(y.full_tensor(), ref)
    _close(total.full_tensor(), ref.sum())


def test_shard_map_partial_out_spec():
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)
    f = sf.shard_map(lambda a, b: a @ b, mesh=M4, in_specs=(P(None, "i"), P("i")), out_specs=P(partial="i"))
    out = f(x, w)
    assert out.spec == P(partial="i")
    _close(out.full_tensor(), x @ w)
    gx, gw = torch.autograd.grad(out.full_tensor().sum(), (x, w))
    _close(gx, torch.ones(5, 3) @ w.T)
    _close(gw, x.T @ torch.ones(5, 3))


def test_shard_map_invariant_output_tiled_over_an_axis():
    w = torch.randn(3, requires_grad=True)
    f = sf.shard_map(lambda v: v * 2, mesh=M4, in_specs=P(), out_specs=P("i"))
    out = f(w)
    _close(out.full_tensor(), (w * 2).repeat(4))
    (g,) = torch.autograd.grad((out.full_tensor() * torch.arange(12.0)).sum(), (w,))
    _close(g, 2 * torch.arange(12.0).view(4, 3).sum(0))


def test_shard_map_current_mesh_and_decorator_form():
    with M4:
        @sf.shard_map(in_specs=P("i"), out_specs=P())
        def total(b):
            return lax.psum(b.sum(), "i")

        assert total(torch.arange(8.0)).full_tensor().item() == 28.0


# -- check_vma -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_check_vma_names_the_axis(rows):
    f = sf.shard_map(lambda b: b.sum(0) * 2, mesh=M4, in_specs=P("i"), out_specs=P())
    with pytest.raises(ShardingError, match=r"varies over mesh axis 'i'.*sf\.lax\.psum\(y, 'i'\).*add 'i' to the out_spec"):
        f(torch.ones(rows, 2))


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_check_vma_on_one_axis_of_two(rows):
    mesh = MESHES[(2, 4)]
    ok = sf.shard_map(lambda b: lax.psum(b, "y"), mesh=mesh, in_specs=P("x", "y"), out_specs=P("x"))
    _close(ok(torch.ones(4, 8)).full_tensor(), torch.full((4, 2), 4.0))
    bad = sf.shard_map(lambda b: lax.psum(b.sum(0), "x"), mesh=mesh, in_specs=P("x", "y"), out_specs=P())
    with pytest.raises(ShardingError, match="varies over mesh axis 'y'"):
        bad(torch.ones(rows, 8))


def test_check_vma_accepts_gathered_and_reduced_values():
    f = sf.shard_map(lambda b: (lax.all_gather(b, "i", tiled=True), lax.pmean(b, "i"), torch.ones(2)),
                     mesh=M4, in_specs=P("i"), out_specs=P())
    full, mean, ones = f(torch.arange(8.0))
    _close(full.full_tensor(), torch.arange(8.0))
    _close(mean.full_tensor(), torch.tensor([3.0, 4.0]))
    _close(ones.full_tensor(), torch.ones(2))


def test_check_vma_false_takes_the_first_replica():
    f = sf.shard_map(lambda b: b * 2, mesh=M4, in_specs=P("i"), out_specs=P(), check_vma=False)
    _close(f(torch.arange(8.0)).full_tensor(), torch.tensor([0.0, 2.0]))


# -- argument errors ---------------------------------------------------------------------------------------


def test_wrong_number_of_in_specs():
    f = sf.shard_map(lambda a, b: a, mesh=M4, in_specs=(P("i"),), out_specs=P("i"))
    with pytest.raises(ShardingError, match="1 entry but the function was called with 2 positional arguments"):
        f(torch.ones(4), torch.ones(4))


def test_in_spec_naming_a_missing_axis():
    f = sf.shard_map(lambda a: a, mesh=M4, in_specs=(P("z"),), out_specs=P("i"))
    with pytest.raises(ShardingError, match=r"args\[0\].*names axis 'z', which the mesh lacks"):
        f(torch.ones(4))


def test_out_spec_naming_a_missing_axis_and_bad_structure():
    f = sf.shard_map(lambda a: a, mesh=M4, in_specs=P("i"), out_specs=P("z"))
    with pytest.raises(ShardingError, match="out_specs for output.*'z'"):
        f(torch.ones(4))
    g = sf.shard_map(lambda a: (a, a), mesh=M4, in_specs=P("i"), out_specs=(P("i"), P("i"), P("i")))
    with pytest.raises(ShardingError, match="out_specs"):
        g(torch.ones(4))


def test_in_spec_too_long_and_partial_in_spec():
    with pytest.raises(ShardingError, match="rank 1"):
        sf.shard_map(lambda a: a, mesh=M4, in_specs=P("i", None), out_specs=P())(torch.ones(4))
    with pytest.raises(ShardingError, match="is a plain tensor.*partial in_spec.*takes a ShardedArray"):
        sf.shard_map(lambda a: a, mesh=M4, in_specs=P(partial="i"), out_specs=P())(torch.ones(4))


def test_devices_diverging_on_collectives():
    def body(b):
        return lax.psum(b, "i") if b.shape[0] == 2 else b

    with pytest.raises(ShardingError, match="diverged"):
        sf.shard_map(body, mesh=M4, in_specs=P("i"), out_specs=P(), check_vma=False)(torch.ones(7))


# -- local_map ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_local_map_uneven_shapes_without_gather(rows):
    x = sf.distribute(torch.randn(rows, 3), P("i"), mesh=M4)
    with sf.debug.CommCounter() as cc:
        y = sf.local_map(lambda t: t * 2, out_specs=P("i"))(x)
        s = sf.local_map(lambda t: t.sum(0, keepdim=True), out_specs=P("i"))(x)
    assert cc.total == 0
    assert tuple(y.shape) == (rows, 3) and tuple(s.shape) == (4, 3)
    _close(y.full_tensor(), x.full_tensor() * 2)
    parts = x.full_tensor().tensor_split([2, 4, 6])
    _close(s.full_tensor(), torch.stack([p.sum(0) for p in parts]))


def test_local_map_partial_output_and_grads():
    xt, wt = torch.randn(5, 8), torch.randn(8, 3)
    x = sf.distribute(xt, P(None, "i"), mesh=M4).requires_grad_()
    w = sf.distribute(wt, P("i"), mesh=M4).requires_grad_()
    out = sf.local_map(torch.matmul, out_specs=P(partial="i"))(x, w)
    assert out.spec == P(partial="i")
    _close(out.full_tensor(), xt @ wt)
    out.full_tensor().sum().backward()
    _close(x.grad.full_tensor(), torch.ones(5, 3) @ wt.T)
    _close(w.grad.full_tensor(), xt.T @ torch.ones(5, 3))


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_local_map_default_grad_of_replicated_weight_is_partial(rows):
    xt, wt = torch.randn(rows, 4), torch.randn(4, 3)
    x = sf.distribute(xt, P("i"), mesh=M4)
    w = sf.distribute(wt, P(), mesh=M4).requires_grad_()
    out = sf.local_map(torch.matmul, out_specs=P("i"))(x, w)
    out.full_tensor().pow(2).sum().backward()
    assert Partial("sum") in w.grad.placements  # never silently labelled Replicate
    _close(w.grad.full_tensor(), xt.T @ (2 * xt @ wt))


def test_local_map_replicated_output_grad_counts_once():
    wt = torch.randn(3)
    w = sf.distribute(wt, P(), mesh=M4).requires_grad_()
    out = sf.local_map(lambda t: t * 3, out_specs=P())(w)
    out.full_tensor().sum().backward()
    _close(w.grad.full_tensor(), torch.full((3,), 3.0))


def test_local_map_explicit_in_grad_specs_follow_dtensor():
    wt = torch.randn(3)
    w = sf.distribute(wt, P(), mesh=M4).requires_grad_()
    out = sf.local_map(lambda t: t * 3, out_specs=P(), in_grad_specs=(P(),))(w)
    out.full_tensor().sum().backward()
    assert w.grad.placements == (Replicate(),)
    _close(w.grad.full_tensor(), torch.full((3,), 3.0))


def test_local_map_in_specs_and_redistribute():
    x = sf.distribute(torch.arange(8.0), P("i"), mesh=M4)
    f = sf.local_map(lambda t: t + 1, out_specs=P(), in_specs=(P(),))
    with pytest.raises(ShardingError, match="redistribute_inputs=True"):
        f(x)
    g = sf.local_map(lambda t: t + 1, out_specs=P(), in_specs=(P(),), redistribute_inputs=True)
    _close(g(x).full_tensor(), torch.arange(8.0) + 1)


def test_local_map_plain_arguments():
    assert torch.equal(sf.local_map(lambda t: t * 2, out_specs=P())(torch.ones(2)), torch.full((2,), 2.0))
    x = sf.distribute(torch.ones(4, 2), P("i"), mesh=M4)
    y = sf.local_map(lambda t, c, s: t * c + s, out_specs=P("i"))(x, torch.tensor([1.0, 2.0]), 1.0)
    _close(y.full_tensor(), torch.tensor([[2.0, 3.0]]).expand(4, 2))


# -- with_sharding_constraint -----------------------------------------------------------------------------------


def test_wsc_reshards_and_is_free_when_matching():
    x = sf.distribute(torch.randn(8, 4), P("i"), mesh=M4)
    with sf.debug.CommCounter() as cc:
        same = sf.with_sharding_constraint(x, P("i"))
    assert cc.total == 0 and cc.bytes == 0 and same.spec == P("i")
    with sf.debug.CommCounter() as cc:
        rep = sf.with_sharding_constraint(x, sf.NamedSharding(M4, P()))
    assert cc.total > 0 and rep.placements == (Replicate(),)
    _close(rep.full_tensor(), x.full_tensor())


def test_wsc_constrains_the_gradient():
    x = sf.distribute(torch.randn(8, 4), P("i"), mesh=M4).requires_grad_()
    y = sf.with_sharding_constraint(x, P(None, "i"))
    assert y.spec == P(None, "i")
    y.full_tensor().mul(torch.arange(32.0).view(8, 4)).sum().backward()
    assert x.grad.spec == P(None, "i")
    _close(x.grad.full_tensor(), torch.arange(32.0).view(8, 4))


def test_wsc_pytrees_and_plain_tensors():
    tree = {"a": sf.distribute(torch.ones(4), P("i"), mesh=M4), "b": [torch.ones(4, 2), 3]}
    with M4:
        out = sf.with_sharding_constraint(tree, {"a": P(), "b": P(None, "i")})
    assert out["a"].spec == P() and out["b"][0].spec == P(None, "i") and out["b"][1] == 3
    with M4:
        out = sf.with_sharding_constraint(tree, (Replicate(),))
    assert all(t.spec == P() for t in (out["a"], out["b"][0]))


def test_wsc_inside_shard_map_is_an_error():
    f = sf.shard_map(lambda b: sf.with_sharding_constraint(b, P()), mesh=M4, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(ShardingError, match="inside a shard_map body"):
        f(torch.ones(4))


# -- examples ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shard_map_matmul", "ring_attention"])
def test_examples_run(name, capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()  # asserts results and gradients equal the unsharded computation
