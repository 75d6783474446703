"""Rules for ops that the OpInfo fallback census (issue 25/21) found replicating their inputs
with a FallbackWarning: upsampling backwards, group norm, glu, prelu's kernels, ``complex``, and
the elementwise losses (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``, ``soft_margin_loss``,
``binary_cross_entropy`` with and without logits: a "mean"/"sum" stays a pending reduction of the
split terms).
Values and gradients against plain torch, with no call through the replicate fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

from _no_fallback import NoFallback


def _full(a):
    return a.full_tensor() if isinstance(a, sf.ShardedArray) else a


_GEN = torch.Generator().manual_seed(0)
_PROBS, _SIGNS = torch.rand(4, 6, generator=_GEN, dtype=torch.float64), torch.randn(4, 6, generator=_GEN, dtype=torch.float64).sign()
_W, _PW = torch.rand(6, generator=_GEN, dtype=torch.float64), torch.rand(6, generator=_GEN, dtype=torch.float64) + 0.5


def _c(like, t, spec):
    """A constant operand: distributed as ``spec`` where the differentiated input is an array."""
    return sf.distribute(t, spec, mesh=like.mesh) if isinstance(like, sf.ShardedArray) else t


_CASES = {
    **{f"bce_with_logits_{r}": (lambda x, r=r: F.binary_cross_entropy_with_logits(
        x, _c(x, _PROBS, P("x")), _c(x, _W, P()), pos_weight=_c(x, _PW, P("y")), reduction=r), [(4, 6)], [P("x", "y")])
       for r in ("none", "mean", "sum")},
    **{f"{n}_{r}": (lambda x, n=n, r=r: getattr(F, n)(x, _c(x, _SIGNS, P(None, "y")), reduction=r), [(4, 6)], [P("x", "y")])
       for n in ("mse_loss", "smooth_l1_loss", "huber_loss") for r in ("none", "mean", "sum")},
    **{f"bce_{r}": (lambda x, r=r: F.binary_cross_entropy(x.sigmoid(), _c(x, _PROBS, P("x")), _c(x, _W, P()), reduction=r),
                    [(4, 6)], [P("x", "y")]) for r in ("none", "mean", "sum")},
    **{f"soft_margin_{r}": (lambda x, r=r: F.soft_margin_loss(x, _c(x, _SIGNS, P()), reduction=r), [(4, 6)], [P("x", "y")])
       for r in ("none", "mean", "sum")},
    **{f"interpolate_{m}": (lambda x, m=m: F.interpolate(x, scale_factor=2, mode=m), [(4, 2, 3, 5)], [P("x", "y")])
       for m in ("nearest", "bilinear", "bicubic", "nearest-exact")},
    "interpolate_linear": (lambda x: F.interpolate(x, scale_factor=1.5, mode="linear"), [(3, 2, 5)], [P("x")]),
    "interpolate_trilinear": (lambda x: F.interpolate(x, size=(3, 4, 2), mode="trilinear"), [(2, 4, 2, 3, 3)],
                              [P(None, ("x", "y"))]),
    "interpolate_antialias": (lambda x: F.interpolate(x, size=(2, 3), mode="bilinear", antialias=True),
                              [(4, 2, 3, 5)], [P("x")]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [(4, 4, 3, 5), (4,), (4,)], [P("x"), P(), P()]),
    "group_norm_uneven": (lambda x, w, b: F.group_norm(x, 2, w, b), [(3, 4, 5), (4,), (4,)], [P(("x", "y")), P(), P()]),
    "group_norm_one_row": (lambda x: F.group_norm(x, 4), [(1, 4, 5)], [P(("x", "y"))]),
    "group_norm_channels": (lambda x, w, b: F.group_norm(x, 2, w, b), [(4, 4, 5), (4,), (4,)], [P(None, "x"), P(), P()]),
    "glu": (lambda x: F.glu(x, 1), [(4, 6, 3)], [P("x", "y")]),
    "glu_last": (lambda x: F.glu(x, -1), [(4, 6, 4)], [P("x", None, "y")]),
    "prelu": (lambda x, w: F.prelu(x, w), [(4, 3, 5), (3,)], [P("x"), P()]),
    "prelu_channels": (lambda x, w: F.prelu(x, w), [(4, 4, 5), (4,)], [P(None, "x"), P("x")]),
    "rfft": (lambda x: torch.view_as_real(torch.fft.rfft(x, dim=-1)), [(4, 6, 8)], [P("x", "y")]),
    "fft2": (lambda x: torch.view_as_real(torch.fft.fft2(x.to(torch.complex128))), [(4, 6, 8)], [P("x", None, "y")]),
    "irfft": (lambda x: torch.fft.irfft(torch.complex(x, x.flip(-1)), n=10), [(4, 6, 6)], [P("x", "y")]),
    "norm": (lambda x, y: F.pairwise_distance(x, y, p=3), [(4, 6), (4, 6)], [P("x", "y"), P("x")]),  # aten.norm
    "unfold_fold": (lambda x: F.fold(F.unfold(x, 2), (3, 5), 2), [(4, 2, 3, 5)], [P("x", "y")]),
    "grid_sample": (lambda x, g: F.grid_sample(x, g.tanh(), align_corners=False), [(4, 2, 3, 5), (4, 2, 3, 2)],
                    [P("x"), P("x")]),
    "channel_shuffle": (lambda x: F.channel_shuffle(x, 2), [(4, 6, 3)], [P("x", "y")]),
    "complex": (lambda x, y: torch.view_as_real(torch.complex(x, y)), [(4, 6), (4, 6)], [P("x"), P(None, "y")]),
}
# the cases whose batch (dim 0) split must stay split in the output
_KEEPS_ROWS = {"rfft", "fft2", "irfft", "norm", "unfold_fold", "grid_sample", "channel_shuffle", "max_unpool","bce_with_logits_none", "soft_margin_none", "mse_loss_none", "huber_loss_none", "bce_none", "interpolate_nearest", "interpolate_bilinear", "group_norm", "group_norm_uneven", "glu", "prelu"}


def _unpool(x):
    """max_pool2d, then max_unpool2d of the pooled values to their positions."""
    y, idx = F.max_pool2d(x, 2, return_indices=True)
    return F.max_unpool2d(y, idx, 2, output_size=x.shape[-2:])


_CASES["max_unpool"] = (_unpool, [(4, 2, 4, 6)], [P("x", "y")])


@pytest.mark.parametrize("name", sorted(_CASES))
def test_census_op_matches_torch_without_fallback(name):
    f, shapes, specs = _CASES[name]
    mesh = sf.Mesh((2, 2), ("x", "y"))
    gen = torch.Generator().manual_seed(len(name))
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    leaves, ref = [x.clone().requires_grad_() for x in xs], [x.clone().requires_grad_() for x in xs]
    want = f(*ref)
    gout = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    with NoFallback():
        got = f(*(sf.distribute(t, s, mesh=mesh) for t, s in zip(leaves, specs)))
        grads = torch.autograd.grad(got, leaves, sf.distribute(gout, P(), mesh=mesh))
    if name in _KEEPS_ROWS:
        assert got.spec[0] == specs[0][0], got.spec
    if name.endswith(("_mean", "_sum")):
        assert got._layout.partial  # the split terms' reduction stays pending
    torch.testing.assert_close(_full(got), want)
    for g, w in zip(grads, torch.autograd.grad(want, ref, gout)):
        torch.testing.assert_close(_full(g), w)
