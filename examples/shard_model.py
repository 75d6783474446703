"""Shard a GPT-style block that was never materialised in full.

The block is built on the meta device (no memory), then ``sf.nn.shard_params`` turns each
parameter into a ShardedArray by regex rules, drawing each device's shard directly with a
sharding-invariant initialiser. The rules give Megatron-style tensor parallelism over the
mesh axis ``tp`` (column-parallel q/k/v and fc1, row-parallel o and fc2) and the batch is
split over ``dp``, on a (2, 4) mesh of simulated devices::

    python examples/shard_model.py

The forward pass is checked against the same block run unsharded on the gathered
parameters, and the collectives it issued are counted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import shardfn as sf
from shardfn import P

D_MODEL, N_HEADS, D_FF, N_LAYERS = 64, 8, 256, 12


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split_heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int = D_MODEL, heads: int = N_HEADS, hidden: int = D_FF) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


init = sf.nn.init
RESIDUAL_STD = 0.02 / math.sqrt(2 * N_LAYERS)  # GPT-2's scaled init of residual projections

RULES = [
    # column parallel: output features split over tp (each device owns whole heads)
    (r"attn\.(q|k|v)\.weight$", P("tp", None), init.normal(std=0.02)),
    (r"attn\.(q|k|v)\.bias$", P("tp"), init.zeros()),
    (r"mlp\.fc1\.weight$", P("tp", None), init.normal(std=0.02)),
    (r"mlp\.fc1\.bias$", P("tp"), init.zeros()),
    # row parallel: input features split over tp; the product is a pending sum over tp
    (r"(attn\.o|mlp\.fc2)\.weight$", P(None, "tp"), init.normal(std=RESIDUAL_STD)),
    (r"(attn\.o|mlp\.fc2)\.bias$", P(), init.zeros()),
    # layer norms replicated, with torch's default init (ones / zeros)
    (r"ln_\d\.", P()),
]


def main() -> None:
    # single-process example: every device simulated in this process (not meant for torchrun)
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    with torch.device("meta"):
        block = Block()
    params = sf.nn.shard_params(block, RULES, mesh=mesh, key=sf.random.key(0))

    full_bytes = sum(p.numel() * p.element_size() for p in params.values())
    shard_bytes = sum(
        max(s.numel() for s in p.local_shards()) * p.element_size() for p in params.values()
    )
    print(f"parameters: {full_bytes / 1024:.0f} KiB in full, {shard_bytes / 1024:.0f} KiB per device")
    for name, p in params.items():
        if name.startswith(("attn.q.", "attn.o.", "mlp.")):
            print(f"  {name:18s} {p}")

    batch, seq = 8, 16
    x = sf.random.normal(sf.random.key(1), (batch, seq, D_MODEL), P("dp"), mesh=mesh)
    with sf.debug.CommCounter() as comm:
        y = torch.func.functional_call(block, params, (x,))
        # the last residual add keeps the MLP's pending sum (free); it is reduced once,
        # by whatever reads it first: here a reshard to the input's layout
        y = sf.reshard(y, P("dp"))
    print(f"output: {y}")
    print(f"collectives in the forward pass: {dict(comm.counts)} ({comm.bytes} bytes per device)")

    dense = {name: sf.gather(p) for name, p in params.items()}
    want = torch.func.functional_call(block, dense, (sf.gather(x),))
    err = (sf.gather(y) - want).abs().max().item()
    print(f"max |sharded - unsharded| = {err:.2e}")
    assert err < 1e-4, err


if __name__ == "__main__":
    main()
