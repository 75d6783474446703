"""Mesh: a named, n-dimensional grid of devices, and the current-mesh stack."""

from __future__ import annotations

import functools
import math
import os
import warnings
import weakref
from typing import Any, Callable, Sequence

import attrs
import torch

from .context import ThreadStack
from .torch_compat import ValueMeta
from .errors import ShardingError, SimulationWarning

_BACKENDS = ("local", "dist")

# backend name -> the device type a mesh on it gets by default; filled by the backends
# package when it is imported (values never import backends)
DEFAULT_DEVICE_TYPES: dict[str, Callable[[], str]] = {}


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise ShardingError(f"Mesh shape must be a tuple of positive ints, got {shape!r}")
    for i, n in enumerate(shape):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ShardingError(
                f"Mesh shape entry {i} is {n!r}; every entry must be a positive int, "
                f"e.g. Mesh((2, 4), ('x', 'y'))"
            )
    return tuple(shape)


def _check_names(names: object, ndim: int) -> tuple[str, ...]:
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, Sequence):
        raise ShardingError(f"Mesh axis_names must be a tuple of str, got {names!r}")
    names = tuple(names)
    for n in names:
        if not isinstance(n, str) or not n:
            raise ShardingError(f"Mesh axis name {n!r} is not a non-empty str")
    if len(names) != ndim:
        raise ShardingError(
            f"Mesh has {ndim} dims but {len(names)} axis_names {names!r}; give one name per dim"
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ShardingError(f"Mesh axis_names {names!r} repeat {dupes[0]!r}; names must be unique")
    return names


def _check_device_type(device_type: object) -> None:
    """A device type this machine has (torch's own availability checks)."""
    if not isinstance(device_type, str):
        raise ShardingError(f"Mesh device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    try:
        kind = torch.device(device_type)
    except (RuntimeError, ValueError, TypeError):
        raise ShardingError(
            f"Mesh device_type {device_type!r} is not a torch device type; use one of {_available_types()}"
        ) from None
    if kind.index is not None or kind.type != device_type:
        raise ShardingError(
            f"Mesh device_type {device_type!r} must be a bare device type (no index); "
            f"use one of {_available_types()}"
        )
    if kind.type not in _available_types():
        raise ShardingError(
            f"Mesh device_type {device_type!r} is not available on this machine; "
            f"available: {_available_types()}"
        )


@functools.lru_cache(maxsize=1)
def _available_types() -> tuple[str, ...]:
    """The device types this machine can allocate on ("meta": shapes only, always there)."""
    found = ["cpu", "meta"]
    for name in ("cuda", "xpu", "mps", "mtia", "hpu"):
        mod = getattr(torch, name, None)
        available = getattr(mod, "is_available", None)
        try:
            if available is not None and available():
                found.append(name)
        except Exception:  # a backend's probe failing means the device is not usable
            continue
    return tuple(found)


def _default_backend(size: int) -> str:
    """``backend=None``: "dist" when the initialised world has ``size`` ranks, else "local" --
    with a :class:`SimulationWarning` where this process looks like one of several (an
    initialised world of another size, or torchrun's environment without a process group),
    since each of them would then simulate the whole mesh."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world == size:
            return "dist"
        _warn_simulation(
            f"Mesh(backend=None) of {size} device{'s' * (size != 1)}: torch.distributed is initialised with "
            f"{world} rank{'s' * (world != 1)} (this is rank {dist.get_rank()}), not {size}, so every one of the "
            f"{world} processes simulates the whole mesh in-process (backend='local'). For one device per rank "
            f"make the mesh size equal the world size ({world}); to simulate on purpose pass backend='local'"
        )
    elif os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None:
        world = os.environ["WORLD_SIZE"]
        _warn_simulation(
            f"Mesh(backend=None) of {size} device{'s' * (size != 1)}: this process was launched as rank "
            f"{os.environ['RANK']} of {world} (RANK/WORLD_SIZE are set, as torchrun sets them) but "
            f"torch.distributed is not initialised, so every process simulates the whole mesh in-process "
            f"(backend='local'). Call torch.distributed.init_process_group() before building the mesh to "
            f"run one device per rank, or pass backend='local' to simulate on purpose"
        )
    return "local"


def _warn_simulation(message: str) -> None:
    # warn_explicit with no registry: shown every time, not once per call site
    # (user warning filters, e.g. "error" or "ignore", still apply)
    import sys

    frame = sys._getframe(1)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the shardfn package
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame = frame.f_back  # the first frame outside shardfn: the code that built the mesh
    warnings.warn_explicit(message, SimulationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=None)


@attrs.frozen(repr=False, init=False)
class Mesh(metaclass=ValueMeta):
    """An immutable grid of devices with named axes; devices are numbered row-major.

    ``backend="local"`` simulates every device in this process; ``"dist"`` runs one
    process per device on torch.distributed. ``None`` picks dist when the initialised
    world size equals the mesh size.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    backend: str
    device_type: str
    # a dist sub-mesh view (see :func:`submesh`): (parent mesh, ((fixed axis, coordinate), ...))
    within: tuple | None = None

    def __init__(
        self,
        shape: Sequence[int] | int,
        axis_names: Sequence[str] | str,
        *,
        backend: str | None = None,
        device_type: str | None = None,
    ) -> None:
        shape = _check_shape(shape)
        names = _check_names(axis_names, len(shape))
        size = math.prod(shape)
        if backend is None:
            backend = _default_backend(size)
        if backend not in _BACKENDS:
            raise ShardingError(f"Mesh backend {backend!r} is unknown; use one of {_BACKENDS}")
        if device_type is None:
            device_type = DEFAULT_DEVICE_TYPES[backend]()
        _check_device_type(device_type)
        self.__attrs_init__(shape, names, backend, device_type)
        _LIVE.setdefault((shape, names, backend, device_type), self)

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_size(self, name: str) -> int:
        """Size of the mesh axis called ``name``."""
        return self.shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        """Position of axis ``name`` in ``axis_names``; a ShardingError if absent."""
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise ShardingError(
                f"axis {name!r} is not in the mesh; its axes are {self.axis_names!r}"
            ) from None

    def coords(self, device: int) -> tuple[int, ...]:
        """Row-major coordinates of ``device`` on the mesh."""
        return _coords(self.shape, device)

    def device_at(self, coords: Sequence[int]) -> int:
        """The device at row-major ``coords`` (the inverse of :meth:`coords`)."""
        dev = 0
        for n, c in zip(self.shape, coords):
            dev = dev * n + c
        return dev

    def flatten(self, axes: Sequence[str], name: str) -> Mesh:
        """A view of this mesh with the adjacent ``axes`` (in mesh order) merged into one
        axis ``name``; same devices, same numbering."""
        return _flatten(self, tuple(axes), name)

    def unflatten(self, axis: str, shape: Sequence[int], names: Sequence[str]) -> Mesh:
        """A view of this mesh with ``axis`` split into axes ``names`` of sizes ``shape``."""
        return _unflatten(self, axis, tuple(shape), tuple(names))

    def __deepcopy__(self, memo: dict) -> Mesh:
        """Itself (immutable): torch.compile keeps a deep copy of each array's flatten context
        for its guards, which then compared two meshes field by field on every call."""
        return self

    def __reduce__(self) -> tuple:
        """Pickles as its constructor's arguments (``torch.load(weights_only=True)`` allows
        the rebuild function)."""
        return _rebuild_mesh, (self.shape, self.axis_names, self.backend, self.device_type)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        if self.device_type != "cpu":  # arrays on meshes of other devices do not mix: say which
            axes += f", device_type={self.device_type!r}"
        if self.within is not None:
            parent, fixed = self.within
            at = ", ".join(f"{a}={c}" for a, c in fixed)
            return f"Mesh({axes}, backend={self.backend!r}, within {parent!r} at {at})"
        return f"Mesh({axes}, backend={self.backend!r})"

    def __enter__(self) -> Mesh:
        _stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


def _identity_first(cls: type) -> None:
    """Give an attrs value class's generated ``__eq__`` (which compares every field, even of
    the very same object) an identity shortcut: every comparison of two layouts compares
    their meshes, almost always the same object. ``__ne__`` and ``__hash__`` are unchanged."""
    fields_eq = cls.__eq__

    def __eq__(self: Any, other: Any) -> Any:
        return True if self is other else fields_eq(self, other)

    __eq__.__doc__ = fields_eq.__doc__
    cls.__eq__ = __eq__


_identity_first(Mesh)


def submesh(parent: Mesh, axes: Sequence[str], fixed: Sequence[tuple[str, int]]) -> Mesh:
    """The view of ``parent`` over its ``axes`` (in mesh order) at the coordinates ``fixed``
    of its other axes: the devices that share those coordinates, numbered row-major over
    ``axes``. A dist partial-manual shard_map body's mesh (the ranks that share this rank's
    manual coordinates); its backend reuses the parent's per-axis process groups."""
    axes = tuple(a for a in parent.axis_names if a in axes)
    mesh = object.__new__(Mesh)
    mesh.__attrs_init__(tuple(parent.axis_size(a) for a in axes), axes, parent.backend, parent.device_type,
                        (parent, tuple(fixed)))
    return mesh


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""(shape, axis_names, backend, device_type) -> a live mesh of those fields (the first one built)."""


def _rebuild_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...], backend: str, device_type: str) -> Mesh:
    """Unpickling: the live mesh equal to the pickled one where there is one (meshes are immutable
    values). A compiled program loaded from torch's caches rebuilds its arrays' layouts with it, so
    arrays it returns are on the caller's mesh object, and comparing their layouts with others'
    takes the identity shortcut instead of comparing every mesh field (``Mesh.__eq__``)."""
    mesh = _LIVE.get((tuple(shape), tuple(axis_names), backend, device_type))
    return mesh if mesh is not None else Mesh(shape, axis_names, backend=backend, device_type=device_type)


torch.serialization.add_safe_globals([_rebuild_mesh])


_coords_cache: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}


def _coords(shape: tuple[int, ...], device: int) -> tuple[int, ...]:
    key = (shape, device)
    hit = _coords_cache.get(key)
    if hit is None:
        out = []
        for n in reversed(shape):
            device, r = divmod(device, n)
            out.append(r)
        hit = _coords_cache[key] = tuple(reversed(out))
    return hit


_entered = ThreadStack()


def _stack() -> list[Mesh]:
    """The meshes entered with ``with mesh:`` in this thread, innermost last."""
    return _entered.items


def current_mesh() -> Mesh | None:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _stack()
    return stack[-1] if stack else None


# -- the device the mesh owns -------------------------------------------------------------------


def mesh_device(mesh: Mesh) -> torch.device:
    """The device this process puts the mesh's shards on (the current CUDA device for "cuda")."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_mesh_device(what: str, device: Any, mesh: Mesh) -> None:
    """A ``device=`` argument of an op on ShardedArrays must name the mesh's device type (the
    mesh owns the device): a ShardingError naming both and the ways to get elsewhere."""
    if device is None:
        return
    if isinstance(device, int) and not isinstance(device, bool):
        _check_device_index(what, device, mesh)
        return
    kind = torch.device(device).type
    if kind != mesh.device_type:
        raise ShardingError(
            f"{what}(device={str(device)!r}): the ShardedArray lives on its mesh's device type "
            f"{mesh.device_type!r} (the mesh owns the device); for a plain tensor there use "
            f"x.full_tensor().to({kind!r}), or distribute onto a Mesh(..., device_type={kind!r})"
        )


def _check_device_index(what: str, index: int, mesh: Mesh) -> None:
    """A bare int device is torch's spelling of the current accelerator's device ``index``: on a
    mesh of that accelerator it is the mesh's device type; elsewhere (a CPU or meta mesh, or no
    accelerator at all, where torch fails starting one) a ShardingError naming both."""
    acc = torch.accelerator.current_accelerator()
    if acc is not None and acc.type == mesh.device_type:
        return
    means = f"{acc.type}:{index}" if acc is not None else "an accelerator's device, and none is available here"
    raise ShardingError(
        f"{what}(device={index}): an int device means {means}, but the ShardedArray lives on its mesh's "
        f"device type {mesh.device_type!r} (the mesh owns the device); name {mesh.device_type!r} or leave "
        f"the device out, or for a plain tensor elsewhere use x.full_tensor().to(...)"
    )


_ACCELERATOR_METHODS = {torch.Tensor.cuda: "cuda", torch.Tensor.xpu: "xpu", torch.Tensor.ipu: "ipu"}
_LIKE = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
         torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
         torch.Tensor.new_full, torch.Tensor.new_empty_strided, torch.Tensor.new_tensor)
DEVICE_FUNCS = frozenset((torch.Tensor.to, torch.Tensor.type, *_ACCELERATOR_METHODS, *_LIKE))
"""The torch functions that take a device and initialise its runtime before any op runs (``x.cuda()``
on a machine without CUDA fails there): :func:`check_call_device` reads it first."""


def _type_device(t: Any) -> str | None:
    """The accelerator a ``Tensor.type`` argument names (``'torch.cuda.FloatTensor'`` or that class);
    a dtype or a CPU type names none here (the cast's rule checks those)."""
    if t is None or isinstance(t, torch.dtype):
        return None
    name = t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', '')}"
    return "cuda" if name.startswith("torch.cuda.") else None


def _to_device(args: tuple, kwargs: dict) -> Any:
    """The device ``Tensor.to(*args, **kwargs)`` names, or None."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    first = args[0] if args else kwargs.get("other", kwargs.get("tensor"))
    if isinstance(first, torch.Tensor):
        return first.device
    # an int is a device index (``x.to(0)``: the current accelerator's device 0), never a dtype
    return first if isinstance(first, (str, torch.device, int)) and not isinstance(first, bool) else None


def check_call_device(func: Any, args: tuple, kwargs: dict, mesh: Mesh) -> None:
    """A :data:`DEVICE_FUNCS` call on a ShardedArray of ``mesh`` naming another device type: the
    ShardingError of :func:`check_mesh_device`, before torch initialises that device's runtime."""
    if func is torch.Tensor.to:
        device, what = _to_device(args[1:], kwargs), "_to_copy"
    elif func in _ACCELERATOR_METHODS:
        dev = args[1] if len(args) > 1 else kwargs.get("device")
        kind = _ACCELERATOR_METHODS[func]
        device = torch.device(kind) if dev is None else torch.device(kind, dev) if isinstance(dev, int) else dev
        what = "_to_copy"
    elif func is torch.Tensor.type:
        device, what = _type_device(args[1] if len(args) > 1 else kwargs.get("dtype")), "_to_copy"
    else:
        device, what = kwargs.get("device"), func.__name__
    check_mesh_device(what, device, mesh)


def to_mesh_device(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """``t`` itself if it is on the mesh's device type, else a copy there (differentiable). A
    meta tensor holds no data to copy: a ShardingError naming the mesh's device type."""
    if t.device.type == mesh.device_type:
        return t
    if t.is_meta:
        raise ShardingError(
            f"a meta tensor of shape {tuple(t.shape)} holds no data, so it cannot move onto the mesh's device type "
            f"{mesh.device_type!r}; give a tensor with values, or use a Mesh(..., device_type='meta')"
        )
    return t.to(mesh_device(mesh))


# -- views: the same devices, other axes --------------------------------------------------------


def _flatten(mesh: Mesh, axes: tuple[str, ...], name: str) -> Mesh:
    axes = tuple(axes)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise ShardingError(f"Mesh.flatten: axes {axes!r} must be axes of {mesh!r}")
    idx = [mesh.axis_names.index(a) for a in axes]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ShardingError(
            f"Mesh.flatten: axes {axes!r} must be adjacent and in mesh order {mesh.axis_names!r}; "
            f"only such axes merge into one axis over the same devices"
        )
    if name in mesh.axis_names and name not in axes:
        raise ShardingError(f"Mesh.flatten: name {name!r} is already an axis of {mesh!r}")
    lo, hi = idx[0], idx[-1] + 1
    shape = (*mesh.shape[:lo], math.prod(mesh.shape[lo:hi]), *mesh.shape[hi:])
    names = (*mesh.axis_names[:lo], name, *mesh.axis_names[hi:])
    return Mesh(shape, names, backend=mesh.backend, device_type=mesh.device_type)


def _unflatten(mesh: Mesh, axis: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    i = mesh.axis_index(axis)
    shape, names = tuple(shape), tuple(names)
    if len(shape) != len(names):
        raise ShardingError(f"Mesh.unflatten: shape {shape!r} and names {names!r} differ in length")
    if math.prod(shape) != mesh.shape[i]:
        raise ShardingError(
            f"Mesh.unflatten: shape {shape!r} has {math.prod(shape)} devices but axis {axis!r} has {mesh.shape[i]}"
        )
    for n in names:
        if n in mesh.axis_names and n != axis:
            raise ShardingError(f"Mesh.unflatten: name {n!r} is already an axis of {mesh!r}")
    return Mesh((*mesh.shape[:i], *shape, *mesh.shape[i + 1:]), (*mesh.axis_names[:i], *names, *mesh.axis_names[i + 1:]),
                backend=mesh.backend, device_type=mesh.device_type)
