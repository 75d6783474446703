"""shard_map, sf.lax, local_map and with_sharding_constraint on both backends: exact
collective outputs, gradients against plain torch, uneven layouts and check_vma."""

from __future__ import annotations

import torch
from dist_harness import assert_equal, collect, scenario

import shardfn as sf
from shardfn import P, lax


def _close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


@scenario
def collectives_exact(mesh: sf.Mesh) -> None:
    """Each collective's exact output, over every axis and over all axes at once."""
    n = mesh.size
    every = mesh.axis_names
    x = torch.arange(n * 2 * n, dtype=torch.float64).view(n * 2, n)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(b):
        return (
            lax.psum(b, every), lax.pmax(b, every), lax.all_gather(b, every, tiled=True),
            lax.psum_scatter(b, every, scatter_dimension=1, tiled=True),
            lax.all_to_all(b, every, 1, 0, tiled=True), lax.ppermute(b, every, ring),
            lax.axis_index(every).reshape(1).double(),
        )

    f = sf.shard_map(body, mesh=mesh, in_specs=P(every),
                     out_specs=(P(), P(), P(), P(None, every), P(None, every), P(every), P(every)))
    got = [o.full_tensor() for o in f(x)]
    blocks = x.view(n, 2, n)
    assert_equal(got[0], blocks.sum(0), "psum")
    assert_equal(got[1], blocks.amax(0), "pmax")
    assert_equal(got[2], x, "all_gather")
    assert_equal(got[3], blocks.sum(0), "psum_scatter")
    assert_equal(got[4], x, "all_to_all")
    assert_equal(got[5], torch.roll(x, 2, 0), "ppermute")
    assert_equal(got[6], torch.arange(n, dtype=torch.float64), "axis_index")


@scenario
def shard_map_mlp_grads(mesh: sf.Mesh) -> None:
    """Tensor-parallel MLP, even and uneven: values and gradients equal plain torch."""
    tp = mesh.axis_names[-1]
    dp = mesh.axis_names[0] if mesh.ndim > 1 else None
    for batch, hidden in ((8, 8), (7, 6)):
        g = torch.Generator().manual_seed(batch)
        args = [torch.randn(batch, 5, generator=g), torch.randn(5, hidden, generator=g), torch.randn(hidden, 3, generator=g)]
        f = sf.shard_map(lambda x, w1, w2: lax.psum(torch.tanh(x @ w1) @ w2, tp), mesh=mesh,
                         in_specs=(P(dp), P(None, tp), P(tp)), out_specs=P(dp))
        xs = [a.clone().requires_grad_() for a in args]
        out = f(*xs).full_tensor()
        ref_in = [a.clone().requires_grad_() for a in args]
        ref = torch.tanh(ref_in[0] @ ref_in[1]) @ ref_in[2]
        _close(out, ref, f"value {batch}")
        for a, b in zip(torch.autograd.grad((out ** 2).sum(), xs), torch.autograd.grad((ref ** 2).sum(), ref_in)):
            _close(a, b, f"grad {batch}")


@scenario
def shard_map_check_vma(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    f = sf.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P(a), out_specs=P())
    try:
        f(torch.ones(8))
    except sf.ShardingError as e:
        assert f"varies over mesh axis {a!r}" in str(e), str(e)
    else:
        raise AssertionError("check_vma did not fire")


@scenario
def local_map_uneven_and_partial_grads(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    xt, wt = torch.randn(7, 4, generator=torch.Generator().manual_seed(1)), torch.ones(4, 3)
    x = sf.distribute(xt, P(a), mesh=mesh)
    w = sf.distribute(wt, P(), mesh=mesh).requires_grad_()
    y = sf.local_map(torch.matmul, out_specs=P(a))(x, w)
    assert tuple(y.shape) == (7, 3), y.shape
    _close(y.full_tensor(), xt @ wt, "local_map value")
    y.full_tensor().sum().backward()
    _close(w.grad.full_tensor(), xt.T @ torch.ones(7, 3), "local_map grad")


@scenario
def with_sharding_constraint_grad(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    x = sf.distribute(torch.arange(32.0).view(8, 4), P(a), mesh=mesh).requires_grad_()
    y = sf.with_sharding_constraint(x, P(None, a))
    assert y.spec == P(None, a)
    y.full_tensor().sum().backward()
    assert x.grad.spec == P(None, a)
    _close(x.grad.full_tensor(), torch.ones(8, 4), "wsc grad")


@scenario
def partial_in_spec_summands(mesh: sf.Mesh) -> None:
    """A partial in_spec (JAX's unreduced): the body sees each device's summand; psum /
    psum_scatter finish the sum; gradients equal plain torch's."""
    a = mesh.axis_names[-1]
    n = mesh.axis_size(a)
    xt, wt = torch.arange(8.0 * n).view(4, 2 * n), torch.arange(2.0 * n * 4).view(2 * n, 4) / 10
    x = sf.distribute(xt, P(None, a), mesh=mesh).requires_grad_()
    w = sf.distribute(wt, P(a, None), mesh=mesh).requires_grad_()
    z = sf.matmul(x, w, out_sharding=P(partial=a))
    total = sf.shard_map(lambda t: lax.psum(t, a), mesh=mesh, in_specs=P(partial=a), out_specs=P())(z)
    scattered = sf.shard_map(lambda t: lax.psum_scatter(t, a, tiled=True), mesh=mesh, in_specs=P(partial=a),
                             out_specs=P(a))(z)
    _close(total.full_tensor(), xt @ wt, "psum of summands")
    _close(scattered.full_tensor(), xt @ wt, "psum_scatter of summands")
    (total.full_tensor().sin().sum() + scattered.full_tensor().sum()).backward()
    want = torch.func.grad(lambda p, q: (p @ q).sin().sum() + (p @ q).sum(), argnums=(0, 1))(xt, wt)
    _close(x.grad.full_tensor(), want[0], "grad x")
    _close(w.grad.full_tensor(), want[1], "grad w")


test_local, test_dist = collect(globals())
