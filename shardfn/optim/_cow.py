"""Copy-on-write for a torch optimizer stepping views of the caller's arrays.

A pure step hands torch.optim tensors that alias the stored parameters, gradients and state
(no copies up front). While it steps, a dispatch mode catches the first in-place write to
each of them and sends it to a fresh buffer instead (``t.set_(buffer)``): the common
element-wise updates run out of place straight into the buffer (``torch.mul(old, c,
out=buffer)``, the same kernel as ``mul_``), anything else copies first and then runs as
torch wrote it. Views taken of a protected tensor get a private copy first, so nothing the
caller passed in ever changes.

On CPU the buffers come from a :class:`BufferPool` that recycles the storage of outputs of
earlier steps once nothing references them: a pure step needs new parameters and state each
time, and fresh allocations fault in new pages from the OS (the C allocator returns large
freed blocks), which costs more than the update itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..values.schema import written

aten = torch.ops.aten

# buffers smaller than this come from the allocator's own free lists (no page faults)
_POOL_MIN_BYTES = 1 << 16


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_LONE = _use_count(torch.empty(16)) if hasattr(torch._C, "_storage_Use_Count") else None


class BufferPool:
    """Output buffers of a pure optimizer step, recycled across steps on CPU.

    The pool keeps one tensor per buffer and only ever hands out aliases of it (other
    tensor objects sharing its storage), so a buffer whose storage has no user but the
    pool's own tensor (torch's storage use count) is unreferenced everywhere — no array,
    view, autograd graph or numpy array holds it — and can be written again."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, list[torch.Tensor]] = {}
        self._taken: dict[tuple, int] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of uninitialised values that nothing else references."""
        nbytes = shape.numel() * dtype.itemsize
        if _LONE is None or device.type != "cpu" or nbytes < _POOL_MIN_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype, device)
        bufs = self._bufs.setdefault(key, [])
        self._taken[key] = self._taken.get(key, 0) + 1
        for k, buf in enumerate(bufs):  # least recently handed out first: usually free
            if _use_count(buf) == _LONE:
                bufs.append(bufs.pop(k))
                return buf.detach()  # an alias: from now on the storage has a user
        buf = torch.empty(shape, dtype=dtype, device=device)
        bufs.append(buf)
        return buf.detach()

    def end_step(self) -> None:
        """Per shape, keep at most as many free buffers as this step took, and at most three
        times that in all (buffers in use may come free for the next step)."""
        for key, bufs in list(self._bufs.items()):
            need = self._taken.get(key, 0)
            if not need:
                del self._bufs[key]
            elif len(bufs) > 2 * need:
                extra = sum(_use_count(b) == _LONE for b in bufs) - need
                kept = []
                for b in bufs:  # oldest first
                    if extra > 0 and _use_count(b) == _LONE:
                        extra -= 1
                    else:
                        kept.append(b)
                self._bufs[key] = kept[-3 * need:]
        self._taken.clear()


# element-wise in-place ops (``aten.mul_``, ``aten._foreach_mul_``, ...) by their out-of-place
# form writing into ``out`` (the same kernel: an in-place op is its out= form with out=self);
# each takes self, then the schema's other arguments in order, one element's worth
def _lerp(a, end, weight, out):
    return torch.lerp(a, end, weight, out=out)


def _addc(fn: Callable) -> Callable:
    def run(a, t1, t2, value=1, out=None):
        return fn(a, t1, t2, value=value, out=out)
    return run


def _add(fn: Callable) -> Callable:
    def run(a, other, alpha=1, out=None):
        return fn(a, other, alpha=alpha, out=out)
    return run


def _binary(fn: Callable) -> Callable:
    def run(a, other, out=None):
        return fn(a, other, out=out)
    return run


def _unary(fn: Callable) -> Callable:
    def run(a, out=None):
        return fn(a, out=out)
    return run


_ELEMENT: dict[str, Callable] = {
    "mul": _binary(torch.mul), "div": _binary(torch.div), "maximum": _binary(torch.maximum),
    "minimum": _binary(torch.minimum), "pow": _binary(torch.pow),
    "add": _add(torch.add), "sub": _add(torch.sub), "lerp": _lerp,
    "addcmul": _addc(torch.addcmul), "addcdiv": _addc(torch.addcdiv),
    "sqrt": _unary(torch.sqrt), "neg": _unary(torch.neg), "abs": _unary(torch.abs), "sign": _unary(torch.sign),
    "exp": _unary(torch.exp), "reciprocal": _unary(torch.reciprocal),
}


def _split(name: str) -> tuple[bool, str] | None:
    """``aten._foreach_mul_`` -> (True, "mul"); ``aten.mul_`` -> (False, "mul"); None for an
    op that is not an in-place form of a table entry."""
    if not name.endswith("_") or name.endswith("__"):
        return None
    base = name[:-1]
    foreach = base.startswith("_foreach_")
    if foreach:
        base = base[len("_foreach_"):]
    return (foreach, base) if base in _ELEMENT else None


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's mutable arguments)."""
    fused_no_scale = func.__name__.startswith("_fused_") and kwargs.get("grad_scale") is None
    skip = ("grads",) if fused_no_scale else ()  # fused optimizers write their gradients only to unscale them
    return [t for t in written(func, args, kwargs, skip) if isinstance(t, torch.Tensor)]


def _views_input(func: Any) -> bool:
    """Whether ``func`` returns an alias of an input (a view op)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _replace(x: Any, old: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return old.get(id(x), x)
    if isinstance(x, (list, tuple)):
        return type(x)(_replace(v, old) for v in x)
    return x


class CopyOnWrite(TorchDispatchMode):
    """While active, the first in-place write to a protected tensor (or a view taken of
    one) moves it onto a buffer of its own; see the module docstring."""

    def __init__(self, protected: Iterable[torch.Tensor], pool: BufferPool) -> None:
        super().__init__()
        self._protected: dict[int, torch.Tensor] = {id(t): t for t in protected}
        self._pool = pool

    def protect(self, t: torch.Tensor) -> None:
        self._protected[id(t)] = t

    def _fresh(self, t: torch.Tensor) -> torch.Tensor:
        return self._pool.take(t.shape, t.dtype, t.device)

    def _own(self, t: torch.Tensor) -> None:
        """Give ``t`` a private copy of its values."""
        buf = self._fresh(t)
        buf.copy_(t)
        t.set_(buf)
        del self._protected[id(t)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._protected:
            return func(*args, **kwargs)
        if func._schema.is_mutable:
            hit = [t for t in _written(func, args, kwargs) if id(t) in self._protected]
            if hit:
                if self._out_of_place(func, args, kwargs, hit):
                    return args[0] if func._schema.returns else None
                for t in hit:
                    if id(t) in self._protected:
                        self._own(t)
        elif _views_input(func):
            for a in args:
                if isinstance(a, torch.Tensor) and id(a) in self._protected:
                    self._own(a)
        return func(*args, **kwargs)

    def _out_of_place(self, func: Any, args: tuple, kwargs: dict, hit: list[torch.Tensor]) -> bool:
        """Run an element-wise in-place op of the table on CPU out of place, straight into
        fresh buffers for its protected ``self`` tensors (the others of a list update in
        place as before); False where it does not apply (the caller copies first)."""
        split = _split(func.__name__.split(".")[0])
        if split is None or not args:
            return False
        foreach, base = split
        selfs = list(args[0]) if foreach else [args[0]]
        ids = {id(s) for s in selfs}
        if len(ids) != len(selfs) or any(id(t) not in ids for t in hit):
            return False  # writes something besides self, or self twice: the generic path
        if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in selfs):
            return False  # accelerators: one foreach launch beats a loop of out= calls
        if foreach and any(t.dtype not in (torch.float32, torch.float64) for t in selfs):
            return False  # CPU foreach kernels round some scalars to 16-bit types first: not bit-equal
        if foreach and func._overloadname == "Tensor" and base in ("addcmul", "addcdiv"):
            return False  # per-element scalars packed in one tensor
        n = len(selfs)
        columns = []  # the arguments after self, one entry per element
        for j, arg in enumerate(func._schema.arguments[1:], start=1):
            if j < len(args):
                v = args[j]
            elif arg.name in kwargs:
                v = kwargs[arg.name]
            elif arg.has_default_value():
                v = arg.default_value
            else:
                return False
            if foreach and isinstance(v, (list, tuple)):
                if len(v) != n:
                    return False
                columns.append(list(v))
            else:
                columns.append([v] * n)
        written = {id(t) for t in hit}
        old: dict[int, torch.Tensor] = {}
        for t in selfs:
            if id(t) in written:
                old[id(t)] = t.detach()  # the values before the write, under a name of their own
        for t in selfs:
            if id(t) in written:
                t.set_(self._fresh(t))
                del self._protected[id(t)]
        fn = _ELEMENT[base]
        for i, t in enumerate(selfs):
            fn(old.get(id(t), t), *(_replace(col[i], old) for col in columns), out=t)
        return True
