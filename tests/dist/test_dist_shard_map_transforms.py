"""shard_map composed with torch.func and checkpointing, on both backends: jvp,
linearize, jacfwd, vmap of shard_map, vmap of grad, grad of grad and
torch.utils.checkpoint inside the body; values and derivatives equal plain torch."""

from __future__ import annotations

import pytest
import torch
from dist_harness import collect, scenario
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn import P, lax
from shardfn.values import torch_compat


def _close(a, b, what=""):
    if isinstance(a, tuple):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]")
        return
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _data(rows=8, hidden=8):
    g = torch.Generator().manual_seed(rows * 31 + hidden)
    return (torch.randn(rows, 8, dtype=torch.float64, generator=g),
            torch.randn(8, hidden, dtype=torch.float64, generator=g),
            torch.randn(hidden, 3, dtype=torch.float64, generator=g))


def _loss_pair(mesh):
    """A tensor-parallel MLP loss with collectives in the body (psum, and on a 1-D mesh
    ppermute and pmax too), and its plain-torch oracle."""
    tp = mesh.axis_names[-1]
    dp = mesh.axis_names[0] if mesh.ndim > 1 else None

    def body(x, w1, w2):
        h = torch.tanh(x @ w1)
        y = lax.psum(h @ w2, tp)
        if dp is not None:
            return lax.psum((y ** 2).sum() + lax.psum(h.sum(), tp), dp)
        ring = [(i, (i + 1) % mesh.axis_size(tp)) for i in range(mesh.axis_size(tp))]
        shifted = lax.psum(lax.ppermute(h, tp, ring).sum(), tp)  # a shifted sum is still the sum
        return (y ** 2).sum() + lax.pmax(shifted, tp)

    f = sf.shard_map(body, mesh=mesh, in_specs=(P(dp), P(None, tp), P(tp)), out_specs=P())

    def run(*a):
        return sf.gather(f(*a))

    def ref(x, w1, w2):
        h = torch.tanh(x @ w1)
        return ((h @ w2) ** 2).sum() + h.sum()

    return run, ref


@scenario
def jvp_linearize_jacfwd(mesh: sf.Mesh) -> None:
    run, ref = _loss_pair(mesh)
    args = _data()
    tangents = tuple(torch.ones_like(a) * 0.1 for a in args)
    _close(torch.func.jvp(run, args, tangents), torch.func.jvp(ref, args, tangents), "jvp")
    _close(torch.func.jacfwd(run, argnums=(0, 1, 2))(*args), torch.func.jacfwd(ref, argnums=(0, 1, 2))(*args), "jacfwd")


# linearize traces with make_fx on real tensors and constant-folds the trace; on dist each
# collective is kept in the trace as one side-effecting node with its wait (else a folded
# collective's copy is taken before it completes: wrong values, then a hang).
@scenario
def linearize(mesh: sf.Mesh) -> None:
    run, ref = _loss_pair(mesh)
    args = _data()
    out, lin = torch.func.linearize(run, *args)
    _close(out, ref(*args), "linearize value")
    for scale in (0.1, -2.0):  # the linear map is reused: every call issues the same collectives
        tangents = tuple(torch.ones_like(a) * scale for a in args)
        _close(lin(*tangents), torch.func.jvp(ref, args, tangents)[1], f"linearize tangent {scale}")
    x, w1, w2 = args  # a sharded output, gathered by a reshard plan (the dist backend's collectives)
    f = sf.shard_map(lambda x, w: torch.tanh(x @ w), mesh=mesh, in_specs=(P(mesh.axis_names), P()),
                     out_specs=P(mesh.axis_names))
    out, lin = torch.func.linearize(lambda x, w: sf.gather(f(x, w)), x, w1)
    _close(out, torch.tanh(x @ w1), "linearize sharded value")
    t = (torch.full_like(x, 0.3), torch.full_like(w1, -0.2))
    _close(lin(*t), torch.func.jvp(lambda x, w: torch.tanh(x @ w), (x, w1), t)[1], "linearize sharded tangent")


@scenario
def higher_order(mesh: sf.Mesh) -> None:
    run, ref = _loss_pair(mesh)
    args = _data()
    grad2 = lambda f: torch.func.grad(lambda *a: torch.func.grad(f, argnums=(0, 1, 2))(*a)[1].sum(), argnums=(0, 1, 2))  # noqa: E731
    _close(grad2(run)(*args), grad2(ref)(*args), "grad of grad")
    hv = lambda f: torch.func.jvp(torch.func.grad(f, argnums=1), args, args)[1]  # noqa: E731
    _close(hv(run), hv(ref), "jvp of grad")
    xs = [a.clone().requires_grad_() for a in args]
    rs = [a.clone().requires_grad_() for a in args]
    g1 = torch.autograd.grad(run(*xs), xs, create_graph=True)
    r1 = torch.autograd.grad(ref(*rs), rs, create_graph=True)
    _close(torch.autograd.grad(g1[0].sum(), xs[1])[0], torch.autograd.grad(r1[0].sum(), rs[1])[0], "double backward")


@scenario
def vmap_of_shard_map_and_of_grad(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    f = sf.shard_map(lambda x, w: torch.sin(lax.psum(x @ w, a)), mesh=mesh, in_specs=(P(None, a), P(a)), out_specs=P())
    x, w, _ = _data()
    xb = torch.stack([x, 2 * x, -x])
    got = torch.func.vmap(lambda v: sf.gather(f(v, w)))(xb)
    _close(got, torch.stack([torch.sin(v @ w) for v in xb]), "vmap")
    got = torch.func.vmap(torch.func.grad(lambda v: sf.gather(f(v, w)).pow(2).sum()))(xb)
    want = torch.func.vmap(torch.func.grad(lambda v: torch.sin(v @ w).pow(2).sum()))(xb)
    _close(got, want, "vmap of grad")
    wb = torch.stack([w, w.flip(0)])
    got = torch.func.vmap(lambda u: sf.gather(f(x, u)), in_dims=0)(wb)
    _close(got, torch.stack([torch.sin(x @ u) for u in wb]), "vmap over the sharded argument")


@scenario
def checkpoint_in_body(mesh: sf.Mesh) -> None:
    if mesh.backend == "local" and not torch_compat.CHECKPOINT_UNDER_VMAP:
        pytest.skip("torch < 2.13: a checkpointing body runs per device, its collectives cannot recompute")
    a = mesh.axis_names[-1]
    calls = []

    def region(x, w):
        calls.append(1)
        return torch.sin(lax.psum(x @ w, a))

    f = sf.shard_map(lambda x, w: checkpoint(region, x, w, use_reentrant=False).pow(2).sum(), mesh=mesh,
                     in_specs=(P(None, a), P(a)), out_specs=P())
    x, w, _ = _data()
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = sf.gather(f(xs, ws))
    ran = len(calls)  # the body, and on dist also its one check_vma trace on meta tensors
    out.backward()
    assert len(calls) == ran + 1, "the checkpointed region was not recomputed once"
    want = torch.func.grad(lambda x, w: torch.sin(x @ w).pow(2).sum(), argnums=(0, 1))(x, w)
    _close((xs.grad, ws.grad), want, "checkpoint grads")


@scenario
def uneven_composes(mesh: sf.Mesh) -> None:
    """7 rows over 4 devices: on local the body runs once per device (threads, one
    re-runnable node under torch.func), on dist each rank runs its own uneven block."""
    a = mesh.axis_names
    f = sf.shard_map(lambda x, w: lax.psum(torch.tanh(x @ w).sum(0), a), mesh=mesh, in_specs=(P(a), P()),
                     out_specs=P())
    x, w, _ = _data(rows=7)

    def run(x, w):
        return torch.sin(sf.gather(f(x, w))).sum()

    def ref(x, w):
        return torch.sin(torch.tanh(x @ w).sum(0)).sum()

    _close(run(x, w), ref(x, w), "value")
    _close(torch.func.grad(run, argnums=(0, 1))(x, w), torch.func.grad(ref, argnums=(0, 1))(x, w), "grad")
    t = (torch.full_like(x, 0.2), torch.full_like(w, -0.1))
    _close(torch.func.jvp(run, (x, w), t), torch.func.jvp(ref, (x, w), t), "jvp")
    _close(torch.func.jacfwd(run, argnums=1)(x, w), torch.func.jacfwd(ref, argnums=1)(x, w), "jacfwd")
    g2 = lambda fn: torch.func.grad(lambda x, w: torch.func.grad(fn, argnums=1)(x, w).sum(), argnums=(0, 1))  # noqa: E731
    _close(g2(run)(x, w), g2(ref)(x, w), "grad of grad")
    wb = torch.stack([w, 2 * w])
    _close(torch.func.vmap(torch.func.grad(run, argnums=1), (None, 0))(x, wb),
           torch.func.vmap(torch.func.grad(ref, argnums=1), (None, 0))(x, wb), "vmap of grad")


@scenario(meshes=("2x2",))
def nested_body_input_gradients_on_every_rank(mesh: sf.Mesh) -> None:
    """A shard_map nested in a partial-manual body takes a body value whole on each device
    of its manual axis; that input's gradient sums their cotangents, so every rank holds the
    whole gradient (on dist the ranks at 'y' = 1 held zeros: fuzzer seed 5781641806)."""
    x = torch.randn(4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    for inner_spec in (P(), P(None, "y")):
        def run(v, inner_spec=inner_spec):
            v = sf.reshard(v, P(None, None, "x"))
            inner = lambda b: sf.shard_map(lambda t: t * 2, mesh=mesh, in_specs=(inner_spec,),  # noqa: E731
                                           out_specs=inner_spec, axis_names={"y"})(b)
            out = sf.shard_map(inner, mesh=mesh, in_specs=(P(None, None, "x"),), out_specs=P(None, None, "x"),
                               axis_names={"x"})(v)
            return (out * out).sum()

        for spec in (P("y"), P(), P(None, None, "x")):
            what = f"inner {inner_spec}, input {spec}"
            xs = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(run(sf.distribute(xs, spec, mesh=mesh)), xs)
            _close(g, 8 * x, f"{what}: autograd")
            g = torch.func.grad(run)(sf.distribute(x, spec, mesh=mesh))
            _close(g.full_tensor(), 8 * x, f"{what}: torch.func.grad")


test_local, test_dist = collect(globals())
