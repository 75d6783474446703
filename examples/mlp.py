"""One training step of a data- and tensor-parallel MLP, on either backend.

The same program runs on a simulated mesh in one process or with one process per device:

    python examples/mlp.py                                  # local backend, (2, 2) mesh
    torchrun --nproc-per-node 4 examples/mlp.py             # dist backend, gloo on CPU
    torchrun --nproc-per-node 4 examples/mlp.py --mesh 4    # pure data parallel

Parameters and data come from ``sf.random`` (values independent of sharding and backend),
so every run prints the same loss (up to rounding). With ordered reductions
(``SHARDFN_DIST_REDUCTIONS=ordered``) and deterministic BLAS (``MKL_CBWR=COMPATIBLE`` on
CPU) the two backends agree bit for bit.
"""

from __future__ import annotations

import argparse
import os

import torch

import shardfn as sf
from shardfn import P

D_IN, D_HIDDEN, D_OUT, BATCH = 16, 64, 8, 32


def axes(mesh: sf.Mesh) -> tuple[str, str | None]:
    """(data-parallel axis, tensor-parallel axis or None) of a 1-D or 2-D mesh."""
    return mesh.axis_names[0], (mesh.axis_names[1] if mesh.ndim > 1 else None)


def init_params(mesh: sf.Mesh, seed: int = 0) -> dict[str, sf.ShardedArray]:
    """Column-parallel first layer, row-parallel second layer (Megatron style)."""
    _, tp = axes(mesh)
    k1, k2, k3 = sf.random.split(sf.random.key(seed), 3)
    return {
        "w1": sf.random.normal(k1, (D_IN, D_HIDDEN), P(None, tp), mesh=mesh) * D_IN ** -0.5,
        "b1": sf.random.normal(k2, (D_HIDDEN,), P(tp), mesh=mesh) * 0.1,
        "w2": sf.random.normal(k3, (D_HIDDEN, D_OUT), P(tp, None), mesh=mesh) * D_HIDDEN ** -0.5,
    }


def batch(mesh: sf.Mesh, seed: int = 1) -> tuple[sf.ShardedArray, sf.ShardedArray]:
    """Inputs and targets, sharded over the data-parallel axis."""
    dp, _ = axes(mesh)
    kx, ky = sf.random.split(sf.random.key(seed))
    return (sf.random.normal(kx, (BATCH, D_IN), P(dp), mesh=mesh),
            sf.random.normal(ky, (BATCH, D_OUT), P(dp), mesh=mesh))


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def train_step(params: dict, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> tuple[dict, torch.Tensor]:
    """SGD step: new parameters (same shardings as the old) and the loss before it."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = loss_fn(leaves, x, y)
    loss.backward()
    new = {k: sf.reshard((v - lr * v.grad).detach(), params[k].sharding) for k, v in leaves.items()}
    return new, loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", choices=["4", "2x2"], default="2x2")
    args = parser.parse_args()
    if "RANK" in os.environ and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = sf.Mesh((4,), ("dp",)) if args.mesh == "4" else sf.Mesh((2, 2), ("dp", "tp"))
    params = init_params(mesh)
    x, y = batch(mesh)
    for step in range(3):
        params, loss = train_step(params, x, y)
        value = loss.full_tensor().item()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"{mesh!r} step {step}: loss {value:.6f}")


if __name__ == "__main__":
    main()
