"""dispatch's warm path (``dispatch._fast_key``): a repeated call skips ``_dispatch``, and
its key still tells apart everything that changes the result (checked against plain torch,
each variant run warm after the others)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P, dispatch as _dispatch
from shardfn import _inplace


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("x", "y"), backend="local")


def _slow_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record every call that takes ``_dispatch`` (the cold path)."""
    seen: list = []
    slow = _dispatch._dispatch

    def counting(func, args, kwargs, fkey=None):
        seen.append(func)
        return slow(func, args, kwargs, fkey)

    monkeypatch.setattr(_dispatch, "_dispatch", counting)
    return seen


def test_warm_call_skips_the_cold_path(mesh, monkeypatch):
    x = sf.distribute(torch.randn(4, 6), P("x"), mesh=mesh)
    w = sf.distribute(torch.randn(6, 3), P(), mesh=mesh)
    for _ in range(2):
        y = torch.softmax(torch.relu(x @ w) * 2.5 + x.sum(0).sum(), -1)
    seen = _slow_calls(monkeypatch)
    z = torch.softmax(torch.relu(x @ w) * 3.5 + x.sum(0).sum(), -1)
    assert seen == []  # a new float scalar still hits
    want = torch.softmax(torch.relu(x.full_tensor() @ w.full_tensor()) * 3.5 + x.full_tensor().sum(), -1)
    torch.testing.assert_close(z.full_tensor(), want)
    assert y.sharding == z.sharding


@pytest.mark.parametrize("order", [0, 1, 2])
def test_key_tells_scalars_apart(mesh, order):
    """int, bool, float and tensor scalars promote differently: each variant, run after the
    others have filled the cache, gives torch's dtype and values."""
    scalars = [2, True, 2.5, 1, False, 2.0, 0, complex(1, 1), torch.tensor(2.5)]
    scalars = scalars[order:] + scalars[:order]
    for t in (torch.arange(8, dtype=torch.int32).reshape(2, 4), torch.arange(8).reshape(2, 4) > 3):
        x = sf.distribute(t, P("x"), mesh=mesh)
        for _ in range(2):
            for s in scalars:
                y, want = x * s, t * s
                got = y.full_tensor()
                assert y.dtype == got.dtype == want.dtype, (t.dtype, s)
                torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", [P("x"), P(), P(None, "y")])
def test_zero_dim_tensor_promotes_like_torch(mesh, dtype, spec):
    """A 0-d tensor operand (plain or a ShardedArray) ranks below dimensioned ones in type
    promotion, also when the local backend stores it with mesh dims."""
    t = (torch.arange(8) * 3 + 1).reshape(2, 4).to(dtype)
    x = sf.distribute(t, spec, mesh=mesh)
    big = torch.tensor(70000) if not dtype.is_floating_point else torch.tensor(3.5, dtype=torch.float64)
    for zero_d in (torch.tensor(3), big, sf.distribute(big, P(), mesh=mesh)):
        plain = zero_d.full_tensor() if isinstance(zero_d, sf.ShardedArray) else zero_d
        for fn in (torch.mul, torch.add, torch.lt, lambda a, b: torch.where(a > 2, a, b)):
            want = fn(t, plain)
            got = fn(x, zero_d)
            assert got.dtype == want.dtype
            for shard in got.local_shards():
                assert shard.dtype == want.dtype
            torch.testing.assert_close(got.full_tensor(), want)


def test_key_tells_layouts_shapes_dtypes_and_kwargs_apart(mesh):
    base = torch.randn(4, 4, dtype=torch.float64)
    variants = [
        (base, P("x")), (base, P(None, "y")), (base, P()), (base.float(), P("x")),
        (base[:2], P("x")), (base.T.contiguous(), P("x", "y")),
    ]
    for _ in range(2):
        for t, spec in variants:
            x = sf.distribute(t, spec, mesh=mesh)
            for fn in (lambda a: a.sum(dim=0), lambda a: a.sum(dim=1, keepdim=True), lambda a: a.sum(1),
                       lambda a: torch.softmax(a, 0), lambda a: a.to(torch.float16), lambda a: a + a):
                got, want = fn(x), fn(t)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert got.full_tensor().dtype == want.dtype
                torch.testing.assert_close(got.full_tensor(), want)


def test_list_arguments_and_views(mesh):
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("x"), mesh=mesh)
    for _ in range(2):
        for shape in ([6, 4], (2, 12), [24], [-1, 3]):
            torch.testing.assert_close(x.reshape(shape).full_tensor(), t.reshape(shape))
        torch.testing.assert_close(torch.cat([x, x], 1).full_tensor(), torch.cat([t, t], 1))
        torch.testing.assert_close(x.permute(1, 0).full_tensor(), t.permute(1, 0))
    v = x.view(2, 12)  # warm: the in-place policy still sees what the view aliases
    assert v.__dict__.get("_aliases_observable") or v.__dict__["_view_of"][0] is x


def test_a_rebound_array_is_keyed_by_its_new_layout(mesh):
    t = torch.randn(4, 4)
    x = sf.distribute(t, P("x"), mesh=mesh)
    for _ in range(2):
        x + x
    new = sf.distribute(2 * t[:, :2], P(None, "y"), mesh=mesh)
    with torch.no_grad():
        _inplace._rebind(x, new)  # what a composite's in-place op on a private temporary does
    got = x + x
    assert got.sharding == new.sharding
    torch.testing.assert_close(got.full_tensor(), 4 * t[:, :2])


def test_explicit_mode_still_checks_warm_calls(mesh):
    x = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    w = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    for _ in range(2):
        x @ w
    with pytest.raises(sf.ImplicitReshardError):
        with sf.explicit():
            x @ w


def test_gradients_through_warm_calls(mesh):
    t = torch.randn(4, 6, requires_grad=True)
    for _ in range(2):
        x = sf.distribute(t, P("x"), mesh=mesh)
        loss = (torch.relu(x) * 2.0).sum()
        (g,) = torch.autograd.grad(loss, t)
        (want,) = torch.autograd.grad((torch.relu(t) * 2.0).sum(), t)
        torch.testing.assert_close(g, want)


def test_fragment_table_reset_keeps_results_right(mesh, monkeypatch):
    monkeypatch.setattr(_dispatch, "_FRAGMENTS_MAX", 4)
    monkeypatch.setattr(_dispatch, "_fragments", {})  # earlier tests may have interned these triples
    for _ in range(2):
        for n in range(2, 12, 2):
            t = torch.randn(n, 4)
            x = sf.distribute(t, P("x"), mesh=mesh)
            torch.testing.assert_close((x * 3).sum(0).full_tensor(), (t * 3).sum(0))
    assert len(_dispatch._fragments) <= 4


def test_copies_share_the_fragment(mesh, monkeypatch):
    import copy

    x = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    for _ in range(2):
        x + x
    y = copy.deepcopy(x)
    assert y._kf is None or y._kf is x._kf
    seen = _slow_calls(monkeypatch)
    torch.testing.assert_close((y + y).full_tensor(), 2 * x.full_tensor())
    assert seen == []
