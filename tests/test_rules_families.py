"""Rules the model-family census needed (issue 21): each against torch on plain tensors,
with the collectives it may issue."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P

aten = torch.ops.aten


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


@pytest.mark.parametrize("spec", [P(None, None, "tp"), P("dp", None, "tp"), P(None, "tp"), P("tp")])
def test_layer_norm_backward_split_gradient_replicated_statistics(mesh: sf.Mesh, spec: P) -> None:
    """A gradient split along a leading dim other than the first against replicated input,
    mean and rstd (Persimmon's per-head q/k LayerNorm under a head-split gradient): torch's
    CPU kernel reads mean / rstd as contiguous, so the local calls get dense shards."""
    x, w, b = torch.randn(2, 8, 4, 16), torch.randn(16), torch.randn(16)
    out, mean, rstd = aten.native_layer_norm(x, [16], w, b, 1e-5)
    g = torch.randn(2, 8, 4, 16)
    want = aten.native_layer_norm_backward(g, x, [16], mean, rstd, w, b, [True, True, True])
    rep = [sf.distribute(t, P(), mesh=mesh) for t in (x, mean, rstd, w, b)]
    got = aten.native_layer_norm_backward(sf.distribute(g, spec, mesh=mesh), rep[0], [16], *rep[1:], [True, True, True])
    for o, e in zip(got, want):
        torch.testing.assert_close(o.full_tensor(), e)


def test_embedding_backward_keeps_pending_gradient(mesh: sf.Mesh) -> None:
    """A gradient pending over tp (a row-parallel product's output) into the embedding's
    backward: the weight's gradient stays pending (no collective), values equal."""
    x, w, idx = torch.randn(4, 8, 10), torch.randn(10, 6), torch.randint(0, 16, (4, 8))
    g = sf.distribute(x, P("dp", None, "tp"), mesh=mesh) @ sf.distribute(w, P("tp"), mesh=mesh)
    assert g.spec == P("dp", partial="tp")
    for pad in (-1, 3):
        with sf.debug.CommCounter() as cc:
            out = aten.embedding_dense_backward(g, sf.distribute(idx, P("dp"), mesh=mesh), 16, pad, False)
        assert cc.total == 0 and set(out.spec.partial) == {"dp", "tp"}, (cc, out.spec)
        torch.testing.assert_close(out.full_tensor(), aten.embedding_dense_backward(x @ w, idx, 16, pad, False))


@pytest.mark.parametrize("freq", [False, True])
@pytest.mark.parametrize("w_spec", [P(None, "tp"), P()])
def test_embedding_backward_keeps_the_embedding_dim_split(mesh: sf.Mesh, w_spec: P, freq: bool) -> None:
    """T5's relative position bias: a (buckets, heads) table looked up by a replicated (q, k)
    bucket map, its output permuted to (heads, q, k) and added to head-split scores of a
    dp-split batch. The gradient arrives split over the heads (tp) and pending over dp; the
    table's gradient keeps both (no collective; before, it was gathered over tp), with or without
    ``scale_grad_by_freq`` (the counts need the whole index map: it is replicated here), the
    table split by heads or replicated (MPNet's). Values and gradients equal torch's."""
    table, buckets = torch.randn(32, 4), torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(4))
    scores = torch.randn(4, 4, 8, 8)
    t = sf.distribute(table, w_spec, mesh=mesh).requires_grad_()
    s = sf.distribute(scores, P("dp", "tp"), mesh=mesh)
    out = (torch.nn.functional.embedding(sf.distribute(buckets, P(), mesh=mesh), t, scale_grad_by_freq=freq)
           .permute(2, 0, 1) + s)
    with sf.debug.CommCounter() as cc:
        out.backward(sf.distribute(torch.ones_like(scores), P("dp", "tp"), mesh=mesh))
    assert cc.total == 0, cc
    assert t.grad.spec == P(None, "tp", partial="dp"), t.grad.spec
    ref = table.clone().requires_grad_()
    (torch.nn.functional.embedding(buckets, ref, scale_grad_by_freq=freq).permute(2, 0, 1) + scores).sum().backward()
    torch.testing.assert_close(t.grad.full_tensor(), ref.grad)


@pytest.mark.parametrize("groups,dims", [(8, 1), (4, 1), (8, 2), (1, 1), (2, 1)])
def test_grouped_convolution_keeps_channels_split(mesh: sf.Mesh, groups: int, dims: int) -> None:
    """A depthwise (or grouped) convolution over channels split over tp and a batch over dp
    (LFM2's short convolution): each device convolves its whole groups with ``groups / n`` (no
    collective, forward or backward; the weight and bias gradients pending over dp, split over
    tp, as the weight). Where the split would cut a group (one group over 2 devices) the input is
    gathered instead; values and gradients equal torch's either way."""
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d)[dims - 1]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, *(6,) * dims, generator=g)
    w, b = torch.randn(8, 8 // groups, *(3,) * dims, generator=g), torch.randn(8, generator=g)
    sx = sf.distribute(x, P("dp", "tp"), mesh=mesh)
    sw = sf.distribute(w, P("tp"), mesh=mesh).requires_grad_()
    sb = sf.distribute(b, P("tp"), mesh=mesh).requires_grad_()
    ones = sf.distribute(torch.ones(4, 8, *(6,) * dims), P("dp", "tp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = conv(sx, sw, sb, padding=1, groups=groups)
        out.backward(ones)
    if groups % 2 == 0:
        assert cc.total == 0, cc
        assert out.spec == P("dp", "tp") and sw.grad.spec == P("tp", partial="dp"), (out.spec, sw.grad.spec)
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    want = conv(x, rw, rb, padding=1, groups=groups)
    want.sum().backward()
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sw.grad.full_tensor(), rw.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sb.grad.full_tensor(), rb.grad, rtol=1e-5, atol=1e-5)


def _write_heads(kv: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
    """DeepSeek's key states: a fresh ``new_empty`` written through two slices."""
    kn, _ = torch.split(kv, [16, 16], -1)
    ks = kv.new_empty(*kv.shape[:-1], 24)
    ks[..., :16].copy_(kn)
    ks[..., 16:].copy_(kr.expand(-1, kn.shape[1], -1, -1))
    return ks


def test_write_split_heads_into_fresh_buffer(mesh: sf.Mesh) -> None:
    """slice_scatter of a head-split value into a replicated fresh buffer takes the value's
    layout (the buffer is cut locally): no collective; under torch.func the gradient's
    CopySlices reads and writes boxes through as_strided / as_strided_scatter: no fallback."""
    kv, kr = torch.randn(4, 4, 8, 32), torch.randn(4, 1, 8, 8)
    skv, skr = sf.distribute(kv, P("dp", "tp"), mesh=mesh), sf.distribute(kr, P("dp"), mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as cc:
            out = _write_heads(skv, skr)
        assert cc.total == 0 and out.spec == P("dp", "tp"), (cc, out.spec)
        torch.testing.assert_close(out.full_tensor(), _write_heads(kv, kr))
        w = torch.randn(4, 4, 8, 24)
        sw = sf.distribute(w, P("dp", "tp"), mesh=mesh)
        with sf.debug.CommCounter() as cc:
            got = torch.func.grad(lambda a, b: (_write_heads(a, b) * sw).sum(), argnums=(0, 1))(skv, skr)
    want = torch.func.grad(lambda a, b: (_write_heads(a, b) * w).sum(), argnums=(0, 1))(kv, kr)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.full_tensor(), e)
    assert set(cc.counts) <= {"all_reduce"}, cc  # kr's gradient: a sum over the split heads


@pytest.mark.parametrize("spec", [P("dp"), P(None, "tp"), P("dp", None, "tp")])
def test_as_strided_box(mesh: sf.Mesh, spec: P) -> None:
    """as_strided that is a box of a dense array: sharded dims taken whole stay sharded,
    the others are cut locally; values equal torch's."""
    x = torch.randn(4, 6, 8)
    sx = sf.distribute(x, spec, mesh=mesh)
    for size, start in [((4, 6, 3), (0, 0, 2)), ((4, 2, 8), (0, 3, 0)), ((2, 6, 8), (2, 0, 0))]:
        off = sum(s * st for s, st in zip(start, x.stride()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = sx.as_strided(size, x.stride(), off)
        torch.testing.assert_close(got.full_tensor(), x.as_strided(size, x.stride(), off))
        base = torch.randn(4, 6, 8)
        src = torch.randn(size)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = aten.as_strided_scatter(sf.distribute(base, spec, mesh=mesh), sf.distribute(src, spec, mesh=mesh),
                                          size, x.stride(), off)
        torch.testing.assert_close(got.full_tensor(), aten.as_strided_scatter(base, src, size, x.stride(), off))


_WRITTEN_VIEWS = {
    "rows": lambda y: y[1:],
    "t": lambda y: y.transpose(0, 1),
    "permute": lambda y: y.permute(2, 0, 1),
    "mT_slice": lambda y: y.mT[1:3],
    "select": lambda y: y[:, 2],
    "step": lambda y: y[::2],
    "diagonal": lambda y: y.diagonal(0, 0, 1),
    "unsqueeze": lambda y: y.unsqueeze(1),
    "flatten": lambda y: y.view(8, 24)[:, 3:9],
    "flat_all": lambda y: y.view(-1)[5:50],
    "unflatten": lambda y: y.unflatten(1, (3, 2))[:, 1],
    "chain": lambda y: y[2:6].transpose(1, 2)[:, 1:],
}


@pytest.mark.parametrize("view", sorted(_WRITTEN_VIEWS))
@pytest.mark.parametrize("spec", [P("dp"), P(None, "tp"), P("dp", "tp"), P(None, None, ("dp", "tp")), P()])
def test_func_grad_of_inplace_op_on_a_view(mesh: sf.Mesh, view: str, spec: P) -> None:
    """torch.func.grad of an in-place op on a view of a ShardedArray: autograd's CopySlices reads
    and writes the view through as_strided / as_strided_scatter, which fell back to replicated
    (FallbackWarning) for any view but a box (a transpose, a select, a step slice, ...)."""
    vf = _WRITTEN_VIEWS[view]

    def f(v):
        y = v.clone()
        vf(y).mul_(2)
        vf(y).add_(v[:1].sum())
        return (y * y.sin()).sum()

    for dtype in (torch.float64, torch.complex128):
        x = torch.randn(8, 6, 4, dtype=dtype)
        if dtype.is_complex:
            g = lambda v: f(v).real  # noqa: E731
        else:
            g = f
        with warnings.catch_warnings():
            warnings.simplefilter("error", sf.FallbackWarning)
            got = torch.func.grad(g)(sf.distribute(x, spec, mesh=mesh))
            val = f(sf.distribute(x, spec, mesh=mesh))
        torch.testing.assert_close(got.full_tensor(), torch.func.grad(g)(x))
        torch.testing.assert_close(val.full_tensor(), f(x))


@pytest.mark.parametrize("spec", [P("x"), P(None, "x")])
def test_as_strided_of_a_transpose_keeps_the_sharding(spec: P) -> None:
    """as_strided that is a permute (or select, step slice) of a dense array keeps the sharding of
    the dims it takes whole, on uneven shards too, with no collective; a view it cannot read as
    index arithmetic (beyond the array's elements) still replicates, as torch reads it."""
    mesh = sf.Mesh((4,), ("x",))
    x = torch.randn(6, 5, 3)
    sx = sf.distribute(x, spec, mesh=mesh)
    sharded = 0 if spec == P("x") else 1
    # (size, stride, offset, the input dims taken whole): a transpose, a select of dim 1, a permute,
    # a step slice of dim 0, a select of dim 2 with a size-1 dim inserted
    cases = [((5, 6, 3), (3, 15, 1), 0, {0, 1, 2}), ((6, 3), (15, 1), 5, {0, 2}), ((3, 5, 6), (1, 3, 15), 0, {0, 1, 2}),
             ((3, 5), (30, 3), 1, {1}), ((6, 1, 5), (15, 7, 3), 2, {0, 1})]
    for size, stride, at, whole in cases:
        with warnings.catch_warnings(), sf.debug.CommCounter() as cc:
            warnings.simplefilter("error", sf.FallbackWarning)
            got = sx.as_strided(size, stride, at)
        assert (cc.total == 0) == (sharded in whole), (size, cc)
        torch.testing.assert_close(got.full_tensor(), x.as_strided(size, stride, at))
        base, src = torch.randn(6, 5, 3), torch.randn(size)
        with warnings.catch_warnings():
            warnings.simplefilter("error", sf.FallbackWarning)
            out = aten.as_strided_scatter(sf.distribute(base, spec, mesh=mesh), sf.distribute(src, P(), mesh=mesh),
                                          size, stride, at)
        torch.testing.assert_close(out.full_tensor(), aten.as_strided_scatter(base, src, size, stride, at))
    got = sx.as_strided((6, 5), (15, 3), 0)
    assert got.spec == P(*spec[:2]), got.spec
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sf.FallbackWarning)  # (warned once per op and process)
        torch.testing.assert_close(sx[1:].as_strided((4,), (1,), 0).full_tensor(), x[1:].as_strided((4,), (1,), 0))
