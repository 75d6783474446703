"""Collectives in a shard_map body whose blocks differ in shape between devices (uneven
in_specs), on the local backend and on 4 gloo processes: a tiled all_gather of pieces of
different lengths concatenates them (values and gradients as unsharded torch); shapes no
collective can combine raise a ShardingError naming the collective on every rank (dist hung
in gloo until the timeout, or aborted a worker)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import collect, scenario

import shardfn as sf
from shardfn import P, lax


def _x(rows: int) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float64).view(rows, 3) / 7


@scenario
def gather_of_pieces_of_different_lengths(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    for rows in (7, 5, 2):  # 2 rows over 4 devices: empty pieces too
        x = _x(rows)
        f = sf.shard_map(lambda b: lax.all_gather(b, a, tiled=True), mesh=mesh, in_specs=P(a), out_specs=P(),
                         check_vma=False)
        xs = sf.distribute(x, P(a), mesh=mesh).requires_grad_()
        out = f(xs)
        torch.testing.assert_close(sf.gather(out), x)
        (out * out).sum().backward()  # the gathered value's cotangent is whole on every device: its piece back
        torch.testing.assert_close(sf.gather(xs.grad), 2 * x)
        # gathered along dim 1 of the transposed block, under a vmap in the body
        f = sf.shard_map(lambda b: torch.func.vmap(lambda r: lax.all_gather(r, a, tiled=True))(b.mT), mesh=mesh,
                         in_specs=P(a), out_specs=P(), check_vma=False)
        torch.testing.assert_close(sf.gather(f(sf.distribute(x, P(a), mesh=mesh))), x.mT)


@scenario
def shapes_no_collective_combines_raise(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    x = _x(7) if mesh.ndim == 1 else _x(3)
    ring = [(i, (i + 1) % mesh.shape[0]) for i in range(mesh.shape[0])]
    cases = {"psum": lambda b: lax.psum(b, a), "pmax": lambda b: lax.pmax(b, a),
             "ppermute": lambda b: lax.ppermute(b, a, ring),
             "all_gather": lambda b: lax.all_gather(b, a, axis=1, tiled=True)}
    for name, fn in cases.items():
        f = sf.shard_map(fn, mesh=mesh, in_specs=P(a), out_specs=P(a), check_vma=False)
        # (the local backend permutes blocks of any shapes; the blocks then fit no output layout)
        with pytest.raises(sf.ShardingError, match=f"sf.lax.{name} over" if name != "ppermute" else None):
            f(sf.distribute(x, P(a), mesh=mesh))


test_local, test_dist = collect(globals())
