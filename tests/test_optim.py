"""sf.optim: optimizers and clipping against torch.optim / clip_grad_norm_ on the unsharded
tensors, purity, None gradients, lr overrides, ZeRO-1 values and state memory, and
torch.optim given ShardedArrays."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import meshes, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

# (name, sf.optim factory, the torch.optim class, options)
CASES = [
    ("sgd", sf.optim.SGD, torch.optim.SGD, dict(lr=0.1)),
    ("sgd_momentum_dampening", sf.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    ("sgd_nesterov_wd", sf.optim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    ("sgd_maximize", sf.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True)),
    ("adam", sf.optim.Adam, torch.optim.Adam, {}),
    ("adam_wd_amsgrad", sf.optim.Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    ("adamw", sf.optim.AdamW, torch.optim.AdamW, {}),
    ("adamw_amsgrad_maximize", sf.optim.AdamW, torch.optim.AdamW, dict(lr=0.01, amsgrad=True, maximize=True)),
    ("adamw_foreach", sf.optim.AdamW, torch.optim.AdamW, dict(foreach=True)),
    ("adamw_fused", sf.optim.AdamW, torch.optim.AdamW, dict(fused=True)),
]
FROM_TORCH = [
    ("adagrad", torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2)),
    ("rmsprop", torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    ("nadam", torch.optim.NAdam, dict(lr=0.01)),
    ("adamax", torch.optim.Adamax, dict(lr=0.01, weight_decay=0.1)),
    ("radam", torch.optim.RAdam, dict(lr=0.01)),
]


def _tree(mesh: sf.Mesh, uneven: bool) -> tuple[dict, dict]:
    """Full tensors and specs on a (2, 4) mesh ("dp", "tp"): sharded, replicated, nested and 0-d."""
    n = 7 if uneven else 8
    full = {"w": torch.randn(n, 12), "b": torch.randn(n), "u": torch.randn(5 if uneven else 4, 8),
            "s": torch.randn(()), "layers": [torch.randn(3, n), torch.randn(n, 2)]}
    spec = {"w": P("tp"), "b": P("tp"), "u": P("dp", "tp"), "s": P(), "layers": [P(None, "tp"), P(("dp", "tp"))]}
    return full, spec


def _put(full: dict, spec: dict, mesh: sf.Mesh) -> dict:
    return {k: [sf.distribute(t, s, mesh=mesh) for t, s in zip(v, spec[k])] if isinstance(v, list)
            else sf.distribute(v, spec[k], mesh=mesh) for k, v in full.items()}


def _flat(tree: dict) -> list:
    return [t for v in tree.values() for t in (v if isinstance(v, list) else [v])]


def _run_both(opt: sf.optim.TorchOptimizer, torch_cls: type, kw: dict, mesh: sf.Mesh, uneven: bool,
              steps: int = 3) -> tuple[list, list]:
    full, spec = _tree(mesh, uneven)
    params = _put(full, spec, mesh)
    ref = [t.clone() for t in _flat(full)]
    topt = torch_cls(ref, **kw)
    state = opt.init(params)
    for _ in range(steps):
        gfull = [torch.randn_like(t) for t in ref]
        it = iter(gfull)
        gtree = {k: [next(it) for _ in v] if isinstance(v, list) else next(it) for k, v in full.items()}
        grads = _put(gtree, spec, mesh)
        params, state = opt.step(params, grads, state)
        for r, g in zip(ref, gfull):
            r.grad = g
        topt.step()
    return [p.full_tensor() for p in _flat(params)], ref


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("name,factory,torch_cls,kw", CASES, ids=[c[0] for c in CASES])
def test_equals_torch_optim(name, factory, torch_cls, kw, uneven, mesh24) -> None:
    mesh = sf.Mesh((2, 4), ("dp", "tp"))
    got, want = _run_both(factory(**kw), torch_cls, kw, mesh, uneven)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("name,torch_cls,kw", FROM_TORCH, ids=[c[0] for c in FROM_TORCH])
def test_from_torch_equals_torch_optim(name, torch_cls, kw, uneven) -> None:
    mesh = sf.Mesh((2, 4), ("dp", "tp"))
    got, want = _run_both(sf.optim.from_torch(torch_cls, **kw), torch_cls, kw, mesh, uneven)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@given(st.data())
def test_adamw_any_mesh_and_spec(data) -> None:
    mesh = data.draw(meshes())
    shape = data.draw(shapes(max_dims=2))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    zero = data.draw(st.sampled_from([None, mesh.axis_names[0]]))
    full = torch.randn(shape)
    p = {"p": sf.distribute(full, spec, mesh=mesh)}
    opt = sf.optim.AdamW(lr=0.1, shard_state_over=zero)
    ref = full.clone()
    topt = torch.optim.AdamW([ref], lr=0.1)
    state = opt.init(p)
    for _ in range(2):
        g = torch.randn(shape)
        p, state = opt.step(p, {"p": sf.distribute(g, spec, mesh=mesh)}, state)
        ref.grad = g
        topt.step()
    assert p["p"].spec == sf.distribute(full, spec, mesh=mesh).spec
    torch.testing.assert_close(p["p"].full_tensor(), ref, rtol=1e-6, atol=1e-7)


def test_step_is_pure_and_none_grads_leave_things_alone() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    params = {"a": sf.distribute(torch.randn(4, 6), P(None, "tp"), mesh=mesh), "b": torch.randn(3)}
    grads = {"a": sf.distribute(torch.randn(4, 6), P(None, "tp"), mesh=mesh), "b": None}
    opt = sf.optim.AdamW(lr=0.1, weight_decay=0.1, maximize=True)
    state = opt.init(params)
    state, _ = opt.step(params, grads, state)[1], None
    snap = lambda t: [x.full_tensor().clone() if isinstance(x, sf.ShardedArray) else x.clone() for x in t]  # noqa: E731
    leaves = lambda tree: [x for x in __import__("optree").tree_leaves(tree) if isinstance(x, torch.Tensor)]  # noqa: E731
    before = [snap(leaves(params)), snap(leaves(grads)), snap(leaves(state))]
    new_params, new_state = opt.step(params, grads, state)
    after = [snap(leaves(params)), snap(leaves(grads)), snap(leaves(state))]
    for x, y in zip(before, after):
        for u, v in zip(x, y):
            assert torch.equal(u, v)
    assert new_params["b"] is params["b"] and new_state["b"] is state["b"]  # None grad: untouched
    assert int(new_state["a"]["step"]) == 2 and int(state["a"]["step"]) == 1
    assert not torch.equal(new_params["a"].full_tensor(), params["a"].full_tensor())


def test_lr_override_is_for_one_step() -> None:
    mesh = sf.Mesh((4,), ("x",))
    full = torch.randn(8, 3)
    p = [sf.distribute(full, P("x"), mesh=mesh)]
    opt = sf.optim.SGD(0.1, momentum=0.9)
    ref = [full.clone()]
    topt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    state = opt.init(p)
    for lr in (0.5, None, 0.01):
        g = torch.randn(8, 3)
        p, state = opt.step(p, [sf.distribute(g, P("x"), mesh=mesh)], state, lr=lr)
        topt.param_groups[0]["lr"] = 0.1 if lr is None else lr
        ref[0].grad = g
        topt.step()
        torch.testing.assert_close(p[0].full_tensor(), ref[0], rtol=1e-6, atol=1e-7)


def test_plain_tensors_and_requires_grad() -> None:
    w = torch.randn(5, requires_grad=True)
    opt = sf.optim.Adam(lr=0.1)
    state = opt.init((w,))
    (new,), state = opt.step((w,), (torch.ones(5),), state)
    assert new.requires_grad and new.is_leaf and not isinstance(new, sf.ShardedArray)
    ref = w.detach().clone()
    torch.optim.Adam([ref], lr=0.1)
    topt = torch.optim.Adam([ref], lr=0.1)
    ref.grad = torch.ones(5)
    topt.step()
    torch.testing.assert_close(new.detach(), ref, rtol=1e-6, atol=1e-7)


def _state_bytes_per_device(state) -> int:
    import optree

    per = None
    for x in optree.tree_leaves(state):
        if isinstance(x, sf.ShardedArray):
            sizes = [s.numel() * s.element_size() for s in x.local_shards()]
            per = sizes if per is None else [a + b for a, b in zip(per, sizes)]
    return max(per)


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_zero1_values_and_state_memory(uneven: bool) -> None:
    mesh = sf.Mesh((2, 4), ("dp", "tp"))
    n = 6 if uneven else 8
    full = {"w": torch.randn(16, n), "v": torch.randn(n * 4)}
    spec = {"w": P(None, "tp"), "v": P()}
    params = {k: sf.distribute(t, spec[k], mesh=mesh) for k, t in full.items()}
    plain, zero = sf.optim.AdamW(lr=0.1), sf.optim.AdamW(lr=0.1, shard_state_over="dp")
    s_plain, s_zero = plain.init(params), zero.init(params)
    assert s_zero["w"]["exp_avg"].spec == P("dp", "tp")
    assert _state_bytes_per_device(s_zero) * 2 == _state_bytes_per_device(s_plain)
    p1 = p2 = params
    for _ in range(3):
        # gradients pending a sum over dp, as data parallelism leaves them
        g = {k: sf.distribute(torch.randn(2, *t.shape), P("dp", *spec[k]), mesh=mesh).sum(0) for k, t in full.items()}
        assert g["w"].spec.partial
        # ZeRO-1 first: a reduction the plain step ran would be at hand (free) for it
        with sf.debug.CommCounter() as cc:
            p2, s_zero = zero.step(p2, g, s_zero)
        p1, s_plain = plain.step(p1, g, s_plain)
        assert "all_reduce" not in cc.counts and cc.counts.get("reduce_scatter") and cc.counts.get("all_gather")
    for k in full:
        assert p2[k].spec == params[k].spec
        torch.testing.assert_close(p2[k].full_tensor(), p1[k].full_tensor(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("zero", [None, "dp"])
def test_params_pending_a_sum_are_reduced_on_entry(zero) -> None:
    """A functional update ``w - lr * g`` with ``g`` pending a sum over dp stays pending (it is
    reduced where read); init and step read such parameters reduced: values equal
    torch.optim's, state and new parameters in the reduced layout."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    w_full, g_full = torch.randn(8, 6), torch.randn(8, 6)
    w = sf.distribute(w_full, P(None, "tp"), mesh=mesh)
    g = sf.distribute(torch.stack([g_full * 0.25, g_full * 0.75]), P("dp", None, "tp"), mesh=mesh).sum(0)
    w = w - 0.1 * g
    assert w.spec == P(None, "tp", partial="dp")
    opt = sf.optim.AdamW(lr=0.1, shard_state_over=zero)
    state = opt.init({"w": w})
    assert state["w"]["exp_avg"].spec == (P(None, "tp") if zero is None else P("dp", "tp"))
    new, state = opt.step({"w": w}, {"w": g}, state)
    assert new["w"].spec == P(None, "tp")
    ref = (w_full - 0.1 * g_full).requires_grad_()
    ref.grad = g_full.clone()
    torch_opt = torch.optim.AdamW([ref], lr=0.1)
    torch_opt.step()
    torch.testing.assert_close(new["w"].full_tensor(), ref.detach())
    torch.testing.assert_close(state["w"]["exp_avg"].full_tensor(), torch_opt.state[ref]["exp_avg"])


def test_state_in_another_layout_is_resharded() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    p = {"w": sf.distribute(torch.randn(4, 4), P("tp"), mesh=mesh)}
    g = {"w": sf.distribute(torch.randn(4, 4), P("tp"), mesh=mesh)}
    opt = sf.optim.Adam(lr=0.1)
    s = opt.step(p, g, opt.init(p))[1]
    moved = {"w": {k: sf.reshard(v, P()) if isinstance(v, sf.ShardedArray) else v for k, v in s["w"].items()}}
    a, sa = opt.step(p, g, s)
    b, sb = opt.step(p, g, moved)
    assert torch.equal(a["w"].full_tensor(), b["w"].full_tensor())
    assert sb["w"]["exp_avg"].spec == P("tp")


def test_bad_inputs_are_errors() -> None:
    mesh = sf.Mesh((2,), ("x",))
    p = {"w": sf.distribute(torch.randn(4), P("x"), mesh=mesh)}
    opt = sf.optim.SGD(0.1)
    with pytest.raises(sf.ShardingError, match=r"grads\['w'\] has shape \(3,\)"):
        opt.step(p, {"w": torch.randn(3)}, opt.init(p))
    with pytest.raises(sf.ShardingError, match="structure"):
        opt.step(p, {"v": torch.randn(4)}, opt.init(p))
    with pytest.raises(sf.ShardingError, match="not an axis"):
        sf.optim.Adam(shard_state_over="dp").init(p)
    with pytest.raises(sf.ShardingError, match="LBFGS is not an element-wise"):
        sf.optim.from_torch(torch.optim.LBFGS)
    with pytest.raises(ValueError):
        sf.optim.Adam(lr=-1.0)


# -- clip_grad_norm --------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_grad_norm_equals_torch(norm_type: float, max_norm: float) -> None:
    mesh = sf.Mesh((2, 4), ("dp", "tp"))
    full = [torch.randn(8, 6), torch.randn(7), torch.randn(5, 3), torch.randn(()), torch.randn(4)]
    grads = [sf.distribute(full[0], P("tp"), mesh=mesh), sf.distribute(full[1], P(("dp", "tp")), mesh=mesh),
             sf.distribute(torch.stack([full[2] / 2, full[2] / 2]), P("dp"), mesh=mesh).sum(0),  # pending a sum
             sf.distribute(full[3], P(), mesh=mesh), full[4].clone()]
    tree = {"a": grads[:3], "b": {"s": grads[3], "plain": grads[4], "none": None}}
    before = [g.full_tensor().clone() if isinstance(g, sf.ShardedArray) else g.clone() for g in grads]
    out, total = sf.optim.clip_grad_norm(tree, max_norm, norm_type=norm_type)
    ref = [t.clone().requires_grad_() for t in full]
    for r, t in zip(ref, full):
        r.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    got = [*out["a"], out["b"]["s"], out["b"]["plain"]]
    assert out["b"]["none"] is None and not isinstance(got[4], sf.ShardedArray)
    for g, r in zip(got, ref):
        g = g.full_tensor() if isinstance(g, sf.ShardedArray) else g
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-7)
    for g, b in zip(grads, before):  # inputs unchanged
        assert torch.equal(g.full_tensor() if isinstance(g, sf.ShardedArray) else g, b)


def test_clip_grad_norm_one_collective() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    grads = [sf.distribute(torch.randn(4, 4), s, mesh=mesh) for s in (P("tp"), P("dp", "tp"), P(), P(None, "dp"))]
    with sf.debug.CommCounter() as cc:
        _, total = sf.optim.clip_grad_norm(grads, 1.0)
    assert sum(cc.counts.values()) == 1, cc.counts
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.stack([g.full_tensor().norm() for g in grads])))


# -- torch.optim and clip_grad_norm_ given ShardedArrays -------------------------------------


@pytest.mark.parametrize("make,name", [
    (lambda w: torch.optim.AdamW([w]), "sf.optim.AdamW"),
    (lambda w: torch.optim.AdamW([w], fused=True), "sf.optim.AdamW"),
    (lambda w: torch.optim.Adam([w], foreach=True), "sf.optim.Adam"),
    (lambda w: torch.optim.SGD([w], lr=0.1, momentum=0.9), "sf.optim.SGD"),
    (lambda w: torch.optim.Adagrad([w]), "sf.optim.from_torch(torch.optim.adagrad.Adagrad"),
])
def test_torch_optim_on_sharded_params_names_sf_optim(make, name) -> None:
    mesh = sf.Mesh((2,), ("x",))
    w = sf.distribute(torch.randn(4, 2), P("x"), mesh=mesh).requires_grad_()
    (w * w).sum().backward()
    before = w.full_tensor().clone()
    opt = make(w)
    with pytest.raises(sf.ImmutableError, match=name.replace("(", r"\(")):
        opt.step()
    assert torch.equal(w.full_tensor(), before)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_underscore_names_sf_optim(foreach) -> None:
    """Whichever path torch takes (foreach norms first), the first thing that goes wrong is
    the in-place scaling, refused naming sf.optim.clip_grad_norm (no FallbackWarning)."""
    mesh = sf.Mesh((2,), ("x",))
    w = sf.distribute(torch.randn(4, 2), P("x"), mesh=mesh).requires_grad_()
    (w * w).sum().backward()
    before = w.grad.full_tensor().clone()
    with pytest.raises(sf.ImmutableError, match=r"sf\.optim\.clip_grad_norm"):
        torch.nn.utils.clip_grad_norm_([w], 0.1, foreach=foreach)
    assert torch.equal(w.grad.full_tensor(), before)


@pytest.mark.parametrize("ord_", [2.0, 1.0, math.inf, -math.inf, 0.0, 3.0])
def test_foreach_norm_on_arrays(ord_) -> None:
    """aten._foreach_norm (torch's get_total_norm / clip_grad_norm_ with foreach) on arrays of
    any layout: torch's numbers, replicated 0-d arrays, one all_reduce per mesh."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    full = [torch.randn(4, 6), torch.randn(5), torch.randn(3, 4), torch.randn(())]
    specs = [P("tp"), P("dp"), P(("dp", "tp")), P()]
    arrays = [sf.distribute(t, s, mesh=mesh) for t, s in zip(full, specs)]
    pending = (arrays[0] * 2).sum(0)  # a pending sum: reduced first
    with sf.debug.CommCounter() as cc:
        got = torch._foreach_norm(arrays, ord_)
    assert sum(cc.counts.values()) == 1, cc.counts
    want = torch._foreach_norm(full, ord_)
    for g, w in zip(got, want):
        assert isinstance(g, sf.ShardedArray) and g.shape == () and g.spec == P()
        torch.testing.assert_close(g.full_tensor(), w, rtol=1e-6, atol=1e-6)
    (n,) = torch._foreach_norm([pending], ord_)
    torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm((full[0] * 2).sum(0), ord_), rtol=1e-6,
                               atol=1e-6)
    total = torch.nn.utils.get_total_norm(arrays, ord_, foreach=True)
    torch.testing.assert_close(total.full_tensor(), torch.nn.utils.get_total_norm(full, ord_), rtol=1e-6, atol=1e-6)


def test_foreach_norm_mixed_and_dtype() -> None:
    mesh = sf.Mesh((2,), ("x",))
    a, b = torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(5)
    got = torch._foreach_norm([sf.distribute(a, P("x"), mesh=mesh), b], 2, dtype=torch.float32)
    want = torch._foreach_norm([a, b], 2, dtype=torch.float32)
    assert isinstance(got[0], sf.ShardedArray) and not isinstance(got[1], sf.ShardedArray)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].full_tensor(), want[0])
    torch.testing.assert_close(got[1], want[1])


def test_inplace_messages_are_well_formed() -> None:
    mesh = sf.Mesh((2,), ("x",))
    w = sf.distribute(torch.randn(4), P("x"), mesh=mesh)
    with pytest.raises(sf.ImmutableError) as e:
        torch._foreach_mul_([w], 2.0)
    assert "torch._foreach_mul(...)" in str(e.value) and "x._foreach_mul" not in str(e.value)
    step = torch.tensor(1.0)
    with pytest.raises(sf.ImmutableError) as e:
        torch._fused_adamw_([w], [w], [w], [w], [], [step], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0,
                            eps=1e-8, amsgrad=False, maximize=False)
    assert "the out-of-place form the functional" not in str(e.value) and "sf.optim" in str(e.value)


def test_plain_parameter_with_a_sharded_gradient() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    params = {"w": sf.distribute(torch.randn(6, 4), P(None, "tp"), mesh=mesh), "b": torch.zeros(4)}
    x = sf.distribute(torch.randn(8, 6), P("dp"), mesh=mesh)
    grads = torch.func.grad(lambda p: ((x @ p["w"] + p["b"]) ** 2).mean())(params)
    assert isinstance(grads["b"], sf.ShardedArray)
    opt = sf.optim.SGD(0.1)
    new, _ = opt.step(params, grads, opt.init(params))
    assert not isinstance(new["b"], sf.ShardedArray)
    torch.testing.assert_close(new["b"], -0.1 * grads["b"].full_tensor())


def test_state_structure_is_fixed_from_init() -> None:
    """init's state has every entry a step writes (SGD's momentum buffer starts as zeros,
    which gives torch's first step), so a checkpoint of it can be loaded like init's."""
    import optree

    mesh = sf.Mesh((2,), ("x",))
    p = {"w": sf.distribute(torch.randn(4), P("x"), mesh=mesh)}
    g = {"w": sf.distribute(torch.randn(4), P("x"), mesh=mesh)}
    for opt in (sf.optim.SGD(0.1, momentum=0.9), sf.optim.Adam(amsgrad=True), sf.optim.from_torch(torch.optim.NAdam)):
        s0 = opt.init(p)
        s1 = opt.step(p, g, s0)[1]
        assert optree.tree_structure(s0) == optree.tree_structure(s1), opt
    s0 = sf.optim.SGD(0.1, momentum=0.9, dampening=0.5).init(p)
    assert s0["w"]["momentum_buffer"] is None  # dampened: torch's first step differs from zeros
