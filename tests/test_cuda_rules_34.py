"""CUDA attention kernels on devices holding no batch rows, and probes of the SDPA and fused
RMS norm rules beyond ``test_cuda_rules`` / ``test_cuda_meta_suite``.

Values and gradients on CPU meshes through test-only CPU kernels (``torch.library``, for this
module only) against the same call unsharded; metadata on meta meshes against torch's meta
kernels. The CPU kernels here reject an empty batch as CUDA's flash kernel does ("batch size
must be positive"), so a device given no batch rows is seen.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardfn as sf
from shardfn import P

import test_attention_kernels as bshd
import test_cuda_rules as bhsd
from _no_fallback import NoFallback

aten = torch.ops.aten


def _rejecting_empty(fn, batch_of):  # noqa: ANN001, ANN202
    def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if batch_of(args).shape[0] == 0:
            raise RuntimeError("batch size must be positive")
        return fn(*args, **kwargs)
    return kernel


def _q(args):  # noqa: ANN001, ANN202
    return args[0]


def _q_of_backward(args):  # noqa: ANN001, ANN202
    return args[1]


@pytest.fixture(scope="module")
def cpu_kernels() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    for name, fn, batch_of in [
            ("_scaled_dot_product_flash_attention", bhsd._flash, _q),
            ("_scaled_dot_product_flash_attention_backward", bhsd._flash_bwd, _q_of_backward),
            ("_scaled_dot_product_efficient_attention", bhsd._efficient, _q),
            ("_scaled_dot_product_efficient_attention_backward", bhsd._efficient_bwd, _q_of_backward),
            ("_scaled_dot_product_cudnn_attention", bhsd._cudnn, _q),
            ("_scaled_dot_product_cudnn_attention_backward", bhsd._cudnn_bwd, _q_of_backward),
            ("_flash_attention_forward", bshd._flash_fwd, _q),
            ("_flash_attention_backward", bshd._flash_bwd, _q_of_backward),
            ("_efficient_attention_forward", bshd._eff_fwd, _q),
            ("_efficient_attention_backward", bshd._eff_bwd, _q_of_backward)]:
        lib.impl(name, _rejecting_empty(fn, batch_of), "CPU")
    yield
    lib._destroy()


# -- devices holding no batch rows -----------------------------------------------------------------

B, H, SQ, SK, D = 3, 4, 5, 7, 8


def _sdpa(kernel: str, q, k, v, b):  # noqa: ANN001, ANN202
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.3)
    if kernel == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, False)
    return aten._scaled_dot_product_cudnn_attention(q, k, v, b, True, 0.0, False, False)


def _bshd(kernel: str, q, k, v, b):  # noqa: ANN001, ANN202
    if kernel == "flash":
        return aten._flash_attention_forward(q, k, v, None, None, SQ, SK, 0.0, True, False, scale=0.3)
    return aten._efficient_attention_forward(q, k, v, b, None, None, SQ, SK, 0.0, 0, True)


CALLS = {f"sdpa_{k}": (_sdpa, k) for k in ("flash", "efficient", "cudnn")}
CALLS |= {f"bshd_{k}": (_bshd, k) for k in ("flash", "efficient")}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("mesh_shape, spec", [((4,), P("x")), ((8,), P("x")), ((2, 4), P("x", "y")),
                                              ((2, 4), P(("x", "y")))], ids=str)
def test_devices_holding_no_batch_rows_get_empty_results(call: str, mesh_shape: tuple, spec: P,
                                                         cpu_kernels: None) -> None:
    """Three batch rows over four or eight devices: those holding none are not handed to the
    kernel (CUDA's flash rejects an empty batch; the test kernels' bias gradient of an empty
    bias had another shape); values and gradients equal torch's, the layout kept."""
    fn, kernel = CALLS[call]
    seq_first = call.startswith("bshd")
    names = ("x", "y")[:len(mesh_shape)]
    mesh = sf.Mesh(mesh_shape, names)
    if seq_first and len(spec) == 2:
        spec = P(spec[0], None, spec[1])  # (batch, seq, heads, dim): heads over 'y'
    g = torch.Generator().manual_seed(0)

    def shaped(s: int, d: int) -> torch.Tensor:
        t = torch.randn(B, H, s, d, generator=g, dtype=torch.float64)
        return t.transpose(1, 2).contiguous() if seq_first else t

    q, k, v = shaped(SQ, D), shaped(SK, D), shaped(SK, D)
    bias = None
    if kernel != "flash":  # a full bias (batch rows too), a gradient asked for where the kernel gives one
        bias = torch.randn(B, H, SQ, SK, generator=g, dtype=torch.float64)
    with_bias_grad = kernel == "efficient"
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    pb = None if bias is None else bias.clone().requires_grad_(with_bias_grad)
    want = fn(kernel, *plain, pb)
    wgrads = torch.autograd.grad((want[0] ** 2).sum(), plain + ([pb] if with_bias_grad else []))
    sharded = [sf.distribute(t, spec, mesh=mesh).requires_grad_() for t in (q, k, v)]
    sb = None if bias is None else sf.distribute(bias, P(), mesh=mesh).requires_grad_(with_bias_grad)
    with NoFallback():
        got = fn(kernel, *sharded, sb)
        grads = torch.autograd.grad((got[0] ** 2).sum(), sharded + ([sb] if with_bias_grad else []))
    assert got[0].spec == spec
    torch.testing.assert_close(got[0].full_tensor(), want[0])
    torch.testing.assert_close(got[1].full_tensor(), want[1])  # logsumexp
    for i, (a, w) in enumerate(zip(grads, wgrads)):
        assert a.shape == w.shape
        torch.testing.assert_close(a.full_tensor(), w, msg=f"grad {i}")


# -- mem-efficient attention's bias alignment ----------------------------------------------------------


def _checks_alignment(fn, bias_at: int):  # noqa: ANN001, ANN202
    """``fn`` rejecting a bias as CUDA's mem-efficient kernel does (xformers' ``check_supported``)."""
    def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        b = args[bias_at]
        if b is not None and (b.stride(-1) != 1 or any(st % 8 for n, st in zip(b.shape[:-1], b.stride()[:-1]) if n > 1)):
            raise RuntimeError(f"attn_bias is not correctly aligned: strides {b.stride()}")
        return fn(*args, **kwargs)
    return kernel


@pytest.fixture
def aligned_kernels() -> Iterator[None]:
    """For one test: on top of (and then back to) the module's kernels."""
    lib = torch.library.Library("aten", "IMPL")
    for name, fn, at in [("_scaled_dot_product_efficient_attention", bhsd._efficient, 3),
                         ("_scaled_dot_product_efficient_attention_backward", bhsd._efficient_bwd, 4),
                         ("_efficient_attention_forward", bshd._eff_fwd, 3),
                         ("_efficient_attention_backward", bshd._eff_bwd, 4)]:
        lib.impl(name, _checks_alignment(fn, at), "CPU")
    yield
    lib._destroy()


def _padded(mask: torch.Tensor) -> torch.Tensor:
    """The mask as torch's SDPA hands it to the kernel (``preprocess_mask``): rows padded to a
    multiple of 8, sliced back, expanded to (batch, heads, queries, keys)."""
    n = mask.shape[-1]
    return torch.nn.functional.pad(mask, (0, 8 - n % 8))[..., :n].expand(B, H, SQ, SK)


@pytest.mark.parametrize("seq_first", [False, True], ids=["sdpa", "bshd"])
@pytest.mark.parametrize("mesh_shape, q_spec, mask_shape, mask_spec", [
    ((2, 2), P("x", "y"), (B, 1, SQ, SK), P(None, None, "x")),  # the mask's queries split: gathered
    ((4,), P(None, "x"), (SQ, SK), P("x")),
    ((2,), P("x"), (H, SQ, SK), P(None, "x")),
    ((3,), P(), (B, 1, 1, SK), P(None, None, None, "x")),  # its keys split
    ((2, 2), P("x", "y"), (1, H, SQ, SK), P()),  # nothing moves: the slices keep the padded rows
], ids=str)
def test_efficient_attention_gets_an_aligned_bias(seq_first: bool, mesh_shape: tuple, q_spec: P, mask_shape: tuple,
                                                  mask_spec: P, aligned_kernels: None) -> None:
    """A mask padded as torch's SDPA pads it, laid out so that it is gathered or restacked: each
    device's kernel still gets strides in multiples of 8 elements (a dense gathered (.., 5, 7)
    bias was rejected by CUDA's kernel); values and gradients equal torch's."""
    mesh = sf.Mesh(mesh_shape, ("x", "y")[:len(mesh_shape)])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, s, D, generator=g, dtype=torch.float64) for s in (SQ, SK, SK))
    if seq_first:
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        q_spec = P(q_spec[0] if len(q_spec) else None, None, q_spec[1] if len(q_spec) > 1 else None)
    mask = torch.randn(mask_shape, generator=g, dtype=torch.float64)

    def attend(q, k, v, m):  # noqa: ANN001, ANN202
        if seq_first:
            return aten._efficient_attention_forward(q, k, v, _padded(m), None, None, SQ, SK, 0.0, 0, True)[0]
        return aten._scaled_dot_product_efficient_attention(q, k, v, _padded(m), True)[0]

    plain = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    want = attend(*plain)
    wgrads = torch.autograd.grad((want ** 2).sum(), plain)
    sharded = [sf.distribute(t, q_spec, mesh=mesh).requires_grad_() for t in (q, k, v)]
    sharded.append(sf.distribute(mask, mask_spec, mesh=mesh).requires_grad_())
    for _ in range(2):  # a warm call too
        got = attend(*sharded)
        grads = torch.autograd.grad((got ** 2).sum(), sharded)
        torch.testing.assert_close(got.full_tensor(), want)
        for i, (a, w) in enumerate(zip(grads, wgrads)):
            torch.testing.assert_close(a.full_tensor(), w, msg=f"grad {i}")


# -- random calls: metadata on meta meshes, values on CPU meshes ------------------------------------
# (seeded draws of kernel, mesh, shapes, grouped-query heads, masks, flags, memory layouts and
# layouts of every argument; a probe of a few thousand such draws found only the two causes above)

MESHES = [((2,), ("x",)), ((3,), ("x",)), ((4,), ("x",)), ((8,), ("x",)), ((2, 2), ("x", "y")), ((2, 3), ("x", "y"))]


def _spec(rng: random.Random, names: tuple, ndim: int, favour: tuple = (0, 1)) -> P:
    """Each mesh axis: unused, on a favoured dim, or on any dim."""
    dims: list = [[] for _ in range(ndim)]
    for n in names:
        r = rng.random()
        if r >= 0.25:
            dims[rng.choice(favour) if r < 0.8 else rng.randrange(ndim)].append(n)
    return P(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])


def _draw(seed: int, values: bool) -> dict:
    rng = random.Random(seed)
    kernel = rng.choice(["flash", "efficient", "cudnn"])
    shape, names = rng.choice(MESHES)
    b, hq = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4, 6])
    # grouped-query heads: flash and cuDNN (torch's efficient backward takes as many kv heads as query heads)
    hkv = rng.choice([h for h in range(1, hq + 1) if hq % h == 0]) if kernel != "efficient" and rng.random() < 0.4 else hq
    sq, sk, d = rng.choice([1, 3, 5]), rng.choice([3, 5]), rng.choice([4, 8])
    dv = d if kernel == "flash" or rng.random() < 0.6 else rng.choice([4, 6])
    bias = None
    if kernel != "flash" and rng.random() < 0.6:  # every broadcastable shape: 2-d, 3-d, size-1 batch/heads/queries
        full = [b, hq, sq, sk][4 - rng.choice([2, 3, 4]):]
        bias = tuple(1 if (i < len(full) - 2 and rng.random() < 0.4) or (i == len(full) - 2 and rng.random() < 0.15)
                     else n for i, n in enumerate(full))
    bias_bool = bias is not None and rng.random() < 0.4
    orders = [tuple(rng.sample(range(4), 4)) if rng.random() < 0.3 else (0, 1, 2, 3) for _ in range(3)]
    q_spec = _spec(rng, names, 4)
    return dict(kernel=kernel, mesh=sf.Mesh(shape, names, device_type="cpu" if values else "meta"), b=b, hq=hq,
                hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, bias=bias, bias_bool=bias_bool, orders=orders,
                causal=rng.random() < 0.3 and sq <= sk, scale=rng.choice([None, 0.3]),
                dropout=0.0 if values else rng.choice([0.0, 0.1]), debug=kernel == "flash" and rng.random() < 0.2,
                lse=kernel == "flash" or values or rng.random() < 0.85,
                dtype=torch.float64 if values else rng.choice([torch.float32, torch.bfloat16, torch.float16]),
                q_spec=q_spec, kv_spec=q_spec if rng.random() < 0.6 else _spec(rng, names, 4),
                bias_spec=P() if bias is None or rng.random() < 0.5 else _spec(rng, names, len(bias), (0,)),
                g_spec=q_spec if rng.random() < 0.5 else _spec(rng, names, 4),
                bias_grad=kernel == "efficient" and bias is not None and not bias_bool and rng.random() < 0.6)


def _tensors(c: dict, device: str) -> tuple:
    g = torch.Generator().manual_seed(0)

    def make(shape: tuple, order: tuple) -> torch.Tensor:  # ``order``: the dims from outermost in memory
        t = torch.randn([shape[i] for i in order], generator=g, dtype=torch.float64)
        return t.permute([order.index(i) for i in range(4)]).to(c["dtype"]).to(device)

    q = make((c["b"], c["hq"], c["sq"], c["d"]), c["orders"][0])
    k = make((c["b"], c["hkv"], c["sk"], c["d"]), c["orders"][1])
    v = make((c["b"], c["hkv"], c["sk"], c["dv"]), c["orders"][2])
    bias = None
    if c["bias"] is not None:
        bias = (torch.rand(c["bias"], generator=g) < 0.7) if c["bias_bool"] else torch.randn(c["bias"], generator=g)
        bias = bias.to(device if c["bias_bool"] else c["dtype"]).to(device)
    grad = torch.randn(c["b"], c["hq"], c["sq"], c["dv"], generator=g, dtype=torch.float64).to(c["dtype"]).to(device)
    return q, k, v, bias, grad


def _call(c: dict, q, k, v, bias):  # noqa: ANN001, ANN202
    if c["kernel"] == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, c["dropout"], c["causal"], c["debug"], scale=c["scale"])
    if c["kernel"] == "efficient":
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, c["lse"], c["dropout"], c["causal"],
                                                            scale=c["scale"])
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, c["lse"], c["dropout"], c["causal"], False,
                                                    scale=c["scale"])


def _run(c: dict, q, k, v, bias, grad) -> tuple:  # noqa: ANN001
    """(outputs, gradients of q, k, v and a bias that asks for one)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bias = None if bias is None else bias.detach().requires_grad_(c["bias_grad"])
    outs = _call(c, q, k, v, bias)
    if not c["lse"]:  # no logsumexp: a forward only
        return outs, ()
    return outs, torch.autograd.grad(outs[0], [q, k, v] + ([bias] if c["bias_grad"] else []), grad)


def _meta(t: object) -> object:
    """Shape, dtype, device and the strides of dims of more than one element (a size-1 dim's is never read)."""
    if not isinstance(t, torch.Tensor):
        return t
    return tuple(t.shape), tuple(s if n > 1 else None for s, n in zip(t.stride(), t.shape)), t.dtype, t.device.type


def _distributed(c: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any) -> tuple:
    """q, k, v and the bias laid out as the draw ``c`` says."""
    mesh = c["mesh"]
    kv = (sf.distribute(t, c["kv_spec"], mesh=mesh) for t in (k, v))
    return (sf.distribute(q, c["q_spec"], mesh=mesh), *kv,
            None if bias is None else sf.distribute(bias, c["bias_spec"], mesh=mesh))


@pytest.mark.parametrize("seed", range(40))
def test_sdpa_kernels_on_meta_meshes_match_torchs_meta_kernels(seed: int) -> None:
    c = _draw(seed, values=False)
    q, k, v, bias, grad = _tensors(c, "meta")
    want, wgrads = _run(c, q, k, v, bias, grad)
    mesh = c["mesh"]
    qs, ks, vs, bs = _distributed(c, q, k, v, bias)
    with NoFallback(), sf.debug.CommCounter() as cc:
        got, grads = _run(c, qs, ks, vs, bs, sf.distribute(grad, c["q_spec"], mesh=mesh))
    assert [_meta(t) for t in got] == [_meta(t) for t in want]
    assert [_meta(t) for t in grads] == [_meta(t) for t in wgrads]
    assert all({s.device.type for s in t.local_shards()} == {"meta"} for t in (*got, *grads)
               if isinstance(t, sf.ShardedArray))
    entries = [(e,) if isinstance(e, str) else e or () for e in c["q_spec"]] + [()] * 4
    heads = math.prod(mesh.axis_size(a) for a in entries[1])
    if (c["kv_spec"] == c["q_spec"] and not entries[2] and not entries[3] and c["hkv"] % heads == 0
            and c["bias_spec"] == P() and not c["bias_grad"]):
        assert cc.records == []  # batch and heads split alike: nothing moves, forward or backward


@pytest.mark.parametrize("seed", range(24))
def test_sdpa_kernels_values_equal_unsharded_in_any_layout(seed: int, cpu_kernels: None) -> None:
    c = _draw(1000 + seed, values=True)
    q, k, v, bias, grad = _tensors(c, "cpu")
    want, wgrads = _run(c, q, k, v, bias, grad)
    mesh = c["mesh"]
    qs, ks, vs, bs = _distributed(c, q, k, v, bias)
    with NoFallback():
        got, grads = _run(c, qs, ks, vs, bs, sf.distribute(grad, c["g_spec"], mesh=mesh))
    for i in (0, 1):  # output, logsumexp
        torch.testing.assert_close(got[i].full_tensor(), want[i])
    assert len(grads) == len(wgrads)
    for i, (a, w) in enumerate(zip(grads, wgrads)):
        torch.testing.assert_close(a.full_tensor(), w, msg=f"grad {i}")


# -- fused RMS norm ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rms_backward_kernel() -> Iterator[None]:
    """CUDA's ``_fused_rms_norm_backward`` has no CPU kernel: torch's decomposition stands in."""
    from torch._decomp.decompositions import _fused_rms_norm_backward as decomposed

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm_backward", lambda *a, **k: tuple(decomposed(*a, **k)), "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("seed", range(24))
def test_fused_rms_norm_and_its_backward_equal_torch(seed: int, rms_backward_kernel: None) -> None:
    """Weight or none, eps None or given, 1+ normalized dims, any dims split (the normalized ones
    too, the weight's and the gradient's alike): metadata on a meta mesh, values on a CPU mesh."""
    rng = random.Random(seed)
    nd = rng.choice([1, 2, 3, 4])
    shape = tuple(rng.choice([1, 2, 3, 5, 8]) for _ in range(nd))
    k = rng.randint(1, nd)
    names_shape, names = rng.choice(MESHES)
    device = ("meta", "cpu")[seed % 2]
    dtype = rng.choice([torch.float32, torch.bfloat16]) if device == "meta" else torch.float64
    g = torch.Generator().manual_seed(seed)
    x, grad = (torch.randn(shape, generator=g, dtype=dtype).to(device) for _ in range(2))
    ns = list(shape[nd - k:])
    w = torch.randn(ns, generator=g, dtype=dtype).to(device) if rng.random() < 0.7 else None
    eps, mask = rng.choice([None, 1e-6]), [True, rng.random() < 0.7]
    mesh = sf.Mesh(names_shape, names, device_type=device)
    specs = [_spec(rng, names, nd, tuple(range(nd))), _spec(rng, names, k, tuple(range(k))),
             _spec(rng, names, nd, tuple(range(nd)))]

    def run(x, w, grad):  # noqa: ANN001, ANN202
        xr = x.detach().requires_grad_()
        wr = None if w is None else w.detach().requires_grad_()
        out, rstd = aten._fused_rms_norm(xr, ns, wr, eps)
        grads = torch.autograd.grad(out, [xr] + ([wr] if wr is not None else []), grad)
        direct = aten._fused_rms_norm_backward(grad, x, ns, rstd.detach(), w, mask)
        return [out, rstd, *grads, *direct]

    want = run(x, w, grad)
    with NoFallback():
        got = run(sf.distribute(x, specs[0], mesh=mesh), None if w is None else sf.distribute(w, specs[1], mesh=mesh),
                  sf.distribute(grad, specs[2], mesh=mesh))
    assert len(got) == len(want)
    for i, (a, w_) in enumerate(zip(got, want)):
        assert (a is None) == (w_ is None), i
        if w_ is None:
            continue
        if device == "meta":
            assert _meta(a) == _meta(w_), i
        else:
            torch.testing.assert_close(a.full_tensor(), w_, msg=f"output {i}")
