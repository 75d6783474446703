"""Collective matmul with sf.shard_map and sf.lax.ppermute (JAX's shard_map notebook).

``C = A @ B`` with ``A`` sharded by rows and ``B`` by columns over a ring of devices.
The plain version all-gathers ``A`` before multiplying; the collective version instead
multiplies the block it holds while passing blocks around the ring with ``ppermute``,
so on real hardware each transfer overlaps a block matmul. Both give ``A @ B`` and the
same gradients. Run: ``python examples/shard_map_matmul.py``.
"""

from __future__ import annotations

import functools

import torch

import shardfn as sf
from shardfn import P, lax

# single-process example: every device simulated in this process (not meant for torchrun)
mesh = sf.Mesh((4,), ("i",), backend="local")


@functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("i", None), P(None, "i")), out_specs=P(None, "i"))
def matmul_allgather(a_block: torch.Tensor, b_block: torch.Tensor) -> torch.Tensor:
    """Gather all rows of A, then multiply by this device's columns of B."""
    return lax.all_gather(a_block, "i", tiled=True) @ b_block


@functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("i", None), P(None, "i")), out_specs=P(None, "i"))
def matmul_collective(a_block: torch.Tensor, b_block: torch.Tensor) -> torch.Tensor:
    """Multiply the A block in hand, then pass it to the next device in the ring.

    At step ``s`` device ``d`` holds the rows of device ``(d - s) % n``, so its product
    is row block ``(d - s) % n`` of the result; the blocks are put in order at the end.
    """
    n = lax.axis_size("i")
    ring = [(j, (j + 1) % n) for j in range(n)]
    products = []
    for step in range(n):
        products.append(a_block @ b_block)
        if step < n - 1:
            a_block = lax.ppermute(a_block, "i", ring)
    stacked = torch.stack(products)  # step -> row block (d - step) % n
    order = (lax.axis_index("i") - torch.arange(n)) % n  # row block j was computed at step (d - j) % n
    return stacked[order].flatten(0, 1)


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(32, 8, requires_grad=True)
    ra, rb = torch.autograd.grad(((a @ b) ** 2).sum(), (a, b))
    ref = (a @ b).detach()
    for name, fn in [("all_gather", matmul_allgather), ("collective (ppermute)", matmul_collective)]:
        with sf.debug.CommCounter() as comm:
            c = fn(a, b)
        err = (c.full_tensor() - ref).abs().max().item()
        ga, gb = torch.autograd.grad((c.full_tensor() ** 2).sum(), (a, b))
        grad_err = max((ga - ra).abs().max().item(), (gb - rb).abs().max().item())
        print(f"{name:<22} result {c!r}")
        print(f"{'':<22} max |C - A@B| = {err:.2e}, max grad error = {grad_err:.2e}, "
              f"collectives {dict(comm.counts)}, {comm.bytes} B/device")
        assert err < 1e-4 and grad_err < 1e-3


if __name__ == "__main__":
    main()
