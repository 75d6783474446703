"""Rules for kernels torch's own functions reach that had none (issue 21): ``F.embedding_bag``'s,
``torch.cdist``'s, the masked softmax of the transformer fast paths, ``segment_reduce``, and
CUDA's fused dropout. Each against torch on plain tensors (values and gradients), with the
collectives a rule promises none of counted; CUDA-only kernels on meta meshes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

aten = torch.ops.aten


@pytest.fixture
def mesh2() -> sf.Mesh:
    return sf.Mesh((2,), ("x",), backend="local")


@pytest.fixture
def mesh22() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- embedding_bag ----------------------------------------------------------------------------

V, D = 11, 6  # uneven over 2 and 4 devices
IDX = torch.tensor([1, 2, 7, 5, 4, 3, 2, 10, 0, 7])
OFF = torch.tensor([0, 3, 5, 5, 8])  # an empty bag


def _bag(w, mode, psw=None, pad=None, last=False, idx=IDX, off=OFF):  # noqa: ANN001, ANN202
    if last:  # the last offset ends the last bag (torch's backward reads garbage for indices after it)
        off = torch.cat([off, torch.tensor([idx.shape[0]])])
    return F.embedding_bag(idx, w, off, mode=mode, per_sample_weights=psw, padding_idx=pad, include_last_offset=last)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("pad", [None, 2])
@pytest.mark.parametrize("spec", [P(None, "x"), P("x"), P()], ids=str)
def test_embedding_bag_1d_mesh(mesh2: sf.Mesh, mode: str, pad: int | None, spec: P) -> None:
    _check_bag(mesh2, spec, mode, pad)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, ("dp", "tp")), P(("tp", "dp")), P("tp", "dp")], ids=str)
def test_embedding_bag_2d_mesh(mesh22: sf.Mesh, mode: str, spec: P) -> None:
    _check_bag(mesh22, spec, mode, 2)


def _check_bag(mesh: sf.Mesh, spec: P, mode: str, pad: int | None, psw: bool = False, last: bool = False) -> None:
    """Columns split: no collective at all, forward and backward. Rows split (sum / mean): the
    output is pending over the row axes and nothing else moves; max gathers the rows."""
    w = torch.randn(V, D, generator=_gen())
    weights = torch.randn(IDX.shape[0], generator=_gen(1)) if psw else None
    sw = sf.distribute(w, spec, mesh=mesh).requires_grad_()
    spsw = sf.distribute(weights, P(), mesh=mesh).requires_grad_() if psw else None
    with sf.debug.CommCounter() as cc:
        out = _bag(sw, mode, spsw, pad, last)
    row_axes = spec[0] if len(spec) else None
    row_axes = (row_axes,) if isinstance(row_axes, str) else tuple(row_axes or ())
    if mode == "max" and row_axes:
        pass  # max over split rows has no rule: the rows are gathered (no warning)
    else:
        assert cc.total == 0, cc
        assert set(a for a, _ in out._layout.partial) == set(row_axes), out.spec
    ref_w = w.clone().requires_grad_()
    ref_psw = weights.clone().requires_grad_() if psw else None
    ref = _bag(ref_w, mode, ref_psw, pad, last)
    torch.testing.assert_close(out.full_tensor(), ref)
    g = torch.randn(ref.shape, generator=_gen(2))
    col = spec[1] if len(spec) > 1 else None
    sg = sf.distribute(g, P(None, col), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        grads = torch.autograd.grad(out, (sw, spsw) if psw else (sw,), sg)
    if not row_axes and not psw:
        assert cc.total == 0, cc
    ref_grads = torch.autograd.grad(ref, (ref_w, ref_psw) if psw else (ref_w,), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.full_tensor(), b)


@pytest.mark.parametrize("spec", [P(None, ("dp", "tp")), P("dp", "tp"), P(("dp", "tp"))], ids=str)
@pytest.mark.parametrize("last", [False, True])
def test_embedding_bag_per_sample_weights(mesh22: sf.Mesh, spec: P, last: bool) -> None:
    _check_bag(mesh22, spec, "sum", None, psw=True, last=last)


def test_embedding_bag_rows_inf_and_out_of_range(mesh2: sf.Mesh) -> None:
    """A row of inf held by one device adds 0, not nan, on the others; an index outside the
    vocabulary raises IndexError as torch does."""
    w = torch.randn(V, D, generator=_gen())
    w[3] = float("inf")
    sw = sf.distribute(w, P("x"), mesh=mesh2)
    torch.testing.assert_close(_bag(sw, "sum").full_tensor(), _bag(w, "sum"))
    with pytest.raises(IndexError):
        _bag(sw, "sum", idx=torch.tensor([1, V]), off=torch.tensor([0]))


def test_embedding_bag_module_2d_input(mesh22: sf.Mesh) -> None:
    """nn.EmbeddingBag on a (batch, bag) input split over the batch: the integer indices are
    gathered, the table's columns stay split and its gradient too."""
    bag = torch.nn.EmbeddingBag(V, 8, mode="mean")
    x = torch.randint(0, V, (4, 3), generator=_gen(3))
    ref = bag(x)
    w = sf.distribute(bag.weight.detach(), P(None, "tp"), mesh=mesh22).requires_grad_()
    out = F.embedding_bag(sf.distribute(x, P("dp"), mesh=mesh22), w, mode="mean")
    torch.testing.assert_close(out.full_tensor(), ref)
    gy = torch.randn(ref.shape, generator=_gen(4))
    with sf.debug.CommCounter() as cc:
        (g,) = torch.autograd.grad(out, w, sf.distribute(gy, P(None, "tp"), mesh=mesh22))
    # only the saved integer indices (flattened from the dp-split batch) are gathered again
    assert cc.bytes <= x.numel() * 8 and {r.axes for r in cc.records} <= {("dp",)}, cc
    (rg,) = torch.autograd.grad(ref, bag.weight, gy)
    torch.testing.assert_close(g.full_tensor(), rg)
    assert g.spec == P(None, "tp")


@pytest.mark.parametrize("spec", [P(None, "tp"), P("dp"), P("dp", "tp")], ids=str)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_on_meta_mesh(spec: P, mode: str) -> None:
    """CUDA's kernels (the meta kernels stand in): the columns stay split, the rows pending."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    w = sf.distribute(torch.randn(V, D, device="meta"), spec, mesh=mesh).requires_grad_()
    with sf.debug.CommCounter() as cc:
        out = _bag(w, mode, idx=IDX.to("meta"), off=OFF.to("meta"))
    if mode == "max" and spec[0]:
        return
    assert cc.total == 0, cc
    assert out.shape == (OFF.shape[0], D)
    assert out._layout.dims == ((), ("tp",) if len(spec) > 1 else ()), out.spec
    assert out._layout.partial == ((("dp", "sum"),) if spec[0] else ()), out.spec
    if not spec[0]:
        with sf.debug.CommCounter() as cc:
            (g,) = torch.autograd.grad(out, w, sf.distribute(torch.ones(out.shape, device="meta"), P(None, "tp"), mesh=mesh))
        assert cc.total == 0 and g.spec == P(None, "tp"), (cc, g.spec)


def test_embedding_bag_float16_rows_are_not_pending(mesh2: sf.Mesh) -> None:
    """A device's part of a float16 bag may overflow where the bag does not: no pending sum."""
    w = torch.zeros(V, D, dtype=torch.float16)
    w[1], w[2], w[7] = 40000, 30000, -40000
    out = _bag(sf.distribute(w, P("x"), mesh=mesh2), "sum")
    assert not out._layout.partial
    torch.testing.assert_close(out.full_tensor(), _bag(w, "sum"))


# -- cdist --------------------------------------------------------------------------------------

CDIST_P = [0.0, 1.0, 2.0, 0.5, 3.0, float("inf")]


def _cdist_inputs(batch: tuple = (5,)) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(5)
    x1, x2 = torch.randn(*batch, 7, 6, generator=g), torch.randn(*batch, 5, 6, generator=g)
    x2[..., 0, :3] = x1[..., 0, :3]  # some equal features (p = 0 counts, |d| = 0 in the gradient)
    return x1, x2


def _check_cdist(mesh: sf.Mesh, s1: P, s2: P, p: float, silent: bool, batch: tuple = (5,)) -> None:
    x1, x2 = _cdist_inputs(batch)
    a, b = (sf.distribute(t, s, mesh=mesh).requires_grad_() for t, s in ((x1, s1), (x2, s2)))
    with sf.debug.CommCounter() as cc:
        out = torch.cdist(a, b, p=p, compute_mode="donot_use_mm_for_euclid_dist")
    if silent:
        assert cc.total == 0, cc
    r1, r2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    ref = torch.cdist(r1, r2, p=p, compute_mode="donot_use_mm_for_euclid_dist")
    torch.testing.assert_close(out.full_tensor(), ref)
    g = torch.randn(ref.shape, generator=_gen(6))
    grads = torch.autograd.grad(out, (a, b), sf.distribute(g, out.spec if not out._layout.partial else P(), mesh=mesh))
    rg = torch.autograd.grad(ref, (r1, r2), g)
    for x, y in zip(grads, rg):
        torch.testing.assert_close(x.full_tensor(), y)


@pytest.mark.parametrize("p", CDIST_P)
@pytest.mark.parametrize("specs", [(P("x"), P("x")), (P(None, "x"), P()), (P(), P(None, "x")),
                                   (P("x"), P()), ], ids=str)
def test_cdist_split_points_and_batch(mesh2: sf.Mesh, p: float, specs: tuple) -> None:
    """Batch, x1's points or x2's points split (uneven: 5 and 7 over 2): no collective in
    the forward, values and gradients equal torch's."""
    _check_cdist(mesh2, *specs, p, silent=specs[0] != P("x") or specs[1] == P("x"))


@pytest.mark.parametrize("p", CDIST_P)
@pytest.mark.parametrize("specs", [(P("dp", "tp"), P("dp")), (P("dp", None, "tp"), P("dp", None, "tp")),
                                   (P(None, "dp", "tp"), P(None, "tp", "dp")), (P("tp", "dp"), P("tp", None, "dp"))],
                         ids=str)
def test_cdist_2d_mesh(mesh22: sf.Mesh, p: float, specs: tuple) -> None:
    """Features split too (specs 2-4): pending for p in (0, inf), gathered otherwise (p = 1
    too: a cached plan cannot tell it from p = 2, see rules/distances.py)."""
    # the features split alike in x1 and x2 (spec 2) pend; split on other axes (3, 4) they move
    silent = specs[0] == P("dp", "tp") or (specs[0] == P("dp", None, "tp") and p in (0.0, float("inf")))
    _check_cdist(mesh22, *specs, p, silent=silent)


def test_cdist_features_pending(mesh2: sf.Mesh) -> None:
    """p = 0 and inf leave the feature split pending (sum, max); p = 1 then 2 on the same
    layouts (one cached plan) gather the features, both right."""
    x1, x2 = _cdist_inputs()
    a, b = (sf.distribute(t, P(None, None, "x"), mesh=mesh2) for t in (x1, x2))
    for p, want in ((0.0, (("x", "sum"),)), (float("inf"), (("x", "max"),)), (1.0, ()), (2.0, ())):
        out = torch.cdist(a, b, p=p, compute_mode="donot_use_mm_for_euclid_dist")
        assert out._layout.partial == want, (p, out.spec)
        torch.testing.assert_close(out.full_tensor(), torch.cdist(x1, x2, p=p, compute_mode="donot_use_mm_for_euclid_dist"))


def test_cdist_broadcast_batch_and_meta(mesh22: sf.Mesh) -> None:
    """A broadcast batch dim stays whole (values right); on a meta mesh the split points and
    batch move nothing, forward and backward."""
    x1, x2 = torch.randn(4, 7, 6), torch.randn(1, 5, 6)
    out = torch.cdist(sf.distribute(x1, P("dp", "tp"), mesh=mesh22), sf.distribute(x2, P(), mesh=mesh22), p=1.0)
    torch.testing.assert_close(out.full_tensor(), torch.cdist(x1, x2, p=1.0))
    meta = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    a = sf.distribute(torch.randn(4, 7, 6, device="meta"), P("dp", "tp"), mesh=meta).requires_grad_()
    b = sf.distribute(torch.randn(4, 5, 6, device="meta"), P("dp"), mesh=meta).requires_grad_()
    with sf.debug.CommCounter() as cc:
        out = torch.cdist(a, b, p=1.0)
        ga, gb = torch.autograd.grad(out, (a, b), sf.distribute(torch.ones(4, 7, 5, device="meta"), P("dp", "tp"),
                                                                 mesh=meta))
    assert cc.total == 0, cc
    assert out.spec == P("dp", "tp") and ga.spec == P("dp", "tp"), (out.spec, ga.spec)
    assert gb._layout.dims[0] == ("dp",) and gb._layout.partial == (("tp", "sum"),), gb.spec  # x1's points summed


# -- masked softmax -----------------------------------------------------------------------------

B_, H_, L_ = 3, 4, 5  # uneven batch over 2


def _masks(kind: str) -> tuple[torch.Tensor, int | None]:
    g = _gen(7)
    if kind == "full":
        m = torch.rand(B_, H_, L_, L_, generator=g) > 0.6
        m[..., 0] = False  # no row wholly masked (torch's mask_type None gives nan there, 2 zeros)
        return m, 2
    if kind == "attn":  # (L, L), mask_type 0
        return torch.ones(L_, L_, dtype=torch.bool).triu(1), 0
    m = torch.zeros(B_, L_, dtype=torch.bool)  # (B, L) key padding, mask_type 1
    m[0, 3:], m[2, 4:] = True, True
    return m, 1


def _mask_spec(kind: str, x_spec: P) -> P:
    s = tuple(x_spec) + (None,) * (4 - len(x_spec))
    return P(*s) if kind == "full" else P() if kind == "attn" else P(s[0])


@pytest.mark.parametrize("kind", ["full", "attn", "pad"])
@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, ("dp", "tp")), P("tp", None, "dp"), P(None, None, "tp")],
                         ids=str)
def test_masked_softmax_splits_other_dims(mesh22: sf.Mesh, kind: str, spec: P) -> None:
    """Batch, heads and query rows split: no collective, values equal torch's; with a full
    mask the backward too."""
    x = torch.randn(B_, H_, L_, L_, generator=_gen(8))
    mask, mtype = _masks(kind)
    sx = sf.distribute(x, spec, mesh=mesh22).requires_grad_()
    sm = sf.distribute(mask, _mask_spec(kind, spec), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        out = aten._masked_softmax(sx, sm, -1, mtype)
    if kind == "full" or not spec[2:]:  # a (L, L) or (B, L) mask keeps x's last two dims whole
        assert cc.total == 0, cc
        assert out.spec == spec
    torch.testing.assert_close(out.full_tensor(), aten._masked_softmax(x, mask, -1, mtype))
    if kind == "full":
        g = torch.randn(x.shape, generator=_gen(9))
        ref = aten._masked_softmax(x, mask, -1, mtype)
        with sf.debug.CommCounter() as cc:
            got = aten._masked_softmax_backward(sf.distribute(g, spec, mesh=mesh22), out, sm, -1)
        assert cc.total == 0, cc
        torch.testing.assert_close(got.full_tensor(), aten._masked_softmax_backward(g, ref, mask, -1))
        # autograd reaches the same backward
        (ga,) = torch.autograd.grad(out, sx, sf.distribute(g, spec, mesh=mesh22))
        xr = x.clone().requires_grad_()
        (gr,) = torch.autograd.grad(aten._masked_softmax(xr, mask, -1, mtype), xr, g)
        torch.testing.assert_close(ga.full_tensor(), gr)


def test_masked_softmax_split_softmax_dim_is_gathered(mesh2: sf.Mesh) -> None:
    """The softmax dim split (dim 1 here, and the last dim): gathered, values right."""
    x = torch.randn(B_, H_, L_, L_, generator=_gen(8))
    mask, _ = _masks("full")
    for dim in (1, -1):
        spec = P(None, "x") if dim == 1 else P(None, None, None, "x")
        out = aten._masked_softmax(sf.distribute(x, spec, mesh=mesh2), sf.distribute(mask, spec, mesh=mesh2), dim, 2)
        torch.testing.assert_close(out.full_tensor(), aten._masked_softmax(x, mask, dim, 2))


def test_masked_softmax_on_meta_mesh() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    x = sf.distribute(torch.randn(B_, H_, L_, L_, device="meta"), P("dp", "tp"), mesh=mesh)
    for kind in ("full", "attn", "pad"):
        mask, mtype = _masks(kind)
        with sf.debug.CommCounter() as cc:
            out = aten._masked_softmax(x, sf.distribute(mask.to("meta"), _mask_spec(kind, P("dp", "tp")), mesh=mesh),
                                       -1, mtype)
        assert cc.total == 0 and out.spec == P("dp", "tp"), (kind, cc, out.spec)


# -- segment_reduce -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("spec", [P(None, "x"), P(None, None, "x")], ids=str)
def test_segment_reduce_axis0(mesh2: sf.Mesh, reduce: str, spec: P) -> None:
    """Segments over dim 0, the other dims split (uneven: 5 over 2): no collective, values
    and gradients equal torch's, with lengths and with offsets."""
    data = torch.randn(6, 5, 3, generator=_gen(11))
    lengths = torch.tensor([2, 0, 3, 1])
    for kw in ({"lengths": lengths}, {"offsets": torch.tensor([0, 2, 2, 5, 6])}):
        sd = sf.distribute(data, spec, mesh=mesh2).requires_grad_()
        with sf.debug.CommCounter() as cc:
            out = torch.segment_reduce(sd, reduce, axis=0, unsafe=False, initial=0.0 if reduce == "sum" else None, **kw)
        assert cc.total == 0, cc
        assert out.spec == spec
        dr = data.clone().requires_grad_()
        ref = torch.segment_reduce(dr, reduce, axis=0, initial=0.0 if reduce == "sum" else None, **kw)
        torch.testing.assert_close(out.full_tensor(), ref, equal_nan=True)
        g = torch.randn(ref.shape, generator=_gen(12))
        with sf.debug.CommCounter() as cc:
            (got,) = torch.autograd.grad(out, sd, sf.distribute(g, spec, mesh=mesh2))
        assert cc.total == 0, cc
        (want,) = torch.autograd.grad(ref, dr, g)
        torch.testing.assert_close(got.full_tensor(), want)


@pytest.mark.parametrize("spec", [P("dp", None, "tp"), P(("dp", "tp")), P(None, None, "dp")], ids=str)
def test_segment_reduce_axis1_rows(mesh22: sf.Mesh, spec: P) -> None:
    """Segments over dim 1, one set per row: rows split with their lengths."""
    data = torch.randn(3, 6, 5, generator=_gen(13))
    lengths = torch.tensor([[2, 3, 1], [1, 1, 4], [6, 0, 0]])
    sd = sf.distribute(data, spec, mesh=mesh22).requires_grad_()
    sl = sf.distribute(lengths, P(spec[0]) if spec[0] else P(), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        out = torch.segment_reduce(sd, "mean", lengths=sl, axis=1)
    assert cc.total == 0, cc
    dr = data.clone().requires_grad_()
    ref = torch.segment_reduce(dr, "mean", lengths=lengths, axis=1)
    torch.testing.assert_close(out.full_tensor(), ref, equal_nan=True)
    g = torch.randn(ref.shape, generator=_gen(14))
    (got,) = torch.autograd.grad(out, sd, sf.distribute(g, spec, mesh=mesh22))
    (want,) = torch.autograd.grad(ref, dr, g)
    torch.testing.assert_close(got.full_tensor(), want)


def test_segment_reduce_split_axis_is_gathered(mesh2: sf.Mesh) -> None:
    data = torch.randn(6, 4, generator=_gen(15))
    lengths = torch.tensor([2, 3, 1])
    out = torch.segment_reduce(sf.distribute(data, P("x"), mesh=mesh2), "max", lengths=lengths)
    torch.testing.assert_close(out.full_tensor(), torch.segment_reduce(data, "max", lengths=lengths))


def test_segment_reduce_on_meta_mesh() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    data = sf.distribute(torch.randn(3, 6, 5, device="meta"), P("dp", None, "tp"), mesh=mesh).requires_grad_()
    lengths = sf.distribute(torch.tensor([[2, 3, 1], [1, 1, 4], [6, 0, 0]], device="meta"), P("dp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = torch.segment_reduce(data, "sum", lengths=lengths, axis=1)
        (g,) = torch.autograd.grad(out, data, sf.distribute(torch.ones(3, 3, 5, device="meta"), P("dp", None, "tp"),
                                                            mesh=mesh))
    assert cc.total == 0, cc
    assert out.spec == P("dp", None, "tp") and g.spec == P("dp", None, "tp"), (out.spec, g.spec)


# -- CUDA's fused dropout -------------------------------------------------------------------------


@pytest.fixture
def masked_scale_cpu() -> Iterator[None]:
    """A test-only CPU kernel for CUDA's ``_masked_scale`` (x * mask * scale)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_masked_scale", lambda x, mask, scale: x * mask * scale, "CPU")
    yield
    lib._destroy()


def _fused(x: torch.Tensor, keep: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    out, mask = aten._fused_dropout(x, keep)
    return out.full_tensor(), mask.full_tensor()


@pytest.mark.parametrize("keep", [0.7, 1.0])
def test_fused_dropout_does_not_depend_on_the_sharding(mesh22: sf.Mesh, masked_scale_cpu: None, keep: float) -> None:
    """``_fused_dropout`` (p: the probability of keeping) draws from global indices like
    native_dropout: the same values for every layout (uneven 5 x 3), uint8 mask, x * mask / p,
    gradient g * mask / p (autograd's ``_masked_scale``: a test-only CPU kernel); the
    generator advances alike."""
    x = torch.randn(5, 3, generator=_gen(16))
    one = sf.Mesh((1,), ("r",), backend="local")
    want = _fused(sf.distribute(x, P(), mesh=one), keep, 3)
    after = torch.rand(2)
    assert want[1].dtype == torch.uint8 and want[1].shape == x.shape
    torch.testing.assert_close(want[0], x * want[1] * (1 / keep))
    if keep < 1:
        assert 0 < int(want[1].sum()) < x.numel()
    for mesh, spec in ((mesh22, P("dp", "tp")), (mesh22, P(("tp", "dp"))), (mesh22, P(None, "dp")), (one, P())):
        sx = sf.distribute(x, spec, mesh=mesh).requires_grad_()
        got = _fused(sx, keep, 3)
        assert torch.equal(torch.rand(2), after)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), spec
        torch.manual_seed(3)
        out, mask = aten._fused_dropout(sx, keep)
        assert out.spec == spec
        g = torch.randn(x.shape, generator=_gen(17))
        (gx,) = torch.autograd.grad(out, sx, sf.distribute(g, spec, mesh=mesh))
        torch.testing.assert_close(gx.full_tensor(), g * want[1] * (1 / keep))


@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, ("dp", "tp")), P("tp")], ids=str)
def test_masked_scale_pointwise(mesh22: sf.Mesh, masked_scale_cpu: None, spec: P) -> None:
    x = torch.randn(5, 6, generator=_gen(18))
    mask = (torch.rand(5, 6, generator=_gen(19)) > 0.3).to(torch.uint8)
    with sf.debug.CommCounter() as cc:
        out = aten._masked_scale(sf.distribute(x, spec, mesh=mesh22), sf.distribute(mask, spec, mesh=mesh22), 1.25)
    assert cc.total == 0 and out.spec == spec, cc
    torch.testing.assert_close(out.full_tensor(), x * mask * 1.25)


def test_fused_dropout_and_masked_scale_on_meta_mesh() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    x = sf.distribute(torch.randn(5, 6, device="meta"), P("dp", "tp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out, mask = aten._fused_dropout(x, 0.8)
        scaled = aten._masked_scale(x, mask, 1.25)
    assert cc.total == 0, cc
    assert out.spec == mask.spec == scaled.spec == P("dp", "tp")
    assert mask.dtype == torch.uint8 and out.device.type == "meta"
