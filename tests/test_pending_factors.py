"""A pending sum times a factor that may hold inf (issue 25, seed 5727497451): torch computes
``total * f``, so a part that is 0 must not give ``0 * inf = nan``, nor parts of both signs
``inf - inf``. A factor not known finite reduces the pending operand first; factors whose op
bounds them (``arrays/bounds.py``) and integer factors keep it pending with no collective."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

INF, NAN = math.inf, math.nan
FACTORS = [0.0, -0.0, 1.5, -2.0, INF, -INF, NAN]
MESHES = [((1,), ("x",)), ((2,), ("x",)), ((3,), ("x",)), ((4,), ("x",)), ((2, 2), ("x", "y"))]


def _close(got, want, tol=0.0):
    """Equal, non-finite entries included (``tol``: the rounding of a sum in another order)."""
    got = got.full_tensor() if isinstance(got, sf.ShardedArray) else got
    torch.testing.assert_close(got, want, equal_nan=True, rtol=tol, atol=tol)


def _pending(mesh: sf.Mesh, a: torch.Tensor, b: torch.Tensor) -> sf.ShardedArray:
    """``a @ b`` pending a sum over every mesh axis (the contraction split over all of them)."""
    axes = mesh.axis_names
    A = sf.distribute(a, P(None, axes), mesh=mesh)
    B = sf.distribute(b, P(axes), mesh=mesh)
    out = A @ B
    assert set(a for a, _ in out._layout.partial) == set(axes)
    return out


@st.composite
def _cases(draw):
    shape, names = draw(st.sampled_from(MESHES))
    m, k, n = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    small = st.sampled_from([0.0, -0.0, 0.0, 1.0, -1.0, 2.0, -3.0])  # zeros often: parts of 0
    a = torch.tensor(draw(st.lists(small, min_size=m * k, max_size=m * k)), dtype=torch.float64).reshape(m, k)
    b = torch.tensor(draw(st.lists(small, min_size=k * n, max_size=k * n)), dtype=torch.float64).reshape(k, n)
    fshape = draw(st.sampled_from([(n,), (m, n), (m, 1), ()]))
    numel = math.prod(fshape)
    f = torch.tensor(draw(st.lists(st.sampled_from(FACTORS), min_size=numel, max_size=numel)),
                     dtype=torch.float64).reshape(fshape)
    kind = draw(st.sampled_from(["plain", "replicated", "sharded"]))
    return shape, names, a, b, f, kind, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_pending_sum_times_tensor_factor_matches_torch(case):
    shape, names, a, b, f, kind, left = case
    mesh = sf.Mesh(shape, names)
    p = _pending(mesh, a, b)
    if kind == "plain":
        F = f
    elif kind == "sharded" and f.dim() and f.shape[-1] > 1:
        F = sf.distribute(f, P(*([None] * (f.dim() - 1)), names[0]), mesh=mesh)
    else:
        F = sf.distribute(f, P(), mesh=mesh)
    want = (a @ b) * f
    _close(F * p if left else p * F, want)


@pytest.mark.parametrize("op", ["mul", "div"])
def test_scalar_class_is_part_of_the_cache_key(op):
    """``p * 2.0`` then ``p * inf`` (``p / 2.0`` then ``p / 0.0``): dispatch caches on a float's
    type only, so the second call must not reuse the first's pass-through strategy."""
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor([0.0, 3.0, -2.0, 0.0])]
    full = sum(parts)
    for _ in range(2):  # the second round runs warm (the fast path)
        for c in (2.0, INF, -INF, NAN, 0.0, -0.0, complex(INF, 0), complex(0.5, 1.0)):
            p = sf.ShardedArray.from_local(parts, P(partial="x"), mesh=mesh)
            _close(p * c if op == "mul" else p / c, full * c if op == "mul" else full / c)


def test_a_float_factor_reduces_first_and_a_bounded_one_does_not():
    mesh = sf.Mesh((2,), ("x",))
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    T = sf.distribute(torch.randn(5), P(), mesh=mesh)

    def pending():  # new arrays each time: no reduction of an earlier product at hand
        return sf.distribute(a, P(None, "x"), mesh=mesh) @ sf.distribute(b, P("x"), mesh=mesh)

    p = pending()
    with sf.debug.CommCounter() as cc:
        out = p * T
    assert cc.total == 1 and not out._layout.partial
    bounded = {"cos": torch.cos(T), "-sin": -torch.sin(T), "tanh": torch.tanh(T), "sigmoid": torch.sigmoid(T)}
    ints = sf.distribute(torch.arange(5), P(), mesh=mesh)
    bounded.update({"int": ints, "int.float()": ints.float(), "cos.view": torch.cos(T).view(1, 5)})
    for name, factor in bounded.items():
        p = pending()
        with sf.debug.CommCounter() as cc:
            out = p * factor
        assert cc.total == 0 and out._layout.partial, name
        torch.testing.assert_close(out.full_tensor(), (a @ b) * factor.full_tensor(), msg=name)


def test_an_in_place_write_drops_the_finite_mark():
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 3.0, -2.0])]
    T = sf.distribute(torch.zeros(3), P(), mesh=mesh)
    p = sf.ShardedArray.from_local(parts, P(partial="x"), mesh=mesh)
    c = torch.cos(T).mul_(INF)  # allowed: nothing else sees the temporary; no longer bounded
    _close(p * c, sum(parts) * torch.full((3,), INF))


def test_narrowing_casts_and_complex_bounded_ops_are_not_marked():
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 2.0])]
    big = sf.distribute(torch.tensor([70000, 1], dtype=torch.int32), P(), mesh=mesh)
    p = sf.ShardedArray.from_local(parts, P(partial="x"), mesh=mesh)
    _close(p.half() * big.half(), sum(parts).half() * torch.tensor([70000, 1], dtype=torch.int32).half())
    z = sf.distribute(torch.tensor([1000j, 0j]), P(), mesh=mesh)
    pc = sf.ShardedArray.from_local([t.to(torch.complex128) for t in parts], P(partial="x"), mesh=mesh)
    _close(pc * torch.cos(z), sum(parts).to(torch.complex128) * torch.cos(torch.tensor([1000j, 0j])))


@pytest.mark.parametrize("shape,names", MESHES)
def test_gradient_of_a_product_by_a_non_finite_factor(shape, names):
    """The backward of ``x * f`` is ``grad * f``: with ``grad`` pending (the input gradient of
    a column-parallel product), it must be ``total * f`` too."""
    mesh = sf.Mesh(shape, names)
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    f1 = torch.tensor([INF, 0.0, -INF, 2.0], dtype=torch.float64)
    f2 = torch.tensor([[1.0], [-INF], [0.5]], dtype=torch.float64)
    grads = []
    for m in (mesh, None):
        xl = x.clone().requires_grad_()
        X = xl if m is None else sf.distribute(xl, P(), mesh=m)
        W = w if m is None else sf.distribute(w, P(None, names), mesh=m)
        ((X * f1 * f2) @ W).sum().backward()
        grads.append(xl.grad)
    _close(*grads, tol=1e-12)


def test_rms_norm_backward_with_a_non_finite_weight():
    """``shardfn::rms_norm``'s backward is linear in the gradient times the weight: a pending
    gradient (a column-parallel product's input gradient) meets the weight's inf."""
    import torch.nn.functional as F

    mesh = sf.Mesh((2,), ("x",))
    x, v = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    w = torch.tensor([1.0, INF, -INF, 0.5], dtype=torch.float64)
    grads = []
    for m in (mesh, None):
        xl = x.clone().requires_grad_()
        X = xl if m is None else sf.distribute(xl, P(), mesh=m)
        W = w if m is None else sf.distribute(w, P(), mesh=m)
        V = v if m is None else sf.distribute(v, P(None, "x"), mesh=m)
        (F.rms_norm(X, (4,), W) @ V).sum().backward()
        grads.append(xl.grad)
    _close(*grads, tol=1e-12)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_product_of_a_pending_sum_and_a_non_finite_factor(dynamic):
    mesh = sf.Mesh((2,), ("x",))
    a, b = torch.randn(3, 4), torch.randn(4, 3)
    a[:, 2:] = 0  # one device's parts are 0
    f, t = torch.tensor([INF, -INF, 0.5]), torch.randn(3)
    A, B = sf.distribute(a, P(None, "x"), mesh=mesh), sf.distribute(b, P("x"), mesh=mesh)
    F, T = sf.distribute(f, P(), mesh=mesh), sf.distribute(t, P(), mesh=mesh)
    got, bounded = torch.compile(lambda A, B, F, T: ((A @ B) * F, (A @ B) * torch.cos(T)), dynamic=dynamic)(A, B, F, T)
    _close(got, (a @ b) * f, tol=1e-6)  # (inf entries compare exactly at any tolerance)
    _close(bounded, (a @ b) * torch.cos(t), tol=1e-6)


_ACTIVATION_BACKWARDS = [
    ("softplus", lambda g, x: torch.ops.aten.softplus_backward(g, x, 1.0, 20.0)),
    ("softplus beta", lambda g, x: torch.ops.aten.softplus_backward(g, x, 3.0, 1000.0)),  # exp(x) overflows: nan
    ("silu", torch.ops.aten.silu_backward), ("gelu", torch.ops.aten.gelu_backward),
    ("gelu tanh", lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    ("mish", torch.ops.aten.mish_backward), ("hardswish", torch.ops.aten.hardswish_backward),
    ("hardsigmoid", torch.ops.aten.hardsigmoid_backward),
    ("hardtanh", lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -1.0, 1.0)),
    ("threshold", lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.0)),
    ("leaky_relu", lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, 0.1, False)),
]


@pytest.mark.parametrize("name, op", _ACTIVATION_BACKWARDS, ids=[n for n, _ in _ACTIVATION_BACKWARDS])
def test_a_pending_gradient_passes_an_activation_backward(name, op):
    """``op(grad_output, x)`` is ``grad_output`` times a derivative bounded for every ``x`` (nan at
    ±inf or nan ``x``, in every part as in the total), or a selection of it: a pending gradient
    passes with no collective (a replicated parameter applied to split activations, as xIELU's
    ``softplus(alpha)`` in Apertus), and the values are torch's on the total, non-finite
    gradients and inputs included."""
    mesh = sf.Mesh((2, 2), ("x", "y"))
    parts = [torch.tensor([1.0, 0.0, INF, -2.0, 0.5, 3.0, 1e30, 0.0], dtype=torch.float64) * s
             for s in (1.0, -1.0, 0.5, 2.0)]
    parts[1][0] = 0.0  # a total of 1.0 beside the ±inf and inf - inf ones
    x = torch.tensor([0.3, -1.5, 2.0, INF, -INF, NAN, 40.0, -0.0], dtype=torch.float64)
    X = sf.distribute(x, P(), mesh=mesh)
    p = sf.ShardedArray.from_local(parts, P(partial=("x", "y")), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = op(p, X)
    assert cc.total == 0 and out._layout.partial, (name, cc)
    _close(out, op(sum(parts), x), tol=1e-12)  # (the parts summed in another order)


def test_an_activation_backward_reduces_first_where_its_factor_may_be_inf():
    """A slope of inf (``leaky_relu``), or ``sigmoid_backward`` / ``tanh_backward`` reading a result
    not known finite, may multiply a part by inf: reduced first; a result their forward made
    (bounded) keeps the gradient pending."""
    mesh = sf.Mesh((2,), ("x",))
    parts = [torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor([-1.0, 3.0, -2.0, 0.0])]
    x = torch.tensor([-1.0, 2.0, -3.0, 0.5])
    X = sf.distribute(x, P(), mesh=mesh)
    cases = [(lambda g, v: torch.ops.aten.leaky_relu_backward(g, v, INF, False), X, x, 1),
             (torch.ops.aten.sigmoid_backward, X * INF, x * INF, 1),
             (torch.ops.aten.tanh_backward, X * INF, x * INF, 1),
             (torch.ops.aten.sigmoid_backward, torch.sigmoid(X), torch.sigmoid(x), 0),
             (torch.ops.aten.tanh_backward, torch.tanh(X), torch.tanh(x), 0)]
    for op, arg, plain, reduces in cases:
        p = sf.ShardedArray.from_local(parts, P(partial="x"), mesh=mesh)
        with sf.debug.CommCounter() as cc:
            out = op(p, arg)
        assert cc.total == reduces, (op, cc)
        _close(out, op(sum(parts), plain), tol=1e-6)
