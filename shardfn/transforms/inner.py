"""sf.lax collectives on tensors traced by a torch.func transform opened inside a shard_map body.

Each shard_map body implementation (``shard_map/stacked``, ``per_device``, ``dist``) runs a
collective on tensors of the functorch level the body was entered at (its *base* level).
A transform opened inside the body (vmap, grad, vjp, jvp, jacrev, ...) wraps tensors at a
higher level; a collective on such a tensor goes through :class:`_Inner`, an
``autograd.Function`` whose rules peel one level at a time, as JAX's batching, JVP and
transpose rules of the collectives do:

- vmap: the batch dim is one more local dim (the collective's dims shift past it), so the
  result is the collective of each batch element.
- jvp: the collectives are linear, so the tangent goes through the same collective
  (pmax / pmin: the tangent of the devices attaining the extreme, shared evenly by ties).
- grad / vjp: the transpose, with JAX's check_vma rules. A cotangent that varies over an
  axis the result is invariant over holds one share per device (torch's inner grad does
  not sum at the implicit broadcast of an invariant value; JAX's pvary transpose does), so
  the shares are summed first. Then psum -> broadcast, all_gather -> this device's slice,
  psum_scatter -> all_gather, all_to_all -> the inverse all_to_all, ppermute -> the
  inverse permutation; where the input was invariant over an axis of the group the
  per-device results are summed over it (the transpose of the implicit pvary).

Which axes a value varies over comes from the body's ``vma(t)``: the stacked body (even
shards) reads it from its vmap levels. The per-device body (uneven shards) and dist cannot
tell for cotangents (autograd makes them out of sight of any tracking), so they treat every
value as varying: a cotangent the same on every device (the seed of a loss replicated over
the group) counts once per device there, as their own collectives' transposes already do.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch._C._functorch as _ft

# A collective: (kind, axes, a, b) with kind one of "sum", "max", "min" (a, b None),
# "all_gather" (a = dim), "psum_scatter" (a = dim), "all_to_all" (a = split, b = concat),
# "ppermute" (a = the (src, dst) pairs). Dims are dims of the local tensor.
Call = tuple


_VARYING = ("psum_scatter", "all_to_all", "ppermute")  # results vary over the group


def run(body: Any, base: int, call: Call, x: torch.Tensor) -> torch.Tensor:
    """``call`` on ``x`` in ``body`` entered at functorch level ``base``."""
    if _ft.maybe_get_level(x) <= base:
        return _raw(body, call, x)
    # traced by a transform opened inside the body
    kind, axes = call[0], call[1]
    vma = _vma(body, x)
    spread: tuple[str, ...] = ()
    if vma is not None and getattr(body, "levels", None) is not None:  # a stacked body (see _Inner)
        if kind in _VARYING or (not vma and _outer_traced(body, x)):
            spread = tuple(a for a in axes if a not in vma and body.mesh.axis_size(a) > 1)
    if spread:  # JAX's implicit pvary: x varies over the whole group, its transpose sums over it
        # + (-0.0) is the identity on every float (-0.0, inf and nan too), and its derivative
        # passes the cotangent unchanged, so x's gradient stays as invariant as x
        zero = (body.axis_index(spread) * 0 + 1).to(x.dtype) * -0.0
        x = x + zero
        vma = vma | set(spread)
    return _Inner.apply(x, body, base, call, spread, vma)


def _outer_traced(body: Any, x: torch.Tensor) -> bool:
    """Whether a transform around the shard_map (below the body's vmap levels) traces ``x``."""
    floor = min((lvl for lvl in body.levels if lvl is not None), default=1) - 1
    while _ft.maybe_get_level(x) > floor:
        x = _ft.get_unwrapped(x)
    return _ft.is_functorch_wrapped_tensor(x)


def _raw(body: Any, call: Call, x: torch.Tensor) -> torch.Tensor:
    kind, axes, a, b = call
    if kind in ("sum", "max", "min"):
        return body.reduce(x, axes, kind)
    if kind == "all_gather":
        return body.all_gather(x, axes, a)
    if kind == "psum_scatter":
        return body.psum_scatter(x, axes, a)
    if kind == "all_to_all":
        return body.all_to_all(x, axes, a, b)
    return body.ppermute(x, axes, a)


@contextlib.contextmanager
def at_level(base: int) -> Iterator[None]:
    """Run with the torch.func transforms above level ``base`` set aside, so tensors made
    here are plain at those levels (a factory under an inner grad would otherwise be
    wrapped at its level, below which the body cannot batch it)."""
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    with contextlib.ExitStack() as stack:
        while (_ft.maybe_current_level() or -1) > base:
            stack.enter_context(retrieve_current_functorch_interpreter().lower())
        yield


def _vma(body: Any, t: torch.Tensor) -> frozenset[str] | None:
    """The mesh axes ``t`` varies over, or None where the body cannot tell."""
    vma = getattr(body, "vma", None)
    return None if vma is None else frozenset(vma(t))


def _shifted(call: Call) -> Call:
    """``call`` on a tensor with one more leading dim (a vmap batch dim moved to 0)."""
    kind, axes, a, b = call
    if kind in ("all_gather", "psum_scatter"):
        return kind, axes, a + 1, b
    if kind == "all_to_all":
        return kind, axes, a + 1, b + 1
    return call


def _psum(body: Any, base: int, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    return run(body, base, ("sum", axes, None, None), t) if axes else t


def _over(axes: tuple[str, ...], within: frozenset[str] | None) -> tuple[str, ...]:
    """The axes of ``axes`` in ``within`` (None: all of them; a body that cannot tell
    treats values as varying)."""
    return axes if within is None else tuple(a for a in axes if a in within)


class _Inner(torch.autograd.Function):
    """One collective on a tensor at a level above the body's: see the module docstring.

    torch.func applies an ``autograd.Function``'s rules at every level that wraps its
    input, a stacked body's own vmap levels included: there :meth:`vmap` runs the body's
    collective under a vmap level of the same number (levels count the transforms
    entered), so the body's batching sees its own level. A level whose input is not
    batched is skipped, so there the result may not vary either: :func:`run` first makes
    the input of psum_scatter / all_to_all / ppermute vary over the group (``spread``,
    JAX's implicit pvary; the transpose then sums over those axes).
    ``vma``: the axes the input varies over (None: the body cannot tell).
    """

    @staticmethod
    def forward(x: torch.Tensor, body: Any, base: int, call: Call, spread: tuple, vma: Any) -> torch.Tensor:
        return run(body, base, call, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        x, body, base, call, spread, vma = inputs
        ctx.body, ctx.base, ctx.call, ctx.spread, ctx.vma = body, base, call, spread, vma
        ctx.n = x.shape[call[2]] if call[0] == "all_gather" else None
        if call[0] in ("max", "min"):
            hit = (x == output).to(x.dtype)
            share = hit / _psum(body, base, hit, _over(call[1], vma))
            ctx.save_for_backward(share)
            ctx.save_for_forward(share)

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> Any:
        return _psum(ctx.body, ctx.base, _transpose(ctx, ct), ctx.spread), None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor, *_: Any) -> torch.Tensor:
        body, base, call = ctx.body, ctx.base, ctx.call
        if call[0] in ("max", "min"):
            (share,) = ctx.saved_tensors
            return _psum(body, base, t * share, _over(call[1], ctx.vma))
        return run(body, base, call, t)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: torch.Tensor, body: Any, base: int, call: Call, spread: tuple,
             vma: Any) -> tuple:
        bd = in_dims[0]
        level = (_ft.maybe_current_level() or 0) + 1  # the level this rule batches
        if level <= base:  # one of a stacked body's own levels, or a transform's around the shard_map
            levels = getattr(body, "levels", None) or []
            out = 0
            if level in levels and call[0] not in _VARYING and body.mesh.axis_names[levels.index(level)] in call[1]:
                out = None  # reduced over this level's mesh axis: the same on its devices
            y = torch.func.vmap(lambda t: _raw(body, call, t), in_dims=bd, randomness=info.randomness)(x)
            return (y, 0) if out == 0 else (y.select(0, 0), None)  # (out_dims=None rejects any BatchedTensor)
        if bd is None:
            return run(body, base, call, x), None
        return run(body, base, _shifted(call), x.movedim(bd, 0)), 0


def _transpose(ctx: Any, ct: torch.Tensor) -> torch.Tensor:
    body, base, (kind, axes, a, b), vma = ctx.body, ctx.base, ctx.call, ctx.vma
    invariant_in = () if vma is None else tuple(x for x in axes if x not in vma)  # psum of those is size * x
    if kind in ("sum", "max", "min", "all_gather"):  # an invariant result: sum the cotangent's shares
        ct = _psum(body, base, ct, _over(axes, _vma(body, ct)))
    if kind == "sum":
        scale = math.prod(body.mesh.axis_size(x) for x in invariant_in)
        return ct * scale if scale != 1 else ct
    if kind in ("max", "min"):
        (share,) = ctx.saved_tensors
        return ct * share
    if kind == "all_gather":  # this device's slice, summed over the copies of an invariant input
        return _psum(body, base, _own_slice(body, base, ct, axes, a, ctx.n), invariant_in)
    if kind == "psum_scatter":
        return run(body, base, ("all_gather", axes, a, None), ct)
    if kind == "all_to_all":
        return run(body, base, ("all_to_all", axes, b, a), ct)
    return run(body, base, ("ppermute", axes, tuple((d, s) for s, d in a), None), ct)


def _own_slice(body: Any, base: int, ct: torch.Tensor, axes: tuple[str, ...], dim: int, n: int) -> torch.Tensor:
    """This device's piece (``n`` long along ``dim``) of ``ct``, the pieces of its group
    over ``axes`` concatenated in group order (the transpose of a tiled all_gather)."""
    index = body.axis_index(axes)
    if getattr(body, "one_shape", False):  # every device's piece has n entries
        g = math.prod(body.mesh.axis_size(x) for x in axes)
        return ct.unflatten(dim, (g, n)).index_select(dim, index.reshape(1)).squeeze(dim)
    # pieces may differ in length (uneven shards): find where this device's starts
    sizes = run(body, base, ("all_gather", axes, 0, None), torch.tensor([n], device=index.device))
    start = int(sizes[: int(index)].sum())
    return ct.narrow(dim, start, n)
