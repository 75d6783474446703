"""Megatron-style tensor-parallel blocks written with plain torch ops (Llama-style: RMSNorm,
GQA attention through sdpa, SwiGLU; GPT-style: LayerNorm, MHA, GELU MLP), weights sharded like
Megatron (q/k/v, gate/up, fc1 column-parallel; o/down, fc2 row-parallel), on the local
backend with a (dp=2, tp=2) mesh: tests/test_comm.py checks their values against torch and
their collectives against Megatron's hand counts (2 all_reduce per layer forward, at most 4
forward+backward). The Hugging Face models are in benchmarks/bench_comm_models.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

B, S, D, H, KV, HD, FF, VOCAB, LAYERS = 4, 16, 64, 8, 4, 8, 128, 96, 2


def _params(kind: str) -> list[dict[str, tuple[torch.Tensor, P]]]:
    """Per layer: name -> (weight, Megatron sharding)."""
    torch.manual_seed(0)
    kv = KV if kind == "llama" else H
    layers = []
    for _ in range(LAYERS):
        p = {
            "norm1": (torch.ones(D), P()), "norm2": (torch.ones(D), P()),
            "q": (torch.randn(H * HD, D) / D**0.5, P("tp")),
            "k": (torch.randn(kv * HD, D) / D**0.5, P("tp")),
            "v": (torch.randn(kv * HD, D) / D**0.5, P("tp")),
            "o": (torch.randn(D, H * HD) / D**0.5, P(None, "tp")),
            "up": (torch.randn(FF, D) / D**0.5, P("tp")),
            "down": (torch.randn(D, FF) / FF**0.5, P(None, "tp")),
        }
        if kind == "llama":
            p["gate"] = (torch.randn(FF, D) / D**0.5, P("tp"))
        layers.append(p)
    return layers


def _norm(kind: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (D,), w) if kind == "llama" else F.layer_norm(x, (D,), w)


def _layer(kind: str, x: torch.Tensor, p: dict) -> torch.Tensor:
    kv = KV if kind == "llama" else H
    h = _norm(kind, x, p["norm1"])
    q = F.linear(h, p["q"]).view(B, S, H, HD).transpose(1, 2)
    k = F.linear(h, p["k"]).view(B, S, kv, HD).transpose(1, 2)
    v = F.linear(h, p["v"]).view(B, S, kv, HD).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != H)
    x = x + F.linear(a.transpose(1, 2).reshape(B, S, H * HD), p["o"])
    h = _norm(kind, x, p["norm2"])
    if kind == "llama":
        m = F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"])
    else:
        m = F.gelu(F.linear(h, p["up"]))
    return x + F.linear(m, p["down"])


def _count(kind: str) -> tuple:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    layers = [{n: sf.distribute(w, s, mesh=mesh).requires_grad_() for n, (w, s) in p.items()}
              for p in _params(kind)]
    x = sf.distribute(torch.randn(B, S, D), P("dp"), mesh=mesh)
    with sf.debug.CommCounter() as fwd:
        for p in layers:
            x = _layer(kind, x, p)
    loss_in = x
    with sf.debug.CommCounter() as bwd:
        (loss_in * loss_in).mean().backward()
    grads = {f"{i}.{n}": w.grad for i, p in enumerate(layers) for n, w in p.items()}
    with sf.debug.CommCounter() as sync:
        sf.reshard(grads, {k: P(*g.spec, partial=None) for k, g in grads.items()})
    return fwd, bwd, sync
