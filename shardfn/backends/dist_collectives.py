"""The dist backend's collectives: a functional collective issued on a mesh group and waited
on (fused with its wait under real-tensor tracing), failures turned into :class:`CollectiveError`
naming the step, the axes and the ranks; dtypes gloo/nccl do not take move as bytes; the
choice between the library's reductions and ordered ones (``dist_groups`` holds the mode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..values.torch_compat import funcol_gather_scatter
from .dist_groups import Group, _mode

_all_gather_single, _reduce_scatter_single = funcol_gather_scatter()  # torch 2.11 / 2.13 names

# dtypes every backend's collectives take; others move as raw bytes, or reduce widened
_WIRE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                   torch.int32, torch.int64})


class CollectiveError(RuntimeError):
    """A collective of the dist backend failed or timed out."""


# -- collectives: issue, wait, and turn failures into clear errors --------------------------------


def _issued(op: Any, *args: Any) -> torch.Tensor:
    """A functional collective and its wait as one graph node that FX treats as side-
    effecting (neither dead-code eliminated nor constant folded)."""
    return funcol.wait_tensor(op(*args))


torch.fx.node.has_side_effect(_issued)


def pin_in_real_trace(out: torch.Tensor) -> torch.Tensor:
    """Under ``make_fx`` on real tensors (``torch.func.linearize`` traces so and then
    constant-folds the graph), fuse the collective that made ``out`` with its wait into
    one side-effecting node. Otherwise a collective on constants is folded apart from
    its wait: the folded copy is taken before the collective completes (wrong, rank-
    dependent values, then mismatched collectives: a hang)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or is_fake(out):
        return out
    slot = get_proxy_slot(out, mode.tracer, None)
    node = slot.proxy.node if slot is not None else None
    wait = torch.ops._c10d_functional.wait_tensor.default
    while node is not None and node.target is wait and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node is not None and getattr(node.target, "namespace", None) == "_c10d_functional":
        node.args = (node.target, *node.args)
        node.target = _issued
    return out


def run_collective(what: str, group: Group, fn: Callable[..., Any], *args: Any) -> torch.Tensor:
    """``fn(*args, group.pg)`` (a functional collective), waited on; a failure or timeout
    becomes a :class:`CollectiveError` naming ``what``, the axes and the ranks."""
    try:
        return pin_in_real_trace(funcol.wait_tensor(fn(*args, group.pg)))
    except RuntimeError as e:
        timeout = group.timeout if group.timeout is not None else "torch's default"
        raise CollectiveError(
            f"shardfn dist backend: {what} over mesh axes {group.axes} (ranks {list(group.ranks)}) failed on "
            f"rank {dist.get_rank()}: {e}\nEvery rank must make the same shardfn calls in the same order; "
            f"a peer may have crashed, diverged or be slow. The collective timeout is {timeout} "
            f"(set it with SHARDFN_DIST_TIMEOUT=<seconds> or shardfn.backends.dist.configure(timeout=...) "
            f"before first using the mesh)."
        ) from e


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in plain row-major memory: lazy conj/neg flags applied, contiguous.
    A collective reads memory, not flags; and every rank must get here whatever its shard's
    shape (a rank that raised alone would leave its peers waiting in the collective)."""
    return x.resolve_conj().resolve_neg().contiguous()


def _bytes(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` dense (:func:`dense`), reinterpreted as bytes if its dtype is not on the wire (the
    last dim ``element_size`` times longer), and the number of wire elements per element (for
    split sizes)."""
    x = dense(x)
    if x.dtype in _WIRE:
        return x, 1
    # through a flat view with unit stride: a contiguous tensor may carry any stride on a size-1
    # dim (a one-element x[::2] keeps stride 2 through reshape), which view(dtype) rejects
    flat = x.reshape(-1).as_strided((x.numel(),), (1,)).view(torch.uint8)
    return (flat.view(*x.shape[:-1], x.shape[-1] * x.element_size()) if x.dim() else flat), x.element_size()


def _from_bytes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_bytes` on a collective's output (a no-op for wire dtypes)."""
    if y.dtype == dtype:
        return y
    y = y.contiguous()
    flat = y.reshape(-1).as_strided((y.numel(),), (1,)).view(dtype)  # size-1 dims may carry any stride
    return flat.view(*y.shape[:-1], y.shape[-1] // dtype.itemsize) if y.dim() else flat


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    wire, _ = _bytes(x)
    return _from_bytes(run_collective("all_gather", group, _all_gather_single, wire, dim), x.dtype)


def _all_to_all(send: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    """all_to_all of a 1-D buffer: ``in_splits[j]`` elements go to member j."""
    wire, k = _bytes(send)
    y = run_collective("all_to_all", group, funcol.all_to_all_single, wire,
                       [n * k for n in out_splits], [n * k for n in in_splits])
    return _from_bytes(y, send.dtype)


def _native_reduce(x: torch.Tensor, op: str, group: Group, scatter_dim: int | None) -> torch.Tensor:
    """all_reduce (``scatter_dim`` None) or reduce_scatter through the library's collective;
    an average is a sum divided here (floor division for integers, as on the local backend);
    a floating max/min reduces order keys (:func:`_order_keys`), so a nan wins as in torch."""
    wire_op = "sum" if op == "avg" else op
    x = dense(x)
    if op in ("max", "min") and x.is_floating_point():
        keys, narrow = _order_keys(x, op)
        if scatter_dim is None:
            y = run_collective("all_reduce", group, funcol.all_reduce, keys, op)
        else:
            y = run_collective("reduce_scatter", group, _reduce_scatter_single, keys, op, scatter_dim)
        return _from_order_keys(y, narrow, x.dtype)
    wire = torch.view_as_real(x) if x.is_complex() else x if x.dtype in _WIRE else x.to(torch.int64)
    if scatter_dim is None:
        y = run_collective("all_reduce", group, funcol.all_reduce, wire.contiguous(), wire_op)
    else:
        y = run_collective("reduce_scatter", group, _reduce_scatter_single, wire.contiguous(), wire_op,
                           scatter_dim)
    y = torch.view_as_complex(y) if x.is_complex() else y.to(x.dtype)
    if op != "avg":
        return y
    if y.is_floating_point() or y.is_complex():
        return y / group.size
    return torch.div(y, group.size, rounding_mode="floor")


def _order_keys(x: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.dtype]:
    """Integers that order as ``x``'s floats do, with every nan the largest key for max and the
    smallest for min, and the integer dtype of ``x``'s bits. gloo's (and nccl's) max/min compare
    with ``<``, so a nan on one rank is dropped or kept by the ring's order; torch's amax/amin
    (the local backend's reduction) give nan (dist seed 33000356: sqrt, then pmin).
    A sign-magnitude float's bits as an integer order the non-negative values; flipping the
    magnitude bits of the negative ones orders those too (-0 below +0). 16-bit keys go on the
    wire as int32. The extreme keys read back as nan bits (see :func:`_from_order_keys`)."""
    bits = _INT_BITS[x.dtype]
    info = torch.iinfo(bits)
    b = x.view(bits)
    keys = torch.where(b < 0, b ^ info.max, b)
    keys = torch.where(x.isnan(), info.max if op == "max" else info.min, keys)
    return (keys.to(torch.int32) if bits == torch.int16 else keys).contiguous(), bits


def _from_order_keys(y: torch.Tensor, bits: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The floats of reduced :func:`_order_keys`: the map is its own inverse on the bits; the
    nan keys (the integer range's ends) are the bits of a nan."""
    y = y.to(bits)
    return torch.where(y < 0, y ^ torch.iinfo(bits).max, y).view(dtype)


_INT_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def _ordered(x: torch.Tensor, op: str, group: Group) -> bool:
    """Whether an all_reduce runs in mesh order (to match the local backend bit for bit;
    a sum of two terms is exact in either order, integer sums and max/min always are)."""
    floating = x.is_floating_point() or x.is_complex()
    return _mode() == "ordered" and floating and op in ("sum", "avg") and group.size > 2


def _scatter_ordered(x: torch.Tensor) -> bool:
    """Whether a reduce_scatter is an all_to_all plus a local reduction in mesh order."""
    mode = _mode()
    return mode == "ordered" or (mode == "auto" and x.device.type == "cpu")
