"""sf.lax collectives: exact outputs on small per-device inputs (JAX's documented
examples), gradients against unsharded torch, and errors. Every test runs on both
local-backend body implementations: stacked (vmap) and per-device (threads)."""

from __future__ import annotations

import functools

import pytest
import torch

import shardfn as sf
from shardfn import P, ShardingError, lax
from shardfn.transforms.shard_map.api import _Inputs


@pytest.fixture(params=["stacked", "per_device"])
def body(request, monkeypatch):
    """Which local body implementation shard_map uses (per_device is forced)."""
    if request.param == "per_device":
        monkeypatch.setattr(_Inputs, "even", lambda self: False)
    return request.param


def smap(mesh, in_specs, out_specs, **kw):
    return functools.partial(sf.shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


M4 = sf.Mesh((4,), ("i",))
M22 = sf.Mesh((2, 2), ("x", "y"))
M24 = sf.Mesh((2, 4), ("x", "y"))
# The example array of JAX's shard_map notebook.
X16 = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 1, 2])


# -- exact outputs ------------------------------------------------------------------------------------


def test_psum_jax_example(body):
    f = smap(M4, P("i"), P())(lambda b: lax.psum(b, "i"))
    assert torch.equal(f(torch.arange(16)).full_tensor(), torch.tensor([24, 28, 32, 36]))


def test_psum_of_python_number_is_axis_size(body):
    f = smap(M24, P(), P())(lambda b: b + lax.psum(1, "y") * 10 + lax.psum(1, ("x", "y")))
    assert torch.equal(f(torch.zeros(1)).full_tensor(), torch.tensor([48.0]))


def test_pmean_pmax_pmin(body):
    f = smap(M4, P("i"), (P(), P(), P()))(lambda b: (lax.pmean(b.float(), "i"), lax.pmax(b, "i"), lax.pmin(b, "i")))
    mean, mx, mn = f(X16)
    blocks = X16.view(4, 4)
    assert torch.equal(mean.full_tensor(), blocks.float().mean(0))
    assert torch.equal(mx.full_tensor(), blocks.amax(0))
    assert torch.equal(mn.full_tensor(), blocks.amin(0))


def test_all_gather_untiled_and_tiled(body):
    f = smap(M4, P("i"), (P(), P()))(lambda b: (lax.all_gather(b, "i"), lax.all_gather(b, "i", tiled=True)))
    stacked, tiled = f(torch.arange(8))
    assert torch.equal(stacked.full_tensor(), torch.arange(8).view(4, 2))
    assert torch.equal(tiled.full_tensor(), torch.arange(8))


def test_all_gather_axis_argument(body):
    f = smap(M4, P(None, "i"), P())(lambda b: lax.all_gather(b, "i", axis=1))
    x = torch.arange(8).view(2, 4)
    assert torch.equal(f(x).full_tensor(), x.view(2, 4, 1))


def test_psum_scatter_jax_example(body):
    f = smap(M4, P("i"), P("i"))(lambda b: lax.psum_scatter(b, "i", tiled=True))
    assert torch.equal(f(X16).full_tensor(), torch.tensor([22, 20, 12, 17]))


def test_psum_scatter_untiled_removes_dim(body):
    f = smap(M4, P("i"), P("i"))(lambda b: lax.psum_scatter(b.view(4, 1), "i"))
    assert torch.equal(f(X16).full_tensor(), torch.tensor([22, 20, 12, 17]))


def test_all_to_all_jax_example(body):
    f = smap(M4, P("i"), P("i"))(lambda b: lax.all_to_all(b, "i", 0, 0, tiled=True))
    want = torch.tensor([3, 5, 5, 9, 1, 9, 3, 7, 4, 2, 5, 1, 1, 6, 8, 2])
    assert torch.equal(f(X16).full_tensor(), want)


def test_all_to_all_untiled_moves_the_mapped_dim(body):
    # device j holds x_j of shape (4, 3); device i receives y_i[j] = x_j[i] (JAX semantics).
    x = torch.arange(4 * 4 * 3).view(4, 4, 3)
    f = smap(M4, P("i"), P("i"))(lambda b: lax.all_to_all(b[0], "i", 0, 0).unsqueeze(0))
    assert torch.equal(f(x).full_tensor(), x.transpose(0, 1))
    g = smap(M4, P("i"), P("i"))(lambda b: lax.all_to_all(b[0], "i", 0, 1).unsqueeze(0))
    assert torch.equal(g(x).full_tensor(), x.permute(1, 2, 0))


def test_ppermute_ring_and_partial(body):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = smap(M4, P("i"), P("i"))(lambda b: lax.ppermute(b, "i", ring))
    assert torch.equal(f(torch.arange(8)).full_tensor(), torch.tensor([6, 7, 0, 1, 2, 3, 4, 5]))
    g = smap(M4, P("i"), P("i"))(lambda b: lax.ppermute(b, "i", [(0, 3), (3, 0)]))
    assert torch.equal(g(torch.arange(1, 5)).full_tensor(), torch.tensor([4, 0, 0, 1]))


def test_axis_index_and_size(body):
    f = smap(M4, (), P("i"))(lambda: (lax.axis_index("i") * 10 + lax.axis_size("i")).reshape(1))
    assert torch.equal(f().full_tensor(), torch.tensor([4, 14, 24, 34]))


def test_axis_index_over_several_axes_is_row_major_in_given_order(body):
    f = smap(M24, (), P(("x", "y")))(lambda: lax.axis_index(("x", "y")).reshape(1))
    assert torch.equal(f().full_tensor(), torch.arange(8))
    g = smap(M24, (), P(("x", "y")))(lambda: lax.axis_index(("y", "x")).reshape(1))
    assert torch.equal(g().full_tensor(), torch.tensor([0, 2, 4, 6, 1, 3, 5, 7]))


def test_collectives_over_one_axis_of_a_2d_mesh(body):
    x = torch.arange(16.0).view(4, 4)  # device (a, b) holds block [2a:2a+2, 2b:2b+2]
    f = smap(M22, P("x", "y"), (P(None, "y"), P("x"), P(("x", "y"))))

    @f
    def g(b):
        return lax.psum(b, "x"), lax.all_gather(b, "y", axis=1, tiled=True), lax.psum(b, ("x", "y")).reshape(1, 4)

    by_x, by_y, total = g(x)
    assert torch.equal(by_x.full_tensor(), x[:2] + x[2:])
    assert torch.equal(by_y.full_tensor(), x)
    blocks = x.view(2, 2, 2, 2).permute(0, 2, 1, 3).reshape(4, 4)
    assert torch.equal(total.full_tensor(), blocks.sum(0).expand(4, 4))


def test_all_gather_over_tuple_axes_in_given_order(body):
    x = torch.arange(8.0)  # device (a, b) holds x[4a + b] under P(('x', 'y'))
    f = smap(M24, P(("x", "y")), (P(), P()))(
        lambda b: (lax.all_gather(b, ("x", "y"), tiled=True), lax.all_gather(b, ("y", "x"), tiled=True))
    )
    xy, yx = f(x)
    assert torch.equal(xy.full_tensor(), x)
    assert torch.equal(yx.full_tensor(), x.view(2, 4).t().reshape(8))


def test_pytree_psum(body):
    f = smap(M4, P("i"), P())(lambda t: lax.psum(t, "i"))
    out = f({"a": torch.arange(4.0), "b": (torch.ones(8),)})
    assert torch.equal(out["a"].full_tensor(), torch.tensor([6.0]))
    assert torch.equal(out["b"][0].full_tensor(), torch.full((2,), 4.0))


# -- gradients against unsharded torch ---------------------------------------------------------------------


def _check_grad(sharded, reference, *inputs):
    xs = [t.clone().requires_grad_() for t in inputs]
    ys = [t.clone().requires_grad_() for t in inputs]
    out = sharded(*xs).full_tensor()
    ref = reference(*ys)
    torch.testing.assert_close(out, ref)
    w = torch.randn(ref.shape)
    gs = torch.autograd.grad((out * w).sum(), xs)
    gr = torch.autograd.grad((ref * w).sum(), ys)
    for a, b in zip(gs, gr):
        torch.testing.assert_close(a, b)


def test_grad_psum(body):
    x = torch.randn(8, 3)
    f = smap(M4, P("i"), P())(lambda b: lax.psum(b.sin(), "i"))
    _check_grad(f, lambda x: x.sin().view(4, 2, 3).sum(0), x)


def test_grad_psum_result_reused_per_device(body):
    x = torch.randn(8, 3)
    f = smap(M4, P("i"), P("i"))(lambda b: b * lax.psum(b.sum(0), "i"))
    _check_grad(f, lambda x: x * x.sum(0), x)


def test_grad_pmax_pmean(body):
    x = torch.randn(8, 3)
    f = smap(M4, P("i"), P())(lambda b: lax.pmax(b, "i") + lax.pmean(b ** 2, "i"))
    _check_grad(f, lambda x: x.view(4, 2, 3).amax(0) + (x ** 2).view(4, 2, 3).mean(0), x)


def test_grad_all_gather(body):
    x = torch.randn(8, 3)
    f = smap(M4, P("i"), P())(lambda b: lax.all_gather(b.exp(), "i", tiled=True) * 2)
    _check_grad(f, lambda x: x.exp() * 2, x)


def test_grad_all_gather_used_per_device(body):
    x = torch.randn(8, 3)
    f = smap(M4, P("i"), P("i"))(lambda b: b * lax.all_gather(b, "i", tiled=True).sum(0))
    _check_grad(f, lambda x: x * x.sum(0), x)


def test_grad_psum_scatter(body):
    x = torch.randn(8, 4)
    f = smap(M4, P("i", None), P(None, "i"))(lambda b: lax.psum_scatter(b.cos(), "i", scatter_dimension=1, tiled=True))
    _check_grad(f, lambda x: x.cos().view(4, 2, 4).sum(0), x)


def test_grad_all_to_all(body):
    x = torch.randn(8, 4)
    f = smap(M4, P("i", None), P(None, "i"))(lambda b: lax.all_to_all(b.tanh(), "i", 1, 0, tiled=True))
    _check_grad(f, torch.tanh, x)


def test_grad_ppermute(body):
    x = torch.randn(8, 2)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = smap(M4, P("i"), P("i"))(lambda b: lax.ppermute(b ** 3, "i", ring))
    _check_grad(f, lambda x: torch.roll(x ** 3, 2, 0), x)


def test_grad_collectives_on_2d_mesh(body):
    x = torch.randn(4, 8)
    f = smap(M24, P("x", "y"), P(None, "y"))(lambda b: lax.psum(b * lax.axis_index("y"), "x"))
    scale = torch.arange(4.0).repeat_interleave(2)
    _check_grad(f, lambda x: (x * scale).view(2, 2, 8).sum(0), x)


# -- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: lax.psum(torch.ones(2), "i"),
    lambda: lax.all_gather(torch.ones(2), "i"),
    lambda: lax.axis_index("i"),
    lambda: lax.axis_size("i"),
    lambda: lax.ppermute(torch.ones(2), "i", [(0, 1)]),
])
def test_collective_outside_shard_map(call):
    with pytest.raises(ShardingError, match="outside sf.shard_map"):
        call()


def test_collective_over_missing_axis(body):
    f = smap(M4, P("i"), P())(lambda b: lax.psum(b, "z"))
    with pytest.raises(ShardingError, match="axis 'z' is not an axis of the shard_map mesh"):
        f(torch.ones(4))


def test_bad_collective_arguments(body):
    with pytest.raises(ShardingError, match="must equal 4"):
        smap(M4, P("i"), P("i"))(lambda b: lax.psum_scatter(b, "i"))(torch.ones(12))
    with pytest.raises(ShardingError, match="repeats a destination"):
        smap(M4, P("i"), P("i"))(lambda b: lax.ppermute(b, "i", [(0, 1), (2, 1)]))(torch.ones(4))
    with pytest.raises(ShardingError, match="out of range"):
        smap(M4, P("i"), P("i"))(lambda b: lax.all_gather(b, "i", axis=2, tiled=True))(torch.ones(4))


def test_collectives_are_counted():
    f = smap(M4, P("i"), P())(lambda b: lax.psum(b, "i"))
    with sf.debug.CommCounter() as cc:
        f(torch.ones(16))
    assert cc.counts["all_reduce"] == 1
    assert cc.bytes == 2 * 3 * 16 // 4  # 4 floats per device, ring all_reduce over 4
