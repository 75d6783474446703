"""CommCounter: count the collectives a block issues and attribute each (a CommRecord: kind,
axes, bytes, op, phase, module, user line); ``records_tree`` prints them by module."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections import Counter
from typing import Any

import attrs
import torch
from torch.nn.modules import module as _nn_module

from ..backends import hooks as _comm_hooks
from ..plans.planner import Step

__all__ = ["CommCounter", "CommRecord", "records_tree"]

_active: list["CommCounter"] = []


@attrs.frozen
class CommRecord:
    """One collective: its ``kind`` ("all_reduce", ...), mesh ``axes``, ``bytes`` (the most any
    device sends, ring costs as ``Plan.bytes_per_device``), the ``op`` that needed it (an aten op
    such as ``"aten.mm.default"``, or the API call such as ``"sf.reshard"``), its ``phase``
    ("forward" or "backward"), the qualified name of the innermost ``nn.Module`` running
    (``None`` outside any; ``""`` is the root module), and ``location`` ("file:line" of the
    innermost user frame: outside shardfn, torch and the standard library)."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    op: str | None
    phase: str
    module: str | None
    location: str | None
    step: Step = attrs.field(repr=False, eq=False)

    def __str__(self) -> str:
        where = "?" if self.location is None else os.path.basename(self.location)
        return f"{self.kind} over {', '.join(self.axes)}: {_fmt_bytes(self.bytes)}, {self.op or '?'} at {where}"


class CommCounter:
    """Context manager counting collectives by kind (``.counts``), the most bytes any device
    sends (``.bytes``, ring costs as in ``Plan.bytes_per_device``), and one
    :class:`CommRecord` per collective (``.records``: kind, axes, bytes, op, phase, module,
    location). ``str(counter)`` prints the records as a tree by module. Counted once, when the
    collective runs eagerly in this process: traces (meta/fake values, torch.compile tracing)
    are not counted, nor are collectives inside a compiled graph.

    Example::

        with sf.debug.CommCounter() as cc:
            loss = model(x).sum()
            loss.backward()
        print(cc)                                  # tree by module, forward/backward
        [r.op for r in cc.records if r.phase == "backward"]
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes = 0
        self.steps: list[Step] = []
        self.records: list[CommRecord] = []

    @property
    def total(self) -> int:
        """Number of communicating steps."""
        return sum(self.counts.values())

    def __enter__(self) -> CommCounter:
        if not _active:
            _comm_hooks.OBSERVERS.append(_observe)
            _TRACKER.start()
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        if not _active:
            _comm_hooks.OBSERVERS.remove(_observe)
            _TRACKER.stop()

    def __repr__(self) -> str:
        return f"CommCounter({dict(self.counts)}, bytes={self.bytes})"

    def __str__(self) -> str:
        return records_tree(self.records, title=repr(self))


def _observe(step: Step) -> None:
    """The observer the backends call for each collective while a counter is active."""
    rec = _make_record(step)
    for c in _active:
        c.counts[step.kind] += 1
        c.bytes += step.bytes
        c.steps.append(step)
        c.records.append(rec)


_BACKWARD_OF = {  # shardfn's autograd functions -> the API call whose backward they run
    "ConstrainBackward": "sf.with_sharding_constraint",
    "_ReshardBackward": "sf.reshard",
    "_CoalescedBackward": "sf.reshard",
    "_DistributeBackward": "sf.distribute",
    "_FullTensorBackward": "sf.ShardedArray.full_tensor",
    "_ToLocalBackward": "sf.ShardedArray.to_local",
    "_FromLocalBackward": "sf.ShardedArray.from_local",
}


def _make_record(step: Step) -> CommRecord:
    backward = torch._C._current_graph_task_id() != -1
    op, location = _op_and_location()
    if backward and location is None:  # autograd's device thread: the caller of backward() waits in the main thread
        location = _first_user_frame(sys._current_frames().get(threading.main_thread().ident))
    if backward:
        node = torch._C._current_autograd_node()
        module = _TRACKER.module_of_node(node)
        if op is None and node is not None:
            op = _BACKWARD_OF.get(node.name(), node.name())
    else:
        module = _TRACKER.current()
    axes = (step.axis,) if isinstance(step.axis, str) else tuple(step.axis)
    return CommRecord(step.kind, axes, step.bytes, op, "backward" if backward else "forward", module, location, step)


# -- which op and which user line --------------------------------------------------------------------

_ROOT = __name__.split(".")[0]  # "shardfn", wherever this module sits in it
_SHARDFN_DIR = os.path.dirname(os.path.abspath(sys.modules[_ROOT].__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_PUBLIC: dict[Any, str] = {}
_PUBLIC_MODULES = ("lax", "nn", "random", "debug", "optim", "checkpoint")
_LIBRARY_DIRS: tuple[str, ...] = ()


def _is_library(filename: str) -> bool:
    """shardfn, torch, optree and the standard library: not where the user's code is."""
    global _LIBRARY_DIRS
    if not _LIBRARY_DIRS:
        import optree

        _LIBRARY_DIRS = (_SHARDFN_DIR, _TORCH_DIR, os.path.dirname(os.path.abspath(optree.__file__)) + os.sep)
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_LIBRARY_DIRS):
        return True
    return path.startswith(_STDLIB_DIR) and "-packages" + os.sep not in path


def _op_and_location() -> tuple[str | None, str | None]:
    """Walking out from here: the innermost aten op being dispatched in shardfn (else the
    outermost public shardfn API entered from user code), and the first user frame."""
    public = _public_names()
    op = api = None
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return op or api, f"{filename}:{frame.f_lineno}"
        if filename.startswith(_SHARDFN_DIR):
            if op is None:
                func = frame.f_locals.get("func")
                if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                    op = str(func)
            name = public.get(frame.f_code)
            if name is not None:
                api = name
        frame = frame.f_back
    return op or api, None


def _first_user_frame(frame: Any) -> str | None:
    while frame is not None:
        if not _is_library(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _public_names() -> dict[Any, str]:
    """Code object -> public name (``sf.reshard``, ``sf.lax.psum``, ``sf.ShardedArray.redistribute``);
    code shared by several public functions (a decorator's wrapper) names none of them."""
    if _PUBLIC:
        return _PUBLIC
    root = sys.modules.get(_ROOT)
    if root is None:
        return _PUBLIC
    found: dict[Any, set[str]] = {}
    spaces = [("sf", root)] + [(f"sf.{n}", getattr(root, n)) for n in _PUBLIC_MODULES
                               if type(getattr(root, n, None)) is type(root)]
    for prefix, space in spaces:
        for name in getattr(space, "__all__", None) or [n for n in dir(space) if not n.startswith("_")]:
            obj = getattr(space, name, None)
            if isinstance(obj, type) and obj.__module__.startswith(_ROOT):
                for meth, fn in vars(obj).items():
                    if not meth.startswith("_"):
                        _codes(found, f"{prefix}.{name}.{meth}", getattr(fn, "__func__", fn))
            else:
                _codes(found, f"{prefix}.{name}", obj)
    _PUBLIC.update({code: min(names, key=len) for code, names in found.items() if len(names) == 1 or _aliases(names)})
    return _PUBLIC


def _aliases(names: set[str]) -> bool:
    """One function re-exported under several paths (``sf.reshard`` and ``sf.array.reshard``)."""
    return len({n.rsplit(".", 1)[-1] for n in names}) == 1


def _codes(found: dict[Any, set[str]], name: str, fn: Any) -> None:
    for _ in range(5):
        code = getattr(fn, "__code__", None)
        if code is not None:
            found.setdefault(code, set()).add(name)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break


# -- which module is running ---------------------------------------------------------------------------


_MAX_CALLS = 100_000


class _ModuleTracker:
    """Qualified names of the running modules (global forward hooks, installed only while a
    counter is active). Backward attribution: each module call spans a range of autograd
    sequence numbers; the node running in backward belongs to the innermost range holding it
    (so it works under torch.func too, where tensor hooks would not see the wrappers). A
    backward is attributed when its forward ran under a counter (not necessarily the same)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.calls: list[list] = []  # [start seq, end seq or None, name], by start
        self.names: dict[int, tuple[Any, dict[int, str]]] = {}
        self.handles: list[Any] = []

    def start(self) -> None:
        # ``calls`` outlives the counter: a backward counted apart from its forward still finds
        # the modules (sequence numbers never repeat in a thread); only the newest are kept.
        self.stack = []
        if len(self.calls) > _MAX_CALLS:
            del self.calls[: len(self.calls) - _MAX_CALLS // 2]
        self.handles = [_nn_module.register_module_forward_pre_hook(self._pre),
                        _nn_module.register_module_forward_hook(self._post, always_call=True)]

    def stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.names = [], {}

    def _name(self, mod: Any) -> str:
        if not self.stack:
            entry = self.names.get(id(mod))
            if entry is None or entry[0] is not mod:
                entry = self.names[id(mod)] = (mod, {id(m): n for n, m in mod.named_modules(remove_duplicate=False)})
            self.root = entry
            return ""
        name = self.root[1].get(id(mod))
        if name is None:  # called but not registered under the root
            parent = self.stack[-1]
            name = f"{parent}.<{type(mod).__name__}>" if parent else f"<{type(mod).__name__}>"
        return name

    def _pre(self, mod: Any, args: Any) -> None:
        name = self._name(mod)
        self.stack.append(name)
        self.calls.append([torch._C._autograd._get_sequence_nr(), None, name])

    def _post(self, mod: Any, args: Any, out: Any) -> None:
        if not self.stack:
            return
        name = self.stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        for call in reversed(self.calls):
            if call[1] is None and call[2] == name:
                call[1] = end
                break

    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def module_of_node(self, node: Any) -> str | None:
        if node is None:
            return None
        seq = node._sequence_nr()
        for start, end, name in reversed(self.calls):
            if start <= seq and (end is None or seq < end):
                return name
        return None


_TRACKER = _ModuleTracker()


# -- the tree ---------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def records_tree(records: list[CommRecord], *, title: str = "") -> str:
    """Records as a tree by module (qualified names, nested by their dots), each module's
    collectives listed under FORWARD / BACKWARD with op and source line, like DTensor's
    CommDebugMode."""
    by_module: dict[str | None, list[CommRecord]] = {}
    for r in records:
        by_module.setdefault(r.module, []).append(r)
    nodes: set[str] = set()
    for m in by_module:
        if m:
            parts = m.split(".")
            nodes.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    lines = [title] if title else []

    def section(recs: list[CommRecord], indent: str) -> None:
        for phase in ("forward", "backward"):
            mine = [r for r in recs if r.phase == phase]
            if mine:
                counts = Counter(r.kind for r in mine)
                lines.append(f"{indent}{phase.upper()}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
                lines.extend(f"{indent}  {r}" for r in mine)

    if None in by_module:
        lines.append("(no module)")
        section(by_module[None], "  ")
    lines.append("(root module)" if "" in by_module or nodes else "")
    if "" in by_module:
        section(by_module[""], "  ")
    for name in sorted(nodes, key=lambda n: [(0, int(p)) if p.isdigit() else (1, p) for p in n.split(".")]):
        depth = name.count(".") + 1
        lines.append("  " * depth + name)
        if name in by_module:
            section(by_module[name], "  " * (depth + 1))
    return "\n".join(line for line in lines if line)
