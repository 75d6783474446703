"""JAX's shard_map test cases (tests/shard_map_test.py) ported to shardfn and checked
against plain-torch oracles: values, per-device blocks, reverse- and forward-mode
derivatives to second order, vmap of shard_map, vmap of grad, and checkpointing."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn import P, lax
from shardfn.values import torch_compat as _compat


def _close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _gathered(f):
    """``f`` returning plain tensors (ShardedArray outputs gathered)."""

    def g(*args):
        out = f(*args)
        return tuple(sf.gather(o) for o in out) if isinstance(out, tuple) else sf.gather(out)

    return g


# -- the systematic cases: functions x meshes x specs, against a per-block oracle ------------------

FUNS = {
    "id": (1, lambda x: x),
    "flip": (2, lambda x, y: (y, x)),
    "transpose": (1, lambda x: x.T if x.dim() == 2 else x),
    "ravel": (1, lambda x: x.reshape(-1)),
    "dot": (2, lambda x, y: x @ y),
    "sin_dot_sin": (2, lambda x, y: torch.sin(torch.sin(x) @ y)),
    "relu": (1, lambda x: torch.relu(x + 1) - 1),
}
MESH_SHAPES = [(1,), (1, 2), (2, 2), (2, 4), (4, 2)]


def _mesh(shape):
    return sf.Mesh(shape, ("i", "j", "k")[:len(shape)])


def _block_index(mesh, spec, shape, coords):
    """The slices of device ``coords``'s block of a value laid out as ``spec`` (JAX's make_indexer)."""
    out = []
    for n, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = n // math.prod(mesh.axis_size(a) for a in axes)
        start = 0
        for a in axes:
            start = start * mesh.axis_size(a) + coords[mesh.axis_index(a)]
        out.append(slice(start * size, (start + 1) * size))
    return tuple(out)


def _dilate(mesh, spec, shape):
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(
        n * math.prod(mesh.axis_size(a) for a in (() if e is None else (e,) if isinstance(e, str) else e))
        for n, e in zip(shape, entries)
    )


def _reference(fun, mesh, in_specs, out_specs):
    """JAX's shmap_reference in torch: run ``fun`` on every device's blocks, place the results."""
    single = not isinstance(out_specs, tuple)
    o_specs = (out_specs,) if single else out_specs

    def ref(*args):
        outs = [None] * len(o_specs)
        for coords in itertools.product(*map(range, mesh.shape)):
            blocks = [a[_block_index(mesh, s, a.shape, coords)] for a, s in zip(args, in_specs)]
            res = fun(*blocks)
            res = (res,) if single else res
            for i, (y, s) in enumerate(zip(res, o_specs)):
                full = _dilate(mesh, s, y.shape)
                if outs[i] is None:
                    outs[i] = y.new_zeros(full)
                idx = _block_index(mesh, s, full, coords)
                outs[i] = torch.index_put(outs[i], _grid(idx, full), y)
        return outs[0] if single else tuple(outs)

    return ref


def _grid(idx, full):
    """Advanced indices equivalent to the slices ``idx`` (index_put is functional)."""
    ranges = [torch.arange(s.start, s.stop) for s in idx]
    return tuple(torch.meshgrid(*ranges, indexing="ij")) if ranges else ()


def _powerset(xs):
    return itertools.chain.from_iterable(itertools.combinations(xs, r) for r in range(len(xs) + 1))


def _partition(rng, axes, k):
    """Assign each of ``axes`` to one of ``k`` dims (a spec entry per dim)."""
    outs = [[] for _ in range(k)]
    for a in axes:
        if k:
            outs[rng.randrange(k)].append(a)
    return P(*(tuple(e) if e else None for e in outs))


def _unmentioned(mesh, spec):
    named = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    return set(mesh.axis_names) - named


def _sample(rng):
    """One case, as JAX's sample_shmap: fun, mesh, in/out specs, global args."""
    name = rng.choice(sorted(FUNS))
    nin, fun = FUNS[name]
    mesh = _mesh(rng.choice(MESH_SHAPES))
    while True:
        shapes = [tuple(rng.sample([1, 2, 3], rng.randint(1, 3))) for _ in range(nin)]
        try:
            fun(*[torch.zeros(s_) for s_ in shapes])
        except RuntimeError:  # shapes the function does not accept (matmul)
            continue
        break
    in_specs = []
    for s in shapes:
        axes = rng.choice(list(_powerset(mesh.axis_names))) if len(s) else ()
        in_specs.append(_partition(rng, axes, len(s)))
    args = []
    for s, spec in zip(shapes, in_specs):
        full = _dilate(mesh, spec, s)
        n = math.prod(full)
        args.append(torch.arange(n, dtype=torch.float64).reshape(full) / n)
    body_in = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    out = fun(*body_in)
    outs = out if isinstance(out, tuple) else (out,)
    reps = [set() for _ in outs]
    u = [_unmentioned(mesh, s) for s in in_specs]
    if name == "flip":
        reps = [u[1], u[0]]
    elif nin == 2:
        reps = [u[0] & u[1]]
    else:
        reps = [u[0]]
    out_specs = []
    for y, rep in zip(outs, reps):
        choices = [s for s in _powerset(mesh.axis_names) if rep | set(s) == set(mesh.axis_names)]
        if not y.dim():
            choices = [c for c in choices if not c]
        if not choices:  # a scalar output that varies: no out_spec can hold it
            out_specs.append(None)
            continue
        out_specs.append(_partition(rng, rng.choice(choices), y.dim()))
    out_specs = tuple(out_specs) if isinstance(out, tuple) else out_specs[0]
    return f"{name}-{mesh.shape}-{tuple(in_specs)}-{out_specs}", fun, mesh, tuple(in_specs), out_specs, tuple(args)


def _cases(n, seed):
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        case = _sample(rng)
        if case[0] not in seen and _valid(case):
            seen.add(case[0])
            out.append(case)
    return out


def _valid(case):
    out_specs = case[4]
    specs = out_specs if isinstance(out_specs, tuple) else (out_specs,)
    return all(isinstance(s, P) for s in specs)


CASES = _cases(40, 0)


def _ref_for(case):
    _, fun, mesh, in_specs, out_specs, _ = case
    return _reference(fun, mesh, in_specs, out_specs)


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_systematic_values_and_blocks(case):
    _, fun, mesh, in_specs, out_specs, args = case
    out = sf.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
    ref = _ref_for(case)(*args)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    specs = out_specs if isinstance(out_specs, tuple) else (out_specs,)
    for o, r, s in zip(outs, refs, specs):
        assert o.placements == sf.NamedSharding(mesh, s).placements(o.ndim)
        _close(o.full_tensor(), r, "value")
        for d, shard in enumerate(o.local_shards()):
            _close(shard, r[_block_index(mesh, s, r.shape, mesh.coords(d))], f"block of device {d}")


def _close_tree(a, b, what):
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        _close(x, y, what)


def _scalarize(f):
    """sum(out * fixed weights) as a scalar loss of ``f``'s outputs."""

    def loss(*args):
        out = f(*args)
        outs = out if isinstance(out, tuple) else (out,)
        total = 0
        for i, o in enumerate(outs):
            w = torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).reshape(o.shape) + i
            total = total + (torch.sin(o) * w).sum()
        return total

    return loss


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_systematic_derivatives_to_second_order(case):
    """JAX's check_grads(order=2) modes fwd and rev: jvp, vjp, jvp of jvp, grad of grad,
    jvp of grad (forward-over-reverse), all against the per-block oracle."""
    _, fun, mesh, in_specs, out_specs, args = case
    f = _gathered(sf.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    ref = _ref_for(case)
    g = torch.Generator().manual_seed(1)
    tangents = tuple(torch.randn(a.shape, generator=g, dtype=a.dtype) for a in args)
    argnums = tuple(range(len(args)))
    # first order
    _close_tree(torch.func.jvp(f, args, tangents)[1], torch.func.jvp(ref, args, tangents)[1], "jvp")
    loss_f, loss_r = _scalarize(f), _scalarize(ref)
    for a, b in zip(torch.func.grad(loss_f, argnums)(*args), torch.func.grad(loss_r, argnums)(*args)):
        _close(a, b, "grad")
    # second order: grad of grad, jvp of grad, jvp of jvp
    gg_f = torch.func.grad(lambda *a: sum((t * w).sum() for t, w in zip(torch.func.grad(loss_f, argnums)(*a), tangents)), argnums)
    gg_r = torch.func.grad(lambda *a: sum((t * w).sum() for t, w in zip(torch.func.grad(loss_r, argnums)(*a), tangents)), argnums)
    for a, b in zip(gg_f(*args), gg_r(*args)):
        _close(a, b, "grad of grad")
    fr_f = torch.func.jvp(torch.func.grad(loss_f, argnums), args, tangents)[1]
    fr_r = torch.func.jvp(torch.func.grad(loss_r, argnums), args, tangents)[1]
    for a, b in zip(fr_f, fr_r):
        _close(a, b, "jvp of grad")
    ff_f = torch.func.jvp(lambda *a: torch.func.jvp(loss_f, a, tangents)[1], args, tangents)[1]
    ff_r = torch.func.jvp(lambda *a: torch.func.jvp(loss_r, a, tangents)[1], args, tangents)[1]
    _close(ff_f, ff_r, "jvp of jvp")
    # torch.autograd, double backward
    xs = [a.clone().requires_grad_() for a in args]
    gs = torch.autograd.grad(loss_f(*xs), xs, create_graph=True)
    second = torch.autograd.grad(sum((t * w).sum() for t, w in zip(gs, tangents)), xs, allow_unused=True)
    for a, b in zip(second, gg_r(*args)):
        _close(torch.zeros_like(b) if a is None else a, b, "autograd double backward")


def _batched_args(case, seed, size=3):
    """Each argument given a batch dim at a random position (or none), as JAX's test_vmap."""
    _, _, _, _, _, args = case
    rng = random.Random(seed)
    while True:
        bdims = tuple(rng.choice([None, *range(a.dim() + 1)]) for a in args)
        if any(b is not None for b in bdims):
            break
    batched = []
    for a, b in zip(args, bdims):
        if b is None:
            batched.append(a)
        else:
            scale = torch.arange(1, size + 1, dtype=a.dtype).reshape([-1 if i == b else 1 for i in range(a.dim() + 1)])
            batched.append(a.unsqueeze(b) * scale)
    return bdims, tuple(batched)


def _stack_slices(f, bdims, batched, size=3):
    outs = [f(*[a if b is None else a.select(b, i) for a, b in zip(batched, bdims)]) for i in range(size)]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(col) for col in zip(*outs))
    return torch.stack(outs)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_systematic_vmap(case):
    _, fun, mesh, in_specs, out_specs, args = case
    f = _gathered(sf.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    bdims, batched = _batched_args(case, CASES.index(case))
    _close_tree(torch.func.vmap(f, bdims)(*batched), _stack_slices(_ref_for(case), bdims, batched), "vmap")


@pytest.mark.parametrize("case", CASES[:20], ids=_ids(CASES[:20]))
def test_systematic_vmap_of_grad_and_jacfwd(case):
    _, fun, mesh, in_specs, out_specs, args = case
    f = _gathered(sf.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    ref = _ref_for(case)
    bdims, batched = _batched_args(case, 7)
    argnums = tuple(range(len(args)))
    got = torch.func.vmap(torch.func.grad(_scalarize(f), argnums), bdims)(*batched)
    want = torch.func.vmap(torch.func.grad(_scalarize(ref), argnums), bdims)(*batched)
    _close_tree(got, want, "vmap of grad")
    for jac in (torch.func.jacfwd, torch.func.jacrev):
        _close_tree(_flat_tree(jac(f, argnums)(*args)), _flat_tree(jac(ref, argnums)(*args)), jac.__name__)


def _flat_tree(t):
    """The tensor leaves of a nested tuple (jacobians of tuple outputs are nested)."""
    if isinstance(t, tuple):
        return tuple(leaf for item in t for leaf in _flat_tree(item))
    return (t,)


@pytest.mark.parametrize("case", CASES[:20], ids=_ids(CASES[:20]))
def test_systematic_grads_closure(case):
    """JAX's test_grads_closure: the body closes over a differentiated scalar."""
    _, fun, mesh, in_specs, out_specs, args = case

    def make(smap):
        def f(x):
            body = lambda *a: fun(*[x * t for t in a])  # noqa: E731
            return (_gathered(sf.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)) if smap
                    else _reference(body, mesh, in_specs, out_specs))(*args)
        return f

    x = torch.tensor(0.2, dtype=torch.float64)
    t = torch.tensor(0.7, dtype=torch.float64)
    f, r = make(True), make(False)
    _close(torch.func.grad(_scalarize(f))(x), torch.func.grad(_scalarize(r))(x), "grad")
    _close_tree(torch.func.jvp(f, (x,), (t,))[1], torch.func.jvp(r, (x,), (t,))[1], "jvp")
    _close(torch.func.grad(torch.func.grad(_scalarize(f)))(x), torch.func.grad(torch.func.grad(_scalarize(r)))(x), "grad of grad")
    xs = torch.linspace(0.1, 0.5, 3, dtype=torch.float64)
    _close_tree(torch.func.vmap(f)(xs), torch.stack([r(v) for v in xs]) if not isinstance(r(x), tuple)
                else tuple(torch.stack(c) for c in zip(*[r(v) for v in xs])), "vmap of closure")


# -- checkpointing (JAX's remat tests) ---------------------------------------------------------------


def _ckpt_case():
    mesh = sf.Mesh((2, 2), ("x", "y"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, dtype=torch.float64, generator=g)
    w = torch.randn(6, 4, dtype=torch.float64, generator=g)
    return mesh, x, w


@pytest.mark.skipif(not _compat.CHECKPOINT_UNDER_VMAP,
                    reason="torch < 2.13: a checkpointing body runs per device, its collectives cannot recompute")
def test_checkpoint_inside_body_recomputes_with_collectives():
    """JAX's test_shmap_of_remat_basic, with a collective inside the checkpointed region:
    the region runs again during backward and gradients equal plain torch's."""
    mesh, x, w = _ckpt_case()
    calls = []

    def region(a, b):
        calls.append(a.shape)
        return torch.sin(lax.psum(a @ b, "y"))

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P("x", "y"), P("y")), out_specs=P())
    def loss(a, b):
        return lax.psum(torch.tanh(checkpoint(region, a, b, use_reentrant=False)).sum(), "x")

    def ref(x, w):
        return torch.tanh(torch.sin(x @ w)).sum()

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = sf.gather(loss(xs, ws))
    _close(out, ref(x, w), "value")
    assert len(calls) == 1
    out.backward()
    assert len(calls) == 2, "the checkpointed region was not recomputed"
    assert calls[1] == calls[0] == torch.Size([2, 3])
    want = torch.func.grad(ref, argnums=(0, 1))(x, w)
    _close(xs.grad, want[0], "grad x")
    _close(ws.grad, want[1], "grad w")


def test_checkpoint_inside_body_double_backward():
    mesh, x, w = _ckpt_case()
    body = sf.shard_map(lambda a, b: lax.psum(checkpoint(lambda u, v: torch.sin(u @ v) ** 2, a, b,
                                                         use_reentrant=False).sum(), "x"),
                        mesh=mesh, in_specs=(P("x"), P()), out_specs=P())

    def ref(x, w):
        return (torch.sin(x @ w) ** 2).sum()

    def second(fn):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        (gx,) = torch.autograd.grad(fn(xs, ws), xs, create_graph=True)
        return torch.autograd.grad((gx * x).sum(), ws)[0]

    _close(second(lambda a, b: sf.gather(body(a, b))), second(ref), "grad of grad")


def test_checkpoint_around_shard_map():
    """JAX's test_remat_basic: remat of a shard_map."""
    mesh = sf.Mesh((4,), ("x",))
    f = sf.shard_map(lambda v: torch.sin(torch.sin(v)), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = torch.arange(4.0, dtype=torch.float64).requires_grad_()
    checkpoint(lambda v: sf.gather(f(v)), x, use_reentrant=False).sum().backward()
    _close(x.grad, torch.cos(torch.sin(x.detach())) * torch.cos(x.detach()), "grad")


def test_checkpoint_under_torch_func_grad_is_torchs_error():
    """Checkpoint under torch.func.grad is a torch limitation (saved tensor hooks), raised
    by torch itself rather than silently wrong."""
    mesh, x, w = _ckpt_case()
    f = sf.shard_map(lambda a: checkpoint(torch.sin, a, use_reentrant=False), mesh=mesh,
                     in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(lambda v: sf.gather(f(v)).sum())(x)


# -- uneven shards ----------------------------------------------------------------------------------


def _uneven_case():
    """A body over uneven shards (7 rows / columns on 4 devices) with a psum, and its oracle."""
    mesh = sf.Mesh((4,), ("i",))
    f = sf.shard_map(lambda x, w: lax.psum(torch.tanh(x) @ w, "i"), mesh=mesh, in_specs=(P(None, "i"), P("i")),
                     out_specs=P())
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 7, dtype=torch.float64, generator=g)
    w = torch.randn(7, 2, dtype=torch.float64, generator=g)

    def loss(x, w):
        return torch.sin(sf.gather(f(x, w))).sum()

    def ref(x, w):
        return torch.sin(torch.tanh(x) @ w).sum()

    return loss, ref, x, w


def test_uneven_composes_with_torch_func():
    """Uneven shards run once per device (threads); under torch.func the run is one node
    whose derivatives re-run it, so grad, jvp, jacfwd, vmap, vmap of grad, jvp of grad
    and grad of grad all equal plain torch."""
    loss, ref, x, w = _uneven_case()
    _close(loss(x, w), ref(x, w), "value")
    _close_tree(torch.func.grad(loss, argnums=(0, 1))(x, w), torch.func.grad(ref, argnums=(0, 1))(x, w), "grad")
    t = (torch.full_like(x, 0.5), torch.full_like(w, -0.3))
    _close_tree(torch.func.jvp(loss, (x, w), t), torch.func.jvp(ref, (x, w), t), "jvp")
    _close_tree(torch.func.jacfwd(loss, argnums=(0, 1))(x, w), torch.func.jacfwd(ref, argnums=(0, 1))(x, w), "jacfwd")
    g2 = lambda fn: torch.func.grad(lambda x, w: torch.func.grad(fn, argnums=1)(x, w).sum(), argnums=(0, 1))  # noqa: E731
    _close_tree(g2(loss)(x, w), g2(ref)(x, w), "grad of grad")
    hv = lambda fn: torch.func.jvp(torch.func.grad(fn, argnums=1), (x, w), t)[1]  # noqa: E731
    _close(hv(loss), hv(ref), "jvp of grad")
    xb = torch.stack([x, 2 * x, -x])
    _close(torch.func.vmap(loss, (0, None))(xb, w), torch.func.vmap(ref, (0, None))(xb, w), "vmap")
    _close(torch.func.vmap(torch.func.grad(loss), (0, None))(xb, w),
           torch.func.vmap(torch.func.grad(ref), (0, None))(xb, w), "vmap of grad")
    with torch.autograd.forward_ad.dual_level():  # forward AD without torch.func
        fa = torch.autograd.forward_ad
        got = fa.unpack_dual(loss(fa.make_dual(x, t[0]), fa.make_dual(w, t[1]))).tangent
    _close(got, torch.func.jvp(ref, (x, w), t)[1], "forward_ad duals")


def test_uneven_linearize_raises():
    """linearize traces with make_fx, which cannot see the per-device threads: a clear
    ShardingError (never constant tangents)."""
    loss, _, x, w = _uneven_case()
    with pytest.raises(sf.ShardingError, match="uneven shards cannot be traced by make_fx"):
        torch.func.linearize(loss, x, w)


def test_uneven_double_backward_plain_autograd():
    """Plain autograd double backward through the per-device threads is exact."""
    mesh = sf.Mesh((4,), ("i",))
    f = sf.shard_map(lambda x: lax.psum(torch.sin(x).sum(0), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    x = torch.randn(7, 3, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(sf.gather(f(xr)).sum(), xr, create_graph=True)
    (g2,) = torch.autograd.grad(g.sum(), xr)
    _close(g2, -torch.sin(x), "double backward")


def test_uneven_closure_under_torch_func_raises_not_wrong():
    """An uneven body closing over a tensor that torch.func differentiates: the device
    threads cannot see the transform, so a ShardingError says to pass it as an argument
    (plain autograd, which the threads do see, is exact)."""
    mesh = sf.Mesh((4,), ("i",))
    x = torch.randn(7, 3, dtype=torch.float64)
    w0 = torch.randn(3, 2, dtype=torch.float64)

    def run(w):
        f = sf.shard_map(lambda x: lax.psum(torch.tanh(x @ w).sum(), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
        return sf.gather(f(x))

    def ref(w):
        return torch.tanh(x @ w).sum()

    w = w0.clone().requires_grad_()
    run(w).backward()
    _close(w.grad, torch.func.grad(ref)(w0), "plain autograd")
    with pytest.raises(sf.ShardingError, match="pass it as an argument|Pass it as an argument"):
        torch.func.grad(run)(w0)
    with pytest.raises(sf.ShardingError, match="Pass it as an argument"):
        torch.func.jvp(run, (w0,), (w0,))
    passed = sf.shard_map(lambda x, w: lax.psum(torch.tanh(x @ w).sum(), "i"), mesh=mesh, in_specs=(P("i"), P()),
                          out_specs=P())
    _close(torch.func.grad(lambda w: sf.gather(passed(x, w)))(w0), torch.func.grad(ref)(w0), "passed as argument")


# -- JAX parity leftovers (issue 23), each compared with JAX 0.10's behaviour --------------------


@pytest.mark.parametrize("spec", [P(None), P("i")])
def test_spec_longer_than_a_python_scalar_is_jaxs_rank_error(spec):
    """JAX: a Python scalar is a rank-0 value; an in_spec of length 1 is 'too long' (ValueError)."""
    mesh = sf.Mesh((4,), ("i",), backend="local")
    f = sf.shard_map(lambda a: a, mesh=mesh, in_specs=spec, out_specs=P())
    with pytest.raises(ValueError, match=r"is a float, a rank-0 value: the spec has length 1 \(and 0 < 1\), too long.*use P\(\)"):
        f(3.0)
    assert sf.shard_map(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P())(3.0) == 3.0


def test_in_specs_none_with_a_plain_argument_is_a_type_error_as_in_jax():
    mesh = sf.Mesh((4,), ("i",), backend="local")
    f = sf.shard_map(lambda a: a, mesh=mesh, in_specs=None, out_specs=P())
    with pytest.raises(TypeError, match=r"did you mean in_specs=P\(\)"):
        f(torch.arange(4.0))
    with pytest.raises(sf.ShardingError, match=r"args\[0\] is a plain tensor"):
        f(torch.arange(4.0))


def test_ppermute_accepts_a_one_shot_iterator():
    mesh = sf.Mesh((4,), ("i",), backend="local")
    f = sf.shard_map(lambda a: lax.ppermute(a, "i", zip(range(4), [1, 2, 3, 0])), mesh=mesh, in_specs=P("i"),
                     out_specs=P("i"))
    assert torch.equal(sf.gather(f(torch.arange(4.0))), torch.tensor([3.0, 0.0, 1.0, 2.0]))


@pytest.mark.parametrize("n", [8, 16])
def test_unchecked_output_transposes_as_jax(n):
    """check_vma=False, out_spec P() on a value varying over 'i': the value is device 0's, and
    (JAX's transpose) every device gets the cotangent over 4, so grad = cos(x) / 4; the same
    under vmap of grad, plain autograd and torch.func.grad."""
    mesh = sf.Mesh((4,), ("i",), backend="local")

    def f(x):
        return sf.gather(sf.shard_map(torch.sin, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False)(x))

    x = torch.linspace(-2, 2, n, dtype=torch.float64)
    torch.testing.assert_close(f(x), torch.sin(x[: n // 4]))
    want = torch.cos(x) / 4
    torch.testing.assert_close(torch.func.grad(lambda t: f(t).sum())(x), want)
    xs = torch.stack([x, 2 * x])
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(lambda t: f(t).sum()))(xs), torch.cos(xs) / 4)
    xr = x.clone().requires_grad_()
    f(xr).sum().backward()
    torch.testing.assert_close(xr.grad, want)
    # a psum result is replicated: the shared-out cotangent sums back to the whole (as JAX)
    g = sf.shard_map(lambda a: lax.psum(torch.sin(a), "i"), mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False)
    torch.testing.assert_close(torch.func.grad(lambda t: sf.gather(g(t)).sum())(x), torch.cos(x))

