"""Differences between the torch versions shardfn supports (2.11 and newer), in one place.

Imported first by the package: an older torch fails here with a clear ImportError instead
of somewhere deep in dispatch. Nothing here imports shardfn (the bottom layer).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

MIN_TORCH = (2, 11)


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.13.0a0+git1'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:  # pragma: no cover - torch always has a numeric version
        raise ImportError(f"shardfn: cannot read torch's version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: str) -> None:
    """ImportError naming the installed and the required version when ``version`` is too old."""
    if _release(version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"shardfn needs torch>={need}; this is torch {version}. Install a newer torch "
                          f"(pip install 'torch>={need}').")


check_torch_version(torch.__version__)

# -- opaque value types (torch.compile) ------------------------------------------------
# torch 2.11's register_opaque_type requires every opaque type's metaclass to be
# torch._opaque_base.OpaqueBaseMeta (2.13 asks it of reference types only). shardfn's
# sharding values (P, Mesh, Layout, placements) are *value* types, never wrapped in a
# FakeScriptObject, so their isinstance checks stay type's own (C speed, no Python hook).
try:
    from torch._opaque_base import OpaqueBaseMeta as _OpaqueBaseMeta
except ImportError:  # pragma: no cover - no torch >= 2.11 lacks it
    _OpaqueBaseMeta = type


class ValueMeta(_OpaqueBaseMeta):  # type: ignore[misc, valid-type]
    """Metaclass of the sharding value types: registrable as opaque values on every
    supported torch, with plain ``isinstance``/``issubclass``."""

    __instancecheck__ = type.__instancecheck__
    __subclasscheck__ = type.__subclasscheck__


# torch 2.11 lets Dynamo read an opaque value's attributes only when they are registered
# (``register_opaque_type(members=...)``); 2.13 reads any attribute of a value type. A
# sharding value is a constant of the graph, so every member is read off the real object
# (``MemberType.USE_REAL``) and the result baked in, as 2.13 does by default.


def opaque_value_members(cls: type, version: str = torch.__version__) -> dict[str, Any] | None:
    """``members=`` for ``register_opaque_type(cls, typ="value")``: None where torch reads a
    value type's attributes without it, else every attribute and field of
    ``cls`` read off the real object (dunders aside: Python finds operators on the type)."""
    if _release(version) >= (2, 13):
        return None
    from torch._library.opaque_object import MemberType

    names = set(dir(cls)) | set(getattr(cls, "__slots__", ()) or ()) | {a.name for a in getattr(cls, "__attrs_attrs__", ())}
    # torch copies each member onto its stand-in object; operators are looked up on the type
    return {n: MemberType.USE_REAL for n in sorted(names) if not (n.startswith("__") and n.endswith("__"))}


# -- symbolic sizes (torch.compile dynamic dims) ------------------------------------------
# 2.13 reads a SymInt's example value with guarding_hint_or_throw; 2.11 with size_hint.


def symint_hint(n: Any) -> int:
    """The example value (hint) of a SymInt, adding no guard."""
    from torch.fx.experimental import symbolic_shapes

    read = getattr(symbolic_shapes, "guarding_hint_or_throw", None) or symbolic_shapes.size_hint
    return int(read(n))


def specialise_symint(n: Any) -> int:
    """``n``'s value, guarded on each backed symbol it is built of, not on ``n`` alone: a guard
    ``s0*s1 == 72`` leaves ``s0`` and ``s1`` symbolic, so sizes built of them stay symbolic
    until a later specialisation (a backward's, under AOTAutograd's second pass) pins them,
    and the first pass's symbolic outputs then had no graph output behind them ("Node ... was
    invalid, but is output", fuzzer seed 5784048470)."""
    if not isinstance(n, torch.SymInt):
        return int(n)
    node = n.node
    env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
    # 2.13 names the symbols' values backed_var_to_val (var_to_val warns); 2.11 var_to_val
    values = getattr(env, "backed_var_to_val", None)
    values = getattr(env, "var_to_val", None) if values is None else values
    if values is not None and expr is not None:
        for sym in sorted(expr.free_symbols, key=str):
            if sym in values:  # backed (an unbacked symbol has no value to pin)
                int(env.create_symintnode(sym, hint=int(values[sym])))
    return int(n)


def settle_guards(t: Any) -> None:
    """Add now the guards torch.compile's tracer adds when it records the metadata of ``t``, a
    shard tensor of symbolic sizes (its contiguity in each memory format). AOTAutograd fixes
    a graph's outputs from a first pass that records none, then traces again and records
    them; a guard there that pins a symbol to one value (``2 - s0 >= 2`` once ``0 <= s0 <= 2``
    is known) left the first pass's symbolic output size with no graph output behind it
    (``IndexError: tuple index out of range`` at run time). Plain tensors meet those guards
    while Dynamo traces; a wrapper's shards are first recorded by AOTAutograd."""
    if not any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride(), t.storage_offset())):
        return
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    _extract_tensor_metadata(t)


def settling_guards() -> Any:
    """A dispatch mode that runs ``settle_guards`` on every tensor each op gives: around a
    computation that AOTAutograd's second (make_fx) pass records but its first does not
    record (a meta run of an op for its output metadata), both passes then add the guards
    the recorder adds on those tensors' metadata. Without it the second pass alone pinned a
    traced int (``s3 == 4``: a meta slice's contiguity) after the first had recorded an
    output size ``s3`` (``IndexError: tuple index out of range``, fuzzer seed 5813716025).
    Not skipping the record instead: its symbolic strides (``s0**2``) need their proxies."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Settling(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    settle_guards(t)
            return out

    return _Settling()


def dynamo_skips_frames(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn``'s frames for Dynamo to run as they are, never compiling them (what it calls
    may still compile). For the getters Dynamo's guards call on a tensor subclass (its
    ``__tensor_flatten__`` names): a getter frame compiled on its own guards on its ``self``
    array's inner tensors through the same getter, so checking its cache called it again,
    until ``RecursionError`` (fuzzer seed 5822865897: an uneven 3-d array under
    ``torch.compile(dynamic=True)``). ``torch._dynamo.eval_frame.skip_code`` in 2.11 and 2.13."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # (no such Dynamo: nothing compiles the frame)
        return fn
    skip_code(fn.__code__)
    return fn


# -- torch.utils.checkpoint under vmap ---------------------------------------------------
# The local backend runs a shard_map body for every device at once under torch.func.vmap.
# 2.11's non-reentrant checkpoint saves its inputs through an autograd.Function with no vmap
# rule (torch.utils.checkpoint._NoopSaveInputs), so such a body runs once per device there
# (shard_map's fallback for bodies vmap cannot batch); 2.13's checkpoint batches.
CHECKPOINT_UNDER_VMAP = _release(torch.__version__) >= (2, 13)


# -- functional collectives -----------------------------------------------------------
# torch 2.11 names the single-tensor gather/scatter all_gather_tensor / reduce_scatter_tensor;
# 2.13 adds all_gather_single / reduce_scatter_single (same arguments).


def funcol_gather_scatter(funcol: Any = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(all_gather(x, gather_dim, group), reduce_scatter(x, op, scatter_dim, group)) of
    ``torch.distributed._functional_collectives`` (or ``funcol``), whichever names it has."""
    if funcol is None:
        import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return gather, scatter
