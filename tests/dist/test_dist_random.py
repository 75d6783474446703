"""Random numbers on both backends: sf.random and torch's random ops give the same gathered
values on dist as on local (and as unsharded), replicas agree, generators stay in step."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import assert_equal, assert_shards, collect, is_dist, local_twin, scenario

import shardfn as sf
from shardfn import P

aten = torch.ops.aten


def _specs(mesh: sf.Mesh, ndim: int) -> list[P]:
    names = mesh.axis_names
    out = [P(), P(names[0]), P(*([None] * (ndim - 1)), names[-1]), P(tuple(reversed(names)))]
    if ndim >= 2 and mesh.ndim == 2:
        out.append(P(names[1], names[0]))
    out.append(P(names[0], partial=names[-1]) if mesh.ndim == 2 else P(partial=names[0]))
    return out


SAMPLERS = {
    "uniform": lambda k, s, sh, m: sf.random.uniform(k, s, sh, mesh=m, dtype=torch.float64),
    "normal": lambda k, s, sh, m: sf.random.normal(k, s, sh, mesh=m, std=3.0),
    "randint": lambda k, s, sh, m: sf.random.randint(k, s, -100, 100, sh, mesh=m),
    "bernoulli": lambda k, s, sh, m: sf.random.bernoulli(k, 0.25, s, sh, mesh=m),
}


@scenario
def sf_random_matches_the_unsharded_call(mesh: sf.Mesh) -> None:
    k = sf.random.key(2**64 - 5)
    for shape in ((8, 4), (7, 5), (3,)):
        for spec in _specs(mesh, len(shape)):
            for name, fn in SAMPLERS.items():
                want = fn(k, shape, None, None)
                out = fn(k, shape, spec, mesh)
                assert_equal(out.full_tensor(), want, f"{name} {shape} {spec}")
                if not spec.partial:
                    assert_shards(out, want, f"{name} {shape} {spec}")


OPS = {
    "dropout": lambda x: F.dropout(x, 0.3),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda x: torch.randint_like(x, 0, 7),
    "bernoulli": lambda x: torch.bernoulli(x, 0.6),
    "uniform": lambda x: aten.uniform(x, -2.0, 2.0),
    "exponential": lambda x: aten.exponential(x, 0.5),
    "normal": lambda x: torch.normal(x, 2.0),
    "native_dropout": lambda x: aten.native_dropout(x, 0.5, True)[0],
}


def _run(op, x: sf.ShardedArray, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    out = op(x)
    return out.full_tensor(), torch.rand(2)


@scenario
def torch_random_ops_match_the_local_backend(mesh: sf.Mesh) -> None:
    twin = local_twin(mesh)
    afters = []
    for shape in ((8, 6), (5, 3)):
        full = torch.randn(shape)  # the same on every rank (seeded by the harness)
        ref = sf.distribute(full, P(), mesh=twin)
        for spec in _specs(mesh, len(shape)):
            x = sf.distribute(full, spec, mesh=mesh)
            for name, op in OPS.items():
                got, after = _run(op, x, 11)
                want, after_ref = _run(op, ref, 11)
                assert_equal(got, want, f"{name} {shape} {spec}")
                assert_equal(after, after_ref, f"generator after {name} {shape} {spec}")
                afters.append(after)
    if is_dist(mesh):
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, torch.stack(afters))
        for other in everyone[1:]:
            assert_equal(other, everyone[0], "later plain draws on every rank")


@scenario
def replicas_hold_identical_draws(mesh: sf.Mesh) -> None:
    for spec in (P(), P(None, mesh.axis_names[-1])):
        x = sf.distribute(torch.zeros(6, 8), spec, mesh=mesh)
        torch.manual_seed(3)
        out = torch.rand_like(x)
        assert_shards(out, out.full_tensor(), f"rand_like {spec}")


@scenario
def dropout_gradient_uses_the_mask(mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(8, 6), P(mesh.axis_names[0]), mesh=mesh).requires_grad_()
    torch.manual_seed(5)
    out = F.dropout(x, 0.5)
    out.sum().backward()
    mask = out.full_tensor() != 0
    assert_equal(x.grad.full_tensor(), mask.float() * 2.0, "grad")


test_local, test_dist = collect(globals())
