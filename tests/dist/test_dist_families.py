"""The rules the model-family census added (issue 21), on both backends: results and
gradients equal the local backend's and plain torch's (tests/test_rules_families.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_harness import check_against_twin_and_torch, collect, scenario

import shardfn as sf
from shardfn import P

f64 = torch.float64


def _axes(mesh: sf.Mesh) -> tuple[str, str]:
    return (mesh.axis_names[0], mesh.axis_names[-1])


@scenario
def layer_norm_backward_of_a_split_gradient(mesh: sf.Mesh) -> None:
    """Replicated input and statistics, the gradient split along a later leading dim."""
    a, b = _axes(mesh)
    x, w, bias, s = torch.randn(2, 8, 4, 16, dtype=f64), torch.randn(16, dtype=f64), torch.randn(16, dtype=f64), \
        torch.randn(2, 8, 4, 16, dtype=f64)
    check_against_twin_and_torch(lambda x, w, bias, s: F.layer_norm(x, (16,), w, bias) * s, mesh,
                                 [(x, P()), (w, P()), (bias, P()), (s, P(None, None, b))], grad=True, exact=False)


@scenario
def embedding_gradient_stays_pending(mesh: sf.Mesh) -> None:
    """A position-embedding-like table broadcast over a split batch: its gradient pending."""
    a, b = _axes(mesh)
    idx = torch.arange(6) % 5
    table, x = torch.randn(5, 8, dtype=f64), torch.randn(4, 6, 8, dtype=f64)

    def f(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i = sf.distribute(idx, P(), mesh=table.mesh) if isinstance(table, sf.ShardedArray) else idx
        return (F.embedding(i, table) + x).pow(2)

    check_against_twin_and_torch(f, mesh, [(table, P()), (x, P(a))], grad=True, exact=False)


def _write_heads(kv: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
    kn, _ = torch.split(kv, [3, 3], -1)
    ks = kv.new_empty(*kv.shape[:-1], 5)
    ks[..., :3].copy_(kn)
    ks[..., 3:].copy_(kr.expand(-1, kn.shape[1], -1, -1))
    return ks * 1.5


@scenario
def write_split_heads_into_a_fresh_buffer(mesh: sf.Mesh) -> None:
    a, b = _axes(mesh)
    kv, kr = torch.randn(4, 4, 3, 6, dtype=f64), torch.randn(4, 1, 3, 2, dtype=f64)
    for skv, skr in ((P(None, b), P()), (P(a, b) if a != b else P(a), P(a))):
        check_against_twin_and_torch(_write_heads, mesh, [(kv, skv), (kr, skr)], grad=True, exact=False,
                                     what=f"{skv} {skr}")


test_local, test_dist = collect(globals())
