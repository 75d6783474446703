"""Ops with sharding propagation on both backends: results and gradients equal the local
backend's (bit for bit for pointwise ops) and plain torch's up to rounding, even and uneven."""

from __future__ import annotations

import torch
from dist_harness import check_against_twin_and_torch, collect, scenario

import shardfn as sf
from shardfn import P


def _axes(mesh: sf.Mesh) -> tuple[str, str]:
    return (mesh.axis_names[0], mesh.axis_names[-1])


@scenario
def pointwise_and_broadcasting(mesh: sf.Mesh) -> None:
    a, b = _axes(mesh)
    for shape in ((8, 6), (7, 5)):
        x, y, v = torch.randn(shape), torch.randn(shape), torch.randn(shape[1])
        for sx, sy, sv in ((P(a), P(a), P()), (P(a), P(None, b), P(b)), (P(None, b), P(a), P())):
            check_against_twin_and_torch(
                lambda x, y, v: torch.relu(x * y + v) - torch.exp(-x.abs()) / 2, mesh,
                [(x, sx), (y, sy), (v, sv)], grad=True, what=f"{shape} {sx} {sy} {sv}",
            )


@scenario
def matmuls(mesh: sf.Mesh) -> None:
    a, b = _axes(mesh)
    for m, k, n in ((8, 12, 4), (7, 10, 5)):
        x, w = torch.randn(m, k), torch.randn(k, n)
        pairs = [(P(a), P()), (P(None, b), P(b)), (P(), P(None, b))]
        if a != b:
            pairs += [(P(a, b), P(b)), (P(a), P(None, b))]
        for sx, sw in pairs:
            check_against_twin_and_torch(lambda x, w: x @ w, mesh, [(x, sx), (w, sw)], grad=True, exact=False,
                                         what=f"{(m, k, n)} {sx} @ {sw}")


@scenario
def reductions_and_views(mesh: sf.Mesh) -> None:
    a, b = _axes(mesh)
    for shape in ((8, 6), (7, 5)):
        x = torch.randn(shape)
        for spec in (P(a), P(None, b), P(a, b) if a != b else P(a)):
            check_against_twin_and_torch(
                lambda x: (x.sum(0), x.mean(1), x.amax(0), x.t() * 2, x.reshape(-1)[:3], x.sum()),
                mesh, [(x, spec)], grad=False, exact=False, what=f"{shape} {spec}",
            )
            check_against_twin_and_torch(lambda x: (x.sum(0) * x.mean()).sum(), mesh, [(x, spec)],
                                         grad=True, exact=False, what=f"{shape} {spec} grad")


@scenario
def local_call_facts(mesh: sf.Mesh) -> None:
    """Rules' declarative local-call facts on every backend: shard offsets (vocabulary-
    sharded embedding, class-sharded nll), squeeze of exactly the globally size-1 dims
    (a sharded dim may be size 1 locally), a mean over even and uneven shards, amax on
    an empty shard."""
    a, b = _axes(mesh)
    F = torch.nn.functional
    for vocab in (12, 10):
        w, idx = torch.randn(vocab, 5), torch.randint(0, vocab, (6, 3))
        check_against_twin_and_torch(lambda w, i: F.embedding(i, w), mesh, [(w, P(a)), (idx, P())],
                                     grad=False, exact=False, what=f"vocab {vocab} embedding")
        logits, target = torch.randn(6, vocab), torch.randint(0, vocab, (6,))
        check_against_twin_and_torch(lambda x, t=target: F.nll_loss(x, t, reduction="sum"), mesh,
                                     [(logits, P(None, a))], grad=True, exact=False, what=f"{vocab} classes nll")
    n = mesh.axis_size(a)
    x = torch.randn(n, 1, 3)
    check_against_twin_and_torch(lambda x: (x.squeeze(), x.squeeze(0), x.squeeze((0, 1))), mesh, [(x, P(a))],
                                 grad=False, what="squeeze of a dim split into size-1 shards")
    for shape in ((8, 6), (7, 5)):
        x = torch.randn(shape)
        check_against_twin_and_torch(lambda x: (x.mean(0), x.mean()), mesh, [(x, P(a, b) if a != b else P(a))],
                                     grad=True, exact=False, what=f"{shape} mean")
    x = torch.randn(n - 1, 4)
    check_against_twin_and_torch(lambda x: (x.amax(0), x.amin(0)), mesh, [(x, P(a))], grad=False,
                                 what="amax over an empty shard")



@scenario
def pending_sum_times_non_finite_factor(mesh: sf.Mesh) -> None:
    """A pending sum (the contraction split) times a factor holding inf is ``total * f`` on both
    backends (the pending operand reduced first), and times a bounded factor (``cos``) stays
    exact with no reduction first."""
    a, b = _axes(mesh)
    inf = float("inf")
    for m, k, n in ((4, 8, 4), (3, 7, 4)):
        x, w = torch.randn(m, k, dtype=torch.float64), torch.randn(k, n, dtype=torch.float64)
        f = torch.tensor([inf, -inf, 2.0, 0.0], dtype=torch.float64)
        for sf_ in (P(), P(b)):
            check_against_twin_and_torch(lambda x, w, f: (x @ w) * f, mesh, [(x, P(None, a)), (w, P(a)), (f, sf_)],
                                         grad=False, exact=False, what=f"{(m, k, n)} f {sf_}")
        t = torch.randn(n, dtype=torch.float64)
        check_against_twin_and_torch(lambda x, w, t: (x @ w) * torch.cos(t), mesh, [(x, P(None, a)), (w, P(a)), (t, P())],
                                     grad=True, exact=False, what=f"{(m, k, n)} cos")


@scenario
def negated_sum_of_zeros(mesh: sf.Mesh) -> None:
    """``-(x.sum(0))`` of zeros is torch's -0 on both backends (each part -0; a ring adds them
    to -0, and the simulated parts' sum keeps that sign), seen through ``1 / v``: -inf.
    A reduce_scatter (the total times a sharded operand) keeps it too."""
    a, b = _axes(mesh)
    x, y = torch.zeros(8, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64).neg()
    for spec in (P(a), P((a, b)) if a != b else P(a)):
        check_against_twin_and_torch(lambda x: 1 / -(x.sum(0)), mesh, [(x, spec)], what=f"sum {spec}")
        check_against_twin_and_torch(lambda x: 1 / -(x.mean(0)), mesh, [(x, spec)], what=f"mean {spec}")
        check_against_twin_and_torch(lambda x, y: 1 / (-(x.sum(0)) + y), mesh, [(x, spec), (y, P(a))],
                                     what=f"reduce_scatter {spec}")


@scenario
def shard_map_of_a_pending_input_keeps_its_partial_out_spec(mesh: sf.Mesh) -> None:
    """``in_specs=None`` on a pending input, out_specs its own spec: the body's value varies over
    the pending axis (each rank holds its part), which the dist backend's vma trace missed
    ("does not vary over 'x'"; dist fuzzer seeds 33001879, 33000316, 33002768)."""
    a, b = _axes(mesh)
    x = torch.randn(4, 3, dtype=torch.float64)

    def f(v):
        if not isinstance(v, sf.ShardedArray):
            return v * 3
        return sf.shard_map(lambda t: t * 3, mesh=v.mesh, in_specs=None, out_specs=v.spec)(v)

    for spec in (P(partial=a), P(b, partial=a) if a != b else P(partial=a)):
        check_against_twin_and_torch(f, mesh, [(x, spec)], exact=False, what=f"pending {spec}")


test_local, test_dist = collect(globals())
