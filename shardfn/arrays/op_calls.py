"""One op call as dispatch sees it: the sharded leaves of its arguments, plain tensors
lifted to replicated arrays, arguments swapped for meta tensors, a description for messages."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..backends.registry import backend_for
from ..values import replica_checks as _replicas
from ..values.errors import ShardingRuntimeError
from ..values.layout import Layout, describe
from ..values.schema import op_name as _op_name
from .array import ShardedArray, dense, wrap
from .redistribute import raw_distribute


def _leaves(args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """(path, value) of every argument, lists flattened one level."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            out.extend(((i, j), b) for j, b in enumerate(a))
            out.append(((i, "len"), len(a)))
        else:
            out.append((i, a))
    for k, v in kwargs.items():
        out.append((k, v))
    return out


def _lift_plain(func: Any, args: tuple, kwargs: dict, leaves: list) -> tuple[tuple, dict]:
    """Plain tensors next to ShardedArrays take part as replicated values (only in
    Tensor parameters: a 0-d tensor passed as a Scalar stays a number to the op)."""
    mesh = next((v.mesh for _, v in leaves if isinstance(v, ShardedArray)), None)
    if mesh is None:
        return args, kwargs
    slots = _tensor_slots(func)

    checked = _replicas.checking()

    def lift(path: Any, v: Any) -> Any:
        slot = path[0] if isinstance(path, tuple) else path
        if isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray) and slot in slots:
            if checked:
                what = f"{_op_name(func)}: {_arg_name(func, path)}, a plain tensor,"
                backend_for(mesh).check_replicas(mesh, v, mesh.axis_names, what)
            if v.device.type != mesh.device_type:
                v = _onto_mesh_device(func, path, v, mesh.device_type)
            layout = Layout(mesh, ((),) * v.dim())
            return wrap(raw_distribute(_materialized(v), layout), layout, v.shape, v.dtype)
        return v

    return _replace(args, kwargs, lift)


def _onto_mesh_device(func: Any, path: Any, v: torch.Tensor, device_type: str) -> torch.Tensor:
    """A plain operand on another device than the mesh's, as torch treats one beside a tensor on
    that device: a 0-d CPU tensor (torch's CPU scalar) moves; a tensor in a list (``index``'s
    indices, which torch takes from the CPU) stays, for the kernels to judge; any other raises
    (torch's "Expected all tensors to be on the same device"). A meta mesh's kernels would
    not check it, and the result would live on the operand's device, off its mesh."""
    if v.dim() == 0 and v.device.type == "cpu":
        return v.to(device_type)
    if isinstance(path, tuple):
        return v
    raise ShardingRuntimeError(
        f"{_op_name(func)}: {_arg_name(func, path)} is a plain tensor on {v.device.type}, and the arrays "
        f"beside it live on their mesh's device type {device_type!r}; tensors of one op must be on one "
        f"device (CPU scalars aside), as torch requires: move it with .to({device_type!r}) or "
        f"sf.distribute it")


def _materialized(v: torch.Tensor) -> torch.Tensor:
    """``v`` without lazy flags: a ZeroTensor (forward AD's zero tangent) as real zeros, conj/neg
    views resolved. Inside ``__torch_dispatch__`` those dispatch keys are skipped, so the local
    kernels would read a ZeroTensor's missing storage or ignore the flag."""
    if v._is_zerotensor():
        return dense(v)
    return v.resolve_conj().resolve_neg() if v.is_conj() or v.is_neg() else v


def _arg_name(func: Any, path: Any) -> str:
    """``argument 'other' (position 1)`` for an op argument at ``path`` (index or keyword, then list index)."""
    slot, rest = (path[0], path[1:]) if isinstance(path, tuple) else (path, ())
    if isinstance(slot, int):
        args = func._schema.arguments
        name = f"argument {args[slot].name!r} (position {slot})" if slot < len(args) else f"argument {slot}"
    else:
        name = f"argument {slot!r}"
    return name + "".join(f"[{i}]" for i in rest)


_SLOTS: dict[Any, frozenset] = {}
# host-side tensor arguments: the per-list-position ``scalars`` of the ``_foreach`` ops, which
# torch requires on the CPU whatever the device of the lists (they stay plain CPU tensors)
_HOST_ARGS = ("scalars",)


def _tensor_slots(func: Any) -> frozenset:
    """Positions and names of the parameters typed Tensor (or Tensor list / optional), but
    the host-side ones (``_HOST_ARGS``)."""
    slots = _SLOTS.get(func)
    if slots is None:
        found = set()
        for i, a in enumerate(func._schema.arguments):
            if "Tensor" in str(a.type) and a.name not in _HOST_ARGS:
                found.update((i, a.name))
        slots = _SLOTS[func] = frozenset(found)
    return slots


def host_slots(func: Any) -> tuple:
    """Positions and names of ``func``'s host-side tensor arguments (see ``_HOST_ARGS``)."""
    return tuple(x for i, a in enumerate(func._schema.arguments) if a.name in _HOST_ARGS for x in (i, a.name))


def _replace(args: tuple, kwargs: dict, fn: Callable[[Any, Any], Any]) -> tuple[tuple, dict]:
    """Rebuild args/kwargs with ``fn(path, value)`` applied to every leaf."""
    new_args = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            new_args.append(type(a)(fn((i, j), b) for j, b in enumerate(a)))
        else:
            new_args.append(fn(i, a))
    return tuple(new_args), {k: fn(k, v) for k, v in kwargs.items()}


def _to_meta(path: Any, v: Any) -> Any:
    if isinstance(v, ShardedArray):  # with the array's strides: outputs get torch's strides
        meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        off = v.storage_offset()
        return meta.as_strided(v.shape, v.stride(), off) if off else meta
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    return v


def _describe_call(func: Any, leaves: list) -> str:
    arrays = [v for _, v in leaves if isinstance(v, ShardedArray)]
    return f"{_op_name(func)}: " + " x ".join(describe(tuple(a.shape), a.dtype, a._layout) for a in arrays)
