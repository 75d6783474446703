"""The local backend's ``set_pending_parts("shares")`` mode: a product whose contraction is
split over the axes its output is pending over runs as one GEMM over the whole contraction,
every device holding an equal share of the sum; calls on such shares run once. Values,
gradients, layouts and collectives are those of the default mode (each device's own part)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import shardfn as sf
from _shard_ops import TorchCalls
from shardfn import P
from shardfn.backends.local import set_pending_parts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_sim  # noqa: E402

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}


@pytest.fixture
def shares():
    old = set_pending_parts("shares")
    try:
        yield
    finally:
        set_pending_parts(old)


def test_set_pending_parts_names_the_modes() -> None:
    with pytest.raises(sf.ShardingError, match="'device', 'shares'"):
        set_pending_parts("equal")
    assert set_pending_parts("device") == "device"


@pytest.mark.parametrize("n", [8, 3])
def test_a_weight_gradient_is_one_gemm_held_as_equal_shares(shares, n: int) -> None:
    mesh = sf.Mesh((n,), ("dp",), backend="local")
    x, g = torch.randn(24, 16, dtype=torch.float64), torch.randn(24, 8, dtype=torch.float64)
    xs, gs = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(g, P("dp"), mesh=mesh)
    sf.reshard(xs.t() @ gs, P())  # the first call of each op also runs it on empty tensors (its metadata)
    with TorchCalls() as mode:
        dw = xs.t() @ gs
    assert dw.spec == P(partial="dp")
    assert sum(f in GEMMS for f in mode.calls) == 1, mode.calls
    shares_ = dw.local_shards()
    for part in shares_:
        torch.testing.assert_close(part, shares_[0], rtol=0, atol=0)
    torch.testing.assert_close(sum(shares_), x.t() @ g)
    with TorchCalls() as mode:
        full = sf.reshard(dw, P())
    assert aten.sum.dim_IntList not in mode.calls, mode.calls  # nothing added up: the shares' sum is n times one
    torch.testing.assert_close(full.full_tensor(), x.t() @ g)
    torch.testing.assert_close((dw * 2 + dw).full_tensor(), 3 * (x.t() @ g))


def test_a_megatron_row_parallel_product_is_one_gemm_and_no_sum(shares) -> None:
    """h @ w1 (columns over 'tp') @ w2 (rows over 'tp'): the second product's contraction is
    the first's columns; it runs as one GEMM and its reduction adds no parts."""
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    h, w1, w2 = (torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64),
                 torch.randn(32, 16, dtype=torch.float64))
    hs = sf.distribute(h, P("dp"), mesh=mesh)
    w1s, w2s = sf.distribute(w1, P(None, "tp"), mesh=mesh), sf.distribute(w2, P("tp", None), mesh=mesh)
    sf.reshard((hs @ w1s) @ w2s, P("dp"))  # warm: a first call also runs on empty tensors
    with TorchCalls() as mode:
        y = sf.reshard((hs @ w1s) @ w2s, P("dp"))
    assert sum(f in GEMMS for f in mode.calls) == 2, mode.calls
    assert aten.sum.dim_IntList not in mode.calls, mode.calls
    torch.testing.assert_close(y.full_tensor(), (h @ w1) @ w2)


def test_what_does_not_fold_as_a_view_or_is_integral_keeps_device_parts(shares) -> None:
    mesh = sf.Mesh((4,), ("tp",), backend="local")
    x, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    # shards stacked whole (from_local): a shard's columns do not merge with the mesh dim
    xs = sf.ShardedArray.from_local([x[:, 4 * d:4 * d + 4].clone() for d in range(4)], P(None, "tp"), mesh=mesh)
    out = xs @ sf.distribute(w, P("tp", None), mesh=mesh)
    assert out.spec == P(partial="tp")
    for d, part in enumerate(out.local_shards()):
        torch.testing.assert_close(part, x[:, 4 * d:4 * d + 4] @ w[4 * d:4 * d + 4])
    xi, wi = torch.randint(-5, 5, (4, 8, 3)), torch.randint(-5, 5, (4, 3, 2))
    xs, ws = sf.distribute(xi, P(None, None, "tp"), mesh=mesh), sf.distribute(wi, P(None, "tp", None), mesh=mesh)
    for d, part in enumerate((xs @ ws).local_shards()):
        torch.testing.assert_close(part, xi[..., d:d + 1] @ wi[:, d:d + 1])


def _block_run(config: str) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    cfg = dict(bench_sim.QUICK)
    shape, names, specs = bench_sim.CONFIGS[config]
    mesh = sf.Mesh(shape, names, backend="local")
    plain = bench_sim.init_params(cfg, dtype=torch.float64)
    params = {k: sf.distribute(v, (specs or {}).get(k, P()), mesh=mesh).requires_grad_() for k, v in plain.items()}
    x, y = bench_sim.make_batch(cfg, 0, dtype=torch.float64)
    xs, ys = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(y, P("dp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        loss = bench_sim.loss_fn(params, xs, ys, cfg["heads"])
        grads = torch.autograd.grad(loss, list(params.values()))
        grads = [sf.reshard(g, p.sharding) for g, p in zip(grads, params.values())]
    return loss.full_tensor(), [g.full_tensor() for g in grads], dict(cc.counts)


@pytest.mark.parametrize("config", list(bench_sim.CONFIGS))
def test_the_block_step_equals_unsharded_with_the_same_collectives(config: str) -> None:
    cfg = dict(bench_sim.QUICK)
    plain = {k: v.requires_grad_() for k, v in bench_sim.init_params(cfg, dtype=torch.float64).items()}
    x, y = bench_sim.make_batch(cfg, 0, dtype=torch.float64)
    want = bench_sim.loss_fn(plain, x, y, cfg["heads"])
    want_grads = torch.autograd.grad(want, list(plain.values()))
    device = _block_run(config)
    old = set_pending_parts("shares")
    try:
        shared = _block_run(config)
    finally:
        set_pending_parts(old)
    assert shared[2] == device[2]
    for loss, grads, _ in (device, shared):
        torch.testing.assert_close(loss, want)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)
