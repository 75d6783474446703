"""How a ShardedArray prints: its values as a tensor prints them (torch's print options)
with the sharding, where this process holds every shard (the simulated mesh); this rank's
shard and the layout on dist. Printing never communicates, so printing on one rank cannot
leave the others waiting in a collective."""

from __future__ import annotations

from typing import Any

import torch

from ..backends.registry import backend_for
from ..values.layout import Layout, describe, device_box

_INDENT = len("ShardedArray(")


def show(x: Any) -> str:
    """``repr``/``str`` of ShardedArray ``x``."""
    layout: Layout = x._layout
    mesh = layout.mesh
    head = f"{describe(tuple(x.shape), x.dtype, layout)}, mesh={mesh!r}{_autograd(x)}"
    backend = backend_for(mesh)
    devices = backend.devices(mesh)
    shards = [s.detach() for s in backend.shard_list(x._local, mesh)]
    if any(_no_values(s) for s in shards):
        return f"ShardedArray({head})"
    if len(devices) == mesh.size:
        with torch.no_grad():
            value = _whole(layout, tuple(x.shape), x.dtype, shards)
        return f"ShardedArray({_values(value, _INDENT)}, {head})"
    lines = [f"ShardedArray({head},"]
    for dev, s in zip(devices, shards):
        coords = ", ".join(f"{a}={c}" for a, c in zip(mesh.axis_names, mesh.coords(dev)))
        box = ", ".join(f"{lo}:{hi}" for lo, hi in device_box(layout, tuple(x.shape), dev)) or "scalar"
        what = "holds" if not layout.partial else (
            "holds a part (pending " + ", ".join(f"{op} over {a!r}" for a, op in layout.partial) + ") of")
        lines.append(f"  rank {dev} ({coords}) {what} [{box}]:")
        lines.append("  " + repr(s).replace("\n", "\n  ") + (")" if dev == devices[-1] else ""))
    return "\n".join(lines)


def _autograd(x: torch.Tensor) -> str:
    if x.grad_fn is not None:
        return f", grad_fn=<{type(x.grad_fn).__name__}>"
    return ", requires_grad=True" if x.requires_grad else ""


def _no_values(t: torch.Tensor) -> bool:
    """A shard with no data to show (meta, fake or functorch-wrapped tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t) or torch._C._functorch.is_functorch_wrapped_tensor(t) or type(t) is not torch.Tensor


def _values(value: torch.Tensor, indent: int) -> str:
    """``value`` as torch prints a tensor, without the ``tensor(`` around it, indented."""
    try:
        text = repr(value)
    except RuntimeError:  # torch's repr unpacks forward-AD duals, which asserts below autograd (inside dispatch)
        return torch._tensor_str._tensor_str(value, indent)
    if not (text.startswith("tensor(") and text.endswith(")")):
        return text
    return text[len("tensor("):-1].replace("\n" + " " * len("tensor("), "\n" + " " * indent)


def _whole(layout: Layout, shape: tuple[int, ...], dtype: torch.dtype, shards: list[torch.Tensor]) -> torch.Tensor:
    """The global value from every device's shard, pending reductions applied (in mesh
    order, innermost axis first), in this process: no collective, no plan, no counter."""
    mesh = layout.mesh
    pending = dict(layout.partial)
    pos = [mesh.axis_index(a) for a in pending]
    groups: dict[tuple, list[int]] = {}
    for dev in range(mesh.size):
        c = mesh.coords(dev)
        groups.setdefault(tuple(v for i, v in enumerate(c) if i not in pos), []).append(dev)
    out = None
    for devs in groups.values():
        parts = torch.stack([shards[d] for d in devs])  # row-major over the pending axes
        if parts.dtype == torch.complex32 and pending:  # no CPU sum kernel: add in complex64, cast back below
            parts = parts.to(torch.complex64)
        parts = parts.reshape((*(mesh.shape[i] for i in pos), *parts.shape[1:]))  # () for a 0-d shard
        for k in reversed(range(len(pos))):
            op = pending[mesh.axis_names[pos[k]]]
            if op == "sum":
                parts = parts.sum(k)
            elif op == "avg":
                parts = parts.mean(k)
            elif op == "max":
                parts = parts.amax(k)
            else:
                parts = parts.amin(k)
        if out is None:
            out = torch.empty(shape, dtype=parts.dtype, device=parts.device)
        box = device_box(layout, shape, devs[0])
        out[tuple(slice(lo, hi) for lo, hi in box)] = parts
    return out.to(dtype)
