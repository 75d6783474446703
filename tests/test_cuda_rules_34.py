"""CUDA attention kernels on devices holding no batch rows, and probes of the SDPA and fused
RMS norm rules beyond ``test_cuda_rules`` / ``test_cuda_meta_suite``.

Values and gradients on CPU meshes through test-only CPU kernels (``torch.library``, for this
module only) against the same call unsharded; metadata on meta meshes against torch's meta
kernels. The CPU kernels here reject an empty batch as CUDA's flash kernel does ("batch size
must be positive"), so a device given no batch rows is seen.
"""

from __future__ import annotations

from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def aligned_kernels() -> Iterator[None]:
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
