"""Dropout in sharded training: the same seed gives the same masks on every mesh and layout.

A small MLP with ``F.dropout`` is trained for a few SGD steps three ways: tensor parallel
plus data parallel on a (2, 4) mesh, pure data parallel on the same mesh, and on a
single device. ``torch.manual_seed`` is set once before training; every dropout call
takes its draw from torch's generator through shardfn's counter-based generator, so each
element's mask bit depends only on its global index and the generator state::

    python examples/dropout_train.py

Note: the masks differ from plain torch's unsharded ``F.dropout`` on ordinary tensors (a
different algorithm). Code that must draw identical masks sharded *and* unsharded should
use ``sf.random.dropout(key, x, rate)`` with an explicit key, as shown at the end;
``sf.random.set_seed(key)`` makes a key drive the torch ops instead of torch's generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardfn as sf
from shardfn import P

D_IN, D_HIDDEN, BATCH, STEPS, LR, RATE = 16, 64, 32, 4, 0.1, 0.25


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_IN, D_HIDDEN), nn.Linear(D_HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(x)), RATE, self.training)
        self.last_mask = h == 0  # kept for the demo (gelu is never exactly 0 here)
        return self.fc2(h)


TENSOR_PARALLEL = [
    (r"fc1\.weight", P("tp", None)),
    (r"fc1\.bias", P("tp")),
    (r"fc2\.weight", P(None, "tp")),
    (r"fc2\.bias", P()),
]
REPLICATED = [(r".*", P())]


def batch(step: int, spec: P, mesh: sf.Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's data, the same values for every layout."""
    kx, ky = sf.random.split(sf.random.fold_in(sf.random.key(99), step))
    x = sf.random.normal(kx, (BATCH, D_IN), spec, mesh=mesh)
    y = sf.random.normal(ky, (BATCH, 1), spec, mesh=mesh)
    return x, y


def train(mesh: sf.Mesh, rules: list, data_spec: P) -> tuple[list[torch.Tensor], list[float]]:
    """A few SGD steps; returns the dropout masks (gathered) and the losses."""
    model = MLP()
    with torch.device("meta"):
        meta = MLP()
    params = sf.nn.shard_params(meta, rules, mesh=mesh, key=sf.random.key(0))
    torch.manual_seed(1234)  # the only seed: every dropout draw follows from it
    masks, losses = [], []
    for step in range(STEPS):
        x, y = batch(step, data_spec, mesh)
        out = torch.func.functional_call(model, params, (x,))
        loss = ((out - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        params = {n: (p - LR * g).detach().requires_grad_() for (n, p), g in zip(params.items(), grads)}
        masks.append(sf.gather(model.last_mask))
        losses.append(sf.gather(loss).item())
    return masks, losses


def main() -> None:
    # single-process example: every device simulated in this process (not meant for torchrun)
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    single = sf.Mesh((1,), ("dp",), backend="local")
    runs = {
        "tp+dp on (2, 4)": train(mesh, TENSOR_PARALLEL, P("dp")),
        "dp on (2, 4)": train(mesh, REPLICATED, P(("dp", "tp"))),
        "one device": train(single, REPLICATED, P()),
    }
    ref_masks, ref_losses = runs["one device"]
    for name, (masks, losses) in runs.items():
        same = all(torch.equal(m, r) for m, r in zip(masks, ref_masks))
        close = all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses))
        kept = torch.stack(masks).logical_not().double().mean().item()
        print(f"{name:16s} losses {[round(v, 5) for v in losses]}  masks identical: {same}  "
              f"kept {kept:.3f} (expect {1 - RATE})")
        assert same and close

    # plain torch draws differently; sf.random.dropout draws the same sharded or not
    torch.manual_seed(1234)
    h = torch.ones(BATCH, D_HIDDEN)
    plain = F.dropout(h, RATE) == 0
    print(f"plain torch F.dropout mask equals the sharded one: {torch.equal(plain, ref_masks[0])}")
    k = sf.random.key(7)
    sharded = sf.random.dropout(k, sf.distribute(h, P("dp", "tp"), mesh=mesh), RATE)
    assert torch.equal(sf.gather(sharded), sf.random.dropout(k, h, RATE))
    print("sf.random.dropout: sharded and unsharded masks identical: True")


if __name__ == "__main__":
    main()
