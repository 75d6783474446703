"""Compiled programs whose shards pass through an op whose CPU kernel lays its output out
otherwise than its meta kernel (``arrays/cpu_layouts.traced_relayout``).

AOTAutograd traces each device's call on fake tensors, whose strides are the meta kernel's.
The gradients of the mse, smooth l1 and huber losses are decompositions there (the input's
dim order) but contiguous from the CPU kernel, so a column-split shard of a replicated input
(a view in another dim order) got a gradient the trace thought viewable across the devices'
columns, and the gather of that gradient, recorded as a view, raised 'view size is not
compatible' when the compiled backward ran (fuzzer seed 5829512817: take_along_dim, then
mse_loss(reduction='none') against a column-split target, then nansum); log_softmax's
gradient (``_log_softmax_backward_data``: the gradient's order on meta) likewise. Plain torch under
``backend="aot_eager"`` raises the same on a transposed input, a torch bug; its inductor runs it.
Values and gradients are compared with plain torch's eager program, eager and compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

LOSSES = {
    "mse": lambda a, b: F.mse_loss(a, b, reduction="none"),
    "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, reduction="none", beta=0.5),
    "huber": lambda a, b: F.huber_loss(a, b, reduction="none", delta=0.5),
    "bce": lambda a, b: F.binary_cross_entropy(a, b, reduction="none"),
    "log_softmax": lambda a, b: a.log_softmax(0) * b,
    "layer_norm": lambda a, b: F.layer_norm(a.t(), (4,)).t() * b,
}


def _program(loss):
    # cumsum's backward needs the columns whole: the loss's gradient, split by columns like the
    # target, is gathered inside the compiled backward
    return lambda v, w: (loss(v.cumsum(1) / 6, w).sum(1) ** 2).sum()


@pytest.mark.parametrize("mode", ["eager", "compile", "compile_dynamic"])
@pytest.mark.parametrize("devices", [2, 4])  # 4: six columns split unevenly (per-device parts)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_split_loss_gradient_gathered_in_a_compiled_backward(name, devices, mode):
    torch.manual_seed(0)
    x = torch.rand(4, 6, dtype=torch.float64) * 0.8 + 0.1
    y = torch.rand(4, 6, dtype=torch.float64) * 0.8 + 0.1
    f = _program(LOSSES[name])
    xl = x.clone().requires_grad_()
    want = f(xl, y)
    (want_grad,) = torch.autograd.grad(want, xl)

    torch._dynamo.reset()
    run = f if mode == "eager" else torch.compile(f, backend="aot_eager", dynamic=True if mode == "compile_dynamic" else None)
    mesh = sf.Mesh((devices,), ("x",))
    xs = x.clone().requires_grad_()
    got = run(sf.distribute(xs, P(), mesh=mesh), sf.distribute(y, P(None, "x"), mesh=mesh))
    (grad,) = torch.autograd.grad(got, xs)
    torch.testing.assert_close(got.full_tensor(), want)
    torch.testing.assert_close(grad, want_grad)


EAGER = {
    "mse": LOSSES["mse"],
    "smooth_l1": LOSSES["smooth_l1"],
    "huber": LOSSES["huber"],
    "log_softmax": lambda a, b: a.log_softmax(1) * b,
    "layer_norm": lambda a, b: F.layer_norm(a, (6,)) * b,
}


@pytest.mark.parametrize("name", sorted(EAGER))
def test_the_gradients_report_the_cpu_kernels_strides(name):
    """Eager: the gradient of a transposed input is contiguous, as torch's CPU kernel makes it
    (the meta kernel said transposed, so ``view(-1)`` raised where torch's ran)."""
    x = torch.randn(6, 4, dtype=torch.float64).t()
    y = torch.randn(6, 4, dtype=torch.float64).t()
    mesh = sf.Mesh((2,), ("x",))
    xl = x.detach().requires_grad_()
    (want,) = torch.autograd.grad(EAGER[name](xl, y).sum(), xl)
    X = sf.distribute(x, P("x"), mesh=mesh).requires_grad_()
    (got,) = torch.autograd.grad(EAGER[name](X, sf.distribute(y, P("x"), mesh=mesh)).sum(), X)
    assert got.stride() == want.stride() == (6, 1)
    assert got.view(-1).shape == (24,)
    torch.testing.assert_close(got.full_tensor(), want)


def test_binary_cross_entropy_keeps_the_inputs_order():
    """Eager: binary cross entropy of a transposed input and its gradient are allocated like the
    input by torch's CPU kernels (the meta kernels: contiguous)."""
    x = (torch.rand(6, 4, dtype=torch.float64) * 0.8 + 0.1).t()
    y = torch.rand(4, 6, dtype=torch.float64) * 0.8 + 0.1
    mesh = sf.Mesh((2,), ("x",))
    xl = x.detach().requires_grad_()
    want = F.binary_cross_entropy(xl, y, reduction="none")
    (want_grad,) = torch.autograd.grad(want.sum(), xl)
    X = sf.distribute(x, P(None, "x"), mesh=mesh).requires_grad_()
    got = F.binary_cross_entropy(X, sf.distribute(y, P(None, "x"), mesh=mesh), reduction="none")
    (grad,) = torch.autograd.grad(got.sum(), X)
    assert got.stride() == want.stride() == (1, 4)
    assert grad.stride() == want_grad.stride() == (1, 4)
    torch.testing.assert_close(got.full_tensor(), want)
    torch.testing.assert_close(grad.full_tensor(), want_grad)
