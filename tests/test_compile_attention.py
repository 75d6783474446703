"""Attention under torch.compile takes the fused kernel the unsharded compiled call takes (not
products and a softmax, which save the (batch, heads, seq, seq) probabilities for the
backward); values and gradients against plain eager torch."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import shardfn as sf
from shardfn import P

B, H, T, D = 4, 4, 8, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)]


def attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _capturing() -> tuple[object, list[set]]:
    """An aot_eager-like backend that records the ops of each forward graph it compiles."""
    graphs: list[set] = []

    def fw(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)), graphs


def _attention_ops(ops: set) -> set:
    return {o for o in ops if "attention" in o or "contract" in o or "softmax" in o}


def test_compiled_attention_takes_the_unsharded_kernel(mesh22):
    plain = _qkv()
    backend, graphs = _capturing()
    torch.compile(attention, backend=backend, fullgraph=True)(*plain)
    want = _attention_ops(graphs[-1])
    assert any("flash_attention_for_cpu" in o for o in want), want  # what torch compiles on the CPU

    leaves = [sf.distribute(t, P("x", "y"), mesh=mesh22).requires_grad_() for t in plain]
    backend, graphs = _capturing()
    out = torch.compile(attention, backend=backend, fullgraph=True)(*leaves)
    assert _attention_ops(graphs[-1]) == want  # no shardfn.contract, no softmax to save

    ref_leaves = [t.clone().requires_grad_() for t in plain]
    ref = attention(*ref_leaves)
    torch.testing.assert_close(sf.gather(out), ref)
    ct = torch.linspace(-1, 1, ref.numel()).reshape(ref.shape)
    grads = torch.autograd.grad(out, leaves, sf.distribute(ct, out.sharding))
    for g, r in zip(grads, torch.autograd.grad(ref, ref_leaves, ct)):
        torch.testing.assert_close(sf.gather(g), r)


def test_compiled_attention_on_shards_with_new_strides(mesh22):
    """Inputs as ``distribute`` stores them, then in another memory order (heads and positions
    swapped in memory): the recompile makes the shards' strides symbolic, and the fused
    kernel's fold over the mesh dims is planned on them."""
    f = torch.compile(attention, backend="aot_eager", fullgraph=True)
    plain = _qkv()
    first = [sf.distribute(t, P(None, "y"), mesh=mesh22) for t in plain]
    second = [sf.distribute(t.transpose(1, 2).contiguous().transpose(1, 2), P(None, "y"), mesh=mesh22) for t in plain]
    assert any(a._local.stride() != b._local.stride() for a, b in zip(first, second))
    want = attention(*plain)
    for qkv in (first, second):
        torch.testing.assert_close(sf.gather(f(*qkv)), want)
