"""Fresh arrays (``shardfn/arrays/fresh.py``, issue 25): an array an op just made (a factory's
buffer, ``new_*``, ``*_like``, ``clone``, or any op's result) accepts in-place writes until its
value is first read, as a functional update that its views see; any other array's in-place
write still raises.
Checked against plain torch: torch.func's Jacobians (whose basis is ``new_zeros`` then
``diagonal().fill_(1)``), ``matrix_power(x, 0)`` (``clone`` then ``copy_``), and the
adversarial routes (a read, a view read, a buffer written while another array aliases it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import ImmutableError, P

from conftest import meshes, specs


def _full(t):
    return t.full_tensor() if isinstance(t, sf.ShardedArray) else t


def _close(a, b):
    torch.testing.assert_close(_full(a), b, atol=1e-9, rtol=1e-7)


def _f(t):
    return t.sin() * t.sum() + t.pow(2)


def _scalar(t):
    return (t.sin() * t).sum() + (t * t).sum() * t.sum()


@settings(max_examples=12, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), transform=st.sampled_from(["jacrev", "jacfwd"]))
def test_jacobians_match_torch(data, n, transform):
    """jacrev/jacfwd over a sharded vector: the Jacobian equals torch's, and no fallback."""
    mesh = data.draw(meshes(max_devices=4))
    spec = data.draw(specs(mesh, 1, partial_ops=()))
    t = torch.randn(n, dtype=torch.float64)
    x = sf.distribute(t, spec, mesh=mesh)
    jac = getattr(torch.func, transform)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        got = jac(_f)(x)
    _close(got, jac(_f)(t))


@settings(max_examples=8, deadline=None)
@given(data=st.data(), shape=st.sampled_from([(3,), (2, 3)]))
def test_hessian_matches_torch(data, shape):
    """hessian (jacfwd over jacrev: the basis is filled inside vmap and jvp) equals torch's."""
    mesh = data.draw(meshes(max_devices=4))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    t = torch.randn(shape, dtype=torch.float64)
    x = sf.distribute(t, spec, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.FallbackWarning)
        got = torch.func.hessian(_scalar)(x)
    _close(got, torch.func.hessian(_scalar)(t))


def test_jacrev_of_a_matrix_function_two_inputs(mesh22):
    """jacrev over two sharded inputs (one basis chunk per output, each ``new_zeros``
    filled on a diagonal offset) equals torch's."""
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    sa, sb = sf.distribute(a, P("x", "y"), mesh=mesh22), sf.distribute(b, P("y"), mesh=mesh22)
    fn = lambda u, v: (u @ v).tanh()  # noqa: E731
    got = torch.func.jacrev(fn, argnums=(0, 1))(sa, sb)
    want = torch.func.jacrev(fn, argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("spec", [P(), P("x"), P(None, None, "y"), "pending"], ids=str)
def test_matrix_power(mesh22, k, spec):
    """matrix_power(x, k), k = 0 being ``clone`` then ``copy_`` of the identity (fuzzer seed
    5728956073: of a pending sum), with gradients."""
    a, b = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    if spec == "pending":  # the contraction split: x is a pending sum
        sa = sf.distribute(a, P(None, None, "x"), mesh=mesh22).requires_grad_()
        x = sa @ sf.distribute(b, P("x"), mesh=mesh22)
        assert x.spec.partial
    else:
        sa = sf.distribute(a, spec, mesh=mesh22).requires_grad_()
        x = sa @ sf.distribute(b, P(), mesh=mesh22)
    ta = a.clone().requires_grad_()
    got, want = torch.linalg.matrix_power(x, k), torch.linalg.matrix_power(ta @ b, k)
    _close(got, want.detach())
    if k:
        g = torch.randn(2, 3, 3, dtype=torch.float64)
        (gx,) = torch.autograd.grad((got * sf.distribute(g, P(), mesh=mesh22)).sum(), sa)
        (gt,) = torch.autograd.grad((want * g).sum(), ta)
        _close(gx, gt)


# -- fresh buffers: torch's values, views included ------------------------------------------------


def test_fresh_buffer_fills_and_views_see_them(mesh22):
    """A zeros_like buffer filled through views and index_add_, as torch fills it."""
    t = torch.randn(4, 4)
    x = sf.distribute(t, P("x", "y"), mesh=mesh22)
    outs = []
    for src in (x, t):
        z = torch.zeros_like(src)
        row, diag = z[1], z.diagonal()
        diag.fill_(2.0)
        z.index_add_(0, torch.tensor([0, 3, 0]), torch.ones(3, 4))
        row.mul_(3.0)
        outs.append((z, row, diag))
    for got, want in zip(outs[0], outs[1]):
        _close(got, want)


def test_clone_then_write_is_torchs_and_leaves_the_source(mesh22):
    t = torch.randn(4, 4)
    x = sf.distribute(t, P("x"), mesh=mesh22)
    y = x.clone()
    y[0] = 5.0
    y.t()[1].zero_()
    want = t.clone()
    want[0] = 5.0
    want.t()[1].zero_()
    _close(y, want)
    _close(x, t)


def test_fresh_write_bumps_the_version_and_autograd_reads_end_it(mesh22):
    """A write bumps the version counter as torch's does; an op that saves the buffer for
    backward reads it, so the buffer can no longer change under autograd."""
    x = sf.distribute(torch.randn(4), P("x"), mesh=mesh22).requires_grad_()
    z = torch.zeros_like(x)
    v = z._version
    z.fill_(1.0)
    assert z._version > v
    y = x * z  # reads z (and saves it): z is a value from here on
    with pytest.raises(ImmutableError):
        z.fill_(2.0)
    y.sum().backward()
    _close(x.grad, torch.ones(4))


def test_fresh_buffer_under_grad_and_vmap(mesh22):
    """A function that fills a buffer it made, under torch.func.grad and vmap."""
    def fn(u):
        buf = u.new_zeros(u.shape)
        buf.diagonal().fill_(2.0)
        buf.index_add_(0, torch.tensor([2, 0]), u[:2].exp())
        return (buf * u).sum()

    t = torch.randn(3, 3, dtype=torch.float64)
    x = sf.distribute(t, P("x"), mesh=mesh22)
    _close(torch.func.grad(fn)(x), torch.func.grad(fn)(t))
    tb = torch.randn(2, 3, 3, dtype=torch.float64)
    xb = sf.distribute(tb, P(None, "y"), mesh=mesh22)
    _close(torch.func.vmap(fn)(xb), torch.func.vmap(fn)(tb))


def test_fresh_buffer_under_compile(mesh22):
    def fn(u):
        buf = torch.zeros_like(u)
        buf.index_add_(0, torch.tensor([1, 0, 1]), u[:3].exp())
        return buf * 2

    t = torch.randn(4, 4)
    x = sf.distribute(t, P(None, "y"), mesh=mesh22)
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    _close(got, fn(t))


@pytest.mark.parametrize("mask", [True, False])
def test_a_compiled_regions_buffer_written_after_a_graph_break_raises_saying_why(mesh22, mask):
    """A buffer made in a compiled region and written after its graph break is a graph output:
    never fresh (whether the graph read or aliased it is not known outside it), so the write
    raises naming the compiled region and the remedy, which works (fuzzer seed 52000311 --gen 5
    --families model: a 0-d clone then ``w[mask] = 0``, whose unsqueeze view is the target)."""
    def made(u):
        w = u.clone()
        torch._dynamo.graph_break()
        return w

    t = torch.tensor(5, dtype=torch.int8)
    x = sf.distribute(t, P(), mesh=mesh22)
    m = torch.tensor(mask)
    e = x.clone()
    e[m] = 0  # eager: the clone is fresh
    torch._dynamo.reset()
    w = torch.compile(made, backend="aot_eager")(x)
    for target in (w, w[None]):
        with pytest.raises(ImmutableError, match=r"torch.compile'd region returned.*w = w.clone\(\)"):
            target[m[None] if target.dim() else m] = 0
    _close(w, t)  # nothing half-changed
    w = w.clone()
    w[m] = 0
    r = t.clone()
    r[m] = 0
    _close(w, r)
    _close(e, r)


# -- adversarial: what another holder can see still raises ----------------------------------------


def _held(mesh):
    return sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)


ROUTES = {
    "read by an op": lambda z: z * 2,
    "read through a view": lambda z: z[0].sum(),
    "full_tensor": lambda z: z.full_tensor(),
    "gather": lambda z: sf.gather(z),
    "reshard": lambda z: sf.reshard(z, P("y")),
    "reshard to its own layout": lambda z: sf.reshard(z, z.sharding),
    "reshard of a tree": lambda z: sf.reshard({"a": z}, {"a": z.sharding}),
    "local_shards": lambda z: z.local_shards(),
    "item of a view": lambda z: z[0, 0].item(),
    "clone": lambda z: z.clone(),
    "copy_ source": lambda z: torch.zeros_like(z).copy_(z),
    "index_add_ source": lambda z: torch.zeros_like(z).index_add_(0, torch.tensor([0]), z[:1]),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("maker", ["zeros_like", "new_empty", "clone"])
def test_a_read_buffer_is_immutable(mesh22, route, maker):
    x = _held(mesh22)
    z = {"zeros_like": lambda: torch.zeros_like(x), "new_empty": lambda: x.new_empty((4, 4)),
         "clone": lambda: x.clone()}[maker]()
    v = z[1:]
    z.fill_(1.0)  # fresh: filled
    ROUTES[route](z)
    before = z.full_tensor()
    with pytest.raises(ImmutableError):
        z.fill_(3.0)
    with pytest.raises(ImmutableError):
        v.zero_()  # a view of it too
    with pytest.raises(ImmutableError):
        z.t().mul_(2)  # a view made after the read
    assert torch.equal(z.full_tensor(), before)


def test_not_fresh_arrays_still_raise(mesh22):
    """Arrays no op made, or read: distribute, a read op output, a view of a held array, a grad."""
    x = _held(mesh22)
    y = x + 1
    _ = y * 2  # read
    for target in (x, y, x[0], y.t(), x.detach()):
        with pytest.raises(ImmutableError):
            target.fill_(0.0)
    for loss in (lambda p: (p * 2).sum(), lambda p: p.sum()):  # (the second's gradient: a view of a ones_like)
        p = sf.distribute(torch.randn(4), P("x"), mesh=mesh22).requires_grad_()
        loss(p).backward()
        with pytest.raises(ImmutableError):
            p.grad.zero_()


def test_a_fresh_buffer_read_by_a_saved_result_keeps_that_result(mesh22):
    """``a = zeros_like(x); b = a + 1`` ends the freshness: b is never rewritten."""
    x = _held(mesh22)
    a = torch.zeros_like(x)
    b = a + 1
    with pytest.raises(ImmutableError):
        a.fill_(7.0)
    _close(b, torch.ones(4, 4))
    _close(a, torch.zeros(4, 4))


def test_pending_clone_written_is_not_a_recomputation(mesh22):
    """Two clones of one pending sum: writing the first must not change the second (a
    pending output is otherwise linked to an earlier equal computation)."""
    t = torch.randn(4, 4)
    s = sf.distribute(t, P(partial="x"), mesh=mesh22) * 1.0
    a = s.clone()
    b = s.clone()
    a.fill_(0.0)
    _close(b + 0, t)
    _close(a + 0, torch.zeros(4, 4))


def test_a_write_into_an_expanded_view_raises_as_torchs(mesh22):
    """Elements sharing memory (an ``expand`` of a fresh buffer, the gradient of a ``sum``):
    torch's kernels refuse the write; so does the policy (a functional update through the
    view would add the copies up)."""
    z = torch.zeros_like(sf.distribute(torch.ones(()), P(), mesh=mesh22))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        z.expand(4).mul_(2)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.zeros(()).expand(4).mul_(2)
    p = sf.distribute(torch.randn(4), P("x"), mesh=mesh22).requires_grad_()
    g = torch.autograd.grad(p.sum(), p)[0]
    with pytest.raises(RuntimeError, match="more than one element"):
        g.mul_(2)
    _close(g, torch.ones(4))


# -- any op's result, unread: a named temporary a function finishes in place ------------------------


def _finish(x, w, b, bias, idx, src):
    """Writes into results a function made and holds by name, as HF's MoE code does: Llama 4's
    ``out = shared_expert(h); out.add_(routed)``, transformers' batched experts
    ``out = bmm(..).squeeze(1); out.add_(bias)``, PhiMoE's backward ``g = a * b; g.scatter_add_``."""
    out = x @ w
    out.add_(b)
    sq = torch.bmm(x.unsqueeze(1), w.expand(x.shape[0], -1, -1)).squeeze(1)
    sq.add_(bias)
    g = x * b
    g.scatter_add_(-1, idx, src)
    return out * 2 + sq + g


@pytest.mark.parametrize("spec", [P(), P("x"), P(None, "y")], ids=str)
def test_an_unread_result_is_fresh_values_and_gradients(mesh22, spec):
    """An op's result no one has read yet is written like a factory's buffer: values and
    gradients (autograd and torch.func) equal torch's; its views see the write."""
    g = torch.Generator().manual_seed(3)
    t = [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    idx = torch.tensor([[0, 1], [2, 3], [1, 1], [0, 3]])
    src = torch.randn(4, 2, generator=g, dtype=torch.float64)
    leaves = [a.clone().requires_grad_() for a in t]
    want = _finish(*leaves, idx, src)
    want.sum().backward()
    arrays = [sf.distribute(a, spec, mesh=mesh22).requires_grad_() for a in t]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _finish(*arrays, idx, src)
        got.sum().backward()
        fgrads = torch.func.grad(lambda a: _finish(*a, idx, src).sum())(
            [sf.distribute(a, spec, mesh=mesh22) for a in t])
    _close(got, want.detach())
    for a, f, leaf in zip(arrays, fgrads, leaves):
        _close(a.grad, leaf.grad)
        _close(f, leaf.grad)
    y = sf.distribute(t[0], spec, mesh=mesh22) * 2
    v = y.t()
    y.add_(1.0)  # never read: fresh; its view sees the write
    _close(v, (t[0] * 2 + 1).t())


def test_a_read_result_is_immutable_and_saved_results_error_as_torch(mesh22):
    """Once read, a result is a value (ImmutableError); a write into a result its own op saved
    for backward (``exp``) fails the backward as torch's does (the version counter)."""
    x = sf.distribute(torch.randn(4), P("x"), mesh=mesh22)
    y = x + 1
    z = y * 2
    with pytest.raises(ImmutableError):
        y.add_(1.0)
    _close(z, (x.full_tensor() + 1) * 2)
    for src in (sf.distribute(torch.randn(4), P("x"), mesh=mesh22), torch.randn(4)):
        e = src.requires_grad_().exp()
        e.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            e.sum().backward()


def test_an_unread_pending_result_written_is_not_a_recomputation(mesh22):
    """Two equal computations of a pending sum: writing the first, unread, must not change the
    second (pending results are otherwise linked to an earlier equal one), nor a third."""
    t = torch.randn(4, 4)
    s = sf.distribute(t, P(partial="x"), mesh=mesh22)
    a = s * 2.0
    b = s * 2.0
    a.fill_(0.0)
    c = s * 2.0
    _close(b + 0, t * 2)
    _close(c + 0, t * 2)
    _close(a + 0, torch.zeros(4, 4))
