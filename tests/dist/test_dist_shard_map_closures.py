"""shard_map bodies that close over tensors (plain, parameters of a module, ShardedArrays):
a closed-over value is replicated on every device, so its gradient is the sum of every
device's contribution, on both backends, as in JAX; checked against plain torch."""

from __future__ import annotations

import torch
from dist_harness import collect, scenario

import shardfn as sf
from shardfn import P, lax


def _close(a, b, what=""):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{what}[{i}]")
        return
    if isinstance(a, sf.ShardedArray):
        a = a.full_tensor()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _data():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(8, 6, dtype=torch.float64, generator=g),
            torch.randn(6, 4, dtype=torch.float64, generator=g),
            torch.randn(4, dtype=torch.float64, generator=g))


def _body_loss(mesh, w, b):
    a = mesh.axis_names

    def body(x):
        return lax.psum(torch.tanh(x @ w + b).pow(2).sum(), a)

    return sf.shard_map(body, mesh=mesh, in_specs=P(a), out_specs=P())


def _ref(x, w, b):
    return torch.tanh(x @ w + b).pow(2).sum()


@scenario
def closure_grad(mesh: sf.Mesh) -> None:
    x, w0, b0 = _data()
    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    xs = x.clone().requires_grad_()
    out = sf.gather(_body_loss(mesh, w, b)(xs))
    _close(out, _ref(x, w0, b0), "value")
    out.backward()
    want = torch.func.grad(_ref, argnums=(0, 1, 2))(x, w0, b0)
    _close((xs.grad, w.grad, b.grad), want, "grads")


@scenario
def closure_torch_func(mesh: sf.Mesh) -> None:
    x, w0, b0 = _data()

    def run(x, w, b):
        return sf.gather(_body_loss(mesh, w, b)(x))

    got = torch.func.grad(run, argnums=(0, 1, 2))(x, w0, b0)
    _close(got, torch.func.grad(_ref, argnums=(0, 1, 2))(x, w0, b0), "torch.func.grad")
    g2 = lambda f: torch.func.grad(lambda *a: torch.func.grad(f, argnums=(0, 1, 2))(*a)[1].sum(), argnums=(0, 1, 2))  # noqa: E731
    _close(g2(run)(x, w0, b0), g2(_ref)(x, w0, b0), "grad of grad")
    t = tuple(torch.full_like(v, 0.1) for v in (x, w0, b0))
    _close(torch.func.jvp(run, (x, w0, b0), t), torch.func.jvp(_ref, (x, w0, b0), t), "jvp")
    hv = lambda f: torch.func.jvp(torch.func.grad(f, argnums=1), (x, w0, b0), t)[1]  # noqa: E731
    _close(hv(run), hv(_ref), "jvp of grad")
    out, lin = torch.func.linearize(run, x, w0, b0)
    _close((out, lin(*t)), torch.func.jvp(_ref, (x, w0, b0), t), "linearize")
    wb = torch.stack([w0, 2 * w0])
    got = torch.func.vmap(torch.func.grad(lambda w: run(x, w, b0)))(wb)
    _close(got, torch.func.vmap(torch.func.grad(lambda w: _ref(x, w, b0)))(wb), "vmap of grad")


@scenario
def closure_double_backward(mesh: sf.Mesh) -> None:
    x0, w0, b0 = _data()
    xs, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
    gx, gw = torch.autograd.grad(sf.gather(_body_loss(mesh, w, b)(xs)), (xs, w), create_graph=True)
    rx, rw, rb = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
    hx, hw = torch.autograd.grad(_ref(rx, rw, rb), (rx, rw), create_graph=True)
    _close((gx, gw), (hx, hw), "first order")
    _close(torch.autograd.grad((gx.sum() + gw.pow(2).sum()), (xs, w, b)),
           torch.autograd.grad((hx.sum() + hw.pow(2).sum()), (rx, rw, rb)), "second order")


@scenario
def module_parameters(mesh: sf.Mesh) -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(6, 4, dtype=torch.float64)
    ref = torch.nn.Linear(6, 4, dtype=torch.float64)
    ref.load_state_dict(lin.state_dict())
    x, _, _ = _data()
    a = mesh.axis_names
    f = sf.shard_map(lambda x: lax.psum(lin(x).pow(2).sum(), a), mesh=mesh, in_specs=P(a), out_specs=P())
    sf.gather(f(x)).backward()
    ref(x).pow(2).sum().backward()
    _close((lin.weight.grad, lin.bias.grad), (ref.weight.grad, ref.bias.grad), "parameter grads")


@scenario
def unmapped_tensor_argument(mesh: sf.Mesh) -> None:
    x0, w0, b0 = _data()
    a = mesh.axis_names
    f = sf.shard_map(lambda x, w: lax.psum((x @ w).sum(), a), mesh=mesh, in_specs=(P(a), None), out_specs=P())
    w = w0.clone().requires_grad_()
    sf.gather(f(x0, w)).backward()
    _close(w.grad, torch.func.grad(lambda w: (x0 @ w).sum())(w0), "in_spec None grad")


@scenario
def sharded_array_closure(mesh: sf.Mesh) -> None:
    x, w0, b0 = _data()
    a = mesh.axis_names
    for spec in (P(), P(None, a[-1])):
        w = sf.distribute(w0, spec, mesh=mesh).requires_grad_()
        f = sf.shard_map(lambda x: lax.psum(torch.tanh(x @ w).sum(), a), mesh=mesh, in_specs=P(a), out_specs=P())
        out = sf.gather(f(x))
        _close(out, torch.tanh(x @ w0).sum(), f"value {spec}")
        out.backward()
        _close(w.grad, torch.func.grad(lambda w: torch.tanh(x @ w).sum())(w0), f"grad {spec}")


@scenario
def closure_in_checkpoint(mesh: sf.Mesh) -> None:
    """A checkpointed region closing over a parameter: recomputed in backward, where the
    closure is seen again."""
    from torch.utils.checkpoint import checkpoint

    x, w0, b0 = _data()
    a = mesh.axis_names
    w = w0.clone().requires_grad_()
    region = lambda x: torch.tanh(x @ w + b0)  # noqa: E731
    f = sf.shard_map(lambda x: lax.psum(checkpoint(region, x, use_reentrant=False).pow(2).sum(), a), mesh=mesh,
                     in_specs=P(a), out_specs=P())
    sf.gather(f(x)).backward()
    _close(w.grad, torch.func.grad(lambda w: _ref(x, w, b0))(w0), "checkpointed closure grad")


@scenario
def closure_no_grad(mesh: sf.Mesh) -> None:
    x, w0, b0 = _data()
    with torch.no_grad():
        _close(sf.gather(_body_loss(mesh, w0, b0)(x)), _ref(x, w0, b0), "no_grad value")


test_local, test_dist = collect(globals())
