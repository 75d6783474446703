"""CUDA's kernels below the SDPA ops and the other CUDA-reached kernels a census found
(``_flash_attention_forward``/``_backward``, ``_efficient_attention_forward``/``_backward``,
``_addmm_activation``, the element-wise ``_foreach`` ops): layouts and collectives on meta
meshes, values and gradients on CPU meshes through test-only CPU kernels (``torch.library``,
for this module only) against the same call unsharded.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

from test_cuda_rules import _backward, _forward, _like_meta

aten = torch.ops.aten
B, S, H, D = 4, 8, 4, 16


# -- test-only CPU kernels ((batch, seq, heads, head_dim) in and out; the math formula) -----------


def _bhsd(*ts):  # noqa: ANN001, ANN202
    return tuple(None if t is None else t.transpose(1, 2) for t in ts)


def _flash_fwd(q, k, v, cq, ck, mq, mk, dropout_p, is_causal, return_debug_mask, *, scale=None, **_):  # noqa: ANN001, ANN003, ANN202
    o, lse = _forward(*_bhsd(q, k, v), None, is_causal, scale)
    return _like_meta(aten._flash_attention_forward.default, (q, k, v, cq, ck, mq, mk, dropout_p, is_causal,
                      return_debug_mask), {"scale": scale}, {0: o.transpose(1, 2), 1: lse})


def _flash_bwd(g, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, rng, unused, *, scale=None, **_):  # noqa: ANN001, ANN003, ANN202
    dq, dk, dv, _ = _backward(*_bhsd(g, q, k, v), None, is_causal, scale)
    return _bhsd(dq, dk, dv)


def _bias(bias):  # noqa: ANN001, ANN202
    return bias


def _eff_fwd(q, k, v, bias, cq, ck, mq, mk, dropout_p, mask_type, compute_lse=False, *, scale=None, **_):  # noqa: ANN001, ANN003, ANN202
    o, lse = _forward(*_bhsd(q, k, v), bias, mask_type == 1, scale)
    meta = [aten._efficient_attention_forward.default(
        *[a.to("meta") if isinstance(a, torch.Tensor) else a for a in (q, k, v, bias, cq, ck, mq, mk, dropout_p,
                                                                         mask_type, compute_lse)], scale=scale)]
    lse_meta = meta[0][1]
    full = torch.zeros(lse_meta.shape, dtype=lse_meta.dtype)
    full[..., :lse.shape[-1]] = lse
    return (o.transpose(1, 2).contiguous(), full, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long),
            meta[0][4], meta[0][5])


def _eff_bwd(g, q, k, v, bias, out, cq, ck, mq, mk, lse, dropout_p, seed, offset, mask_type, bias_requires_grad,  # noqa: ANN001, ANN202
             *, scale=None, **_):  # noqa: ANN003
    dq, dk, dv, db = _backward(*_bhsd(g, q, k, v), bias, mask_type == 1, scale)
    db = db if bias is not None and bias_requires_grad else None  # undefined, as CUDA returns it
    return (*_bhsd(dq, dk, dv), db)


@pytest.fixture(scope="module")
def cpu_kernels() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_flash_attention_forward", _flash_fwd), ("_flash_attention_backward", _flash_bwd),
                     ("_efficient_attention_forward", _eff_fwd), ("_efficient_attention_backward", _eff_bwd)]:
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


def _attend(kernel: str, q, k, v, bias=None, causal=False, scale=None, dropout=0.0):  # noqa: ANN001, ANN202
    if kernel == "flash":
        return aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], dropout, causal, False,
                                             scale=scale)
    return aten._efficient_attention_forward(q, k, v, bias, None, None, q.shape[1], k.shape[1], dropout,
                                             1 if causal else 0, True, scale=scale)


def _inputs(hkv: int = H, heads: int = H, bias: str | None = None, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, heads, D, generator=g)
    k, v = torch.randn(B, S, hkv, D, generator=g), torch.randn(B, S, hkv, D, generator=g)
    b = {None: None, "full": lambda: torch.randn(B, heads, S, S, generator=g),
         "broadcast": lambda: torch.randn(1, 1, S, S, generator=g).expand(B, heads, S, S)}[bias]
    b = b() if b is not None else None
    return tuple(None if t is None else t.to(device) for t in (q, k, v, b))


def _shard(mesh: sf.Mesh, spec: P, q, k, v, b=None):  # noqa: ANN001, ANN202
    qs, ks, vs = (sf.distribute(t, spec, mesh=mesh).requires_grad_() for t in (q, k, v))
    bs = None if b is None else sf.distribute(b.contiguous() if b.stride(0) else b, P(), mesh=mesh)
    return qs, ks, vs, bs


HEADS = P("dp", None, "tp")  # batch over dp, heads over tp


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("hkv", [H, H // 2])
def test_heads_sharded_moves_nothing_on_meta_mesh(kernel: str, hkv: int) -> None:
    if kernel == "efficient" and hkv != H:
        pytest.skip("the efficient kernel takes as many kv heads as query heads (SDPA repeats them)")
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    qs, ks, vs, _ = _shard(mesh, HEADS, *_inputs(hkv, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as cc:
            outs = _attend(kernel, qs, ks, vs, causal=True, scale=0.3, dropout=0.1)
            grads = torch.autograd.grad(outs[0].sum(), (qs, ks, vs))
    assert [r.kind for r in cc.records if r.op != "aten.sum.default"] == [], cc.records
    assert outs[0].spec == HEADS and outs[1].spec == P("dp", "tp")  # logsumexp (batch, heads, seq)
    assert all(o.spec == P() for o in outs[2:4])  # RNG state / philox seed and offset: per call
    assert [g.spec for g in grads] == [HEADS] * 3 and grads[1].shape == (B, S, hkv, D)
    assert all(t.device.type == "meta" for t in (outs[0], *grads))


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("spec, moved", [
    (P(None, "dp"), True),  # sequence split: gathered (the kernel needs whole sequences)
    (P(None, None, None, "tp"), True),  # head_dim split: gathered
    (P(None, None, ("dp", "tp")), False),  # heads over both axes
])
def test_other_layouts_on_meta_mesh(kernel: str, spec: P, moved: bool) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    qs, ks, vs, _ = _shard(mesh, spec, *_inputs(device="meta"))
    with sf.debug.CommCounter() as cc:
        outs = _attend(kernel, qs, ks, vs)
    assert bool(cc.records) == moved and {r.kind for r in cc.records} <= {"all_gather"}
    assert outs[0].spec == (spec if not moved else P()) and outs[0].shape == (B, S, H, D)


def test_gqa_more_pieces_than_kv_heads_gathers_kv_heads_on_meta_mesh() -> None:
    """Two kv heads cannot pair with query heads split four ways: heads stay whole."""
    mesh = sf.Mesh((4,), ("tp",), backend="local", device_type="meta")
    qs, ks, vs, _ = _shard(mesh, P(None, None, "tp"), *_inputs(hkv=2, device="meta"))
    outs = _attend("flash", qs, ks, vs)
    assert outs[0].spec == P() and outs[0].shape == (B, S, H, D)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("case", ["plain", "causal_scale", "gqa", "uneven_heads", "bias_full", "bias_broadcast",
                                  "seq_split", "head_dim_split"])
def test_values_and_grads_equal_unsharded(kernel: str, case: str, cpu_kernels: None) -> None:
    hkv, heads, bias, causal, scale, spec = {
        "plain": (H, H, None, False, None, HEADS),
        "causal_scale": (H, H, None, True, 0.3, HEADS),
        "gqa": (H // 2, H, None, True, None, HEADS),
        "uneven_heads": (3, 3, None, False, None, P("dp", None, "tp")),
        "bias_full": (H, H, "full", False, None, HEADS),
        "bias_broadcast": (H, H, "broadcast", True, 0.5, HEADS),
        "seq_split": (H, H, None, True, None, P("dp", "tp")),
        "head_dim_split": (H, H, None, False, None, P(None, None, None, "tp")),
    }[case]
    if kernel == "flash" and bias or kernel == "efficient" and hkv != heads:
        pytest.skip("flash takes no bias; efficient no grouped kv heads")
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v, b = _inputs(hkv, heads, bias)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = _attend(kernel, q, k, v, b, causal, scale)[0]
    want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))
    qs, ks, vs, bs = _shard(mesh, spec, q.detach(), k.detach(), v.detach(), b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        got = _attend(kernel, qs, ks, vs, bs, causal, scale)[0]
        grads = torch.autograd.grad((got * got).sum(), (qs, ks, vs))
    torch.testing.assert_close(got.full_tensor(), want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.full_tensor(), w)


def test_efficient_bias_gradient_is_a_pending_sum_where_it_broadcasts(cpu_kernels: None) -> None:
    """The bias gradient of a bias broadcast over batch and heads adds up over both."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v, _ = _inputs()
    bias = torch.randn(1, 1, S, S)
    want = torch.autograd.grad((_attend("efficient", q.requires_grad_(), k, v, bias.requires_grad_())[0] ** 2).sum(),
                               bias)[0]
    qs, ks, vs, _ = _shard(mesh, HEADS, q.detach(), k, v)
    bs = sf.distribute(bias.detach(), P(), mesh=mesh).requires_grad_()
    out = _attend("efficient", qs, ks, vs, bs)[0]
    (gb,) = torch.autograd.grad((out ** 2).sum(), bs)
    torch.testing.assert_close(gb.full_tensor(), want)


# -- _addmm_activation ---------------------------------------------------------------------------


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("x_spec, w_spec, b_spec, out_spec", [
    (P("dp"), P(None, "tp"), P("tp"), P("dp", "tp")),  # rows and columns split: nothing moves
    (P(None, "tp"), P("tp"), P(), P()),  # contraction split: no pending sum may pass the activation
])
def test_addmm_activation(gelu: bool, x_spec: P, w_spec: P, b_spec: P, out_spec: P) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(8, 16, generator=g), torch.randn(16, 12, generator=g), torch.randn(12, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as cc:
            y = aten._addmm_activation(sf.distribute(b, b_spec, mesh=mesh), sf.distribute(x, x_spec, mesh=mesh),
                                       sf.distribute(w, w_spec, mesh=mesh), use_gelu=gelu)
    assert y.spec == out_spec and bool(cc.records) == (out_spec == P())
    torch.testing.assert_close(y.full_tensor(), aten._addmm_activation(b, x, w, use_gelu=gelu))


# -- _foreach ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_foreach_ops_keep_each_array_layout(device: str) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=device)
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(8, 6, generator=g), torch.randn(5, generator=g), torch.randn(3, 4, generator=g).abs() + 0.1]
    specs = [P("dp", "tp"), P(("dp", "tp")), P(None, "tp")]  # one uneven
    xs = [sf.distribute(t, s, mesh=mesh) for t, s in zip(ts, specs)]
    scalars = torch.tensor([0.5, 2.0, -1.0])
    calls = [
        lambda a: torch._foreach_add(a, a, alpha=0.5),
        lambda a: torch._foreach_mul(a, 3.0),
        lambda a: torch._foreach_mul(a, torch.tensor(2.0)),
        lambda a: torch._foreach_lerp(a, [t * 2 for t in a], 0.25),
        lambda a: torch._foreach_addcdiv(a, a, [t.abs() + 1 for t in a], 0.1),
        lambda a: torch._foreach_addcmul(a, a, a, scalars),
        lambda a: torch._foreach_sqrt(torch._foreach_abs(a)),
        lambda a: torch._foreach_maximum(a, 0.0),
        lambda a: torch._foreach_pow(a, 2),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        for fn in calls:
            with sf.debug.CommCounter() as cc:
                got = fn(xs)
            assert cc.records == [] and [y.spec for y in got] == specs
            assert all(y.device.type == device for y in got)
            if device == "cpu":
                for y, w in zip(got, fn(ts)):
                    torch.testing.assert_close(y.full_tensor(), w)


def test_foreach_resolves_pending_sums_first() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    pending = sf.distribute(a, P(None, "x"), mesh=mesh) @ sf.distribute(b, P("x"), mesh=mesh)
    assert pending.spec == P(partial="x")
    (y,) = torch._foreach_exp([pending])
    assert y.spec == P()
    torch.testing.assert_close(y.full_tensor(), (a @ b).exp())


# -- the census ----------------------------------------------------------------------------------


def test_census_of_the_cuda_kernels_finds_no_fallback_on_a_meta_mesh() -> None:
    """tools/fallback_census.py's direct kernel calls, SDPA variants and sf.optim kernels on a
    dp x tp meta mesh: no op falls back, no run raises."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import fallback_census

    rows = fallback_census.run_census("meta", [torch.float32], ["cuda"], ["sdpa", "kernels", "optim"], ["dptp"])
    assert [r[0] for r in rows] == ["sdpa/dptp", "kernels/dptp", "optim/dptp"]
    assert all(r[3] == [] for r in rows), fallback_census.report(rows)


# -- F.scaled_dot_product_attention where torch takes its math path --------------------------------


@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, "tp"), P("dp"), P(("dp", "tp"))])
@pytest.mark.parametrize("case", ["plain", "causal", "float_mask", "bool_mask", "scale", "gqa"])
def test_sdpa_on_the_math_path_keeps_heads_sharded_and_equals_torch(spec: P, case: str) -> None:
    """torch's math path folds (batch, heads) into one dim; shardfn runs the same formula with
    batched products instead, so head-sharded attention moves nothing, with torch's values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    g = torch.Generator().manual_seed(1)
    b, h, s, d = 4, 6, 5, 8  # 6 heads: uneven over the 4 devices of P(("dp", "tp"))
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    if case == "gqa":
        k, v = k[:, :2], v[:, :2]
    kw: dict = {"causal": {"is_causal": True}, "scale": {"scale": 0.3}, "gqa": {"enable_gqa": True},
                "float_mask": {"attn_mask": torch.randn(b, 1, s, s, generator=g, dtype=torch.float64)},
                "bool_mask": {"attn_mask": torch.rand(s, s, generator=g) > 0.3}}.get(case, {})
    kv_spec = P(spec[0]) if case == "gqa" else spec
    qs = sf.distribute(q, spec, mesh=mesh).requires_grad_()
    ks, vs = (sf.distribute(t, kv_spec, mesh=mesh).requires_grad_() for t in (k, v))
    skw = {n: sf.distribute(m, P(), mesh=mesh) if isinstance(m, torch.Tensor) else m for n, m in kw.items()}
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*plain, **kw)
        with sf.debug.CommCounter() as cc:
            out = F.scaled_dot_product_attention(qs, ks, vs, **skw)
        grads = torch.autograd.grad((out ** 2).sum(), (qs, ks, vs))
    wgrads = torch.autograd.grad((want ** 2).sum(), plain)
    if case != "gqa" and spec == P("dp", "tp"):
        assert cc.records == [] and out.spec == spec
    torch.testing.assert_close(out.full_tensor(), want)
    for got, w in zip(grads, wgrads):
        torch.testing.assert_close(got.full_tensor(), w)


def test_sdpa_on_a_meta_mesh_keeps_heads_sharded() -> None:
    # torch runs its math path for meta tensors: batch over dp, heads over tp move nothing
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    bhsd = P("dp", "tp")  # F.scaled_dot_product_attention takes (batch, heads, seq, head_dim)
    qs, ks, vs = (sf.distribute(torch.randn(B, H, S, D, device="meta", dtype=torch.bfloat16), bhsd, mesh=mesh)
                  .requires_grad_() for _ in range(3))
    with sf.debug.CommCounter() as cc:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.autograd.grad(out.float().pow(2).sum(), (qs, ks, vs))
    assert cc.records == []
    assert out.spec == bhsd and out.device.type == "meta"


# -- multi-query attention: one kv head serves every query head ----------------------------------


@pytest.mark.parametrize("q_spec", [P("dp", "tp"), P(None, ("dp", "tp")), P(None, "tp")])
def test_multi_query_keeps_query_heads_split_and_kv_whole(q_spec: P) -> None:
    """Megatron's multi-query plan: the query heads split (over any axes), the one key/value head
    whole (its projection replicated), as F.scaled_dot_product_attention runs it on CPU (the fused
    CPU kernel, grouped-query): no collective in the forward, nor in the backward, whose key and
    value gradients are sums over the heads' devices left pending (each device's heads read the
    kv head); values and gradients equal torch's. (Before, the query heads were gathered: the
    rule paired kv heads with query heads only when the pieces divided the kv heads.)"""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, 1, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    qs = sf.distribute(q, q_spec, mesh=mesh).requires_grad_()
    kv_spec = P(q_spec[0])
    ks, vs = (sf.distribute(t, kv_spec, mesh=mesh).requires_grad_() for t in (k, v))
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True)
    wgrads = torch.autograd.grad((want ** 2).sum(), plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as cc:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            grads = torch.autograd.grad((out ** 2).sum(), (qs, ks, vs))
    assert [r.kind for r in cc.records if r.op != "aten.sum.default"] == [], cc.records
    assert out.spec == q_spec and grads[0].spec == q_spec
    heads_axes = q_spec[1] if isinstance(q_spec[1], tuple) else (q_spec[1],)
    assert all({a for a, _ in gr._layout.partial} == set(heads_axes) for gr in grads[1:]), grads[1]._layout
    torch.testing.assert_close(out.full_tensor(), want)
    for got, w in zip(grads, wgrads):
        torch.testing.assert_close(got.full_tensor(), w)


def test_multi_query_flash_kernel_on_meta_mesh() -> None:
    """CUDA's flash kernel with one kv head: query heads over tp, kv whole, nothing moves."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    q, k, v, _ = _inputs(hkv=1, device="meta")
    qs = sf.distribute(q, HEADS, mesh=mesh).requires_grad_()
    ks, vs = (sf.distribute(t, P("dp"), mesh=mesh).requires_grad_() for t in (k, v))
    with sf.debug.CommCounter() as cc:
        outs = _attend("flash", qs, ks, vs, causal=True)
        grads = torch.autograd.grad(outs[0].sum(), (qs, ks, vs))
    assert [r.kind for r in cc.records if r.op != "aten.sum.default"] == [], cc.records
    assert outs[0].spec == HEADS and grads[0].spec == HEADS
    assert all(g._layout.partial for g in grads[1:]) and grads[1].shape == (B, S, 1, D)


def test_multi_query_flash_kernel_values_and_grads(cpu_kernels: None) -> None:
    """The same through the flash kernel (its test-only CPU formula): values and gradients equal
    the unsharded call, nothing gathered."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    q, k, v, _ = _inputs(hkv=1)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _attend("flash", *plain, causal=True, scale=0.3)[0]
    wgrads = torch.autograd.grad((want * want).sum(), plain)
    qs = sf.distribute(q, HEADS, mesh=mesh).requires_grad_()
    ks, vs = (sf.distribute(t, P("dp"), mesh=mesh).requires_grad_() for t in (k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as cc:
            got = _attend("flash", qs, ks, vs, causal=True, scale=0.3)[0]
            grads = torch.autograd.grad((got * got).sum(), (qs, ks, vs))
    assert "all_gather" not in cc.counts, cc
    torch.testing.assert_close(got.full_tensor(), want)
    for g, w in zip(grads, wgrads):
        torch.testing.assert_close(g.full_tensor(), w)
