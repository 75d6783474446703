"""Adversarial checks of the kernels torch reaches on CUDA, beyond ``test_cuda_rules``,
``test_attention_kernels`` and ``test_cuda_meta_suite``: low-precision matrix products,
grouped products' backward, the functional fused optimizers, ``_foreach_max``, torch's
attention math path called directly. Layouts and collectives on meta meshes (no
``FallbackWarning``, every shard on the mesh's device); values and gradients on CPU meshes
against the same call unsharded (CPU kernels where torch has them).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

from _no_fallback import NoFallback

aten = torch.ops.aten


def _on_meta(*arrays: sf.ShardedArray) -> bool:
    return all(a.device.type == "meta" and {s.device.type for s in a.local_shards()} == {"meta"} for a in arrays)


# -- float8 / int8 / int4 matrix products ---------------------------------------------------------

SCALED_LAYOUTS = [  # (self, mat2, output, moved)
    (P("dp"), P(), P("dp")),
    (P(), P(None, "tp"), P(None, "tp")),
    (P("dp"), P(None, "tp"), P("dp", "tp")),
    (P(("dp", "tp")), P(), P(("dp", "tp"))),
    (P(None, "tp"), P("tp"), None),  # the contraction split: pending only with tensor-wise scales
]


@pytest.mark.parametrize("scales", ["tensorwise", "rowwise", "bias"])
@pytest.mark.parametrize("a_spec, b_spec, out_spec", SCALED_LAYOUTS, ids=str)
def test_scaled_mm_shards_rows_and_columns_and_equals_torch(scales: str, a_spec: P, b_spec: P, out_spec: P) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    if scales == "rowwise":
        sa, sb = torch.rand(32, 1, generator=g) + 0.5, torch.rand(1, 64, generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    kw = {"bias": torch.randn(64, generator=g).to(torch.bfloat16)} if scales == "bias" else {}
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, **kw)
    if out_spec is None:
        out_spec = P(partial="tp") if scales == "tensorwise" else P()
    for device in ("cpu", "meta"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        args = [sf.distribute(t.to(device), s, mesh=mesh) for t, s in ((a, a_spec), (b, b_spec), (sa, P()), (sb, P()))]
        skw = {k: sf.distribute(v.to(device), P(), mesh=mesh) for k, v in kw.items()}
        with NoFallback(), sf.debug.CommCounter() as cc:
            got = torch._scaled_mm(*args, out_dtype=torch.bfloat16, **skw)
        assert got.spec == out_spec and got.dtype == torch.bfloat16 and got.shape == (32, 64)
        assert bool(cc.records) == (out_spec == P())  # only the kept-whole contraction gathers
        if device == "cpu":
            torch.testing.assert_close(got.full_tensor().float(), want.float(), rtol=2e-2, atol=1e-1)
        else:
            assert _on_meta(got)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_scaled_mm_keeps_cuda_sizes_on_every_device(device: str) -> None:
    """48 columns over two devices are 24 each, not a multiple of 16 as CUDA's kernel needs (the
    meta kernel raised for the shards): the columns are gathered rather than split."""
    mesh = sf.Mesh((2,), ("tp",), device_type=device)
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    b = torch.randn(48, 64).to(torch.float8_e4m3fn).t()
    s = torch.tensor(1.0)
    with NoFallback():
        got = torch._scaled_mm(*(sf.distribute(t.to(device), sp, mesh=mesh) for t, sp in ((a, P()), (b, P(None, "tp")),
                                                                                           (s, P()), (s, P()))),
                               out_dtype=torch.bfloat16)
    assert got.spec == P() and got.shape == (32, 48)
    if device == "cpu":
        torch.testing.assert_close(got.full_tensor().float(), torch._scaled_mm(a, b, s, s, out_dtype=torch.bfloat16).float())


def test_scaled_mm_local_calls_get_a_column_major_mat2() -> None:
    """cuBLASLt takes ``self`` row-major and ``mat2`` column-major only: shards of such operands
    reach each device's call in those layouts, whatever the shards' storage."""
    seen = []

    def spy(self, mat2, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((self.stride(-1), mat2.stride(0)))
        return torch.zeros(self.shape[0], mat2.shape[1], dtype=kwargs.get("out_dtype") or torch.bfloat16)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_mm", spy, "CPU")
    try:
        mesh = sf.Mesh((2,), ("tp",))
        a = sf.distribute(torch.randn(16, 32).to(torch.float8_e4m3fn), P(), mesh=mesh)
        b = sf.distribute(torch.randn(32, 32).to(torch.float8_e4m3fn).t(), P(None, "tp"), mesh=mesh)
        assert b.stride() == (1, 32)
        s = sf.distribute(torch.tensor(1.0), P(), mesh=mesh)
        torch._scaled_mm(a, b, s, s, out_dtype=torch.bfloat16)
    finally:
        lib._destroy()
    assert seen and all(st == (1, 1) for st in seen)


@pytest.mark.parametrize("a_spec, b_spec, out_spec", [
    (P("dp"), P(), P("dp")), (P(), P(None, "tp"), P(None, "tp")), (P(None, "tp"), P("tp"), P(partial="tp")),
    (P(("dp", "tp")), P(), P("dp")),  # 48 rows over 4 devices is 12 each: CUDA needs more than 16
])
def test_int_mm_equals_torch_and_keeps_cuda_sizes(a_spec: P, b_spec: P, out_spec: P) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-5, 5, (48, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-5, 5, (64, 32), dtype=torch.int8, generator=g)
    for device in ("cpu", "meta"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        with NoFallback():
            got = torch._int_mm(sf.distribute(a.to(device), a_spec, mesh=mesh), sf.distribute(b.to(device), b_spec, mesh=mesh))
        assert got.spec == out_spec and got.dtype == torch.int32
        for s in got.local_shards():
            assert s.shape[0] == 0 or s.shape[0] > 16 or out_spec == P(partial="tp")
        if device == "cpu":
            assert torch.equal(got.full_tensor(), torch._int_mm(a, b))


@pytest.mark.parametrize("x_spec, w_spec, s_spec, out_spec", [
    (P("dp"), P(), P(), P("dp")), (P(), P("tp"), P("tp"), P(None, "tp")), (P(), P("tp"), P(), P(None, "tp")),
    (P(None, "tp"), P(None, "tp"), P(), P(partial="tp")), (P("dp"), P("tp"), P(), P("dp", "tp")),
], ids=str)
def test_weight_int8pack_mm_equals_torch(x_spec: P, w_spec: P, s_spec: P, out_spec: P) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, dtype=torch.bfloat16, generator=g)
    w = torch.randint(-5, 5, (32, 64), dtype=torch.int8, generator=g)
    s = torch.rand(32, dtype=torch.bfloat16, generator=g)
    for device in ("cpu", "meta"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        with NoFallback(), sf.debug.CommCounter() as cc:
            got = aten._weight_int8pack_mm(*(sf.distribute(t.to(device), sp, mesh=mesh)
                                             for t, sp in ((x, x_spec), (w, w_spec), (s, s_spec))))
        assert cc.records == [] and got.spec == out_spec
        if device == "cpu":
            torch.testing.assert_close(got.full_tensor().float(), aten._weight_int8pack_mm(x, w, s).float(),
                                       rtol=2e-2, atol=2e-1)


def test_weight_int4pack_mm_on_a_meta_mesh_keeps_rows_split() -> None:
    """torch's meta kernel reads ``fake_device`` (an AttributeError on a plain meta tensor): the
    rule computes the output's metadata as CUDA's kernel gives it."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type="meta")
    x = sf.distribute(torch.randn(16, 64, dtype=torch.bfloat16, device="meta"), P("dp"), mesh=mesh)
    w = sf.distribute(torch.empty(4, 1, 32, 4, dtype=torch.int32, device="meta"), P(), mesh=mesh)
    sz = sf.distribute(torch.randn(2, 32, 2, dtype=torch.bfloat16, device="meta"), P(), mesh=mesh)
    with NoFallback(), sf.debug.CommCounter() as cc:
        out = aten._weight_int4pack_mm(x, w, 32, sz)
    assert cc.records == [] and out.spec == P("dp") and out.shape == (16, 32) and out.dtype == torch.bfloat16
    assert _on_meta(out)


# -- _grouped_mm: the backward of two grouped 2-D operands -----------------------------------------


@pytest.mark.parametrize("a_spec, b_spec, out_spec", [
    (P(), P(), P()), (P("dp"), P(), P(None, "dp")), (P(), P(None, "tp"), P(None, None, "tp")),
    (P("dp"), P(None, "tp"), P(None, "dp", "tp")),
], ids=str)
def test_grouped_mm_2d_by_2d_backward_moves_nothing_and_equals_torch(a_spec: P, b_spec: P, out_spec: P) -> None:
    """The input gradient of (m, k) x (k, n) grouped over k is a (groups, m, n) x (n, k) call
    grouped over k's columns, which had no rule (replicated, a FallbackWarning)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 24, generator=g), torch.randn(24, 32, generator=g)
    offs = torch.tensor([5, 12, 24], dtype=torch.int32)
    pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = torch._grouped_mm(pa, pb, offs)
    wgrads = torch.autograd.grad((want ** 2).sum(), (pa, pb))
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    sa, sb = sf.distribute(a, a_spec, mesh=mesh).requires_grad_(), sf.distribute(b, b_spec, mesh=mesh).requires_grad_()
    with NoFallback(), sf.debug.CommCounter() as cc:
        got = torch._grouped_mm(sa, sb, sf.distribute(offs, P(), mesh=mesh))
        grads = torch.autograd.grad((got ** 2).sum(), (sa, sb))
    assert got.spec == out_spec and [r for r in cc.records if "grouped" in str(r.op)] == []
    torch.testing.assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-4)
    meta = sf.Mesh((2, 2), ("dp", "tp"), device_type="meta")
    ma, mb = (sf.distribute(t.to("meta", torch.bfloat16), s, mesh=meta).requires_grad_()
              for t, s in ((a, a_spec), (b, b_spec)))
    with NoFallback():
        mo = torch._grouped_mm(ma, mb, sf.distribute(offs.to("meta"), P(), mesh=meta))
        mgrads = torch.autograd.grad((mo * mo).sum(), (ma, mb))  # (an expanded gradient: torch's meta kernel refuses it)
    assert [m.shape for m in mgrads] == [(16, 24), (24, 32)] and _on_meta(*mgrads)
    for gr, w in zip(grads, wgrads):
        torch.testing.assert_close(gr.full_tensor(), w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("g_spec, w_spec, out_spec", [
    (P(None, "dp"), P(), P("dp")), (P(None, None, "tp"), P("tp"), P(partial="tp")), (P("dp"), P(), P()),
], ids=str)
def test_grouped_mm_3d_by_2d_grouped_columns(g_spec: P, w_spec: P, out_spec: P) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 16, 24, generator=g), torch.randn(24, 32, generator=g)
    offs = torch.tensor([8, 20, 32], dtype=torch.int32)
    for device, dtype in (("cpu", torch.float32), ("meta", torch.bfloat16)):  # CUDA's kernel takes bfloat16
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        with NoFallback():
            got = torch._grouped_mm(sf.distribute(x.to(device, dtype), g_spec, mesh=mesh),
                                    sf.distribute(w.to(device, dtype), w_spec, mesh=mesh),
                                    sf.distribute(offs.to(device), P(), mesh=mesh))
        assert got.spec == out_spec and got.shape == (16, 32)
        if device == "cpu":
            torch.testing.assert_close(got.full_tensor(), torch._grouped_mm(x, w, offs), rtol=1e-4, atol=1e-4)


# -- the functional fused optimizer kernels (functionalised torch.optim fused=True) ----------------

PARAM_SHAPES = [(4, 6), (5,), (3, 2)]
PARAM_SPECS = [P("dp", "tp"), P("tp"), P()]


def _pending(t: torch.Tensor, mesh: sf.Mesh) -> sf.ShardedArray:
    """``t`` as a pending sum over 'dp' (each device holds half)."""
    return sf.ShardedArray.from_local([t / 2] * mesh.size, P(partial="dp"), mesh=mesh)


def _optimizer_call(op: str, overload: str, device: str) -> tuple:
    """(torch's op, plain args, kwargs, arrays-args builder) for one fused optimizer call."""
    g = torch.Generator().manual_seed(0)
    ps, gs = ([torch.randn(s, generator=g) for s in PARAM_SHAPES] for _ in range(2))
    bufs = [[torch.rand(s, generator=g) + 0.1 for s in PARAM_SHAPES] for _ in range(3)]
    steps = [torch.tensor(3.0) for _ in PARAM_SHAPES]
    lr = torch.tensor(0.01) if overload == "tensor_lr" else 0.01
    if op in ("_fused_adam", "_fused_adamw"):
        args = (ps, gs, bufs[0], bufs[1], bufs[2], steps)
        kw = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=True, maximize=False)
    elif op == "_fused_sgd":
        args = (ps, gs, bufs[0])
        kw = dict(weight_decay=0.1, momentum=0.9, lr=lr, dampening=0.0, nesterov=True, maximize=False, is_first_step=False)
    else:
        args = (ps, gs, bufs[0], steps)
        kw = dict(lr=lr, lr_decay=0.01, weight_decay=0.1, eps=1e-10, maximize=True)

    def sharded(mesh: sf.Mesh) -> tuple:
        out = []
        for i, lst in enumerate(args):
            if lst is steps:
                out.append([sf.distribute(t.to(device), P(), mesh=mesh) for t in lst])
            elif i == 1:  # gradients: batch-sharded, replicated, pending
                out.append([sf.distribute(gs[0].to(device), P("dp"), mesh=mesh), sf.distribute(gs[1].to(device), P(), mesh=mesh),
                            _pending(gs[2].to(device), mesh)])
            else:  # parameters as laid out; the states of the first replicated
                out.append([sf.distribute(t.to(device), s if (i == 0 or j) else P(), mesh=mesh)
                            for j, (t, s) in enumerate(zip(lst, PARAM_SPECS))])
        skw = {k: sf.distribute(v.to(device), P(), mesh=mesh) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        return tuple(out), skw

    return getattr(getattr(aten, op), overload), args, kw, sharded


@pytest.mark.parametrize("overload", ["default", "tensor_lr"])
@pytest.mark.parametrize("op", ["_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad"])
def test_functional_fused_optimizers_keep_parameter_layouts_and_equal_torch(op: str, overload: str) -> None:
    """They ran replicated (a FallbackWarning) and handed back their lists of lists as plain tensors."""
    for device in ("cpu", "meta"):
        func, args, kw, sharded = _optimizer_call(op, overload, device)
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        sargs, skw = sharded(mesh)
        with NoFallback(), sf.debug.CommCounter() as cc:
            got = func(*sargs, **skw)
        assert {r.kind for r in cc.records} <= {"all_reduce", "reduce_scatter"}  # the pending gradient only
        want = func(*args, **kw)  # (torch has no meta kernel for most of them)
        assert len(got) == len(want)
        for gl, wl in zip(got, want):
            assert len(gl) == len(wl)
            for j, (x, w) in enumerate(zip(gl, wl)):
                assert isinstance(x, sf.ShardedArray) and x.shape == w.shape and x.dtype == w.dtype
                assert x.spec == (PARAM_SPECS[j] if w.dim() else P()) and x.device.type == device
                if device == "cpu":
                    torch.testing.assert_close(x.full_tensor(), w)
                else:
                    assert _on_meta(x)


@pytest.fixture(scope="module")
def list_and_tensor_op() -> Iterator[object]:
    """A test-only op with no rule returning (Tensor[], Tensor): each input doubled, and their sum."""
    lib = torch.library.Library("meta30_test", "DEF")
    lib.define("pair(Tensor[] xs) -> (Tensor[], Tensor)")

    def pair(xs):  # noqa: ANN001, ANN202
        return [x * 2 for x in xs], sum(x.sum() for x in xs)

    lib.impl("pair", pair, "CPU")
    lib.impl("pair", lambda xs: ([torch.empty_like(x) for x in xs], xs[0].new_empty(())), "Meta")
    yield torch.ops.meta30_test.pair.default
    lib._destroy()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_fallback_wraps_every_tensor_of_list_outputs(device: str, list_and_tensor_op: object) -> None:
    """An op without a rule returning a list among its outputs (``_amp_foreach_non_finite_check_and_unscale``
    had none) gave that list's tensors back plain (off the mesh); each is a replicated array on
    the mesh's device now."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
    ts = [torch.randn(4, 6), torch.randn(3)]
    xs = [sf.distribute(t.to(device), P("dp", "tp")[:t.dim()], mesh=mesh) for t in ts]
    with warnings.catch_warnings():  # (given once per op: the first device type's call warns)
        warnings.simplefilter("ignore", sf.FallbackWarning)
        outs, total = list_and_tensor_op(xs)
    assert all(isinstance(o, sf.ShardedArray) and o.spec == P() for o in (*outs, total))
    if device == "cpu":
        for o, t in zip(outs, ts):
            torch.testing.assert_close(o.full_tensor(), t * 2)
        torch.testing.assert_close(total.full_tensor(), ts[0].sum() + ts[1].sum())
    else:
        assert _on_meta(*outs, total)


# -- _foreach_max (clip_grad_norm_'s inf-norm and foreach paths call it) --------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_foreach_max_is_replicated_and_equals_torch(device: str) -> None:
    """It ran replicated (a FallbackWarning). Layouts: split both ways, over both axes with an
    empty shard (2 entries over 4 devices), bfloat16 over one axis, a pending sum."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4, 6, generator=g) - 5, torch.randn(2, generator=g), torch.randn(3, generator=g).to(torch.bfloat16),
          torch.randn(1, generator=g)]
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
    xs = [sf.distribute(ts[0].to(device), P("dp", "tp"), mesh=mesh), sf.distribute(ts[1].to(device), P(("dp", "tp")), mesh=mesh),
          sf.distribute(ts[2].to(device), P("tp"), mesh=mesh),
          sf.ShardedArray.from_local([ts[3].to(device) / 4] * 4, P(partial=("dp", "tp")), mesh=mesh)]
    with NoFallback():
        out = torch._foreach_max(xs)
    assert [(o.spec, o.shape, o.dtype) for o in out] == [(P(), (), t.dtype) for t in ts]
    if device == "cpu":
        for o, w in zip(out, torch._foreach_max(ts)):
            torch.testing.assert_close(o.full_tensor(), w)
    else:
        assert _on_meta(*out)


# -- torch's attention math path called directly ---------------------------------------------------

MATH_CASES = {
    "plain": {}, "causal": {"is_causal": True}, "scale_neg": {"scale": -0.3}, "gqa": {"enable_gqa": True},
    "bool_mask": {"attn_mask": "bool"},  # added (True as 1), as the math op does, unlike F.scaled_dot_product_attention
    "float_mask": {"attn_mask": "float"},
}


@pytest.mark.parametrize("case", list(MATH_CASES))
@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, "tp"), P(None, ("dp", "tp")), P("dp")], ids=str)
def test_attention_math_op_keeps_heads_sharded_and_equals_torch(spec: P, case: str) -> None:
    """``aten._scaled_dot_product_attention_math``'s composite folds (batch, heads) into one dim:
    heads split over a second axis were gathered, the outputs replicated."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 6, 5, 8  # 6 heads: uneven over the 4 devices of P(None, ("dp", "tp"))
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    hkv = 2 if case == "gqa" else h
    k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    kw = dict(MATH_CASES[case])
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(s, s, generator=g) > 0.4
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(b, 1, s, s, generator=g, dtype=torch.float64)
    kv_spec = P(*spec[:1]) if case == "gqa" else spec
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    want = aten._scaled_dot_product_attention_math(*plain, **kw)
    wgrads = torch.autograd.grad((want[0] ** 2).sum() + want[1].sum(), plain)
    for device in ("cpu", "meta"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        qs = sf.distribute(q.to(device), spec, mesh=mesh).requires_grad_()
        ks, vs = (sf.distribute(t.to(device), kv_spec, mesh=mesh).requires_grad_() for t in (k, v))
        skw = {n: sf.distribute(t.to(device), P(), mesh=mesh) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
        with NoFallback(), sf.debug.CommCounter() as cc:
            out, attn = aten._scaled_dot_product_attention_math(qs, ks, vs, **skw)
            grads = torch.autograd.grad((out ** 2).sum() + attn.sum(), (qs, ks, vs))
        assert out.spec == spec and attn.spec == spec
        if case != "gqa" or spec in (P("dp"), P(None, "tp")):
            assert cc.records == []
        if device == "cpu":
            torch.testing.assert_close(out.full_tensor(), want[0])
            torch.testing.assert_close(attn.full_tensor(), want[1])
            for gr, w in zip(grads, wgrads):
                torch.testing.assert_close(gr.full_tensor(), w)
        else:
            assert _on_meta(out, attn, *grads)


def test_attention_math_op_with_dropout_keeps_heads_sharded_on_a_meta_mesh() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type="meta")
    qs, ks, vs = (sf.distribute(torch.randn(2, 4, 8, 16, device="meta", dtype=torch.bfloat16), P("dp", "tp"), mesh=mesh)
                  .requires_grad_() for _ in range(3))
    with NoFallback(), sf.debug.CommCounter() as cc:
        out, attn = aten._scaled_dot_product_attention_math(qs, ks, vs, None, 0.2, True)
        torch.autograd.grad(out.float().sum(), (qs, ks, vs))
    assert cc.records == [] and out.spec == attn.spec == P("dp", "tp") and attn.shape == (2, 4, 8, 8)


# -- GradScaler's functional kernels ----------------------------------------------------------------


@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_amp_unscale_and_update_scale_keep_layouts_and_equal_torch(device: str, nonfinite: bool) -> None:
    """Both ran replicated (FallbackWarnings); the unscaled gradients keep their layouts, the
    inf check spans every shard (an inf on one device sets found_inf everywhere)."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4, 6, generator=g), torch.randn(3, generator=g).half(), torch.randn(())]
    if nonfinite:
        ts[0][3, 5] = float("inf")  # on the last device only
    found, inv = torch.zeros(1), torch.tensor([0.25])
    scale, tracker = torch.tensor([2.0 ** 16]), torch.tensor([3], dtype=torch.int32)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
    specs = [P("dp", "tp"), P(("dp", "tp")), P()]
    xs = [sf.distribute(t.to(device), s, mesh=mesh) for t, s in zip(ts, specs)]
    with NoFallback():
        outs, f = aten._amp_foreach_non_finite_check_and_unscale(
            xs, sf.distribute(found.to(device), P(), mesh=mesh), sf.distribute(inv.to(device), P(), mesh=mesh))
        s, gt = aten._amp_update_scale(sf.distribute(scale.to(device), P(), mesh=mesh),
                                       sf.distribute(tracker.to(device), P(), mesh=mesh), f, 2.0, 0.5, 2000)
    assert [o.spec for o in outs] == specs and [o.dtype for o in outs] == [t.dtype for t in ts]
    assert (f.spec, s.spec, gt.spec) == (P(), P(), P()) and (f.shape, s.shape, gt.dtype) == ((1,), (1,), torch.int32)
    if device == "cpu":
        wouts, wf = aten._amp_foreach_non_finite_check_and_unscale(ts, found, inv)
        ws, wg = aten._amp_update_scale(scale, tracker, wf, 2.0, 0.5, 2000)
        assert wf.item() == float(nonfinite)
        for o, w in zip(outs, wouts):
            torch.testing.assert_close(o.full_tensor(), w)
        assert torch.equal(f.full_tensor(), wf) and torch.equal(s.full_tensor(), ws) and torch.equal(gt.full_tensor(), wg)
    else:
        assert _on_meta(*outs, f, s, gt)


def test_reshape_below_autograd_localises_its_shape() -> None:
    """A handler running on arrays inside dispatch sees ``aten.reshape`` itself (its composite
    runs above): the view rule named its shape argument ``size`` and raised ValueError."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh)
    one = sf.distribute(torch.tensor([0.25]), P(), mesh=mesh)
    with torch._C._AutoDispatchBelowAutograd():
        assert one.reshape(()).shape == ()
        for shape in ((24,), (2, 12), (2, 2, 6)):
            assert torch.equal(x.reshape(shape).full_tensor(), t.reshape(shape))
        assert torch.equal(x.t().reshape(24).full_tensor(), t.t().reshape(24))


@pytest.mark.parametrize("ord_", [2, 3, 1.5])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_foreach_powsum_is_replicated_and_equals_torch(device: str, ord_: float) -> None:
    """It ran replicated (a FallbackWarning); the sums of |x|^ord are the p-norms' parts."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4, 6, generator=g), torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(2, generator=g)]
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
    xs = [sf.distribute(ts[0].to(device), P("dp", "tp"), mesh=mesh), sf.distribute(ts[1].to(device), P(("dp", "tp")), mesh=mesh),
          ts[2].to(device)]  # a plain tensor among them stays plain
    with NoFallback():
        out = aten._foreach_powsum(xs, ord_)
    assert [getattr(o, "spec", None) for o in out] == [P(), P(), None] and [o.dtype for o in out] == [t.dtype for t in ts]
    if device == "cpu":
        for o, w in zip(out, aten._foreach_powsum(ts, ord_)):
            torch.testing.assert_close(o.full_tensor() if isinstance(o, sf.ShardedArray) else o, w, rtol=1e-2, atol=1e-2)
    else:
        assert all(o.device.type == "meta" for o in out)


# -- batch normalisation: native_batch_norm (CPU) and cudnn_batch_norm (CUDA) -----------------------

BN_LAYOUTS = [  # (input, training: output layout and collectives, evaluation: output layout)
    (P(None, "tp"), (P(None, "tp"), False), P(None, "tp")),  # channels split: local both ways
    (P("dp"), (P("dp"), True), P("dp")),  # batch split: training's statistics all-reduced (rules/sync_batch_norm)
    (P("dp", "tp"), (P("dp", "tp"), True), P("dp", "tp")),
]


@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (4, 6), (4, 6, 7)], ids=str)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("x_spec, train_out, eval_out", BN_LAYOUTS, ids=str)
def test_batch_norm_splits_channels_and_equals_torch(shape: tuple, training: bool, x_spec: P, train_out: tuple,
                                                     eval_out: P) -> None:
    """It had no rule: every call ran replicated (a FallbackWarning), channel-split inputs gathered."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    w, b, rm = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3))
    rv = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    stats = (None, None) if training else (rm, rv)
    plain = [t.clone().requires_grad_() for t in (x, w, b)]
    want = F.batch_norm(plain[0], *stats, plain[1], plain[2], training=training)
    wgrads = torch.autograd.grad((want ** 2).sum(), plain)
    for device in ("cpu", "meta"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        xs = sf.distribute(x.to(device), x_spec, mesh=mesh).requires_grad_()
        ws, bs = (sf.distribute(t.to(device), P(), mesh=mesh).requires_grad_() for t in (w, b))
        sstats = tuple(None if t is None else sf.distribute(t.to(device), P(), mesh=mesh) for t in stats)
        with NoFallback(), sf.debug.CommCounter() as cc:
            out = F.batch_norm(xs, *sstats, ws, bs, training=training)
            grads = torch.autograd.grad((out ** 2).sum(), (xs, ws, bs))
        assert out.spec == (train_out[0] if training else eval_out)
        assert bool(cc.records) == (train_out[1] if training else False)
        assert set(cc.counts) <= {"all_reduce"}  # per-channel sums, never the activation gathered
        if device == "cpu":
            torch.testing.assert_close(out.full_tensor(), want)
            for gr, wg in zip(grads, wgrads):
                torch.testing.assert_close(gr.full_tensor(), wg)
        else:
            assert _on_meta(out, *grads)


@pytest.mark.parametrize("training", [True, False])
def test_cudnn_batch_norm_keeps_channels_split_on_a_meta_mesh(training: bool) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type="meta")
    x = sf.distribute(torch.randn(4, 6, 5, 5, device="meta"), P(None, "tp"), mesh=mesh)
    w, b = (sf.distribute(torch.randn(6, device="meta"), P(), mesh=mesh) for _ in range(2))
    stats = (None, None) if training else tuple(sf.distribute(f(6, device="meta"), P(), mesh=mesh)
                                                for f in (torch.zeros, torch.ones))
    with NoFallback(), sf.debug.CommCounter() as cc:
        out = aten.cudnn_batch_norm(x, w, b, *stats, training, 0.1, 1e-5)
        grads = aten.cudnn_batch_norm_backward(x, out[0], w, None, None, out[1], out[2], 1e-5, out[3]) if training else ()
    assert cc.records == [] and out[0].spec == P(None, "tp") and out[3].spec == P()  # the reserve: whole
    assert [o.shape for o in out] == [(4, 6, 5, 5), (6,) if training else (0,), (6,) if training else (0,), (0,)]
    assert [gr.spec for gr in grads] == ([P(None, "tp"), P("tp"), P("tp")] if training else [])
    assert _on_meta(*out, *grads)


def test_cudnn_batch_norm_refuses_array_running_stats_in_training() -> None:
    """Like ``native_batch_norm``, it updates its running statistics without saying so in its schema."""
    mesh = sf.Mesh((2,), ("tp",), device_type="meta")
    x = sf.distribute(torch.randn(4, 6, 5, device="meta"), P(None, "tp"), mesh=mesh)
    w, rm, rv = (sf.distribute(torch.ones(6, device="meta"), P(), mesh=mesh) for _ in range(3))
    with pytest.raises(sf.ImmutableError, match="batch_norm"):
        aten.cudnn_batch_norm(x, w, w, rm, rv, True, 0.1, 1e-5)


# -- device placement: a plain 0-d CPU tensor after a 0-d array on the mesh's device ----------------


def test_a_plain_cpu_scalar_after_an_array_scalar_on_a_meta_mesh() -> None:
    """The cache key held no device: ``x * torch.tensor(2.0)`` (the 0-d CPU tensor lifted as an
    array on the CPU) reused the entry compiled for ``x * s`` (``s`` a 0-d array on the meta
    mesh), which stacked both on the mesh's device: 'Tensor on device cpu is not on the expected
    device meta'."""
    for device in ("meta", "cpu"):
        mesh = sf.Mesh((2, 2), ("dp", "tp"), device_type=device)
        t = torch.randn(4, 6)
        x = sf.distribute(t.to(device), P("dp", "tp"), mesh=mesh)
        s = sf.distribute(torch.tensor(0.5).to(device), P(), mesh=mesh)
        assert (x * s).spec == P("dp", "tp")
        y = x * torch.tensor(2.0)
        assert y.spec == P("dp", "tp") and _on_meta(y) == (device == "meta")
        if device == "cpu":
            assert torch.equal(y.full_tensor(), t * 2) and torch.equal((x * s).full_tensor(), t * 0.5)
