"""Rules of the kernels torch reaches on CUDA, tested on CPU.

Layouts and collectives on meta meshes (torch's meta kernels stand in for the CUDA ones);
values and gradients on CPU meshes through test-only CPU kernels for the CUDA-only ops
(``torch.library``, registered for this module only), against the same call unsharded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

import shardfn as sf
from shardfn import P

aten = torch.ops.aten
B, H, S, D = 4, 4, 8, 16


# -- test-only CPU kernels: attention by the math formula ------------------------------------------


def _scores(q, k, bias, causal, scale):  # noqa: ANN001, ANN202
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if bias is not None:
        s = s + bias
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _expand_kv(q, k, v):  # noqa: ANN001, ANN202
    rep = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3), rep


def _forward(q, k, v, bias, causal, scale):  # noqa: ANN001, ANN202
    k, v, _ = _expand_kv(q, k, v)
    s = _scores(q, k, bias, causal, scale)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _backward(g, q, k, v, bias, causal, scale, delta=None, lse=None):  # noqa: ANN001, ANN202
    """``delta``: the rows of ``g * out`` summed, as kernels that read the forward's output
    compute it (the same value as from the probabilities, where ``out`` is read right);
    ``lse``: the forward's logsumexp, which the probabilities are then rebuilt from."""
    k2, v2, rep = _expand_kv(q, k, v)
    sc = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    if lse is None:
        p = torch.softmax(_scores(q, k2, bias, causal, scale), -1)
    else:
        p = torch.exp(_scores(q, k2, bias, causal, scale) - lse[..., :q.shape[-2], None])
    dv = p.transpose(-1, -2) @ g
    dp = g @ v2.transpose(-1, -2)
    ds = p * (dp - ((dp * p).sum(-1, keepdim=True) if delta is None else delta))
    dq, dk = ds @ k2 * sc, ds.transpose(-1, -2) @ q * sc
    if rep > 1:
        dk = dk.unflatten(-3, (-1, rep)).sum(-3)
        dv = dv.unflatten(-3, (-1, rep)).sum(-3)
    dbias = None
    if bias is not None and bias.numel():
        dbias = ds.sum_to_size(bias.shape) if bias.shape != ds.shape else ds
    return dq, dk, dv, dbias


def _like_meta(op, args, kwargs, values):  # noqa: ANN001, ANN202
    """The op's outputs shaped as its meta kernel says, ``values`` (index -> tensor) filled in."""
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
              **{n: a.to("meta") if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
    out = []
    for i, m in enumerate(meta):
        if not isinstance(m, torch.Tensor):
            out.append(m)
            continue
        t = torch.zeros_like(m, device="cpu")  # the meta kernel's strides: CUDA's output layouts
        if i in values and values[i] is not None:
            val = values[i]
            if val.dim() + 1 == m.dim():  # cudnn's logsumexp has a trailing 1
                val = val.unsqueeze(-1)
            t[tuple(slice(0, n) for n in val.shape)] = val.to(m.dtype)
        out.append(t)
    return tuple(out)


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN202
    o, lse = _forward(q, k, v, None, is_causal, scale)
    return _like_meta(aten._scaled_dot_product_flash_attention.default, (q, k, v, dropout_p, is_causal,
                      return_debug_mask), {"scale": scale}, {0: o, 1: lse})


def _flash_bwd(g, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset, *, scale=None):  # noqa: ANN001, ANN202
    # CUDA's kernel reads the logsumexp by a bare pointer, as (b, h, s) dense: read so here
    read = lse.as_strided(lse.shape, torch.empty(lse.shape, device="meta").stride(), lse.storage_offset())
    dq, dk, dv, _ = _backward(g, q, k, v, None, is_causal, scale, lse=read)
    return dq, dk, dv


def _efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
    o, lse = _forward(q, k, v, bias, is_causal, scale)
    return _like_meta(aten._scaled_dot_product_efficient_attention.default, (q, k, v, bias, compute_lse, dropout_p,
                      is_causal), {"scale": scale}, {0: o, 1: lse if compute_lse else None})


def _efficient_bwd(g, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
    # CUDA's kernel reads ``out`` as its forward wrote it, (b, s, h, d) dense, whatever its strides:
    # row stride heads * dim (xformers' ``o_strideM``); read so here, an ``out`` in another layout
    # gives wrong query and key gradients, as on the GPU
    b_, h_, s_, d_ = out.shape
    read = out.as_strided(out.shape, (out.stride(0), out.stride(1), h_ * d_, 1), out.storage_offset())
    delta = (g * read).sum(-1, keepdim=True)
    dq, dk, dv, db = _backward(g, q, k, v, bias, is_causal, scale, delta)
    return dq, dk, dv, db if db is not None and mask[3] else torch.empty(0)


def _cudnn(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN202
    o, lse = _forward(q, k, v, bias, is_causal, scale)
    return _like_meta(aten._scaled_dot_product_cudnn_attention.default, (q, k, v, bias, compute_lse, dropout_p,
                      is_causal, return_debug_mask), {"scale": scale}, {0: o, 1: lse})


def _cudnn_bwd(g, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, dropout_p, is_causal, *, scale=None):  # noqa: ANN001, ANN202
    dq, dk, dv, _ = _backward(g, q, k, v, bias, is_causal, scale)
    return dq, dk, dv


@pytest.fixture(scope="module")
def cpu_kernels() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_scaled_dot_product_flash_attention", _flash),
                     ("_scaled_dot_product_flash_attention_backward", _flash_bwd),
                     ("_scaled_dot_product_efficient_attention", _efficient),
                     ("_scaled_dot_product_efficient_attention_backward", _efficient_bwd),
                     ("_scaled_dot_product_cudnn_attention", _cudnn),
                     ("_scaled_dot_product_cudnn_attention_backward", _cudnn_bwd)]:
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


# -- calling each kernel as CUDA's SDPA does -------------------------------------------------------


def attend(kernel: str, q, k, v, bias=None, causal=False, scale=None, dropout=0.0):  # noqa: ANN001, ANN201
    """(output, all outputs) of one SDPA kernel."""
    if kernel == "flash":
        outs = aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)
    elif kernel == "efficient":
        outs = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout, causal, scale=scale)
    else:
        outs = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, dropout, causal, False, scale=scale)
    return outs[0], outs


KERNELS = ["flash", "efficient", "cudnn"]
CASES = {  # name: (kv heads, bias kind, causal, scale)
    "plain": (H, None, False, None),
    "causal_scale": (H, None, True, 0.3),
    "gqa": (H // 2, None, True, None),
    "bias_full": (H, "full", False, None),
    "bias_broadcast": (H, "broadcast", True, 0.5),
}


def _inputs(hkv: int, bias: str | None, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g)
    k, v = torch.randn(B, hkv, S, D, generator=g), torch.randn(B, hkv, S, D, generator=g)
    b = None
    if bias == "full":
        b = torch.randn(B, H, S, S, generator=g)
    elif bias == "broadcast":
        b = torch.randn(1, 1, S, S, generator=g)
    return tuple(t.to(device) if t is not None else None for t in (q, k, v, b))


def _cases(kernel: str) -> list[str]:
    """Flash takes no bias; grouped-query heads reach only flash (SDPA repeats k/v for the others)."""
    return [c for c, (hkv, bias, *_) in CASES.items()
            if not (bias and kernel == "flash") and not (hkv != H and kernel != "flash")]


def _shard(mesh: sf.Mesh, q, k, v, b):  # noqa: ANN001, ANN202
    """Batch over dp, heads over tp; a full bias likewise, a broadcast one replicated."""
    qs, ks, vs = (sf.distribute(t, P("dp", "tp"), mesh=mesh).requires_grad_() for t in (q, k, v))
    bs = None if b is None else sf.distribute(b, P("dp", "tp") if b.shape[0] == B else P(), mesh=mesh)
    return qs, ks, vs, bs


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_sharded_attention_on_meta_mesh_moves_nothing(kernel: str) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    for case in _cases(kernel):
        hkv, bias, causal, scale = CASES[case]
        qs, ks, vs, bs = _shard(mesh, *_inputs(hkv, bias, "meta"))
        with sf.debug.CommCounter() as cc:
            out, outs = attend(kernel, qs, ks, vs, bs, causal, scale)
            grads = torch.autograd.grad(out.sum(), (qs, ks, vs))
        assert [r.kind for r in cc.records] == [], (kernel, case)
        assert out.spec == P("dp", "tp") and out.shape == (B, H, S, D)
        assert outs[1].spec == P("dp", "tp")  # logsumexp follows batch and heads
        for extra in outs[2:]:
            if isinstance(extra, sf.ShardedArray) and extra.dim() < 2:
                assert extra.spec == P()  # philox seed/offset, sequence offsets: replicated
        assert [g.spec for g in grads] == [P("dp", "tp")] * 3 and grads[1].shape == (B, hkv, S, D)
        assert all(isinstance(t, sf.ShardedArray) and t.device.type == "meta" for t in (out, *grads))


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_keeps_heads_sharded(kernel: str) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    qs, ks, vs, _ = _shard(mesh, *_inputs(H, None, "meta"))
    with sf.debug.CommCounter() as cc:
        out, _ = attend(kernel, qs, ks, vs, dropout=0.1)
        grads = torch.autograd.grad(out.sum(), (qs, ks, vs))
    assert cc.records == [] and out.spec == P("dp", "tp") and [g.spec for g in grads] == [P("dp", "tp")] * 3


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_values_and_grads_equal_unsharded(kernel: str, cpu_kernels: None) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    for case in _cases(kernel):
        hkv, bias, causal, scale = CASES[case]
        q, k, v, b = _inputs(hkv, bias)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        want, _ = attend(kernel, q, k, v, b, causal, scale)
        want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))
        qs, ks, vs, bs = _shard(mesh, q.detach(), k.detach(), v.detach(), b)
        with sf.debug.CommCounter() as cc:
            got, _ = attend(kernel, qs, ks, vs, bs, causal, scale)
        grads = torch.autograd.grad((got * got).sum(), (qs, ks, vs))
        assert cc.records == [], (kernel, case)
        torch.testing.assert_close(got.full_tensor(), want, msg=f"{kernel} {case}")
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g.full_tensor(), w, msg=f"{kernel} {case} grad")


@pytest.mark.parametrize("bias", [None, "broadcast"])
@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, "tp"), P("dp"), P()])
def test_efficient_backward_reads_an_output_in_any_layout(bias: str | None, spec: P, cpu_kernels: None) -> None:
    # the kernel reads ``out`` by its forward's layout, not its strides: an ``out`` laid out
    # otherwise (here (b, h, s, d) dense, as a restacked or resharded shard is) is relaid first,
    # on the batched path (no bias) and the per-device one (a bias)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v, b = _inputs(H, bias)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, b, True)[:4]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    want = aten._scaled_dot_product_efficient_attention_backward(g, q, k, v, b, out, lse, seed, offset, 0.0,
                                                                 [True, True, True, False])
    assert not out.is_contiguous()  # the test kernel lays its output out as CUDA's does
    d = {n: sf.distribute(t, spec, mesh=mesh) for n, t in dict(g=g, q=q, k=k, v=v, out=out.contiguous()).items()}
    ls = sf.distribute(lse, P(*spec[:2]), mesh=mesh)
    bs = None if b is None else sf.distribute(b, P(), mesh=mesh)
    for _ in range(2):  # a warm call (the batched path's replay) too
        got = aten._scaled_dot_product_efficient_attention_backward(
            d["g"], d["q"], d["k"], d["v"], bs, d["out"], ls, seed, offset, 0.0, [True, True, True, False])
        for x, w in zip(got[:3], want[:3]):
            torch.testing.assert_close(x.full_tensor(), w)


def test_flash_backward_reads_a_logsumexp_of_any_layout(cpu_kernels: None) -> None:
    # the kernel reads the logsumexp by a bare pointer: one whose heads are split from a
    # replicated copy (a strided slice on each device) is made dense first
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v = (t[:3] for t in _inputs(H, None)[:3])  # an uneven batch: each device's own call
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[:2]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    extra = (None, None, S, S, 0.0, True, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    want = aten._scaled_dot_product_flash_attention_backward(g, q, k, v, out, lse, *extra)
    d = [sf.distribute(t, P("dp", "tp"), mesh=mesh) for t in (g, q, k, v, out)]
    for spec in (P("dp"), P(), P(None, "tp")):
        got = aten._scaled_dot_product_flash_attention_backward(*d, sf.distribute(lse, spec, mesh=mesh), *extra)
        for x, w in zip(got, want):
            torch.testing.assert_close(x.full_tensor(), w, msg=str(spec))


def test_test_kernels_match_torch_math() -> None:
    # the test-only kernels are the math path (checked against torch's own SDPA)
    q, k, v, b = _inputs(H // 2, "broadcast")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(_forward(q, k, v, b, False, 0.5)[0], want)


@pytest.mark.parametrize("mesh_device", ["meta", "cpu"])
def test_fused_rms_norm_keeps_rows_sharded(mesh_device: str) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=mesh_device)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(B, S, D, generator=g).requires_grad_(), torch.randn(D, generator=g).requires_grad_()
    xs = sf.distribute(x.detach().to(mesh_device), P("dp", "tp"), mesh=mesh).requires_grad_()
    ws = sf.distribute(w.detach().to(mesh_device), P(), mesh=mesh).requires_grad_()
    with sf.debug.CommCounter() as cc:
        out, rstd = aten._fused_rms_norm(xs, [D], ws, 1e-6)
        gx, gw = torch.autograd.grad(out.sum(), (xs, ws))
    # nothing moves: off CUDA torch decomposes the backward, where a row-split broadcast rstd
    # meets a replicated gradient (sliced locally); the fused backward kernel is checked below
    assert cc.records == []
    assert out.spec == P("dp", "tp") and rstd.spec == P("dp", "tp")
    assert gx.spec == P("dp", "tp") and gw.spec == P(partial=("dp", "tp"))
    if mesh_device == "cpu":
        want, _ = aten._fused_rms_norm(x, [D], w, 1e-6)
        wgx, wgw = torch.autograd.grad(want.sum(), (x, w))
        torch.testing.assert_close(out.full_tensor(), want)
        torch.testing.assert_close(gx.full_tensor(), wgx)
        torch.testing.assert_close(gw.full_tensor(), wgw)


def test_fused_rms_norm_backward_kernel_on_meta_mesh_moves_nothing() -> None:
    """CUDA's backward is ``_fused_rms_norm_backward`` itself: rows stay split, the weight
    gradient is a pending sum over the row axes."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    xs = sf.distribute(torch.randn(B, S, D), P("dp", "tp"), mesh=mesh)
    ws = sf.distribute(torch.randn(D), P(), mesh=mesh)
    out, rstd = aten._fused_rms_norm(xs, [D], ws, 1e-6)
    with sf.debug.CommCounter() as cc:
        gx, gw = aten._fused_rms_norm_backward(out, xs, [D], rstd, ws, [True, True])
    assert cc.records == [] and gx.spec == P("dp", "tp") and gw.spec == P(partial=("dp", "tp"))
    assert gx.device.type == "meta" and gw.shape == (D,)


@pytest.mark.parametrize("kernel, heads, kv_heads, pieces, spec, moved", [
    ("flash", 3, 3, 2, P(None, "x"), False),  # uneven heads: 2 + 1 per device, nothing moves
    ("efficient", 3, 3, 2, P(None, "x"), False),
    ("cudnn", 3, 3, 2, P(None, "x"), False),
    ("flash", 4, 1, 4, P(None, "x"), True),  # one kv head split four ways: it is gathered, the query heads stay split
    ("flash", 8, 2, 4, P(None, "x"), True),  # kv heads fewer than pieces: heads gathered
    ("efficient", 4, 4, 2, P(None, None, "x"), True),  # sequence split: gathered
    ("cudnn", 4, 4, 2, P(None, None, None, "x"), True),  # head_dim split: gathered
])
def test_uneven_heads_and_few_kv_heads_values_equal_unsharded(kernel: str, heads: int, kv_heads: int, pieces: int,
                                                               spec: P, moved: bool, cpu_kernels: None) -> None:
    mesh = sf.Mesh((pieces,), ("x",), backend="local")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, S, D, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, S, D, generator=g, requires_grad=True) for _ in range(2))
    want, _ = attend(kernel, q, k, v, causal=True)
    want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))
    qs, ks, vs = (sf.distribute(t.detach(), spec, mesh=mesh).requires_grad_() for t in (q, k, v))
    with sf.debug.CommCounter() as cc:
        got, _ = attend(kernel, qs, ks, vs, causal=True)
        grads = torch.autograd.grad((got * got).sum(), (qs, ks, vs))
    # (multi-query: every query head reads the one kv head, gathered whole; the query heads stay split)
    assert bool(cc.records) == moved and got.spec == (P() if moved and kv_heads > 1 else spec)
    torch.testing.assert_close(got.full_tensor(), want)
    for a, w in zip(grads, want_grads):
        torch.testing.assert_close(a.full_tensor(), w)


class _KernelCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The attention kernels' calls on plain tensors (a ShardedArray op dispatches under the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if any(issubclass(t, sf.ShardedArray) for t in types):
            with self:
                return sf.ShardedArray.__torch_dispatch__(func, types, args, kwargs)
        if "_scaled_dot_product" in str(func):
            q = args[0] if "backward" not in str(func) else args[1]
            self.batches.append(("backward" if "backward" in str(func) else "forward", q.shape[0] * q.shape[1]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec, heads_inner", [(P("dp", "tp"), False), (P("dp"), False), (P("dp", "tp"), True)])
def test_attention_kernels_run_once_for_the_whole_mesh(kernel: str, spec: P, heads_inner: bool) -> None:
    # the mesh dims fold into the batch or the heads: one call forward, one backward, of B * H
    # (batch, head) problems: where the inputs are replicated over 'tp', computed once, not per device
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    q, k, v, _ = _inputs(H, None, "meta")
    # the heads of a column-split projection: 'tp' next to the heads in memory, not to the batch
    qs, ks, vs = (sf.distribute(t.transpose(1, 2).contiguous(), P("dp", None, "tp"), mesh=mesh).transpose(1, 2)
                  .requires_grad_() if heads_inner else sf.distribute(t, spec, mesh=mesh).requires_grad_()
                  for t in (q, k, v))
    batch = B * H
    out, _ = attend(kernel, qs, ks, vs, causal=True)  # cold: the dispatcher's meta run calls the kernel too
    torch.autograd.grad(out.sum(), (qs, ks, vs))
    for _ in range(2):
        calls = _KernelCalls()
        with calls:
            out, _ = attend(kernel, qs, ks, vs, causal=True)
            torch.autograd.grad(out.sum(), (qs, ks, vs))
        assert calls.batches == [("forward", batch), ("backward", batch)], (kernel, calls.batches)
        assert out.spec == spec


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("form", ["replicated_over_tp", "heads_inner", "heads_inner_gqa"])
def test_folded_attention_values_equal_unsharded(kernel: str, form: str, cpu_kernels: None) -> None:
    # the mesh dims folded into the batch, or 'tp' into the heads (a column-split projection's
    # heads, 'tp' next to them in memory; grouped-query kv heads too), on a CPU mesh
    if form == "heads_inner_gqa" and kernel != "flash":
        pytest.skip("grouped-query heads reach only flash")
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v, _ = _inputs(H // 2 if form == "heads_inner_gqa" else H, None)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want, wouts = attend(kernel, q, k, v, causal=True, scale=0.3)
    want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))

    def shard(t: torch.Tensor) -> sf.ShardedArray:
        if form == "replicated_over_tp":
            return sf.distribute(t.detach(), P("dp"), mesh=mesh).requires_grad_()
        return sf.distribute(t.detach().transpose(1, 2).contiguous(), P("dp", None, "tp"), mesh=mesh).transpose(1, 2)

    qs, ks, vs = (shard(t) for t in (q, k, v))
    if form != "replicated_over_tp":
        qs, ks, vs = (t.detach().requires_grad_() for t in (qs, ks, vs))
    for _ in range(2):
        with sf.debug.CommCounter() as cc:
            got, outs = attend(kernel, qs, ks, vs, causal=True, scale=0.3)
            grads = torch.autograd.grad((got * got).sum(), (qs, ks, vs))
        assert cc.records == []
        torch.testing.assert_close(got.full_tensor(), want)
        torch.testing.assert_close(outs[1].full_tensor().reshape(wouts[1].shape), wouts[1])  # logsumexp
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g.full_tensor(), w)


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_devices_holding_no_heads_on_meta_mesh(kernel: str) -> None:
    # one head over tp=2: a device holds no heads, and the kernel's undefined outputs (None)
    # stay None in its empty results
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    q, k, v = (sf.distribute(torch.randn(3, 1, 16, 64, dtype=torch.bfloat16, device="meta"), P("dp", "tp"), mesh=mesh)
               .requires_grad_() for _ in range(3))
    call = {"flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
            "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True),
            "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)}[kernel]
    out = call()[0]
    grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
    assert out.shape == q.shape and out.device.type == "meta"
    assert all(g.shape == q.shape for g in grads)
