"""Pointwise ops whose operands shard different dims, and pending sums through selections
(found in T5's SDPA attention, ``create_position_bias_mask``: ``where(mask, position_bias,
min)`` and its backward).

- ``where(mask, bias, x)`` with a ``(batch, 1, q, k)`` mask split over dp and a ``(1, heads,
  q, k)`` bias split over tp: the output is ``(dp, tp)``-split with no move (before, one of
  the two was gathered);
- ``where(c, grad, 0)`` / ``masked_fill(grad, m, 0)`` of a pending gradient (the bias's,
  summed over the batch): the pending sum passes, as through ``add`` (before, it was
  all-reduced over dp at every use: 2 per decoder of T5, where DDP reduces the weight's
  gradient once). A nonzero fill is not linear: the pending operand is reduced first.

The oracle is plain torch: values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import shardfn as sf
from shardfn import P


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _pending(mesh: sf.Mesh, a: torch.Tensor, b: torch.Tensor) -> sf.ShardedArray:
    """``a @ b`` pending a sum over dp (the contraction split over it)."""
    out = sf.distribute(a, P(None, "dp"), mesh=mesh) @ sf.distribute(b, P("dp"), mesh=mesh)
    assert out._layout.partial == (("dp", "sum"),)
    return out


def test_where_keeps_both_operands_split(mesh: sf.Mesh) -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 1, 8, 8, generator=g) > 0.3
    bias, w = torch.randn(1, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    sm = sf.distribute(mask, P("dp"), mesh=mesh)
    sb = sf.distribute(bias, P(None, "tp"), mesh=mesh).requires_grad_()
    sw = sf.distribute(w, P("dp", "tp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = torch.where(sm, sb, -1e9)
        (out * sw).sum().backward()
    assert out.spec == P("dp", "tp"), out.spec
    assert "all_gather" not in cc.counts, cc
    assert sb.grad._layout.partial == (("dp", "sum"),)
    ref = bias.clone().requires_grad_()
    want = torch.where(mask, ref, -1e9)
    (want * w).sum().backward()
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(sb.grad.full_tensor(), ref.grad)


def test_broadcast_operands_sharding_one_dim_on_two_axes_keep_one(mesh: sf.Mesh) -> None:
    """Operands sharding the same output dim on different axes cannot both be kept: the
    plain rule (one of them gathered) answers, values equal."""
    x = torch.randn(4, 1, 3)
    y = torch.randn(4, 5, 1)
    sx, sy = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(y, P("tp"), mesh=mesh)
    torch.testing.assert_close((sx + sy).full_tensor(), x + y)


@pytest.mark.parametrize("fill", ["zero_tensor", "replicated", "sharded_zero"])
def test_where_passes_a_pending_sum(mesh: sf.Mesh, fill: str) -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    c = torch.rand(6, 5, generator=g) > 0.5
    other = torch.zeros(()) if fill != "replicated" else torch.randn(6, 5, generator=g)
    p = _pending(mesh, a, b)
    o = other if fill == "zero_tensor" else sf.distribute(other, P(), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = torch.where(c, p, o)
    assert cc.total == 0, cc
    assert out._layout.partial == (("dp", "sum"),)
    torch.testing.assert_close(out.full_tensor(), torch.where(c, a @ b, other))
    with sf.debug.CommCounter() as cc:
        out = torch.where(c, o, p)  # the pending operand second
    assert cc.total == 0, cc
    torch.testing.assert_close(out.full_tensor(), torch.where(c, other, a @ b))


@pytest.mark.parametrize("value", [0.0, 1.5, -math.inf])
def test_masked_fill_passes_a_pending_sum_only_for_zero(mesh: sf.Mesh, value: float) -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    m = torch.rand(6, 5, generator=g) > 0.5
    with sf.debug.CommCounter() as cc:
        out = _pending(mesh, a, b).masked_fill(m, value)
    assert (cc.total == 0) == (value == 0.0), cc
    assert bool(out._layout.partial) == (value == 0.0)
    torch.testing.assert_close(out.full_tensor(), (a @ b).masked_fill(m, value))


def test_position_bias_gradient_stays_pending_through_the_mask(mesh: sf.Mesh) -> None:
    """T5's decoder self-attention under SDPA: ``where(causal, bias, min)`` added to every batch
    row's scores; the bias's gradient (summed over the dp-split batch) passes ``where``'s
    backward pending: no collective in the backward, as DDP; values equal."""
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(1, 4, 8, 8, generator=g)
    q, k, v = (torch.randn(4, 4, 8, 16, generator=g) for _ in range(3))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    sb = sf.distribute(bias, P(None, "tp"), mesh=mesh).requires_grad_()
    sq, sk, sv = (sf.distribute(t, P("dp", "tp"), mesh=mesh) for t in (q, k, v))
    min_ = torch.finfo(torch.float32).min

    def f(b, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(causal, b, min_))

    out = f(sb, sq, sk, sv)
    with sf.debug.CommCounter() as cc:
        out.backward(sf.distribute(torch.ones_like(q), P("dp", "tp"), mesh=mesh))
    assert cc.total == 0, cc
    assert sb.grad._layout.partial == (("dp", "sum"),)
    ref = bias.clone().requires_grad_()
    want = f(ref, q, k, v)
    want.sum().backward()
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(sb.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-5)
