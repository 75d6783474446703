"""The strides a ShardedArray reports for a non-contiguous global value: ``sf.distribute`` of a
transposed, permuted or sliced tensor reports the strides torch gives a copy of it (``clone``:
the input's own where dense, else dense in its dim order), so ``is_contiguous()`` and
``view`` answer as torch's; ``from_local`` without ``stride=`` infers them from the shards' dim
order, as DTensor's ``from_local`` does; factories are contiguous, as torch's. (They reported
contiguous strides whatever the input: ``x.t().view(-1)`` ran where torch raises.)"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, generator=g)
    return {
        "t": a.t(),
        "permute3": torch.randn(2, 4, 6, generator=g).permute(2, 0, 1),
        "step_slice": a[:, ::2],
        "t_step_slice": a.t()[::2],
        "expanded": a.unsqueeze(0).expand(2, 4, 6),
        "narrow_t": a.t()[1:5],
        "contiguous": a,
    }


SPECS = [P(), P("x"), P(None, "x"), P("x", "y"), P(("x", "y")), P(None, ("y", "x"))]


@pytest.fixture(params=["cpu", "meta"])
def mesh(request: pytest.FixtureRequest) -> sf.Mesh:
    return sf.Mesh((2, 2), ("x", "y"), backend="local", device_type=request.param)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("name", sorted(_inputs()))
def test_distribute_reports_a_copys_strides(mesh: sf.Mesh, name: str, spec: P) -> None:
    t = _inputs()[name]
    x = sf.distribute(t.to(mesh.device_type), spec, mesh=mesh)
    want = t.clone()
    assert x.stride() == want.stride() and x.is_contiguous() == want.is_contiguous(), (x.stride(), want.stride())
    assert x.shape == t.shape and x.storage_offset() == 0
    if mesh.device_type != "meta":
        torch.testing.assert_close(x.full_tensor(), t, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P(), P("x"), P(None, "y")], ids=str)
def test_views_of_a_transposed_copy_answer_as_torch(mesh: sf.Mesh, spec: P) -> None:
    """``view(-1)`` of the transposed copy raises torch's RuntimeError; ``.t().view(-1)``,
    ``reshape`` and ``contiguous().view`` give torch's values; results of ops keep torch's
    strides (an elementwise op and ``zeros_like`` preserve the transposed order)."""
    t = _inputs()["t"].to(mesh.device_type)
    x = sf.distribute(t, spec, mesh=mesh)
    want = t.clone()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        want.view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.view(-1)
    assert not x.is_contiguous() and x.t().is_contiguous()
    for f in (lambda v: v.t().view(-1), lambda v: v.reshape(-1), lambda v: v.contiguous().view(-1),
              lambda v: v + 1, lambda v: torch.zeros_like(v), lambda v: v.transpose(0, 1).contiguous()):
        got, ref = f(x), f(want)
        assert got.shape == ref.shape and got.stride() == ref.stride(), (got.stride(), ref.stride())
        if mesh.device_type != "meta":
            torch.testing.assert_close(got.full_tensor(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P(), P("x"), P(None, ("x", "y"))], ids=str)
def test_gradient_through_a_transposed_copy(spec: P) -> None:
    """Values and the gradient of the plain input equal torch's, the input transposed."""
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 5, generator=torch.Generator().manual_seed(4))
    a = base.clone().requires_grad_()
    x = sf.distribute(a.t(), spec, mesh=mesh)
    loss = (x @ sf.distribute(w, P(), mesh=mesh)).sin().sum()
    loss.backward()
    ref = base.clone().requires_grad_()
    want = (ref.t().clone() @ w).sin().sum()
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.grad, ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec, want", [
    (P(), (1, 6)),  # replicated: the global value is the local one, transposed
    (P("x"), (1, 12)),  # (12, 6) gathered from (6, 6) shards transposed: dim 0 innermost
    (P(None, "y"), (1, 6)),  # (6, 12): dim 0 innermost
], ids=str)
def test_from_local_infers_strides_from_the_shards(spec: P, want: tuple) -> None:
    """DTensor's rule: the global strides are dense in the dim order of the shards."""
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    g = torch.Generator().manual_seed(5)
    same = torch.randn(6, 6, generator=g).t()
    shards = [same if spec == P() else torch.randn(6, 6, generator=g).t() for _ in range(4)]
    if spec == P("x"):  # replicas over 'y' equal
        shards[1], shards[3] = shards[0], shards[2]
    if spec == P(None, "y"):
        shards[2], shards[3] = shards[0], shards[1]
    x = sf.ShardedArray.from_local(shards, spec, mesh=mesh)
    assert x.stride() == want and not x.is_contiguous()
    full = {str(P()): same, str(P("x")): torch.cat([shards[0], shards[2]]),
            str(P(None, "y")): torch.cat([shards[0], shards[1]], 1)}[str(spec)]
    assert torch.empty(full.shape[::-1]).t().stride() == want  # (dense, dim 0 innermost)
    torch.testing.assert_close(x.full_tensor(), full, rtol=0, atol=0)
    assert sf.ShardedArray.from_local([s.contiguous() for s in shards], spec, mesh=mesh).is_contiguous()
    given = sf.ShardedArray.from_local(shards, spec, mesh=mesh, stride=x.t().contiguous().t().stride())
    assert given.stride() == x.t().contiguous().t().stride()


def test_factories_are_contiguous(mesh: sf.Mesh) -> None:
    """Factories lay out a fresh value contiguously, as torch's; ``*_like`` of a transposed
    array keeps its order, as torch's ``preserve_format``."""
    for make in (sf.zeros, sf.ones, sf.empty):
        x = make((4, 6), P("x"), mesh=mesh)
        assert x.stride() == (6, 1) and x.is_contiguous()
    t = sf.distribute(_inputs()["t"].to(mesh.device_type), P("x"), mesh=mesh)
    for like in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.rand_like):
        assert like(t).stride() == like(_inputs()["t"]).stride() == (1, 6)
