"""A pending sum in a contraction with a factor that may hold inf (issue 25, seed 5749662553):
torch computes ``total @ B``, so a part of 0 must not give ``0 * inf = nan`` nor parts of both
signs ``inf - inf``. Every product rule (``rules/dims.py``: mm, bmm, addmm, baddbmm, mv, dot,
vdot, inner, outer, einsum, tensordot, linear, matmul, shardfn's own ``contract``) reduces a
pending operand first unless the other factors are known finite (``arrays/bounds.py``);
integer factors and bounded ones (softmax, cos, clamp...) keep it pending with no collective."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

INF, NAN = math.inf, math.nan
MESHES = [((2,), ("x",)), ((3,), ("x",)), ((2, 2), ("x", "y"))]


def _close(got, want, tol=1e-12):
    """Equal, inf and nan positions included, in the real and the imaginary part (``tol``: a
    sum in another order)."""
    got = got.full_tensor() if isinstance(got, sf.ShardedArray) else got
    if got.is_complex():  # assert_close takes a nan in either part as the whole value's nan
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=tol, atol=tol)


def _pending(mesh: sf.Mesh, parts: list[torch.Tensor]) -> sf.ShardedArray:
    """A pending sum over every mesh axis with these parts (one per device)."""
    return sf.ShardedArray.from_local(parts, P(partial=mesh.axis_names), mesh=mesh)


def _parts(draw, mesh: sf.Mesh, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    """Parts of small integers, zeros often (a device whose part is 0 meets the inf)."""
    vals = st.sampled_from([0.0, 0.0, 0.0, 1.0, -1.0, 2.0, -3.0])
    n = math.prod(shape)
    out = []
    for _ in range(mesh.size):
        t = torch.tensor(draw(st.lists(vals, min_size=n, max_size=n)), dtype=torch.float64).reshape(shape)
        if dtype.is_complex:
            t = torch.complex(t, torch.tensor(draw(st.lists(vals, min_size=n, max_size=n)),
                                               dtype=torch.float64).reshape(shape))
        out.append(t.to(dtype))
    return out


def _factor(draw, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    vals = st.sampled_from([0.0, 1.5, -2.0, INF, -INF, NAN, 1.0])
    n = math.prod(shape)
    t = torch.tensor(draw(st.lists(vals, min_size=n, max_size=n)), dtype=torch.float64).reshape(shape)
    if dtype.is_complex:  # inf in the real or the imaginary part
        t = torch.complex(t, torch.tensor(draw(st.lists(vals, min_size=n, max_size=n)),
                                           dtype=torch.float64).reshape(shape))
    return t.to(dtype)


# name -> (pending shape, factor shape, fn(pending, factor)); m=2, k=3, n=2, batch 2
OPS = {
    "mm": ((2, 3), (3, 2), lambda p, f: p @ f),
    "mm_left": ((3, 2), (2, 3), lambda p, f: f @ p),
    "bmm": ((2, 2, 3), (2, 3, 2), torch.bmm),
    "bmm_left": ((2, 3, 2), (2, 2, 3), lambda p, f: torch.bmm(f, p)),
    "matmul_bcast": ((2, 3), (2, 3, 2), torch.matmul),
    "mv": ((2, 3), (3,), torch.mv),
    "mv_vec": ((3,), (2, 3), lambda p, f: torch.mv(f, p)),
    "dot": ((3,), (3,), torch.dot),
    "vdot": ((3,), (3,), torch.vdot),
    "vdot_left": ((3,), (3,), lambda p, f: torch.vdot(f, p)),
    "inner": ((2, 3), (2, 3), torch.inner),
    "outer": ((3,), (2,), torch.outer),
    "einsum": ((2, 3), (3, 2), lambda p, f: torch.einsum("ik,kj->ij", p, f)),
    "tensordot": ((2, 3, 2), (3, 2), lambda p, f: torch.tensordot(p, f, dims=([1, 2], [0, 1]))),
    "linear": ((2, 3), (2, 3), F.linear),
    "linear_weight": ((2, 3), (2, 3), lambda p, f: F.linear(f, p)),
    "addmm": ((2, 3), (3, 2), lambda p, f: torch.addmm(torch.ones(2, dtype=f.dtype), p, f)),
    "baddbmm": ((2, 2, 3), (2, 3, 2), lambda p, f: torch.baddbmm(torch.ones(2, 2, 2, dtype=f.dtype), p, f, alpha=2.0)),
    "addmv": ((2, 3), (3,), lambda p, f: torch.addmv(torch.ones(2, dtype=f.dtype), p, f)),
    "addr": ((2,), (3,), lambda p, f: torch.addr(torch.ones(2, 3, dtype=f.dtype), p, f)),
}


@st.composite
def _cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    mesh = sf.Mesh(shape, names)
    name = draw(st.sampled_from(sorted(OPS)))
    pshape, fshape, fn = OPS[name]
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.complex128]))
    parts = _parts(draw, mesh, pshape, dtype)
    f = _factor(draw, fshape, dtype)
    return mesh, name, fn, parts, f, draw(st.booleans())


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_pending_sum_in_a_contraction_with_inf_matches_torch(case):
    mesh, name, fn, parts, f, plain = case
    p = _pending(mesh, parts)
    F_ = f if plain else sf.distribute(f, P(), mesh=mesh)
    got = fn(p, F_)
    if f.is_complex():
        # torch's complex kernels disagree on the parts of a non-finite product (mv's gemv gives
        # nan+nanj where a batched kernel gives -inf+nanj, with no pending sum at all): the
        # non-finite positions are torch's, the finite values too
        got, want = got.full_tensor(), fn(sum(parts), f)
        assert torch.equal(got.isfinite(), want.isfinite())
        torch.testing.assert_close(got[got.isfinite()], want[want.isfinite()], rtol=1e-12, atol=1e-12)
    else:
        _close(got, fn(sum(parts), f))


def test_the_fuzzer_case_inner_over_a_split_size_one_dim():
    """Seed 5749662553: ``inner`` over a size-1 dim split over an axis (a device holding none of
    it has a part of 0), the other operand ``o / x`` holding inf."""
    mesh = sf.Mesh((2, 3), ("x", "y"))
    x = torch.tensor([[0.0], [2.0], [-1.0]])
    w = torch.tensor([[1.0, -2.0, 0.5]])
    o = torch.tensor([[1.0], [1.0], [0.0]]) / x  # inf, 0.5, -0
    X = sf.distribute(o, P(), mesh=mesh)
    W = sf.distribute(w, P("y", "x"), mesh=mesh)
    _close(torch.inner(X, W.t()), torch.inner(o, w.t()))
    _close(torch.inner(W.t(), X), torch.inner(w.t(), o))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_factors_keep_the_sum_pending(dtype):
    """Integers hold no inf: a pending integer product meets another integer with no collective."""
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([[1, 0, 2], [0, 0, 3]], dtype=dtype), torch.tensor([[0, 4, -2], [5, 0, 0]], dtype=dtype)]
    f = torch.tensor([[1, -2], [3, 0], [0, 7]], dtype=dtype)
    p = _pending(mesh, parts)
    F_ = sf.distribute(f, P(), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = p @ F_
    assert cc.total == 0 and out._layout.partial
    assert torch.equal(out.full_tensor(), sum(parts) @ f)


def test_a_float_factor_reduces_first_and_a_bounded_one_does_not():
    mesh = sf.Mesh((2,), ("x",))
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    t = torch.randn(4, 4, dtype=torch.float64)
    T = sf.distribute(t, P(), mesh=mesh)

    def pending():  # new arrays each time: no reduction of an earlier product at hand
        return sf.distribute(a, P(None, "x"), mesh=mesh) @ sf.distribute(b, P("x"), mesh=mesh)

    with sf.debug.CommCounter() as cc:
        out = pending() @ T
    assert cc.total == 1 and not out._layout.partial
    bounded = {
        "softmax": torch.softmax(T, -1), "cos": torch.cos(T), "tanh": torch.tanh(T), "atan": torch.atan(T),
        "sign": torch.sign(T), "clamp": T.clamp(-2.0, 3.0), "hardtanh": F.hardtanh(T), "relu6": F.relu6(T),
        "int.double()": sf.distribute(torch.arange(16).reshape(4, 4), P(), mesh=mesh).double(),
        "softmax.t()": torch.softmax(T, -1).t(),
    }
    for name, factor in bounded.items():
        for left in (False, True):
            p = pending()
            with sf.debug.CommCounter() as cc:
                out = factor @ p.t() if left else p @ factor
            assert cc.total == 0 and out._layout.partial, name
            want = factor.full_tensor() @ (a @ b).t() if left else (a @ b) @ factor.full_tensor()
            _close(out, want, tol=1e-10)
    # one bound missing, or not finite: not bounded
    for name, factor in {"clamp(min=0)": T.clamp(min=0.0), "clamp(-inf, 1)": T.clamp(-INF, 1.0), "exp": T.exp()}.items():
        with sf.debug.CommCounter() as cc:
            pending() @ factor
        assert cc.total == 1, name


def test_an_in_place_write_drops_the_finite_mark_of_a_contraction_factor():
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])]
    T = sf.distribute(torch.zeros(2, 2), P(), mesh=mesh)
    c = torch.softmax(T, -1).mul_(INF)
    _close(_pending(mesh, parts) @ c, sum(parts) @ torch.full((2, 2), INF))


def test_complex_inf_in_the_imaginary_part():
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([[1 + 0j, 0j]]), torch.tensor([[0j, 2 - 1j]])]
    f = torch.tensor([[complex(0, INF)], [complex(1, 0)]])
    p = _pending(mesh, parts)
    _close(p @ sf.distribute(f, P(), mesh=mesh), sum(parts) @ f)
    _close(torch.vdot(p[0], sf.distribute(f[:, 0], P(), mesh=mesh)), torch.vdot(sum(parts)[0], f[:, 0]))


@pytest.mark.parametrize("shape,names", MESHES)
def test_vmapped_contraction_of_a_pending_sum(shape, names):
    """Under vmap the product runs as shardfn's ``contract`` (its own rule, the same check)."""
    mesh = sf.Mesh(shape, names)
    parts = [torch.zeros(2, 1, 3, dtype=torch.float64) for _ in range(mesh.size)]
    parts[0][:, 0, 0], parts[-1][:, 0, 1] = 1.0, -2.0
    f = torch.tensor([[INF, 1.0], [-INF, 0.0], [2.0, NAN]], dtype=torch.float64)
    p = _pending(mesh, parts)
    F_ = sf.distribute(f, P(), mesh=mesh)
    _close(torch.vmap(lambda r: r @ F_)(p), torch.vmap(lambda r: r @ f)(sum(parts)))


@pytest.mark.parametrize("shape,names", MESHES)
@pytest.mark.parametrize("how", ["autograd", "func"])
def test_gradient_through_a_contraction_with_inf(shape, names, how):
    """The backward of ``x @ W1`` is ``grad @ W1.T``: with ``grad`` pending (the input gradient
    of a column-parallel product after it) and ``W1`` holding inf, it must be ``total @ W1.T``."""
    mesh = sf.Mesh(shape, names)
    x = torch.randn(3, 2, dtype=torch.float64)
    w1 = torch.tensor([[INF, 0.0, 1.0], [2.0, -INF, 0.0]], dtype=torch.float64)
    w2 = torch.randn(3, 4, dtype=torch.float64)
    w2[:, 1:] = 0  # columns held by most devices contribute 0 to the pending gradient

    def loss(x, w1, w2):
        return ((x @ w1) @ w2).sum()

    want = torch.func.grad(loss)(x, w1, w2)
    X, W1 = sf.distribute(x, P(), mesh=mesh), sf.distribute(w1, P(), mesh=mesh)
    W2 = sf.distribute(w2, P(None, names), mesh=mesh)
    if how == "func":
        got = torch.func.grad(loss)(X, W1, W2)
    else:
        X.requires_grad_()
        loss(X, W1, W2).backward()
        got = X.grad
    _close(got, want)


def test_attention_with_a_pending_query():
    """SDPA reduces a pending query first (its rule passes no pending sum): ``softmax(q k^T)``
    is not linear in ``q``; values compare with torch."""
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.zeros(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 2, 3, 4, dtype=torch.float64)]
    parts[0][..., 0], parts[1][..., 1] = 1.0, -2.0
    k = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    v = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    v[0, 0, 0, 0] = INF
    q = _pending(mesh, parts)
    K, V = sf.distribute(k, P(), mesh=mesh), sf.distribute(v, P(), mesh=mesh)
    _close(F.scaled_dot_product_attention(q, K, V), F.scaled_dot_product_attention(sum(parts), k, v))


def test_nll_loss_backward_of_a_pending_gradient_with_an_inf_weight():
    """``nll_loss``'s backward multiplies its gradient by the class weight."""
    mesh = sf.Mesh((2,), ("x",))
    logp = torch.randn(3, 4, dtype=torch.float64).log_softmax(-1)
    target = torch.tensor([0, 1, 3])
    weight = torch.tensor([INF, 1.0, 2.0, -INF], dtype=torch.float64)
    parts = [torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64), torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)]
    g = _pending(mesh, parts)
    X, T, W = (sf.distribute(t, P(), mesh=mesh) for t in (logp, target, weight))
    tw = torch.tensor(0.0, dtype=torch.float64)
    got = torch.ops.aten.nll_loss_backward(g, X, T, W, 0, -100, sf.distribute(tw, P(), mesh=mesh))
    _close(got, torch.ops.aten.nll_loss_backward(sum(parts), logp, target, weight, 0, -100, tw))
