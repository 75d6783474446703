"""Quickstart: shard a tensor over a simulated (2, 4) mesh, compute, reshard, gather.

Run: python examples/quickstart.py
"""

import torch

import shardfn as sf
from shardfn import P

# A 2 x 4 grid of simulated devices (backend="local": all in this process). This is a
# single-process example; under torchrun every process would run its own simulated copy.
mesh = sf.Mesh((2, 4), ("x", "y"), backend="local")

# Rows over 'x', columns over 'y'. 7 x 5 does not divide evenly: that is fine.
full = torch.arange(35.0).reshape(7, 5)
x = sf.distribute(full, P("x", "y"), mesh=mesh)
print(x)
sf.debug.visualize_sharding(x)

# Ops run shard-wise with sharding propagation; the result stays sharded.
y = x * 2.0 + 1.0
print("y:", y.spec, "equals the unsharded result:", torch.equal(y.full_tensor(), full * 2 + 1))

# Move to another layout with the cheapest plan; see what it costs first.
print(sf.plan_redistribute(P("x", "y"), P("y", "x"), x.shape, mesh=mesh))
with sf.debug.CommCounter() as comm:
    z = sf.reshard(y, P("y", "x"))
print("reshard issued", dict(comm.counts), f"({comm.bytes} bytes on the busiest device)")

# Gradients flow through shardings back to the plain tensor.
w = torch.randn(7, 5, requires_grad=True)
loss = sf.reshard(sf.distribute(w, P("x"), mesh=mesh), P(None, "y")).full_tensor().pow(2).sum()
loss.backward()
print("grad equals 2*w:", torch.allclose(w.grad, 2 * w.detach()))
print("z gathered equals y gathered:", torch.equal(z.full_tensor(), y.full_tensor()))
