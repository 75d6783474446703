"""The inputs and outputs of one shard_map call, shared by its every form: arguments
matched to in_specs and checked, the body run by the mesh's backend, outputs assembled
into ShardedArrays and checked against out_specs (``check_vma``)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import optree
import torch

from ...arrays.array import ShardedArray
from ...arrays.functorch import base_array, layout_of, static_int
from ...backends.registry import backend_for
from ...values.errors import ShardingError
from ...values.layout import Layout, is_even
from ...values.mesh import Mesh, to_mesh_device
from ...values.spec import NamedSharding, P, Replicate, _is_placements, layout_to_spec
from .. import boundary as B
from ...values.context import ThreadStack
from ..lax import _in_shard_map
from ..specs import _arg_specs, _layout, _match, _mesh_for, _path_str


class _Inputs:
    """The flattened arguments of one shard_map call and their layouts."""

    def __init__(self, in_specs: Any, args: tuple, mesh: Mesh | None) -> None:
        specs = _own_specs(args) if in_specs is None else _arg_specs(in_specs, args, "shard_map in_specs")
        self.paths, self.leaves, specs, self.treespec = _match(specs, args, "shard_map in_specs", "args")
        self.mesh = _mesh_for(mesh, self.leaves, "shard_map", self.paths)
        self.layouts: list[Layout | None] = []
        for path, v, s in zip(self.paths, self.leaves, specs):
            self.layouts.append(self._layout(path, v, s))

    def _layout(self, path: str, v: Any, spec: Any) -> Layout | None:
        if not isinstance(v, torch.Tensor):
            check_scalar_spec(path, v, spec, "in_specs")
            return None
        if spec is None:
            return None
        layout = _layout(spec, v.dim(), self.mesh, f"shard_map in_specs for {path}")
        if layout.partial and not isinstance(v, ShardedArray) and base_array(v) is None:
            raise ShardingError(
                f"shard_map in_specs for {path} is {layout_to_spec(layout)!r}, but {path} is a plain tensor "
                f"(a whole value, not pending sums): a partial in_spec (the body sees each device's summand, "
                f"JAX's unreduced) takes a ShardedArray with pending sums over those axes, e.g. from "
                f"sf.matmul(..., out_sharding=P(partial=...)); give a plain tensor a spec without partial="
            )
        return layout

    def even(self) -> bool:
        # symbolic sizes (torch.compile, dynamic) are specialised: evenness decides the runner
        return all(l is None or is_even(l, tuple(static_int(n) for n in v.shape)) for v, l in zip(self.leaves, self.layouts))

    def rebuild(self, leaves: list) -> tuple:
        return optree.tree_unflatten(self.treespec, leaves)


def _own_specs(args: tuple) -> tuple:
    """in_specs=None: each ShardedArray argument's own spec (plain tensors are an error)."""
    paths, leaves, treespec = optree.tree_flatten_with_path(args, none_is_leaf=True)
    specs = []
    for path, v in zip(paths, leaves):
        if isinstance(v, torch.Tensor) and not isinstance(v, ShardedArray) and base_array(v) is None:
            from ...values.errors import ShardingTypeError

            raise ShardingTypeError(  # a TypeError too, as JAX's in_specs=None error
                f"shard_map with in_specs=None takes each argument's own spec, but {_path_str('args', path)} "
                f"is a plain tensor with no spec; pass in_specs= (instead of in_specs=None, did you mean "
                f"in_specs=P()?), or sf.distribute it first"
            )
        specs.append(v._layout if isinstance(v, ShardedArray) else layout_of(v) if isinstance(v, torch.Tensor) else None)
    return tuple(optree.tree_unflatten(treespec, specs))


def _shard_map(f: Callable, mesh: Mesh | None, in_specs: Any, out_specs: Any, check_vma: bool,
               args: tuple, kwargs: dict) -> Any:
    if _in_shard_map():
        raise ShardingError("shard_map inside a shard_map body is not supported; call collectives directly")
    inputs = _Inputs(in_specs, args, mesh)
    return backend_for(inputs.mesh).shard_map(f, inputs, out_specs, check_vma, kwargs)


def check_output_vma(path: str, spec: Any, layout: Layout, varying: set[str]) -> None:
    """The check_vma rule: an output may vary only over axes its out_spec names."""
    mesh = layout.mesh
    missing = [a for a in mesh.axis_names if a in varying and a not in B.used_axes(layout)]
    if missing:
        a = missing[0]
        hint = f"P({a!r})" if layout.ndim else f"P(partial={a!r})"
        more = "".join(f" and {b!r}" for b in missing[1:])
        over = repr(a) if len(missing) == 1 else repr(tuple(missing))
        inferred = ", ".join(repr(b) for b in mesh.axis_names if b in varying)
        raise ShardingError(
            f"shard_map {path} varies over mesh axis {a!r}{more}, but its out_spec {spec!r} "
            f"leaves {a!r}{more} out (it was inferred to vary over {inferred}), so the devices along "
            f"{a!r} would disagree on its value; reduce it with sf.lax.psum(y, {over}) (or pmean / pmax / "
            f"all_gather), or add {a!r}{more} to the out_spec (e.g. {hint}); check_vma=False takes device "
            f"{a}=0's value"
        )
    for a in mesh.axis_names:
        # (over an axis of size 1 the one copy is the value: nothing to multiply, and the
        # inference treats every value as invariant there, a pending input's parts included)
        if a in layout.partial_ops and a not in varying and mesh.axis_size(a) > 1:
            raise ShardingError(
                f"shard_map {path} has out_spec {spec!r} with partial over mesh axis {a!r}, but it does "
                f"not vary over {a!r}: " + (
                    f"summing its identical copies would multiply it by {mesh.axis_size(a)}"
                    if layout.partial_ops[a] == "sum" else
                    f"its {mesh.axis_size(a)} identical copies are no pending {layout.partial_ops[a]}")
                + f"; drop {a!r} from partial= (or psum over {a!r} in the body only where the value really differs)"
            )


def check_scalar_output(path: str, v: Any, spec: Any) -> None:
    """A body's non-tensor output: a Python number (the same on every device, a rank-0
    value as in JAX) under a spec that can hold it, or None (an empty subtree); anything
    else (a string, an object) is no value a mesh can hold."""
    if v is not None and not isinstance(v, (numbers.Number, torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise ShardingError(
            f"shard_map: the body's {path} is a {type(v).__name__} ({_short(v)}), but out_specs gives it "
            f"{spec!r}: a body's outputs must be tensors, or Python numbers (the same on every device, with "
            f"out_specs P()); return it from outside the shard_map, or make it a tensor"
        )
    check_scalar_spec(path, v, spec, "out_specs")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def check_scalar_spec(path: str, v: Any, spec: Any, what: str) -> None:
    """A non-tensor leaf (a Python number) is the same on every device: only a spec that
    shards nothing and sums nothing can hold for it."""
    if spec is None:
        return
    n = len(spec) if isinstance(spec, P) else len(spec.spec) if isinstance(spec, NamedSharding) else 0
    if n:  # JAX: a Python number is a rank-0 value, and a spec longer than its rank is an error
        raise ShardingError(
            f"shard_map {what} for {path} is {spec!r}, but {path} is a {type(v).__name__}, a rank-0 value: the "
            f"spec has length {n} (and 0 < {n}), too long for it; entries in {what} must be of length no greater "
            f"than the number of axes of the value. For scalar values (rank 0) use P() (or None), or make it a tensor"
        )
    if _is_trivial(spec):
        return
    raise ShardingError(
        f"shard_map {what} for {path} is {spec!r}, but {path} is a {type(v).__name__}, not a tensor: "
        f"it has no dims to split and is the same on every device, so that spec cannot hold; use P() "
        f"(or None), or make it a tensor"
    )


def _is_trivial(spec: Any) -> bool:
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if isinstance(spec, Layout):
        return spec.is_replicated()
    if _is_placements(spec):
        return all(isinstance(p, Replicate) for p in spec)
    if isinstance(spec, P):
        return not spec.partial and all(e is None for e in spec)
    return False


def _out_layout(path: str, spec: Any, ndim: int, mesh: Mesh) -> Layout:
    if spec is None:
        raise ShardingError(f"shard_map out_specs for {path} is None; tensor outputs need a P(...)")
    return _layout(spec, ndim, mesh, f"shard_map out_specs for {path}")


def assemble_parts(path: str, outs: list, spec: Any, mesh: Mesh, check_vma: bool,
                   vma_of: Callable[[Any], frozenset[str]] | None, exchange: bool = False) -> Any:
    """One ShardedArray from the local outputs of the devices this process holds."""
    if not isinstance(outs[0], torch.Tensor):
        check_scalar_output(path, outs[0], spec)
        return outs[0]
    outs = [to_mesh_device(o, mesh) for o in outs]  # the mesh owns the device: a body's new tensors move there
    layout = _out_layout(path, spec, outs[0].dim(), mesh)
    if check_vma and vma_of is not None:
        check_output_vma(path, spec, layout, set().union(*(vma_of(o) for o in outs)))
    # unchecked outputs (their replicas may differ): JAX's transpose, the cotangent shared out
    first_only = True if check_vma else "mean"
    return B.ExitParts.apply(layout, _global_shape(path, outs, layout, exchange), first_only, *outs)


def _global_shape(path: str, outs: list, layout: Layout, exchange: bool = False) -> tuple[int, ...]:
    """The global shape the local outputs describe, from their actual sizes (see
    ``Backend.output_shape``: with ``exchange`` processes that hold one device's output
    swap their sizes, for uneven inputs; else the layout is taken to be even)."""
    if any(o.dim() != outs[0].dim() for o in outs):
        raise ShardingError(f"shard_map {path}: devices returned tensors of different ranks")
    dtypes = {o.dtype for o in outs}
    if len(dtypes) > 1:  # one array has one dtype: its shards' differing was an array that misreports it
        named = ", ".join(f"device {i}: {o.dtype}" for i, o in enumerate(outs) if o.dtype != outs[0].dtype)
        raise ShardingError(
            f"{path}: devices returned tensors of different dtypes (device 0: {outs[0].dtype}, {named}); every "
            f"device's output must have one dtype: cast them alike (e.g. .to({outs[0].dtype}))")
    try:
        return backend_for(layout.mesh).output_shape(B.first_replicas(outs, layout), layout, exchange)
    except ShardingError as e:
        raise ShardingError(f"{path}: {e}") from None


_submeshes = ThreadStack()


def _subs() -> list[Mesh]:
    """The submeshes of the partial-manual bodies running in this thread."""
    return _submeshes.items
