"""A ShardedArray as DCP sees it (the checkpointable-tensor protocol) and as pickle sees it.

``torch.distributed.checkpoint`` asks a tensor for its write items / chunk list and for the
tensor of one chunk (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, the hooks DTensor implements). A ShardedArray answers with one
chunk per *distinct* shard this process holds (replicas are one chunk; DCP deduplicates
the chunks several processes hold), so each distinct shard is written once on both
backends. Arrays layer: no imports from transforms or edge packages.
"""

from __future__ import annotations

import hashlib
import functools
import math
from pathlib import Path
from typing import Any

import torch

from ..values import layout as _lay
from ..backends.registry import backend_for
from ..values.errors import ShardingError
from ..values.layout import Box, Layout
from ..values.mesh import Mesh


def _held_boxes(layout: Layout, shape: tuple[int, ...]) -> list[tuple[Box, int]]:
    """The distinct non-empty boxes of the devices this process holds, each with the first
    device holding it (a value with no elements: one empty box at the origin)."""
    mesh = layout.mesh
    return list(_distinct_boxes(layout, shape, tuple(backend_for(mesh).devices(mesh))))


@functools.lru_cache(maxsize=4096)
def _distinct_boxes(layout: Layout, shape: tuple[int, ...], devices: tuple[int, ...]) -> tuple[tuple[Box, int], ...]:
    boxes = _lay.all_boxes(layout, shape)
    seen: dict[Box, int] = {}
    for d in devices:
        box = boxes[d]
        if box not in seen and _lay.box_numel(box) > 0:
            seen[box] = d
    if not seen and math.prod(shape) == 0:
        seen[tuple((0, n) for n in shape)] = -1
    return tuple(seen.items())


@functools.lru_cache(maxsize=4096)
def _by_offset(layout: Layout, shape: tuple[int, ...], devices: tuple[int, ...]) -> dict[torch.Size, tuple[Box, int]]:
    return {_offsets(box): (box, d) for box, d in _distinct_boxes(layout, shape, devices)}


def _offsets(box: Box) -> torch.Size:
    return torch.Size(lo for lo, _ in box)


def _sizes(box: Box) -> torch.Size:
    return torch.Size(hi - lo for lo, hi in box)


def _readable(x: Any) -> tuple[Any, Layout]:
    """``x``'s backend value with pending reductions resolved (on dist every process calls
    this in the same order: DCP plans every state dict entry on every rank), and its layout.
    The reduced value is kept on the array (``raw_reshard`` under ``redistribute``), so the
    later shard lookup runs no collective."""
    layout = x._layout.without_partial()
    with torch.no_grad():
        return x.redistribute(layout)._local, layout


def _shard_of(x: Any, value: Any, layout: Layout, index: Any) -> torch.Tensor:
    """The tensor of the chunk at ``index.offset`` (a view of the array's storage)."""
    shape = tuple(x.shape)
    mesh = layout.mesh
    devices = tuple(backend_for(mesh).devices(mesh))
    if index.offset is None:
        found = next(iter(_distinct_boxes(layout, shape, devices)), None)
    else:
        found = _by_offset(layout, shape, devices).get(torch.Size(index.offset))
    if found is None:
        raise ValueError(f"{index.fqn!r}: this process holds no shard at offset {tuple(index.offset or ())} "
                         f"of {_lay.describe(shape, x.dtype, x._layout)}")
    _, device = found
    if device < 0:
        return torch.empty(shape, dtype=x.dtype)
    return backend_for(mesh).shard(value, mesh, device)


def create_write_items(x: Any, fqn: str) -> list:
    """DCP write items: one SHARD item per distinct shard this process holds."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    _, layout = _readable(x)
    size = torch.Size(x.shape)
    props = TensorProperties(dtype=x.dtype)
    return [
        WriteItem(
            index=MetadataIndex(fqn, _offsets(box)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=_offsets(box), sizes=_sizes(box)), properties=props, size=size),
        )
        for box, _ in _held_boxes(layout, tuple(x.shape))
    ]


def create_chunk_list(x: Any) -> list:
    """DCP's chunks to read into ``x`` (``dcp.load``, which loads in place): ``x`` is first
    given fresh shards of its own, so arrays that shared storage with it never change;
    then one chunk per distinct shard this process holds."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    if x._layout.partial:
        raise ShardingError(
            f"cannot load into {_lay.describe(tuple(x.shape), x.dtype, x._layout)}: it has pending reductions; "
            f"load into an array without them (x.redistribute(...) to a layout without partial=), "
            f"or use sf.checkpoint.load(path, like), which returns new arrays")
    x._local = empty_value(x._layout, tuple(x.shape), x.dtype)
    x.__dict__.pop("_reduced", None)
    return [ChunkStorageMetadata(offsets=_offsets(box), sizes=_sizes(box))
            for box, _ in _held_boxes(x._layout, tuple(x.shape))]


def get_tensor_shard(x: Any, index: Any) -> torch.Tensor:
    """The tensor of one chunk: on save, the (reduced) shard; on load, the view of the
    fresh storage that DCP writes into."""
    value, layout = _readable(x)
    return _own_storage(_shard_of(x, value, layout, index))


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU view) as a tensor whose storage is exactly its bytes, sharing
    its memory: DCP's writer clones a view of a larger storage before saving it (else
    torch.save would write the whole storage), a second pass over every byte; the local
    backend's shards are views of one stacked buffer. Writes through the result reach ``t``."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes or t.numel() == 0:
        return t
    # as_strided, not reshape: a contiguous tensor may carry any stride on a size-1 dim (even 0)
    flat = torch.from_numpy(t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy())  # numpy keeps t alive
    return flat.view(t.dtype).view(t.shape)


def mesh_device(mesh: Mesh) -> torch.device:
    """The device this process puts its shards on."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def empty_value(layout: Layout, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A backend value of uninitialised shards in which devices holding the same box share
    one tensor, so filling each distinct shard once fills every replica."""
    return backend_for(layout.mesh).empty(layout, shape, dtype, mesh_device(layout.mesh))


# -- pickling --------------------------------------------------------------------------------


def _mesh_key(mesh: Mesh) -> str:
    key = f"{mesh.shape}|{mesh.axis_names}|{mesh.backend}|{mesh.device_type}"
    if mesh.within is not None:  # a sub-mesh: which part of which parent
        parent, fixed = mesh.within
        key += f"|within {_mesh_key(parent)} at {tuple(fixed)}"
    return key


def _inner_key(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}|{t.stride()}|{t.dtype}|{t.device}"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of every source file of the installed shardfn package (read once a process)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def stable_hash(x: Any) -> str:
    """``_stable_hash_for_caching``: a process-independent key for torch.compile's caches
    (AOTAutograd's cache key pickles a subclass input through this instead of the array):
    mesh (shape, names, backend, device type, parent of a sub-mesh), layout, global shape,
    stride and dtype, the metadata of the tensors ``__tensor_flatten__`` gives (never their
    values), and the devices this process holds: on dist, ranks with equal shard shapes
    trace different constants (shard offsets), so they must not share an entry. And shardfn's
    own source (:func:`code_fingerprint`): AOTAutograd keys its cache on the Dynamo graph, in
    which a call on arrays is one node whatever shardfn traces it into, so an entry made by an
    older shardfn would run its old decomposition."""
    lay, mesh = x._layout, x._layout.mesh
    local = x._local
    inner = ";".join(_inner_key(t) for t in (local if isinstance(local, tuple) else (local,)))
    held = tuple(backend_for(mesh).devices(mesh))
    key = (f"{_mesh_key(mesh)}|{lay.dims}|{lay.partial}|{tuple(x.shape)}|{x.stride()}|{x.dtype}|"
           f"{x.requires_grad}|{isinstance(local, tuple)}|{inner}|held {held if len(held) < mesh.size else 'all'}|"
           f"{code_fingerprint()}")
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def pickle_args(x: Any) -> tuple:
    """``__reduce_ex__``'s arguments of ``array.rebuild_array``: where this process holds every
    device's shard (the local backend), the mesh, layout, shape, dtype and shards; elsewhere a
    TypeError naming sf.checkpoint."""
    mesh = x.mesh
    held = backend_for(mesh).devices(mesh)
    if len(held) != mesh.size:
        raise TypeError(
            f"a ShardedArray {_lay.describe(tuple(x.shape), x.dtype, x._layout)} on {mesh!r} cannot be pickled: "
            f"this process holds only device(s) {list(held)} of {mesh.size}. Save arrays whose shards live in "
            f"several processes with sf.checkpoint.save(path, tree) (every process calls it), or pickle x.full_tensor()")
    shards = tuple(backend_for(mesh).shard_list(x._local, mesh))
    layout = x._layout
    return (mesh, layout.dims, layout.partial, shards, tuple(x.shape), x.dtype, x.requires_grad)
