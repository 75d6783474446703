"""Output strides on a CPU mesh are torch's CPU kernels' strides (``arrays/cpu_layouts.py``).

torch's meta kernels that ask for a device (FFTs, convolutions, SVD/eig, 2-d padding,
pixel shuffle) lay a meta tensor's outputs out as on CUDA; a few CPU kernels (dropout
backward, 2-d padding backward) allocate otherwise than their meta kernels. Found by
``tools/stride_census.py``: each case here reported other strides than torch before, so
``view(-1)`` raised where torch's did not (or ran where torch's raised). Strides, the
``view(-1)`` verdict, values and gradients match plain torch on sharded layouts too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

aten = torch.ops.aten


def _transposed(shape, perm):
    """A tensor of ``shape`` whose memory is laid out in ``perm``'s dim order."""
    inverse = [perm.index(i) for i in range(len(shape))]
    return torch.randn([shape[p] for p in perm], dtype=torch.float64).permute(inverse)


def _cl(shape):
    return torch.randn(shape, dtype=torch.float64).to(memory_format=torch.channels_last)


CASES = {
    "rfftn_t": (lambda a: torch.fft.rfftn(a), lambda: [_transposed((4, 6, 5), [0, 2, 1])]),
    "fftn_rev": (lambda a: torch.fft.fftn(a, dim=(0, 2)), lambda: [_transposed((4, 6, 5), [2, 1, 0]).to(torch.complex128)]),
    "irfft_rev": (lambda a: torch.fft.irfft(a, dim=0), lambda: [_transposed((4, 6, 5), [2, 1, 0]).to(torch.complex128)]),
    "hfft_rev": (lambda a: torch.fft.hfft(a, dim=1), lambda: [_transposed((4, 6, 5), [2, 1, 0]).to(torch.complex128)]),
    "conv1d_t_weight": (lambda a, w: F.conv1d(a, w), lambda: [torch.randn(4, 3, 8, dtype=torch.float64),
                                                             _transposed((2, 3, 3), [0, 2, 1])]),
    "conv2d_channels_last": (lambda a, w: F.conv2d(a, w, padding=1), lambda: [_cl((4, 3, 5, 6)),
                                                                             torch.randn(2, 3, 3, 3, dtype=torch.float64)]),
    "svd": (lambda a: torch.linalg.svd(a, full_matrices=False), lambda: [_transposed((4, 5, 3), [0, 2, 1])]),
    "eig": (lambda a: torch.linalg.eig(a), lambda: [_transposed((4, 3, 3), [0, 2, 1])]),
    "reflect_pad_cl": (lambda a: F.pad(a, (1, 2, 2, 1), mode="reflect"), lambda: [_cl((4, 3, 5, 6))]),
    "replicate_pad_cl": (lambda a: F.pad(a, (-1, 1, 1, -1), mode="replicate"), lambda: [_cl((4, 3, 5, 6))]),
    "pixel_shuffle_cl": (lambda a: F.pixel_shuffle(a, 2), lambda: [_cl((4, 8, 3, 3))]),
    "dropout_backward_t": (lambda g, m: aten.native_dropout_backward(g, m > 0, 2.0),
                           lambda: [_transposed((4, 5, 6), [0, 2, 1]), _transposed((4, 5, 6), [0, 2, 1])]),
}


def _outs(o):
    return [t for t in (o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor)]


def _verdict(t):
    try:
        t.view(-1)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("spec", [P(), P("x")])
@pytest.mark.parametrize("name", sorted(CASES))
def test_strides_views_and_values_match_torch(name, spec):
    fn, make = CASES[name]
    torch.manual_seed(0)
    xs = make()
    mesh = sf.Mesh((2,), ("x",))
    Xs = [sf.distribute(x, spec if i == 0 else P(), mesh=mesh) for i, x in enumerate(xs)]
    want, got = _outs(fn(*xs)), _outs(fn(*Xs))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.stride() == w.stride(), (name, g.stride(), w.stride())
        assert _verdict(g) == _verdict(w)
        if name != "eig" and not (name == "svd"):  # vectors' signs and phases are not unique
            torch.testing.assert_close(g.full_tensor(), w)


@pytest.mark.parametrize("name", ["reflect_pad_cl", "replicate_pad_cl", "conv2d_channels_last", "rfftn_t", "conv1d_t_weight"])
def test_gradient_strides_match_torch(name):
    """The input gradients (padding backward keeps channels-last on CPU) have torch's strides
    and values."""
    fn, make = CASES[name]
    torch.manual_seed(0)
    xs = [x.detach().requires_grad_() for x in make()]
    mesh = sf.Mesh((2,), ("x",))
    Xs = [sf.distribute(x.detach(), P("x") if i == 0 else P(), mesh=mesh).requires_grad_() for i, x in enumerate(xs)]

    def loss(outs):
        return sum((torch.view_as_real(o) if o.is_complex() else o).pow(2).sum() for o in outs)

    want = torch.autograd.grad(loss(_outs(fn(*xs))), xs)
    got = torch.autograd.grad(loss(_outs(fn(*Xs))), Xs)
    for g, w in zip(got, want, strict=True):
        assert g.stride() == w.stride(), (name, g.stride(), w.stride())
        torch.testing.assert_close(g.full_tensor(), w)


def test_a_meta_mesh_keeps_the_meta_kernels_layout():
    """Only a CPU mesh asks for the CPU kernels' layouts: a meta mesh (standing for CUDA)
    reports what torch's meta kernels give, as a CUDA kernel would."""
    x = _transposed((4, 6, 5), [0, 2, 1])
    want = torch.fft.rfftn(x.to("meta"))
    got = torch.fft.rfftn(sf.distribute(x.to("meta"), P(), mesh=sf.Mesh((2,), ("x",), device_type="meta")))
    assert got.stride() == want.stride()


@pytest.mark.parametrize("spec", [P(), P(None, "x")])
@pytest.mark.parametrize("op", ["copysign", "div_floor", "floor_divide", "masked_fill_"])
def test_binary_ops_and_writes_keep_a_transposed_operands_order(op, spec):
    """A binary op of a transposed array and a 0-d one keeps the transposed order on the CPU
    (TensorIterator; ``copysign``'s and rounding division's Python meta kernels lost it), and
    an in-place write keeps its target's strides (a fresh array's ``masked_fill_`` ran as
    ``masked_fill``, contiguous, and rebound the target to it: the gradient of ``torch.norm``
    of a transposed input was contiguous where torch's is transposed)."""
    fns = {"copysign": lambda a, s: torch.copysign(a, s),
           "div_floor": lambda a, s: torch.div(a, s, rounding_mode="floor"),
           "floor_divide": lambda a, s: torch.floor_divide(a, s),
           "masked_fill_": lambda a, s: (a / s).masked_fill_(s == 0, 0).add_(1)}
    mesh = sf.Mesh((2,), ("x",))
    x, s = torch.randn(6, 4, dtype=torch.float64).t(), torch.tensor(-2.0, dtype=torch.float64)
    want = fns[op](x, s)
    got = fns[op](sf.distribute(x, spec, mesh=mesh), sf.distribute(s, P(), mesh=mesh))
    assert got.stride() == want.stride() == (1, 4)
    assert _verdict(got) == _verdict(want) is False
    torch.testing.assert_close(got.full_tensor(), want)


def test_norm_gradient_of_a_transposed_input_is_transposed():
    x = torch.randn(6, 4, dtype=torch.float64)
    xt = x.t().detach().requires_grad_()
    (w,) = torch.autograd.grad(torch.norm(xt), xt)
    X = sf.distribute(x.t(), P(None, "x"), mesh=sf.Mesh((2,), ("x",))).requires_grad_()
    (g,) = torch.autograd.grad(torch.norm(X), X)
    assert g.stride() == w.stride()
    torch.testing.assert_close(g.full_tensor(), w)
