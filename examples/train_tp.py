"""Functional training of a transformer block with tensor + data parallelism.

Parameters are a dict of ShardedArrays on a simulated (dp=2, tp=2) mesh: attention and
MLP weights are split Megatron-style over 'tp' (q/k/v/fc1 by output column, o/fc2 by
input row), the batch is split over 'dp'. Gradients come from ``torch.func.grad``, the
optimizer is a pure AdamW written with ``optree.tree_map``, and the same step runs eager
and under ``torch.compile(fullgraph=True)``. The loss curve is checked against the same
code on plain single-device tensors.

Run: python examples/train_tp.py [--steps 20] [--backend aot_eager|inductor|none]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import optree
import torch

import shardfn as sf
from shardfn import P

DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 4, 64, 8, 8

# Megatron layout: column-parallel in, row-parallel out; everything else replicated.
PARAM_SPECS = {
    "ln1": P(), "ln2": P(),
    "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
    "w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": P(),
}
DATA_SPEC = P("dp")


def init_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[0])).to(dtype)

    return {
        "ln1": torch.ones(DIM, dtype=dtype), "ln2": torch.ones(DIM, dtype=dtype),
        "wq": w(DIM, DIM), "wk": w(DIM, DIM), "wv": w(DIM, DIM), "wo": w(DIM, DIM),
        "w1": w(DIM, HIDDEN), "b1": torch.zeros(HIDDEN, dtype=dtype),
        "w2": w(HIDDEN, DIM), "b2": torch.zeros(DIM, dtype=dtype),
    }


def make_batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, SEQ, DIM, generator=g).to(dtype)
    return x, torch.roll(x, 1, dims=1).tanh()  # a learnable target: previous token, squashed


# -- model: plain torch ops; the same code runs on plain tensors and on ShardedArrays --------


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def attention(h: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    b, t, d = h.shape
    hd = d // HEADS

    def heads(z: torch.Tensor) -> torch.Tensor:  # (b, t, d) -> (b, heads, t, hd)
        return z.reshape(b, t, HEADS, hd).transpose(1, 2)

    q, k, v = heads(h @ p["wq"]), heads(h @ p["wk"]), heads(h @ p["wv"])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, t, d) @ p["wo"]


def block(x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    x = x + attention(rms_norm(x, p["ln1"]), p)
    h = torch.nn.functional.gelu(rms_norm(x, p["ln2"]) @ p["w1"] + p["b1"])
    return x + h @ p["w2"] + p["b2"]


def loss_fn(p: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (block(x, p) - y).pow(2).mean()


# -- pure functional AdamW ----------------------------------------------------------------------


def adamw_init(params: dict[str, Any]) -> dict[str, Any]:
    zeros = optree.tree_map(torch.zeros_like, params)
    return {"m": zeros, "v": optree.tree_map(torch.zeros_like, params)}


def adamw_update(params: dict, grads: dict, state: dict, step: torch.Tensor, *, lr: float = 1e-2,
                 b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, wd: float = 0.01) -> tuple[dict, dict]:
    # Gradients come back in whatever layout autograd produced (e.g. pending sums over
    # 'dp'); lay each out like its parameter: this is the data-parallel all-reduce.
    grads = optree.tree_map(_like, grads, params)
    m = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    bc1, bc2 = 1 - b1**step, 1 - b2**step

    def update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return p - lr * ((m / bc1) / ((v / bc2).sqrt() + eps) + wd * p)

    return optree.tree_map(update, params, m, v), {"m": m, "v": v}


def _like(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return sf.reshard(g, p.sharding) if isinstance(p, sf.ShardedArray) else g


def train_step(params: dict, state: dict, x: torch.Tensor, y: torch.Tensor,
               step: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
    params, state = adamw_update(params, grads, state, step)
    return params, state, loss


# -- driver ----------------------------------------------------------------------------------------


def shard(params: dict[str, torch.Tensor], mesh: sf.Mesh) -> dict[str, sf.ShardedArray]:
    return {k: sf.distribute(v, PARAM_SPECS[k], mesh=mesh) for k, v in params.items()}


def as_float(loss: torch.Tensor) -> float:
    return float(sf.gather(loss) if isinstance(loss, sf.ShardedArray) else loss)


def train(steps: int, mesh: sf.Mesh | None, backend: str | None, dtype: torch.dtype = torch.float32,
          timings: list | None = None) -> list[float]:
    """Loss per step; ``mesh=None`` trains unsharded, ``backend=None`` runs eagerly."""
    params = init_params(dtype=dtype)
    if mesh is not None:
        # `* 1` materialises replicated shards (stored as broadcast views) so the first
        # compiled step sees the strides every later step has: no recompilation.
        params = optree.tree_map(lambda p: p * 1, shard(params, mesh))
    state = adamw_init(params)
    step_fn = train_step if backend is None else torch.compile(train_step, backend=backend, fullgraph=True)
    losses = []
    for i in range(steps):
        x, y = make_batch(i, dtype)
        if mesh is not None:
            x, y = sf.distribute(x, DATA_SPEC, mesh=mesh), sf.distribute(y, DATA_SPEC, mesh=mesh)
        t0 = time.perf_counter()
        params, state, loss = step_fn(params, state, x, y, torch.tensor(float(i + 1), dtype=dtype))
        losses.append(as_float(loss))
        if timings is not None:
            timings.append(time.perf_counter() - t0)
    return losses


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend, or 'none'")
    ap.add_argument("--mesh", default="2,2", help="dp,tp mesh shape, e.g. 2,2 or 2,4")
    args = ap.parse_args()
    # single-process example: every device simulated in this process (not meant for torchrun)
    mesh = sf.Mesh(tuple(int(n) for n in args.mesh.split(",")), ("dp", "tp"), backend="local")

    ref = train(args.steps, None, None)
    runs = {"eager": train(args.steps, mesh, None)}
    if args.backend != "none":
        runs[f"compiled ({args.backend})"] = train(args.steps, mesh, args.backend)
    print(f"mesh {mesh}; {args.steps} steps; loss {ref[0]:.5f} -> {ref[-1]:.5f} (single device)")
    for name, losses in runs.items():
        rel = max_rel_diff(losses, ref)
        print(f"  sharded {name:<22} loss {losses[0]:.5f} -> {losses[-1]:.5f}; "
              f"max relative diff vs single device {rel:.2e} {'OK' if rel <= 1e-5 else 'MISMATCH'}")


if __name__ == "__main__":
    main()
