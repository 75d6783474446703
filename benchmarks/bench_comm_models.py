"""Collectives a Megatron-style tensor-parallel forward+backward issues per layer, next
to Megatron's hand count (2 all_reduces forward, 2 backward per transformer layer).

Small Llama-style (RMSNorm, GQA attention through sdpa, SwiGLU) and GPT-style (LayerNorm,
MHA, GELU MLP) blocks written here with plain torch ops, weights sharded like Megatron
(q/k/v, gate/up, fc1 column-parallel; o/down, fc2 row-parallel), on the local backend
with a (dp=2, tp=2) mesh, activations batch-sharded over 'dp'. Counts come from
sf.debug.CommCounter; the data-parallel gradient sync is counted apart. RMSNorm runs as
one op (``shardfn::rms_norm``), so its input gradient is one pending sum, reduced once
(torch's composite gave two, each reduced). tests/test_comm.py asserts the forward's 2
all_reduces per layer and at most 4 per layer forward+backward. Run
``python benchmarks/bench_comm_models.py``.
"""

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


def _per_layer(cc: sf.debug.CommCounter) -> str:
    return ", ".join(f"{k} {v / LAYERS:g}" for k, v in sorted(cc.counts.items())) or "none"


def main() -> None:
    print(f"Megatron TP on Mesh(dp=2, tp=2), {LAYERS} layers, batch {B} x seq {S}, d_model {D}")
    print(f"{'model':6} {'pass':22} {'shardfn per layer':40} Megatron per layer")
    for kind in ("llama", "gpt"):
        fwd, bwd, sync = _count(kind)
        print(f"{kind:6} {'forward':22} {_per_layer(fwd):40} all_reduce 2")
        print(f"{kind:6} {'backward (+loss)':22} {_per_layer(bwd):40} all_reduce 2")
        print(f"{kind:6} {'dp grad sync (total)':22} {dict(sync.counts)!s:40} DDP: 1 all_reduce per 25 MB bucket")


if __name__ == "__main__":
    main()
