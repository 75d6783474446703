"""torch.func transforms over ShardedArrays on both backends (grad, grad_and_value, vjp,
jvp, vmap over an unsharded dim, functional_call with dict params): results equal the
unsharded computation."""

from __future__ import annotations

import optree
import torch
from dist_harness import collect, scenario
from torch.func import functional_call, grad, grad_and_value, jvp, vjp, vmap

import shardfn as sf
from shardfn import P


def _full(t):
    return sf.gather(t) if isinstance(t, sf.ShardedArray) else t


def _close(a, b, what=""):
    ta, tb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(ta) == len(tb), f"{what}: {len(ta)} leaves != {len(tb)}"
    for i, (x, y) in enumerate(zip(ta, tb)):
        torch.testing.assert_close(_full(x), _full(y), atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"{what} {i}: {m}")


def _data():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g),
            "x": torch.randn(4, 8, generator=g), "xb": torch.randn(3, 4, 8, generator=g)}


def _axes(mesh):
    """(dp, tp): the data axis (None on a 1-D mesh) and the tensor-parallel axis."""
    return (mesh.axis_names[0] if mesh.ndim > 1 else None), mesh.axis_names[-1]


def _sharded(d, mesh):
    dp, tp = _axes(mesh)
    params = {"w": sf.distribute(d["w"], P(None, tp), mesh=mesh), "b": sf.distribute(d["b"], P(tp), mesh=mesh)}
    return params, sf.distribute(d["x"], P(dp), mesh=mesh)


def _plain(d):
    return {"w": d["w"], "b": d["b"]}, d["x"]


def layer(p, x):
    return (x @ p["w"] + p["b"]).tanh()


def loss(p, x):
    return layer(p, x).pow(2).sum()


def _loss_resharding(mesh):
    a = mesh.axis_names[0]

    def f(p, x):  # an explicit layout change inside the differentiated function
        h = sf.reshard(layer(p, x), P(None, a))
        return sf.gather(h).pow(2).sum()

    return f


@scenario
def grad_dict_params(mesh: sf.Mesh) -> None:
    d = _data()
    params, x = _sharded(d, mesh)
    ref = grad(loss)(*_plain(d))
    for fn in (loss, _loss_resharding(mesh)):
        g = grad(fn)(params, x)
        assert all(isinstance(v, sf.ShardedArray) and v.mesh == mesh for v in g.values())
        assert tuple(g["w"].spec) == tuple(params["w"].spec), g["w"].spec  # maybe partial over dp
        _close(g, ref, fn.__name__)


@scenario
def grad_and_value_argnums(mesh: sf.Mesh) -> None:
    d = _data()
    params, x = _sharded(d, mesh)
    (gp, gx), value = grad_and_value(_loss_resharding(mesh), argnums=(0, 1))(params, x)
    (rp, rx), ref = grad_and_value(loss, argnums=(0, 1))(*_plain(d))
    assert isinstance(gx, sf.ShardedArray) and gx.mesh == mesh
    _close((gp, gx, value), (rp, rx, ref), "grad_and_value")


@scenario
def vjp_with_sharded_cotangent(mesh: sf.Mesh) -> None:
    d = _data()
    dp, tp = _axes(mesh)
    params, x = _sharded(d, mesh)
    out, pull = vjp(layer, params, x)
    ct = torch.linspace(-1, 1, 24).reshape(4, 6)
    got = pull(sf.distribute(ct, P(dp, tp) if dp else P(None, tp), mesh=mesh))
    ref_out, ref_pull = vjp(layer, *_plain(d))
    _close((out, got), (ref_out, ref_pull(ct)), "vjp")
    # a cotangent in another layout than the output's
    _close(pull(sf.distribute(ct, P(mesh.axis_names[-1]), mesh=mesh)), ref_pull(ct), "vjp other layout")


@scenario
def jvp_through_reshard(mesh: sf.Mesh) -> None:
    d = _data()
    dp, tp = _axes(mesh)
    a = mesh.axis_names[0]
    params, x = _sharded(d, mesh)
    tw, tb = torch.ones(8, 6), torch.full((6,), 0.5)
    tangents = ({"w": sf.distribute(tw, P(None, tp), mesh=mesh), "b": sf.distribute(tb, P(), mesh=mesh)},
                sf.distribute(torch.zeros(4, 8), P(dp), mesh=mesh))

    def f(p, x):
        return sf.reshard(layer(p, x), P(None, a))

    out, t = jvp(f, (params, x), tangents)
    ref_out, ref_t = jvp(layer, _plain(d), ({"w": tw, "b": tb}, torch.zeros(4, 8)))
    assert isinstance(t, sf.ShardedArray) and t.spec == P(None, a), t
    _close((out, t), (ref_out, ref_t), "jvp")


@scenario
def vmap_over_unsharded_dim(mesh: sf.Mesh) -> None:
    d = _data()
    a, tp = mesh.axis_names[0], mesh.axis_names[-1]
    params, _ = _sharded(d, mesh)
    ref = vmap(layer, in_dims=(None, 0))(_plain(d)[0], d["xb"])
    for spec in (P(None, a), P(None, None, tp)):
        xb = sf.distribute(d["xb"], spec, mesh=mesh)
        _close(vmap(layer, in_dims=(None, 0))(params, xb), ref, f"vmap {spec}")
    # vmapped dim 1, with a reshard and a gather inside
    xt = sf.distribute(d["xb"].transpose(0, 1).contiguous(), P(a), mesh=mesh)

    def f(x):
        h = sf.reshard(layer(params, x), P(None, tp))
        return sf.gather(h).sum(0)

    out = vmap(f, in_dims=1)(xt)
    assert not isinstance(out, sf.ShardedArray)
    _close(out, vmap(lambda x: layer(_plain(d)[0], x).sum(0))(d["xb"]), "vmap in_dims=1")


@scenario
def per_example_grads(mesh: sf.Mesh) -> None:
    d = _data()
    params, _ = _sharded(d, mesh)
    xb = sf.distribute(d["xb"], P(None, mesh.axis_names[0]), mesh=mesh)
    g = vmap(grad(_loss_resharding(mesh)), in_dims=(None, 0))(params, xb)
    _close(g, vmap(grad(loss), in_dims=(None, 0))(_plain(d)[0], d["xb"]), "per-example grads")


@scenario
def functional_call_module_grad(mesh: sf.Mesh) -> None:
    dp, tp = _axes(mesh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    specs = {"0.weight": P(tp), "0.bias": P(tp), "2.weight": P(None, tp), "2.bias": P()}
    params = {k: sf.distribute(v, specs[k], mesh=mesh) for k, v in ref_params.items()}
    xt = _data()["x"]
    x = sf.distribute(xt, P(dp), mesh=mesh)

    def f(p, x):
        return functional_call(model, p, (x,)).pow(2).mean()

    g, value = grad_and_value(f)(params, x)
    assert all(tuple(g[k].spec) == tuple(params[k].spec) for k in g), {k: v.spec for k, v in g.items()}
    _close((f(params, x), value, g), (f(ref_params, xt), f(ref_params, xt), grad(f)(ref_params, xt)),
           "functional_call")


@scenario
def grad_of_grad_and_distribute_inside(mesh: sf.Mesh) -> None:
    dp, tp = _axes(mesh)
    w = torch.linspace(-1, 1, 12).reshape(4, 3)
    ws = sf.distribute(w, P(dp, tp) if dp else P(tp), mesh=mesh)

    def df(w):
        return grad(lambda w: w.sin().sum())(w).pow(2).sum()

    _close(grad(df)(ws), grad(df)(w), "grad of grad")
    d = _data()

    def f(w):  # a plain tensor distributed inside the transform gets a plain gradient
        return sf.gather(d["x"] @ sf.distribute(w, P(None, tp), mesh=mesh)).pow(2).sum()

    got = grad(f)(d["w"])
    assert type(got) is torch.Tensor
    _close(got, grad(lambda w: (d["x"] @ w).pow(2).sum())(d["w"]), "distribute inside grad")


@scenario
def grad_of_inplace_ops_on_views(mesh: sf.Mesh) -> None:
    """An in-place op on a view (a transpose, a select, a step slice, a flatten) of a clone
    under grad: CopySlices' as_strided / as_strided_scatter run on the shards (no fallback to
    replicated) and the gradient equals the unsharded one."""
    import warnings

    a = mesh.axis_names[-1]
    x = torch.randn(8, 6, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    views = [lambda y: y.transpose(0, 1), lambda y: y[:, 2], lambda y: y[::2], lambda y: y.view(8, 24)[:, 3:9]]
    for spec in (P(a), P(None, a), P(None, None, a)):
        for vf in views:
            def f(v, vf=vf):
                y = v.clone()
                vf(y).mul_(2)
                return (y * y.sin()).sum()

            with warnings.catch_warnings():
                warnings.simplefilter("error", sf.FallbackWarning)
                got = grad(f)(sf.distribute(x, spec, mesh=mesh))
            _close(got, grad(f)(x), f"{spec}")


test_local, test_dist = collect(globals())
