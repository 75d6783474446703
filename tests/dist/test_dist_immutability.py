"""Immutability on both backends (issue 13): in-place routes raise with the array unchanged;
tensors handed in or out never alias the shards; a shard_map body writing its input and
gradient routes leave arrays unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_harness import assert_shards, collect, scenario

import shardfn as sf
from shardfn import ImmutableError, P


def _raises(fn, x, full):
    try:
        fn(x)
    except ImmutableError as e:
        assert "out-of-place" in str(e), str(e)
    else:
        raise AssertionError("no ImmutableError")
    assert_shards(x, full, "after a refused mutation")


@scenario
def inplace_routes_raise_unchanged(mesh):
    full = torch.arange(32.0).view(8, 4)
    ax = mesh.axis_names[0]
    for spec in (P(), P(ax), P(None, mesh.axis_names[-1])):
        x = sf.distribute(full, spec, mesh=mesh)
        for fn in (lambda a: a.add_(1), lambda a: a.__setitem__(0, 5.0), lambda a: a[1:].mul_(0),
                   lambda a: F.relu(a, inplace=True), lambda a: torch.nn.Dropout(0.5, inplace=True)(a),
                   lambda a: torch.add(a, 1, out=a), lambda a: a.copy_(torch.zeros(8, 4)),
                   lambda a: torch.nn.init.normal_(a)):
            _raises(fn, x, full)


@scenario
def no_aliasing_and_shard_map_inputs(mesh):
    ax = mesh.axis_names[0]
    t = torch.arange(32.0).view(8, 4)
    keep = t.clone()
    x = sf.distribute(t, P(ax), mesh=mesh)
    t.add_(100)  # the input of distribute
    x.full_tensor().add_(1)
    for s in x.local_shards():
        s.mul_(0)
    loc = x.to_local()
    for s in (loc if isinstance(loc, list) else [loc]):
        s.detach().mul_(0)
    assert_shards(x, keep, "after writes to tensors handed out")
    y = sf.shard_map(lambda a: a.mul_(0) + 1, mesh=mesh, in_specs=P(ax), out_specs=P(ax))(x)
    assert_shards(x, keep, "after a body wrote its input")
    assert_shards(y, torch.ones(8, 4), "body result")
    p = sf.distribute(keep, P(ax), mesh=mesh).requires_grad_()
    (p * p).sum().backward()
    g = p.grad.full_tensor().clone()
    try:
        p.grad.zero_()
    except ImmutableError:
        pass
    else:
        raise AssertionError("p.grad.zero_() did not raise")
    torch.testing.assert_close(p.grad.full_tensor(), g)


test_local, test_dist = collect(globals())
