"""dispatch's warm path (``dispatch._fast_key``): a repeated call skips ``_dispatch``, and
its key still tells apart everything that changes the result (checked against plain torch,
each variant run warm after the others)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P
from shardfn.arrays import aliases as _aliases
from shardfn.arrays import dispatch as _dispatch
from shardfn.arrays import fragments as _fragments


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


def test_warm_aliases_skip_the_cold_path(mesh, monkeypatch):
    """detach / alias / clone (autograd's detaches every step) of contiguous, strided and
    pending arrays: a warm one is a wrap on the fast path, reporting torch's strides, with the
    view link and the pending sum's reduction as on the cold path."""
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("x"), mesh=mesh)
    xt = x.t()  # strides (1, 6)
    pending = sf.distribute(t, P(None, "y"), mesh=mesh) @ sf.distribute(torch.randn(6, 2), P("y"), mesh=mesh)
    ops = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default)
    runs = []
    for warm in (False, True):
        if warm:
            seen = _slow_calls(monkeypatch)
        runs.append([(op, a, op(a)) for op in ops for a in (x, xt, pending)])
    assert seen == []
    for (op, a, cold), (_, _, hot) in zip(*runs):
        want = op(torch.empty_strided(tuple(a.shape), a.stride()))
        assert (hot.stride(), hot.storage_offset()) == (want.stride(), want.storage_offset()) == (
            cold.stride(), cold.storage_offset())
        assert hot.sharding == cold.sharding == a.sharding
        torch.testing.assert_close(hot.full_tensor(), a.full_tensor())
        if op is not torch.ops.aten.clone.default:
            assert hot.__dict__.get("_aliases_observable") or hot.__dict__["_view_of"][0] is a


def test_warm_clone_into_a_memory_format_copies_on_the_fast_path(mesh, monkeypatch):
    """``.contiguous()`` of a transposed view (torch's SDPA and reshape do it every step): a warm
    one is a copy reached on the fast path, never an alias of the strided shards."""
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("x"), mesh=mesh)
    pending = sf.distribute(t, P(None, "y"), mesh=mesh) @ sf.distribute(torch.randn(6, 4), P("y"), mesh=mesh)
    outs = []
    for warm in (False, True):
        if warm:
            seen = _slow_calls(monkeypatch)
        outs.append([a.t().contiguous() for a in (x, pending)])
    assert torch.ops.aten.clone.default not in seen
    for a, cold, hot in zip((x, pending), *outs):
        assert hot.is_contiguous() and hot.stride() == cold.stride() == (a.shape[0], 1)
        assert hot.sharding == cold.sharding
        assert hot._local is not a._local and hot._local is not cold._local
        torch.testing.assert_close(hot.full_tensor(), a.full_tensor().t())


def test_warm_views_keep_lazy_flags(mesh, monkeypatch):
    """A warm view of a lazily conjugated or negated array keeps the flag, as torch's views do
    (the fast path reads the flags off the dispatch keys), and an unflagged one gets none."""
    t = torch.randn(4, 6, dtype=torch.complex64)
    x = sf.distribute(t, P("x"), mesh=mesh)
    for flagged, plain in ((x.conj(), t.conj()), (torch._neg_view(x), torch._neg_view(t)), (x, t)):
        for _ in range(2):
            for got, want in ((flagged.t(), plain.t()), (flagged.view(2, 12), plain.view(2, 12))):
                assert (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg())
                torch.testing.assert_close(got.full_tensor(), want.resolve_conj().resolve_neg())
    seen = _slow_calls(monkeypatch)
    x.conj().t()
    assert aten_t not in seen


aten_t = torch.ops.aten.t.default


def test_views_judge_their_base_alike_cold_and_warm(mesh):
    """The in-place policy counts references to a view's base: the warm path holds none more
    than the cold one, so a named base is observable and an unnamed temporary private on both."""
    judged = []
    for n in (6, 7):  # each shape's first view takes the cold path, its second the warm one
        base = sf.distribute(torch.randn(4, n), P("x"), mesh=mesh)
        for _ in range(2):
            judged.append((bool(base.view(2, -1).__dict__.get("_aliases_observable")),
                           bool((base * 2).view(2, -1).__dict__.get("_aliases_observable"))))
    assert judged == [(True, False)] * 4


def test_a_rebound_array_is_keyed_by_its_new_layout(mesh):
    t = torch.randn(4, 4)
    x = sf.distribute(t, P("x"), mesh=mesh)
    for _ in range(2):
        x + x
    new = sf.distribute(2 * t[:, :2], P(None, "y"), mesh=mesh)
    with torch.no_grad():
        _aliases.rebind(x, new)  # what a composite's in-place op on a private temporary does
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
    monkeypatch.setattr(_fragments, "_FRAGMENTS_MAX", 4)
    monkeypatch.setattr(_fragments, "_fragments", {})  # earlier tests may have interned these triples
    for _ in range(2):
        for n in range(2, 12, 2):
            t = torch.randn(n, 4)
            x = sf.distribute(t, P("x"), mesh=mesh)
            torch.testing.assert_close((x * 3).sum(0).full_tensor(), (t * 3).sum(0))
    assert len(_fragments._fragments) <= 4


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


def test_low_rank_arrays_skip_the_torch_function_hook(mesh):
    """Arrays of 2 dims or fewer reach ``__torch_dispatch__`` without a torch-function hook;
    arrays with batch dims keep the one that runs batched matmul / einsum / rms_norm as one
    op. Both are ShardedArrays, flatten as pytrees, and ops pick the output's class by rank."""
    import optree

    disabled = torch._C._disabled_torch_function_impl
    x2 = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    x4 = sf.distribute(torch.randn(2, 2, 4, 4), P("x", "y"), mesh=mesh)
    assert isinstance(x2, sf.ShardedArray) and isinstance(x4, sf.ShardedArray)
    assert type(x2).__torch_function__ is disabled
    assert type(x4).__torch_function__ is not disabled
    assert type(x4.sum((0, 1))) is type(x2) and type(x2.unsqueeze(0)) is type(x4)
    tree = {"a": x2, "b": x4}
    leaves, spec = optree.tree_flatten(tree, namespace="shardfn")
    back = optree.tree_unflatten(spec, leaves)
    for k in tree:
        assert type(back[k]) is type(tree[k])
        torch.testing.assert_close(back[k].full_tensor(), tree[k].full_tensor())
    q = sf.distribute(torch.randn(2, 2, 4, 3), P("x", "y"), mesh=mesh)
    k = sf.distribute(torch.randn(2, 2, 5, 3), P("x", "y"), mesh=mesh)
    s = torch.matmul(q, k.transpose(2, 3))  # heads stay split: the hook ran contract
    assert s.spec == P("x", "y")
    torch.testing.assert_close(s.full_tensor(), q.full_tensor() @ k.full_tensor().transpose(2, 3))


def test_non_canonical_storage_takes_the_checked_path(mesh, monkeypatch):
    """The fast path assumes op outputs' storage form (size 1 on mesh dims a value does
    not vary over). An array stored otherwise (a replicated value repeated per device)
    gets no fast key, and its results have torch's values and the canonical form."""
    from shardfn.arrays.array import ShardedArray

    t = torch.randn(3, 3)
    r = sf.distribute(t, P(), mesh=mesh)
    expanded = ShardedArray(t.expand(2, 2, 3, 3), r._layout, (3, 3), t.dtype)
    for _ in range(2):
        torch.addmm(r, r, r.t())  # warm the entry with canonical arrays
    assert _dispatch._fast_key(torch.ops.aten.addmm.default, (expanded, expanded, r), {}) is None
    for _ in range(2):
        y = torch.addmm(expanded, expanded, r.t())
        torch.testing.assert_close(y.full_tensor(), t + t @ t.t())
        assert tuple(y._local.shape[:2]) == (1, 1)


@pytest.mark.parametrize("spec", [P(), P("x"), P(None, "y")])
def test_calls_the_same_on_every_device_run_once(spec):
    """On a mesh whose devices all compute the same thing (replicated inputs, or a mesh of
    size-1 axes) an op without a plain batched form runs once, as one device runs it:
    values, dtype and gradients as plain torch, warm and cold."""
    mesh = sf.Mesh((1, 1), ("x", "y"), backend="local") if spec != P() else sf.Mesh((2, 2), ("x", "y"), backend="local")
    g = torch.Generator().manual_seed(0)
    b, x, w = torch.randn(5, generator=g), torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    bs, xs, ws = (sf.distribute(v, spec if v.dim() == 2 else P(), mesh=mesh).requires_grad_() for v in (b, x, w))
    for _ in range(3):
        y = torch.addmm(bs, xs, ws, beta=0.5, alpha=2.0)
        torch.testing.assert_close(y.full_tensor(), torch.addmm(b, x, w, beta=0.5, alpha=2.0))
        s = xs.sum()
        torch.testing.assert_close(s.full_tensor(), x.sum())
    (y.sum() + s).backward()
    br, xr, wr = (v.clone().requires_grad_() for v in (b, x, w))
    (torch.addmm(br, xr, wr, beta=0.5, alpha=2.0).sum() + xr.sum()).backward()
    for got, want in ((bs, br), (xs, xr), (ws, wr)):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad)
    i = sf.distribute(torch.arange(12, dtype=torch.int32).reshape(3, 4), spec, mesh=mesh)
    for _ in range(2):
        z = torch.mm(i, i.t())
        assert z.dtype == torch.int32
        torch.testing.assert_close(z.full_tensor(), torch.mm(i.full_tensor(), i.full_tensor().t()))


def test_run_once_chains_read_the_kept_squeezed_output():
    """A run-once call keeps its output's squeezed form, so the next run-once call reads it
    without indexing the stacked value: same values (and gradients) as plain torch."""
    mesh = sf.Mesh((2, 2), ("x", "y"), backend="local")
    g = torch.Generator().manual_seed(1)
    b, x, w = torch.randn(5, generator=g), torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g)
    v = torch.randn(5, 5, generator=g)
    bs, xs, ws = (sf.distribute(t, P(), mesh=mesh).requires_grad_() for t in (b, x, w))
    vs = sf.distribute(v, P(), mesh=mesh)
    for i in range(3):
        y = torch.addmm(bs, xs, ws)
        if i:  # warm: the run-once path
            assert "_squeezed" in y._local.__dict__ and y._local.__dict__["_squeezed"].shape == (3, 5)
        z = torch.softmax(torch.addmm(bs, y, vs), -1).sum()
    br, xr, wr = (v.clone().requires_grad_() for v in (b, x, w))
    zr = torch.softmax(torch.addmm(br, torch.addmm(br, xr, wr), v), -1).sum()
    torch.testing.assert_close(z.full_tensor(), zr)
    z.backward()
    zr.backward()
    for got, want in ((bs, br), (xs, xr), (ws, wr)):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad)


def test_moves_needing_no_gradient_skip_the_autograd_function(mesh, monkeypatch):
    """``sf.reshard`` / ``distribute`` / ``full_tensor`` of values needing no gradient (an optimizer
    step's gradients, a batch) run the move alone; with a gradient to record they take the
    autograd Function, and gradients flow as before."""
    from shardfn.arrays import redistribute as _redistribute

    applied: list = []
    for cls in (_redistribute._Reshard, _redistribute._Distribute, _redistribute._FullTensor):
        monkeypatch.setattr(cls, "apply", classmethod(lambda c, *a, _f=cls.apply.__func__: applied.append(c) or _f(c, *a)))
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("x"), mesh=mesh)
    pending = sf.distribute(t, P(None, "y"), mesh=mesh) @ sf.distribute(torch.randn(6, 2), P("y"), mesh=mesh)
    r, g, f = sf.reshard(x, P(None, "y")), sf.reshard(pending, P()), x.full_tensor()
    assert applied == []
    assert r.sharding.spec == P(None, "y") and g.sharding.spec == P() and r.grad_fn is None and not r.requires_grad
    torch.testing.assert_close(r.full_tensor(), t)
    torch.testing.assert_close(g.full_tensor(), pending.full_tensor())
    torch.testing.assert_close(f, t)
    with torch.no_grad():  # grad mode off: nothing to record either
        sf.reshard(x.detach().requires_grad_(), P(None, "y"))
    assert applied == []
    w = t.clone().requires_grad_()
    xs = sf.distribute(w, P("x"), mesh=mesh)
    (sf.reshard(xs, P(None, "y")).full_tensor() * 2).sum().backward()
    assert applied[:3] == [_redistribute._Distribute, _redistribute._Reshard, _redistribute._FullTensor]  # (then backward)
    torch.testing.assert_close(w.grad, torch.full_like(t, 2.0))


def test_first_read_of_a_fresh_buffer_takes_the_fast_path(mesh, monkeypatch):
    """A factory's or clone's output is fresh (``fresh.py``) until first read; that read ends
    its freshness as the slow path would, then runs warm (autograd's ``ones_like`` seed and a
    ``.contiguous()`` copy are read every step)."""
    x = sf.distribute(torch.randn(4, 6), P("x"), mesh=mesh)
    for _ in range(2):
        x.clone() * 2
    seen = _slow_calls(monkeypatch)
    y = x.clone()
    assert "_fresh" in y.__dict__
    z = y * 2
    assert seen == [] and "_fresh" not in y.__dict__
    torch.testing.assert_close(z.full_tensor(), x.full_tensor() * 2)
    with pytest.raises(sf.ImmutableError):
        y.add_(1)  # read, so no longer a buffer to fill
    w = x.clone()
    w.add_(1)  # never read: still fresh, filled in place
    torch.testing.assert_close(w.full_tensor(), x.full_tensor() + 1)


def test_views_of_a_fresh_array_skip_the_observability_test(mesh, monkeypatch):
    """A view of a fresh array (an op's output not yet read: ``fresh.py``) is linked to its base
    whoever holds the base, so ``note_views`` does not count the base's references
    (``is_observed``: a Python call on most warm view ops); a view of a read array still does.
    Writes into the fresh base reach its views, as in torch."""
    x = sf.distribute(torch.randn(4, 6), P("x"), mesh=mesh)
    asked: list = []
    observed = _aliases.is_observed

    def counting(*args, **kwargs):
        asked.append(args[0])
        return observed(*args, **kwargs)

    monkeypatch.setattr(_aliases, "is_observed", counting)
    for _ in range(2):  # cold, then warm
        asked.clear()
        y = x * 2
        v = y.t()
        assert asked == [] and "_view_of" in v.__dict__
        y.add_(1)  # still fresh: filled in place, its view follows
        torch.testing.assert_close(v.full_tensor(), (x.full_tensor() * 2 + 1).t())
        y * 1  # read: fresh no longer
        w = y.t()
        assert [a is y for a in asked] == [True]
        torch.testing.assert_close(w.full_tensor(), (x.full_tensor() * 2 + 1).t())


def test_warm_detach_of_a_batched_array_calls_no_torch_function_hook(mesh, monkeypatch):
    """A warm detach of an array with batch dims (autograd's engine detaches saved outputs such
    as attention's in the backward, outside any torch-function hook: two a step in bench_sim)
    reads the dtype from its cache entry, not off the array through its torch-function hook (a
    Python call each); the result is the same kind of array with the same value and fast key."""
    from shardfn.arrays import array as _array
    from shardfn.arrays import special_ops as _special
    from shardfn.arrays.fresh import held_fragment

    t = torch.randn(4, 2, 6)
    x = sf.distribute(t, P("x", "y"), mesh=mesh) * 2
    entry = _special.alias_entry(torch.ops.aten.detach.default, (x,), {})
    hooked: list = []
    hook = _array._BatchedArray.__dict__["__torch_function__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        hooked.append(func)
        return hook(cls, func, types, args, kwargs)

    monkeypatch.setattr(_array._BatchedArray, "__torch_function__", classmethod(counting))
    d = entry.warm((x,), {})
    assert hooked == [], hooked
    assert type(d) is _array._BatchedArray and d._local is x._local and d._layout is x._layout
    assert d._kf is held_fragment(x) is not None  # (x is fresh: the fragment it holds back)
    monkeypatch.undo()
    assert d.dtype == t.dtype and tuple(d.shape) == (4, 2, 6)
    torch.testing.assert_close(d.full_tensor(), t * 2)
