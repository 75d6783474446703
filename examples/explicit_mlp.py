"""A tensor-parallel MLP written twice: once with sharding propagation, once under
``sf.explicit`` with ``out_sharding=``, printing the collectives each issues.

    python examples/explicit_mlp.py

Both compute the same loss and gradients. Propagation moves data where an op needs it
(here an all_reduce of the row-parallel layer's pending sum: the subtraction ``y - target``
keeps it pending, the square needs it whole); under ``sf.explicit`` that implicit move is an error, and the code says
where the data goes instead: ``out_sharding=P(("dp", "tp"))`` on the second matmul is one
reduce_scatter (sequence-parallel style), half the bytes of the all_reduce.
"""

from __future__ import annotations

import torch

import shardfn as sf
from shardfn import P

D_IN, D_HIDDEN, BATCH = 16, 64, 32


def make(mesh: sf.Mesh) -> tuple[dict, sf.ShardedArray, sf.ShardedArray]:
    k1, k2, kx, ky = sf.random.split(sf.random.key(0), 4)
    params = {
        "w1": sf.random.normal(k1, (D_IN, D_HIDDEN), P(None, "tp"), mesh=mesh) * D_IN ** -0.5,  # column parallel
        "w2": sf.random.normal(k2, (D_HIDDEN, D_IN), P("tp", None), mesh=mesh) * D_HIDDEN ** -0.5,  # row parallel
    }
    x = sf.random.normal(kx, (BATCH, D_IN), P("dp"), mesh=mesh)
    target = sf.random.normal(ky, (BATCH, D_IN), P("dp"), mesh=mesh)
    return params, x, target


def loss_propagated(p: dict, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Shardings follow from the inputs; data moves wherever an op needs it."""
    h = torch.relu(x @ p["w1"])          # P('dp', 'tp'), no communication
    y = h @ p["w2"]                      # P('dp', partial='tp'), no communication
    return ((y - target) ** 2).mean()    # the square needs y - target whole: an implicit all_reduce


@sf.explicit()
def loss_explicit(p: dict, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Every move is written down; anything else would raise sf.ImplicitReshardError."""
    h = torch.relu(sf.matmul(x, p["w1"], out_sharding=P("dp", "tp")))
    y = sf.matmul(h, p["w2"], out_sharding=P(("dp", "tp")))   # one reduce_scatter
    t = sf.reshard(target, P(("dp", "tp")))                   # a local slice, no communication
    return ((y - t) ** 2).mean()


def run(fn, params: dict, x: sf.ShardedArray, target: sf.ShardedArray) -> tuple[torch.Tensor, dict, dict]:
    """Loss, gradients (as full tensors) and the collectives of the forward (up to the
    pending loss) and of the backward."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    with sf.debug.CommCounter() as fwd:
        loss = fn(leaves, x, target)
    with sf.debug.CommCounter() as bwd:
        loss.backward()
    counts = {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}
    return sf.reshard(loss, P()).full_tensor(), {k: v.grad.full_tensor() for k, v in leaves.items()}, counts


def main() -> dict:
    # single-process example: every device simulated in this process (not meant for torchrun)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    params, x, target = make(mesh)
    results = {}
    for name, fn in (("propagation", loss_propagated), ("explicit", loss_explicit)):
        loss, grads, counts = run(fn, params, x, target)
        results[name] = (loss, grads, counts)
        print(f"{name:12s} loss {loss.item():.6f}  forward {counts['forward']}  backward {counts['backward']}")
    try:
        with sf.explicit():
            loss_propagated(params, x, target)
    except sf.ImplicitReshardError as e:
        print(f"propagation under sf.explicit: {e}")
    (l1, g1, _), (l2, g2, _) = results["propagation"], results["explicit"]
    same = torch.allclose(l1, l2, atol=1e-5) and all(torch.allclose(g1[k], g2[k], atol=1e-5) for k in g1)
    print(f"same loss and gradients: {same}")
    return results


if __name__ == "__main__":
    main()
