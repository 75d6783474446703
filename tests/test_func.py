"""torch.func transforms over ShardedArrays, checked against plain single-device torch."""

from __future__ import annotations

import optree
import pytest
import torch
from torch.func import functional_call, grad, grad_and_value, jvp, vjp, vmap

import shardfn as sf
from shardfn import P

ATOL = 1e-5


def _full(t):
    return sf.gather(t) if isinstance(t, sf.ShardedArray) else t


def _close(a, b, atol=ATOL):
    ta, tb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        torch.testing.assert_close(_full(x), _full(y), atol=atol, rtol=1e-5)


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 6, generator=g),
        "b": torch.randn(6, generator=g),
        "x": torch.randn(4, 8, generator=g),
        "xb": torch.randn(3, 4, 8, generator=g),
    }


def _sharded(data, mesh):
    params = {"w": sf.distribute(data["w"], P(None, "y"), mesh=mesh),
              "b": sf.distribute(data["b"], P("y"), mesh=mesh)}
    return params, sf.distribute(data["x"], P("x"), mesh=mesh)


def layer(p, x):
    return (x @ p["w"] + p["b"]).tanh()


def loss(p, x):
    return layer(p, x).pow(2).sum()


def loss_resharding(p, x):
    # explicit layout changes inside the differentiated function
    h = sf.reshard(layer(p, x), P(None, "x"))
    return sf.gather(h).pow(2).sum()


def _plain(data):
    return {"w": data["w"], "b": data["b"]}, data["x"]


@pytest.mark.parametrize("fn", [loss, loss_resharding])
def test_grad_dict_params(mesh22, data, fn):
    params, x = _sharded(data, mesh22)
    g = grad(fn)(params, x)
    assert all(isinstance(v, sf.ShardedArray) for v in g.values())
    _close(g, grad(loss)(*_plain(data)))


def test_grad_and_value_argnums(mesh22, data):
    params, x = _sharded(data, mesh22)
    (gp, gx), value = grad_and_value(loss_resharding, argnums=(0, 1))(params, x)
    (rp, rx), ref = grad_and_value(loss, argnums=(0, 1))(*_plain(data))
    _close((gp, gx, value), (rp, rx, ref))
    assert gx.mesh == mesh22


def test_vjp_with_sharded_cotangent(mesh22, data):
    params, x = _sharded(data, mesh22)
    out, pull = vjp(layer, params, x)
    ct = torch.linspace(-1, 1, 24).reshape(4, 6)
    got = pull(sf.distribute(ct, P("x", "y"), mesh=mesh22))
    ref_out, ref_pull = vjp(layer, *_plain(data))
    _close((out, got), (ref_out, ref_pull(ct)))


def test_jvp(mesh22, data):
    params, x = _sharded(data, mesh22)
    tw, tb = torch.ones(8, 6), torch.full((6,), 0.5)
    tangents = ({"w": sf.distribute(tw, P(None, "y"), mesh=mesh22),
                 "b": sf.distribute(tb, P(), mesh=mesh22)},
                sf.distribute(torch.zeros(4, 8), P("x"), mesh=mesh22))

    def f(p, x):
        return sf.reshard(layer(p, x), P(None, "x"))

    out, t = jvp(f, (params, x), tangents)
    ref_out, ref_t = jvp(layer, _plain(data), ({"w": tw, "b": tb}, torch.zeros(4, 8)))
    assert isinstance(t, sf.ShardedArray) and t.spec == P(None, "x")
    _close((out, t), (ref_out, ref_t))


def test_functional_call_module(mesh22, data):
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    specs = {"0.weight": P("y"), "0.bias": P("y"), "2.weight": P(None, "y"), "2.bias": P()}
    params = {k: sf.distribute(v, specs[k], mesh=mesh22) for k, v in ref_params.items()}
    x = sf.distribute(data["x"], P("x"), mesh=mesh22)

    def f(p, x):
        return functional_call(model, p, (x,)).pow(2).mean()

    value, g = f(params, x), grad(f)(params, x)
    _close((value, g), (f(ref_params, data["x"]), grad(f)(ref_params, data["x"])))


@pytest.mark.parametrize("x_spec", [P(None, "x"), P(None, None, "y")])
def test_vmap_unsharded_batch_dim(mesh22, data, x_spec):
    params, _ = _sharded(data, mesh22)
    xb = sf.distribute(data["xb"], x_spec, mesh=mesh22)
    out = vmap(layer, in_dims=(None, 0))(params, xb)
    _close(out, vmap(layer, in_dims=(None, 0))(_plain(data)[0], data["xb"]))


def test_vmap_nonzero_in_dim_with_reshard_and_gather(mesh22, data):
    params, _ = _sharded(data, mesh22)
    xb = sf.distribute(data["xb"].transpose(0, 1).contiguous(), P("x"), mesh=mesh22)  # vmapped dim 1

    def f(x):
        h = sf.reshard(layer(params, x), P(None, "y"))
        return sf.gather(h).sum(0)

    out = vmap(f, in_dims=1)(xb)
    ref = vmap(lambda x: layer(_plain(data)[0], x).sum(0))(data["xb"])
    assert not isinstance(out, sf.ShardedArray)
    _close(out, ref)


def test_per_example_grads(mesh22, data):
    params, _ = _sharded(data, mesh22)
    xb = sf.distribute(data["xb"], P(None, "x"), mesh=mesh22)
    g = vmap(grad(loss_resharding), in_dims=(None, 0))(params, xb)
    _close(g, vmap(grad(loss), in_dims=(None, 0))(_plain(data)[0], data["xb"]))


def test_grad_of_grad(mesh22):
    w = torch.linspace(-1, 1, 12).reshape(4, 3)
    ws = sf.distribute(w, P("x", "y"), mesh=mesh22)

    def f(w):
        return w.sin().sum()

    def df(w):
        return grad(f)(w).pow(2).sum()

    _close(grad(df)(ws), grad(df)(w))


def test_distribute_inside_grad(mesh22, data):
    """A plain tensor distributed inside the transform gets its gradient back as a plain tensor."""

    def f(w):
        ws = sf.distribute(w, P(None, "y"), mesh=mesh22)
        return sf.gather(data["x"] @ ws).pow(2).sum()

    got = grad(f)(data["w"])
    assert type(got) is torch.Tensor
    _close(got, grad(lambda w: (data["x"] @ w).pow(2).sum())(data["w"]))


def test_train_tp_example_matches_single_device():
    """examples/train_tp.py, eager: 20 steps of TP+DP training give the single-device
    loss curve to 1e-5 relative."""
    from conftest import load_example

    train_tp = load_example("train_tp")
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    ref = train_tp.train(20, None, None)
    got = train_tp.train(20, mesh, None)
    assert ref[-1] < 0.5 * ref[0]  # it does learn
    assert train_tp.max_rel_diff(got, ref) <= 1e-5
