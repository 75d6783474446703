"""Batch norm over split inputs: synchronised statistics (small all_reduces), no gather, no
fallback (``rules/batch_norm.py``). Values, gradients and updated running statistics match
single-device torch; each split layout communicates per-channel sums only."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

MESH = sf.Mesh((2, 2), ("dp", "x"))

SPECS = {
    "batch": P("dp"),
    "batch_2d": P(("dp", "x")),
    "spatial": P(None, None, "x"),
    "batch_and_spatial": P("dp", None, None, "x"),
    "channels": P(None, "x"),
    "replicated": P(),
}


def _run(x, spec, weight, bias, training, rm=None, rv=None):
    """Forward and backward of a cubic loss: (out, dx, dw, db) and the collectives."""
    X = sf.distribute(x, spec, mesh=MESH).requires_grad_()
    W = None if weight is None else sf.distribute(weight, P(), mesh=MESH).requires_grad_()
    B = None if bias is None else sf.distribute(bias, P(), mesh=MESH).requires_grad_()
    RM = None if rm is None else sf.distribute(rm, P(), mesh=MESH)
    RV = None if rv is None else sf.distribute(rv, P(), mesh=MESH)
    leaves = [t for t in (X, W, B) if t is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as comm:
            out = F.batch_norm(X, RM, RV, W, B, training=training, eps=1e-3)
            grads = torch.autograd.grad(out.float().pow(3).sum(), leaves)
    return out, grads, comm


def _reference(x, weight, bias, training, rm=None, rv=None):
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias) if t is not None]
    it = iter(leaves)
    xr = next(it)
    wr = next(it) if weight is not None else None
    br = next(it) if bias is not None else None
    out = F.batch_norm(xr, rm, rv, wr, br, training=training, eps=1e-3)
    return out, torch.autograd.grad(out.float().pow(3).sum(), leaves)


def _close(got, want, tol=1e-9):
    got = got.full_tensor() if isinstance(got, sf.ShardedArray) else got
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("training", [True, False])
def test_values_gradients_and_communication(name, training):
    torch.manual_seed(0)
    x = torch.randn(8, 4, 6, 4, dtype=torch.float64)
    w, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    rm, rv = (None, None) if training else (torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5)
    out, grads, comm = _run(x, SPECS[name], w, b, training, rm, rv)
    want, wgrads = _reference(x, w, b, training, rm, rv)
    _close(out, want)
    for g, r in zip(grads, wgrads, strict=True):
        _close(g, r)
    assert out._layout == sf.distribute(x, SPECS[name], mesh=MESH)._layout.without_partial()
    assert set(comm.counts) <= {"all_reduce"}, comm.counts  # never a gather of the activation
    # per-channel sums only: the forward mean and variance, the backward's two sums (and the
    # weight and bias gradients' sums in evaluation), each of C values
    assert all(r.bytes <= 4 * 8 for r in comm.records), [(r.kind, r.bytes) for r in comm.records]
    if name == "channels" or name == "replicated":
        assert not comm.counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_is_computed_in_float32(dtype):
    torch.manual_seed(1)
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    out, grads, _ = _run(x.to(dtype), P("dp"), None, None, True)
    want = F.batch_norm(x, None, None, training=True, eps=1e-3)
    assert out.dtype == dtype
    _close(out.float(), want.float(), tol=2e-2)
    torch_out = F.batch_norm(x.to(dtype), None, None, training=True, eps=1e-3)
    assert (out.full_tensor().double() - want).abs().max() <= 2 * (torch_out.double() - want).abs().max() + 1e-3


def test_weight_and_bias_optional_and_5d():
    torch.manual_seed(2)
    x = torch.randn(4, 3, 2, 3, 4, dtype=torch.float64)
    out, grads, _ = _run(x, P("dp", None, "x"), None, None, True)
    want, wgrads = _reference(x, None, None, True)
    _close(out, want)
    _close(grads[0], wgrads[0])


def test_functional_running_statistics_update():
    """``_native_batch_norm_legit_functional`` (what functionalization and torch.compile make
    of a training batch norm with running statistics): the new statistics are the momentum
    blend with the unbiased variance, as torch's."""
    torch.manual_seed(3)
    x = torch.randn(8, 3, 4, dtype=torch.float64)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    w, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    op = torch.ops.aten._native_batch_norm_legit_functional.default
    want = op(x, w, b, rm, rv, True, 0.3, 1e-3)
    args = [sf.distribute(t, P("dp", None, "x") if t.dim() == 3 else P(), mesh=MESH) for t in (x, w, b, rm, rv)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        with sf.debug.CommCounter() as comm:
            got = op(*args, True, 0.3, 1e-3)
    for g, r in zip(got, want, strict=True):
        _close(g, r)
    assert set(comm.counts) <= {"all_reduce"}


_FORMS = {  # op -> extra arguments after (input, weight, bias); the mode is a parameter where the op has one
    "native_batch_norm": lambda rm, rv, training: (torch.ops.aten.native_batch_norm.default, (rm, rv, training)),
    "legit_no_stats": lambda rm, rv, training: (torch.ops.aten._native_batch_norm_legit.no_stats, (training,)),
    "legit_functional": lambda rm, rv, training: (
        torch.ops.aten._native_batch_norm_legit_functional.default, (rm, rv, training)),
    "legit_no_training": lambda rm, rv, training: (torch.ops.aten._native_batch_norm_legit_no_training.default,
                                                   (rm, rv)),
}


@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float16, torch.float16),
                                    (torch.float16, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("name", ["batch", "channels", "spatial", "replicated"])
def test_every_aten_form_values_and_dtypes_as_the_cpu_kernel(form, training, dtypes, name):
    """The forms torch.export and functionalization make of a batch norm, on every layout, no
    fallback: values, shapes and dtypes as torch's CPU kernel gives them (a float16 input with
    float16 parameters saves float16 statistics, where the meta kernel says float32; in
    evaluation the saved statistics are empty and the functional form returns its running
    statistics unchanged, not summed over a split batch)."""
    if form == "legit_no_stats" and not training:
        pytest.skip("torch requires running statistics in evaluation")
    if form == "native_batch_norm" and training:
        rm_rv = (None, None)  # (with them: written in place, refused for arrays)
    else:
        rm_rv = None
    torch.manual_seed(7)
    xdt, pdt = dtypes
    x = torch.randn(4, 4, 6, dtype=xdt)
    w, b = torch.rand(4, dtype=pdt) + 0.5, torch.randn(4, dtype=pdt)
    rm, rv = rm_rv or (torch.randn(4, dtype=pdt), torch.rand(4, dtype=pdt) + 0.5)
    op, extra = _FORMS[form](rm, rv, training)
    want = op(x, w, b, *extra, 0.1, 1e-5)
    args = [sf.distribute(t, SPECS[name], mesh=MESH) if t is x else sf.distribute(t, P(), mesh=MESH)
            if isinstance(t, torch.Tensor) else t for t in (x, w, b, *extra)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        got = op(*args, 0.1, 1e-5)
    tol = 1e-9 if xdt == torch.float64 else 1e-2
    for g, r in zip(got, want, strict=True):
        assert (g.dtype, g.shape) == (r.dtype, r.shape)
        assert g.full_tensor().dtype == r.dtype
        torch.testing.assert_close(g.full_tensor(), r, rtol=tol, atol=tol)


def test_module_under_functional_call_and_grad():
    """nn.BatchNorm2d in evaluation through torch.func: the gradient of a data-parallel loss."""
    torch.manual_seed(4)
    bn = torch.nn.BatchNorm2d(3).double().eval()
    bn.running_mean.normal_()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    params = {k: v.detach() for k, v in bn.named_parameters()}
    buffers = {k: v.detach() for k, v in bn.named_buffers()}

    def loss(p, inp):
        return torch.func.functional_call(bn, (p, buffers), (inp,)).pow(2).sum()

    want = torch.func.grad(loss)(params, x)
    sp = {k: sf.distribute(v, P(), mesh=MESH) for k, v in params.items()}
    got = torch.func.grad(loss)(sp, sf.distribute(x, P("dp"), mesh=MESH))
    for k in want:
        _close(got[k], want[k])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 5), c=st.integers(1, 3), h=st.integers(1, 4),
       spec=st.sampled_from([P("dp"), P("x"), P(("dp", "x")), P(None, None, "x"), P("dp", "x"), P(None, "dp", "x")]))
def test_uneven_layouts(n, c, h, spec):
    """Uneven and empty shards (a mesh larger than a dim): the sums of what each device holds."""
    torch.manual_seed(n * 100 + c * 10 + h)
    x = torch.randn(n, c, h, dtype=torch.float64)
    w, b = torch.randn(c, dtype=torch.float64), torch.randn(c, dtype=torch.float64)
    out, grads, _ = _run(x, spec, w, b, True)
    want, wgrads = _reference(x, w, b, True)
    _close(out, want)
    for g, r in zip(grads, wgrads, strict=True):
        _close(g, r)
