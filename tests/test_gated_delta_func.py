"""A write into a view of a non-contiguous array under ``torch.func.grad``: autograd's CopySlices
copies the base's gradient into ``new_empty_strided(base's size, base's strides)`` and views it by
``as_strided`` with those strides. shardfn's ``new_empty_strided`` reported contiguous strides, so
for a transposed base (``zeros_like`` of a ``solve_triangular`` result) the view read the wrong
elements: wrong gradients, no warning (Qwen3-Next's chunked gated delta rule in transformers:
its linear-attention gradients off by their own size under torch.func, right under autograd)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2,), ("dp",), backend="local")


def test_new_empty_strided_reports_its_strides(mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(2, 4, 4), P("dp"), mesh=mesh)
    for stride in ((16, 1, 4), (1, 8, 2), (16, 4, 1)):
        assert x.new_empty_strided((2, 4, 4), stride).stride() == stride


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
@pytest.mark.parametrize("dims", [(-1, -2), (0, 2), (1, 3)])
def test_write_into_a_transposed_fresh_array_under_func(mesh: sf.Mesh, spec: P, dims: tuple) -> None:
    """``out = zeros_like(x.transpose(..))``, ``out[:, i] = f(x)``: values and gradients equal torch's."""
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 4, 4, generator=g)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x.transpose(*dims).contiguous().transpose(*dims))  # (x.shape, permuted strides)
        for i in range(2):
            out[:, i] = x[:, i] @ w + i
        return (out ** 2).sum()

    want = torch.func.grad_and_value(f, argnums=(0, 1))(X, W)
    got = torch.func.grad_and_value(f, argnums=(0, 1))(sf.distribute(X, spec, mesh=mesh), sf.distribute(W, P(), mesh=mesh))
    torch.testing.assert_close(got[1].full_tensor(), want[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_chunk_gated_delta_rule_func_grad(mesh: sf.Mesh, spec: P) -> None:
    """transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next) under torch.func.grad."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 8, 2, 4
    ins = [torch.randn(B, S, H, D, generator=g) for _ in range(3)]
    ins += [-torch.rand(B, S, H, generator=g), torch.rand(B, S, H, generator=g)]

    def f(q, k, v, decay, beta):
        return (qwen3_next.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=4)[0] ** 2).sum()

    argnums = tuple(range(5))
    want = torch.func.grad(f, argnums=argnums)(*ins)
    got = torch.func.grad(f, argnums=argnums)(*[sf.distribute(t, spec, mesh=mesh) for t in ins])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-4, atol=1e-4)
