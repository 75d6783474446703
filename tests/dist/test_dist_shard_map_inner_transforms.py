"""sf.lax collectives on tensors traced by a torch.func transform opened inside a
shard_map body (vmap, grad, vjp, jvp, jacrev; transforms/inner.py), on the local
backend (even shards: the stacked body; uneven: one thread per device) and on dist.

Oracles are plain torch, per device by hand: each device's block of the input, the
collective computed from its group's blocks. Gradients inside the body follow JAX's
transposes: the gradient on device i is that of the sum over devices of their (varying)
losses with respect to device i's block; a loss the same on every device (invariant)
counts once on the local backend, which knows which values vary (dist cannot tell, and
counts it once per device: the ``local`` scenarios).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import box_slices, collect, scenario

import shardfn as sf
from shardfn import P, lax


def _close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=lambda m: f"{what}: {m}")


def _x(rows, cols=8, seed=0):
    return torch.randn(rows, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + rows))


def _blocks(x, mesh):
    """Each device's rows of ``x`` split over every mesh axis (P(mesh.axis_names))."""
    spec = P(mesh.axis_names)
    return [x[box_slices(spec, mesh, tuple(x.shape), d)] for d in range(mesh.size)]


def _group(mesh, d, axes):
    """The devices of ``d``'s group over ``axes``, ranked row-major over them, and ``d``'s rank."""
    ais = [mesh.axis_names.index(a) for a in axes]
    c = mesh.coords(d)
    members = {}
    for e in range(mesh.size):
        ce = mesh.coords(e)
        if all(ce[k] == c[k] for k in range(mesh.ndim) if k not in ais):
            r = 0
            for k in ais:
                r = r * mesh.shape[k] + ce[k]
            members[r] = e
    order = [members[r] for r in sorted(members)]
    return order, order.index(d)


def _by_hand(x, mesh, axes, fn):
    """cat over devices of ``fn(member_blocks, rank)`` (differentiable in ``x``)."""
    bl = _blocks(x, mesh)
    out = []
    for d in range(mesh.size):
        order, rank = _group(mesh, d, axes)
        out.append(fn([bl[e] for e in order], rank))
    return torch.cat(out)


def _axes_cases(mesh):
    """The last axis alone, and every axis (a tuple) on a 2-D mesh."""
    return [(mesh.axis_names[-1],)] + ([tuple(mesh.axis_names)] if mesh.ndim > 1 else [])


def _run(mesh, body, x, n_out=1):
    spec = P(mesh.axis_names)
    f = sf.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * n_out if n_out > 1 else spec)
    out = f(sf.distribute(x, spec, mesh=mesh))
    return tuple(sf.gather(o) for o in out) if n_out > 1 else sf.gather(out)


# -- vmap inside the body ---------------------------------------------------------------------------


@scenario
def vmap_of_each_collective(mesh: sf.Mesh) -> None:
    """vmap over rows of every collective: the collective of each row (even shards)."""
    x = _x(8)
    for axes in _axes_cases(mesh):
        g = mesh.size if len(axes) > 1 else mesh.shape[-1]
        ring = [(i, (i + 1) % g) for i in range(g)]

        def row(r, axes=axes, ring=ring, g=g):
            return (lax.psum(r, axes), lax.pmax(r, axes), lax.pmin(r, axes), lax.pmean(r, axes),
                    lax.all_gather(r, axes), lax.all_gather(r, axes, tiled=True), lax.ppermute(r, axes, ring),
                    lax.psum_scatter(r, axes, tiled=True), lax.all_to_all(r.reshape(g, -1), axes, 0, 0, tiled=True),
                    lax.all_to_all(r.reshape(g, -1), axes, 0, 1), r * lax.axis_index(axes))

        got = _run(mesh, lambda b: torch.func.vmap(row)(b), x, n_out=11)

        def want_of(ms, k, g=g):
            s = torch.stack(ms)
            n = ms[0].shape[0] // g  # ms: the members' rows
            pieces = [m.reshape(g, n)[k] for m in ms]
            return (s.sum(0), s.amax(0), s.amin(0), s.mean(0), s, torch.cat(ms), ms[(k - 1) % g],
                    s.sum(0)[k * n:(k + 1) * n], torch.stack(pieces), torch.stack(pieces, -1), ms[k] * k)

        for i, name in enumerate(["psum", "pmax", "pmin", "pmean", "all_gather", "all_gather tiled", "ppermute",
                                  "psum_scatter", "all_to_all tiled", "all_to_all", "axis_index"]):
            want = _by_hand(x, mesh, axes, lambda ms, k, i=i: torch.stack(
                [want_of([m[r] for m in ms], k)[i] for r in range(ms[k].shape[0])]))
            _close(got[i], want, f"{name} over {axes}")


@scenario
def vmap_whole_gradient(mesh: sf.Mesh) -> None:
    """Values and gradients of the whole shard_map whose body vmaps psum and all_gather."""
    a = mesh.axis_names[-1]

    def body(b):
        return torch.func.vmap(lambda r: torch.sin(lax.psum(r, a)) * r + lax.all_gather(r, a, tiled=True)[: r.shape[0]])(b)

    def ref(x):
        return _by_hand(x, mesh, (a,), lambda ms, k: torch.sin(torch.stack(ms).sum(0)) * ms[k] + torch.cat(ms, -1)[..., :8])

    x = _x(8)
    loss = lambda f: lambda v: (f(v) ** 2).sum()  # noqa: E731
    _close(_run(mesh, body, x), ref(x), "value")
    _close(torch.func.grad(loss(lambda v: _run(mesh, body, v)))(x), torch.func.grad(loss(ref))(x), "gradient")


@scenario
def vmap_uneven_shards(mesh: sf.Mesh) -> None:
    """7 rows over 4 devices (local: one thread per device): vmap over the columns."""
    a = mesh.axis_names[-1]
    x = _x(7)

    def body(b):
        return torch.func.vmap(lambda c: lax.psum(c.sum(), a) * c.mean(), in_dims=1)(b).unsqueeze(0)

    def ref(x):
        return _by_hand(x, mesh, (a,), lambda ms, k: (torch.stack([m.sum(0) for m in ms]).sum(0) * ms[k].mean(0))[None])

    _close(_run(mesh, body, x), ref(x), "value")
    loss = lambda f: lambda v: (f(v) ** 2).sum()  # noqa: E731
    _close(torch.func.grad(loss(lambda v: _run(mesh, body, v)))(x), torch.func.grad(loss(ref))(x), "gradient")


# -- grad / vjp / jacrev inside the body (varying losses: every backend) ------------------------------


def _group_sum(ms):
    return torch.stack(ms).sum(0)


@scenario
def grad_of_varying_losses(mesh: sf.Mesh) -> None:
    for rows in (8, 7):  # even and uneven shards
        x = _x(rows)
        for axes in _axes_cases(mesh):
            g = mesh.size if len(axes) > 1 else mesh.shape[-1]
            # psum: sum_i <S, b_i> = |S|^2 -> 2 S (S: the group's sum of column sums)
            body = lambda b, axes=axes: torch.func.grad(  # noqa: E731
                lambda v: (lax.psum(v.sum(0), axes) * v.sum(0)).sum())(b)
            want = _by_hand(x, mesh, axes, lambda ms, k: (2 * _group_sum([m.sum(0) for m in ms])).expand_as(ms[k]))
            _close(_run(mesh, body, x), want, f"grad psum, {rows} rows, {axes}")
            # pmax of the column sums, weighted by rank + 1: the argmax device gets sum(rank + 1)
            body = lambda b, axes=axes: torch.func.grad(  # noqa: E731
                lambda v: (lax.pmax(v.sum(0), axes) * (lax.axis_index(axes) + 1)).sum())(b)
            want = _by_hand(x, mesh, axes, lambda ms, k, g=g: (
                (torch.stack([m.sum(0) for m in ms]).argmax(0) == k).double() * g * (g + 1) / 2).expand_as(ms[k]))
            _close(_run(mesh, body, x), want, f"grad pmax, {rows} rows, {axes}")
            # all_gather (tiled, pieces of different lengths when uneven), weighted by rank + 1
            body = lambda b, axes=axes: torch.func.grad(  # noqa: E731
                lambda v: (lax.all_gather(v, axes, tiled=True) ** 2).sum() * (lax.axis_index(axes) + 1))(b)
            want = _by_hand(x, mesh, axes, lambda ms, k, g=g: 2 * ms[k] * g * (g + 1) / 2)
            _close(_run(mesh, body, x), want, f"grad all_gather, {rows} rows, {axes}")


@scenario
def vjp_of_moving_collectives(mesh: sf.Mesh) -> None:
    """psum_scatter -> all_gather, all_to_all -> all_to_all back, ppermute -> the inverse
    permutation, with cotangents that differ per device."""
    x = _x(8)
    for axes in _axes_cases(mesh):
        g = mesh.size if len(axes) > 1 else mesh.shape[-1]
        ring = [(i, (i + 1) % g) for i in range(g)]
        cases = {
            "psum_scatter": lambda v: lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True),
            "all_to_all": lambda v: lax.all_to_all(v, axes, 1, 0, tiled=True),
            "ppermute": lambda v: lax.ppermute(v, axes, ring),
        }
        for name, fn in cases.items():
            def body(b, fn=fn):
                y, back = torch.func.vjp(fn, b)
                ct = torch.cos(y) * (lax.axis_index(axes) + 1)
                return back(ct)[0]

            def want(ms, k, name=name):
                n = ms[0].shape[1] // g
                if name == "psum_scatter":  # cotangent of member j's piece: cos(psum piece j) * (j + 1)
                    s = _group_sum(ms)
                    return torch.cat([torch.cos(s[:, j * n:(j + 1) * n]) * (j + 1) for j in range(g)], 1)
                if name == "all_to_all":
                    return _a2a_back(ms, k, g)
                return torch.cos(ms[k]) * ((k + 1) % g + 1)

            _close(_run(mesh, body, x), _by_hand(x, mesh, axes, want), f"vjp {name} over {axes}")


def _a2a(ms, j, g):
    """Member j's result of all_to_all(split 1, concat 0, tiled): piece j of every member's columns, stacked by rows."""
    n = ms[0].shape[1] // g
    return torch.cat([m[:, j * n:(j + 1) * n] for m in ms], 0)


def _a2a_back(ms, k, g):
    """The all_to_all vjp on member k of the cotangent cos(y_j) * (j + 1) held by member j."""
    rows, n = ms[0].shape[0], ms[0].shape[1] // g
    return torch.cat([torch.cos(_a2a(ms, j, g)[k * rows:(k + 1) * rows]) * (j + 1) for j in range(g)], 1)


@scenario
def nested_vmap_of_grad_and_jvp(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    x = _x(8)
    # vmap over rows of a grad: each row's loss <psum(r), r> -> 2 * the row's group sum
    body = lambda b: torch.func.vmap(torch.func.grad(lambda r: (lax.psum(r, a) * r).sum()))(b)  # noqa: E731
    _close(_run(mesh, body, x), _by_hand(x, mesh, (a,), lambda ms, k: 2 * _group_sum(ms)), "vmap of grad")
    # jvp: the tangent goes through the same collective (pmax: the argmax device's tangent)
    body = lambda b: torch.func.jvp(lambda v: lax.psum(torch.sin(v), a), (b,), (2 * b,))[1]  # noqa: E731
    _close(_run(mesh, body, x), _by_hand(x, mesh, (a,), lambda ms, k: _group_sum([torch.cos(m) * 2 * m for m in ms])),
           "jvp psum")
    body = lambda b: torch.func.jvp(lambda v: lax.pmax(v, a), (b,), (b * b,))[1]  # noqa: E731
    _close(_run(mesh, body, x), _by_hand(x, mesh, (a,), lambda ms, k: torch.stack(ms).amax(0) ** 2), "jvp pmax")
    body = lambda b: torch.func.jvp(lambda v: lax.all_gather(v, a, tiled=True)[:2], (b,), (3 * b,))[1]  # noqa: E731
    _close(_run(mesh, body, x), _by_hand(x, mesh, (a,), lambda ms, k: 3 * torch.cat(ms)[:2]), "jvp all_gather")


# -- invariant losses: JAX's psum transpose is a broadcast (local backend) --------------------------------


@scenario(backends=("local",))
def grad_and_jacrev_of_invariant_results(mesh: sf.Mesh) -> None:
    """Even shards (the stacked body knows which cotangents vary): d psum(b) / d b is the
    identity on each device (JAX: psum transposes to a broadcast of the invariant
    cotangent); a replicated input's gradient through a psum of it is the group size (its
    implicit pvary transposes to a psum). (Uneven shards and dist count a cotangent the same
    on every device once per device, see transforms/inner.py.)"""
    a = mesh.axis_names[-1]
    g = mesh.shape[-1]
    x = _x(8)
    body = lambda b: torch.func.grad(lambda v: lax.psum(v.sum(0), a).sum())(b)  # noqa: E731
    _close(_run(mesh, body, x), torch.ones_like(x), "grad of an invariant loss")
    body = lambda b: torch.func.grad(lambda v: (v * (lax.axis_index(a) + 1)).sum())(b)  # noqa: E731
    _close(_run(mesh, body, x), _by_hand(x, mesh, (a,), lambda ms, k: torch.full_like(ms[k], k + 1.0)),
           "axis_index under an inner grad")
    body = lambda b: torch.func.jacrev(lambda v: lax.psum(v[0], a))(b).permute(1, 0, 2)  # noqa: E731
    want = torch.zeros(8, 8, 8, dtype=torch.float64)
    want[::2] = torch.eye(8, dtype=torch.float64)  # row 0 of each device's block: d psum(b[0]) / d b[0] = I
    _close(_run(mesh, body, x), want, "jacrev psum")
    w = torch.randn(8, dtype=torch.float64)
    f = sf.shard_map(lambda w: torch.func.grad(lambda v: lax.psum(v * v, a).sum())(w), mesh=mesh,
                     in_specs=P(), out_specs=P())
    _close(sf.gather(f(w)), 2 * g * w, "grad of a replicated input")
    # a replicated input of ppermute / psum_scatter varies first (JAX's pvary); its gradient
    # sums over the devices and stays replicated (out_specs P() passes check_vma)
    ring = [(i, (i + 1) % g) for i in range(g)]
    for name, fn, scale in (("ppermute", lambda v: lax.ppermute(v, a, ring), 2 * g),
                            ("psum_scatter", lambda v: lax.psum_scatter(v, a, tiled=True), 2 * g * g)):
        f = sf.shard_map(lambda w, fn=fn: torch.func.grad(lambda v: (fn(v) ** 2).sum())(w), mesh=mesh,
                         in_specs=P(), out_specs=P())
        _close(sf.gather(f(w)), scale * w, f"grad of a replicated input of {name}")


test_local, test_dist = collect(globals())
