"""An op's local call on the local backend: once on the stacked values (``StackedCall``,
through ``batching``) when every layout is even and the op has a batched form, else once
per device (``PerDeviceCall``)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ..values.errors import ShardingError
from ..values.layout import is_even
from ..values.mesh import Mesh
from .device_call import DeviceCall, _reshape, call_is_complex, empty_outputs, raw_op, skips_empty, substitute
from .local_values import SHARES, batch_consistent, device_view, from_parts, full, settle
from .view_replay import plain


# -- running an op's local call -------------------------------------------------------------


def compile_call(func: Any, call: Any, cand: Any, out_shapes: Sequence[Any], positional: tuple | None) -> Any:
    """The local computation of one strategy on this backend's values: one call on the
    stacked values when every layout is even and the call has a batched form
    (``batching``), else once per device. ``(args, kwargs, values, symbolic) -> flat
    outputs`` (stacked values or per-device tuples, non-tensor outputs as they are)."""
    from . import batching as _batching

    canon = tuple(torch.Size(v._layout.varying_sizes) for _, v in call.arrays)
    even = all(is_even(l, tuple(v.shape)) for (_, v), l in zip(call.arrays, cand.in_layouts)) and all(
        l is None or is_even(l, s) for l, s in zip(cand.out_layouts, out_shapes))
    per_device = PerDeviceCall(func, cand, call, out_shapes, positional, even)
    batched = _batching.batched_call(func, cand, call, out_shapes) if even else None
    if batched is None:
        return per_device
    return StackedCall(batched, per_device, call.mesh, cand.out_layouts, positional, canon,
                       _copy_dims(func, call.mesh, cand.in_layouts), _returns_alias(func))


def _returns_alias(func: Any) -> bool:
    """Whether ``func`` is a view op (an output aliases an input): its batched form is one view
    of the stacked value, where running it once on device 0's part adds an index and an unsqueeze."""
    schema = getattr(func, "_schema", None)
    return schema is not None and not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _copy_dims(func: Any, mesh: Mesh, layouts: Sequence[Any]) -> tuple[int, ...]:
    """The mesh dims on which this call's inputs may all be equal shares of pending sums
    (``local_values.set_pending_parts``): dims an input is pending over and no input shards.
    Where every input holds one part expanded there, every device computes the same thing,
    so the call runs once (a seeded random op draws per device: never)."""
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return ()
    names = mesh.axis_names
    pending = {a for l in layouts if l is not None for a in l.partial_ops}
    sharded = {a for l in layouts if l is not None for a in l.axis_dim}
    return tuple(k for k, a in enumerate(names) if a in pending and a not in sharded and mesh.shape[k] > 1)


def _flat(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class StackedCall:
    """One local call on the stacked values. Mesh dims of size 1 (the same on every
    device) broadcast; the first run for each combination of input mesh-dim sizes is
    checked (:func:`batch_consistent`), and a call that fails it or raises is run on
    values expanded to the full mesh, and if that raises too, once per device."""

    keeps_symbolic = True

    def __init__(self, fn: Any, per_device: "PerDeviceCall", mesh: Mesh, layouts: tuple, positional: tuple | None,
                 canon: tuple, copy_dims: tuple[int, ...] = (), view: bool = False) -> None:
        self.fn, self.per_device, self.mesh, self.layouts, self.positional = fn, per_device, mesh, layouts, positional
        self.copy_dims = copy_dims  # where inputs that are equal parts everywhere are cut to one (``_copies``)
        self.mode = "batched"  # -> "full" -> "per_device" as calls show what the op supports
        self.verified: dict = {}
        batched_direct = getattr(fn, "direct", None)  # the op itself when no argument needs adapting
        self.direct = raw_op(batched_direct)
        self.m = mesh.ndim
        self.canon = canon  # the inputs' mesh-dim sizes when the arrays are stored canonically
        self.ready = False  # that call verified: ``lean`` may run it without looking at shapes
        self.settles = False  # and its output then put in canonical form (``settle``: a ``ones_like`` of a pending loss)
        # ``lean``'s call of a batched form whose adaptation (dims, sizes) is fixed for canonical
        # inputs and static arguments: (fn, adapted positional arguments, keywords), made once
        self.bound: tuple | None = None
        self.fn_static = bool(getattr(fn, "static", False))
        # canonical inputs and outputs the same on every device (a 1-device mesh, a fully
        # replicated computation), and a batched form that is more than the aten op itself
        # and more than one view (``view``: a view op's batched form is one view, as ``t`` is a
        # ``transpose``): ``lean`` runs device 0's call on the squeezed values instead
        same = all(n == 1 for sizes in canon for n in sizes) and all(
            l is None or all(n == 1 for n in l.varying_sizes) for l in layouts)
        adapted = not isinstance(batched_direct, torch._ops.OpOverload) and not view
        self.once = per_device.device_call if same and adapted and positional is not None else None
        self.once_direct = raw_op(self.once.direct) if self.once is not None else None
        self.first = 0 if self.m == 1 else (0,) * self.m

    def lean(self, args: tuple, kwargs: dict) -> Any:
        """The lone output for arrays at ``positional``, stored canonically and needing no
        move (dispatch's fast path), or None until such a call has been verified."""
        if self.once is not None:
            return self._once(args, kwargs)
        if not self.ready or self.copy_dims and SHARES[0] and _copies(
                {p: args[p]._local for p in self.positional}, self.copy_dims) is not None:
            return None
        bound = self.bound
        if bound is None and self.fn_static:
            self.fn_static = False  # (asked once)
            if _static_args(args, kwargs, self.positional):
                bound = self.bound = _bind(self.fn, args, kwargs, self.positional)
        if bound is not None:  # the adapted call, its operands filled in
            a = [*bound[1]]
            for p in self.positional:
                a[p] = args[p]._local
            out = bound[0](*a, **bound[2])
        else:
            a = list(args)  # (``with_locals``, inlined: one Python call less on every warm op)
            for p in self.positional:
                a[p] = args[p]._local
            out = self.direct(*a, **kwargs) if self.direct is not None else self.fn(tuple(a), kwargs, False)
        return settle(out, self.layouts[0]) if self.settles else out

    def _once(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Device 0's call on the squeezed values, its output given size-1 mesh dims: what
        per-device execution gives when every device computes the same thing. The output
        keeps its squeezed form (``_squeezed``), so a chain of such calls indexes nothing."""
        a = list(args)
        first = self.first
        for p in self.positional:
            v = args[p]._local
            sq = v.__dict__.get("_squeezed")
            a[p] = v[first] if sq is None else sq
        direct = self.once_direct
        out = direct(*a, **kwargs) if direct is not None else self.once(tuple(a), kwargs, 0)[0]
        res = out.unsqueeze(0) if self.m == 1 else out.view((1,) * self.m + tuple(out.shape))
        res._squeezed = out  # a view of res's own storage: valid as long as res is
        return res

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        if self.copy_dims and SHARES[0] and not symbolic:
            values = _copies(values, self.copy_dims) or values
        if self.mode == "batched":
            m = self.m
            sig = tuple([v.shape[:m] for v in values.values()])
            try:
                settled = self.verified.get(sig)
            except TypeError:  # torch.compile(dynamic=True) made the mesh dims symbolic: they are not
                sig = tuple(tuple(n if isinstance(n, int) else n.node.hint for n in s) for s in sig)
                settled = self.verified.get(sig)
            a, k = substitute(args, kwargs, values, self.positional)
            if settled is True:
                out = self.direct(*a, **k) if self.direct is not None else self.fn(a, k, symbolic)
                return list(out) if isinstance(out, (tuple, list)) else [out]
        mesh, layouts = self.mesh, self.layouts
        if self.mode == "batched":
            try:
                outs = _flat(self.fn(a, k, symbolic))
            except (RuntimeError, IndexError, ValueError) as e:
                if _is_sharding_error(e):
                    raise
                outs = None
            tensors = [o if isinstance(o, torch.Tensor) and l is not None else None
                       for o, l in zip(outs or (), layouts)]
            if outs is not None and (settled is not None or batch_consistent(list(values.values()), tensors, mesh, layouts)):
                fixed = [o if t is None else settle(o, l) for o, t, l in zip(outs, tensors, layouts)]
                if len(self.verified) < 64:
                    self.verified[sig] = all(f is o for f, o in zip(fixed, outs))
                    canon = self.verified.get(self.canon)
                    self.ready = canon is not None and self.positional is not None
                    self.settles = canon is False
                return fixed
            self.mode, self.ready = "full", False
        if self.mode == "full":
            a, k = substitute(args, kwargs, values, self.positional, functools.partial(full, mesh=mesh))
            try:
                outs = _flat(self.fn(a, k, symbolic))
            except (RuntimeError, IndexError, ValueError) as e:
                if symbolic or _is_sharding_error(e):
                    raise
                self.mode, self.ready = "per_device", False
            else:
                return [settle(o, l) if isinstance(o, torch.Tensor) and l is not None else o
                        for o, l in zip(outs, layouts)]
        return self.per_device(args, kwargs, values, symbolic)


def _copies(values: dict, dims: tuple[int, ...]) -> dict | None:
    """``values`` cut to size 1 on each of ``dims`` on which every stacked value is one part
    expanded (stride 0) or size 1, with at least one expanded; None where there is none."""
    cut = []
    for k in dims:
        expanded = False
        for v in values.values():
            if not isinstance(v, torch.Tensor) or v.dim() <= k:
                return None
            if v.shape[k] != 1:
                if v.stride(k) != 0:
                    break
                expanded = True
        else:
            if expanded:
                cut.append(k)
    if not cut:
        return None
    out = {}
    for p, v in values.items():
        for k in cut:
            if v.shape[k] != 1:
                v = v.narrow(k, 0, 1)
        out[p] = v
    return out


def _is_sharding_error(e: Exception) -> bool:
    return isinstance(e, ShardingError)


# argument types a fast key holds by value (``dispatch._fast_key``): calls hitting one cache entry
# pass equal such arguments (floats and complex numbers are keyed by type only)
_BY_VALUE = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})


def _static(v: Any) -> bool:
    t = type(v)
    return t in _BY_VALUE or ((t is list or t is tuple) and all(_static(x) for x in v))


def _static_args(args: tuple, kwargs: dict, positional: tuple) -> bool:
    """Whether every argument but the arrays (at ``positional``) is keyed by value."""
    return all(_static(a) for i, a in enumerate(args) if i not in positional) and all(
        _static(v) for v in kwargs.values())


def _bind(fn: Any, args: tuple, kwargs: dict, positional: tuple) -> tuple | None:
    """``fn``'s adapted call for this call's operands (at ``positional``, stored canonically)
    with the operand slots emptied (the template keeps no shards alive); None if the
    adaptation left a tensor elsewhere. A view as a reshape is ``Tensor.reshape`` itself."""
    a = list(args)
    for p in positional:
        a[p] = args[p]._local
    args, kw = fn.adapt(tuple(a), kwargs)
    args = list(args)
    for p in positional:
        args[p] = None
    if any(isinstance(v, torch.Tensor) for v in (*args, *kw.values())):
        return None
    op = fn.fn
    if op is _reshape and len(args) == 2 and not kw:
        op = torch.Tensor.reshape
    return raw_op(op), args, kw  # (an aten op's C++ callable: no ``OpOverload.__call__`` frame per call)


class PerDeviceCall:
    """The local call once per device, on each device's shard (uneven layouts, or ops
    with no batched form); outputs are stored in their preferred form.

    On even layouts it keeps symbolic sizes symbolic (``keeps_symbolic``: torch.compile with
    dynamic shapes): each device's shard of a stacked value is a view of symbolic sizes, its
    size arguments are localised from the call's own sizes (``DeviceCall``), and the even
    outputs stack back. Otherwise dispatch specialises the sizes, and a specialisation first
    made in a compiled backward (an op with no batched form, only in the backward) left
    AOTAutograd's forward without the outputs' symbolic sizes its first pass recorded
    (fuzzer seeds 5827461094, 5827462382: ``diagonal_backward``). A ``local_fn`` and shard
    facts are written against concrete shards: not kept symbolic."""

    lean = None  # no fast form: a warm call takes ``__call__``

    def __init__(self, func: Any, cand: Any, call: Any, out_shapes: Sequence[Any], positional: tuple | None,
                 even: bool = False) -> None:
        self.mesh = call.mesh
        self.device_call = DeviceCall(func, cand, [tuple(v.shape) for _, v in call.arrays], out_shapes,
                                      range(call.mesh.size), call_is_complex(call))
        self.keeps_symbolic = even and cand.local_fn is None and not cand.facts
        self.layouts, self.out_shapes, self.positional = cand.out_layouts, list(out_shapes), positional
        # devices whose outputs are all empty: not called (a functional op), else a kernel rejecting
        # the empty piece is forgiven there
        self.empty = empty_outputs(cand, out_shapes, getattr(call, "out_metas", None))
        self.skip_empty = bool(self.empty) and skips_empty(func)

    def __call__(self, args: tuple, kwargs: dict, values: dict, symbolic: bool = False) -> list:
        mesh = self.mesh
        per_dev: list = []
        failed = None
        symbolic = symbolic and self.keeps_symbolic
        skip = bool(self.empty) and (self.skip_empty or _traced(values))
        for dev in range(mesh.size):
            if skip and dev in self.empty:
                per_dev.append(None)  # (filled below, as a forgiven kernel's are)
                continue
            a, k = substitute(args, kwargs, values, self.positional, lambda v, dev=dev: device_view(v, mesh, dev))
            try:
                per_dev.append(self.device_call(a, k, dev, symbolic))
            except (RuntimeError, IndexError, ValueError) as e:
                if dev not in self.empty or _is_sharding_error(e):
                    raise
                per_dev.append(None)  # filled below with empty outputs of another device's dtypes
                failed = e
        if failed is not None or skip:
            like = next((o for o in per_dev if o is not None), None)
            if like is None and failed is not None:
                raise failed
            per_dev = [o if o is not None else [None if sh is None else torch.empty(sh, dtype=t.dtype, device=t.device)
                                                for sh, t in zip(self.empty[dev], like)]
                       for dev, o in enumerate(per_dev)]
        out = []
        for i, (layout, shape) in enumerate(zip(self.layouts, self.out_shapes)):
            col = [o[i] for o in per_dev]
            # an undefined output (a CUDA kernel's gradient nobody asked for) is None on every device
            out.append(col[0] if layout is None or col[0] is None else from_parts(col, layout, shape))
        return out


def _traced(values: dict) -> bool:
    """Whether the shards are a trace's (fake, functional or functorch-wrapped tensors). Their
    kernels are meta kernels, which accept an empty piece that the real kernel rejects, so a
    device whose outputs are all empty is not called at all: the compiled graph would run the
    real kernel on it (batch_norm of a shard with no channel, fuzzer seed 5849704170)."""
    for v in values.values():
        t = v[0] if isinstance(v, tuple) else v
        if isinstance(t, torch.Tensor):
            return not plain(t)
    return False
