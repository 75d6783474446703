"""sf.checkpoint.save / load: pytrees of ShardedArrays through torch.distributed.checkpoint.

The tree is flattened to DCP's flat state dict (keys: the path's entries joined with ".",
as DCP names nested dicts), and DCP does the I/O through the arrays' checkpointable-tensor
protocol (``shardfn/arrays/checkpointable.py``): each distinct shard is one chunk, written once;
loading builds fresh arrays of the requested layout and reads, per held distinct shard, only
the slices of the saved chunks it overlaps (DCP's resharding read items), by default with
``_reader.DirectFileSystemReader`` (the bytes go straight into the new shards).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import optree
import torch

from ..arrays.checkpointable import empty_value
from ..arrays.array import ARRAY_TYPES, ShardedArray, wrap
from ..arrays.redistribute import reshard
from ..backends.registry import backend_for
from ..values.errors import ShardingError
from ..values.mesh import Mesh, current_mesh
from ..values.spec import NamedSharding, P, to_layout
from ._reader import DirectFileSystemReader

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _is_leaf(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, P, NamedSharding))


def _flatten(tree: Any, what: str) -> tuple[list[str], list[Any], Any]:
    """Leaves with their DCP keys (path entries joined with '.'), and the treespec."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    keys = [".".join(str(p) for p in path) for path in paths]
    seen: dict[str, tuple] = {}
    for key, path in zip(keys, paths):
        if key in seen:
            raise ShardingError(
                f"{what}: the paths {seen[key]!r} and {path!r} both name the checkpoint key {key!r} "
                f"(keys join nested entries with '.'); rename one")
        seen[key] = path
    return keys, leaves, spec


def _multi_process(meshes: list[Mesh]) -> bool:
    """Whether the I/O is coordinated over torch.distributed: some array's shards live in
    several processes; with no arrays at all, whenever torch.distributed is initialised
    (DCP's default). Trees of local-backend arrays are saved by the one process holding them."""
    if meshes:
        return any(len(backend_for(m).devices(m)) != m.size for m in meshes)
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet(no_dist: bool) -> Iterator[None]:
    """DCP warns that it "assumes" one process whenever it runs without a process group;
    here that is decided (``_multi_process``), not assumed."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _path_id(path: Any) -> Any:
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else path


def save(path: str | os.PathLike | None, tree: Any, *, storage_writer: Any = None) -> None:
    """Write a pytree (dict, list, tuple) of ShardedArrays, plain tensors and Python scalars
    in torch.distributed.checkpoint's format (a folder). Each distinct shard is written once
    (replicas, also across processes, are one chunk). On the dist backend every process
    calls it. ``storage_writer``: any DCP ``StorageWriter`` (default: the file system)."""
    import torch.distributed.checkpoint as dcp

    keys, leaves, _ = _flatten(tree, "sf.checkpoint.save")
    meshes = []
    for key, leaf in zip(keys, leaves):
        if type(leaf) in ARRAY_TYPES:
            if leaf.mesh.device_type == "meta":
                raise ShardingError(f"sf.checkpoint.save: {key!r} is an array on a meta mesh (no values to save); "
                                    f"save arrays of a mesh whose device holds data (cpu, cuda)")
            meshes.append(leaf.mesh)
        elif isinstance(leaf, (P, NamedSharding)):
            raise ShardingError(f"sf.checkpoint.save: {key!r} is a sharding ({leaf!r}), not a value; "
                                f"save arrays, tensors and Python scalars")
        elif isinstance(leaf, torch.Tensor):
            if leaf.is_meta:
                raise ShardingError(f"sf.checkpoint.save: {key!r} is a meta tensor (no values to save)")
        elif not isinstance(leaf, _SCALARS):
            raise ShardingError(f"sf.checkpoint.save: {key!r} is a {type(leaf).__name__}; "
                                f"a checkpoint holds ShardedArrays, tensors and Python scalars")
    if path is None and storage_writer is None:
        raise ShardingError("sf.checkpoint.save: give a path (a folder) or storage_writer=")
    if storage_writer is None and os.path.exists(_path_id(path)) and not os.path.isdir(_path_id(path)):
        raise ShardingError(f"sf.checkpoint.save: path {os.fspath(path)!r} is a file; a checkpoint is a folder "
                            f"(give a new path or an existing folder)")
    flat = dict(zip(keys, (leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)))
    no_dist = not _multi_process(meshes)
    with _quiet(no_dist), _own_error(no_dist):
        dcp.save(flat, checkpoint_id=_path_id(path), storage_writer=storage_writer, no_dist=no_dist)


@contextlib.contextmanager
def _own_error(one_process: bool) -> Iterator[None]:
    """In one process, what DCP's I/O raised (an ``OSError``, a storage's own error) as itself: DCP
    reports every failure as a ``CheckpointException``, a ``BaseException`` that ``except
    Exception`` does not catch, holding each rank's error. Over several processes it stays DCP's."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        if not one_process or len(failures) != 1:
            raise
        cause = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
        if not isinstance(cause, BaseException):
            raise
        raise cause from e


def _metadata(path: Any, storage_reader: Any) -> tuple[Any, Any]:
    if storage_reader is None:
        if path is None:
            raise ShardingError("sf.checkpoint.load: give a path (a folder) or storage_reader=")
        if not os.path.isdir(_path_id(path)):
            raise ShardingError(f"sf.checkpoint.load: {os.fspath(path)!r} is not a checkpoint folder")
        storage_reader = DirectFileSystemReader(_path_id(path))
    elif path is not None:
        storage_reader.reset(_path_id(path))
    return storage_reader, storage_reader.read_metadata()


def _saved(md: Any, key: str) -> Any:
    entry = md.state_dict_metadata.get(key)
    if entry is None:
        known = sorted(md.state_dict_metadata)
        shown = ", ".join(map(repr, known[:12])) + (f", ... ({len(known)} keys)" if len(known) > 12 else "")
        raise ShardingError(f"sf.checkpoint.load: the checkpoint has no key {key!r}; it has {shown}")
    return entry


def _tensor_meta(md: Any, key: str, what: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = _saved(md, key)
    if not isinstance(entry, TensorStorageMetadata):
        raise ShardingError(f"sf.checkpoint.load: {key!r} was saved as a Python object, but like gives {what}")
    return entry


def _check_shape(key: str, saved: Any, shape: tuple[int, ...]) -> None:
    if tuple(saved.size) != tuple(shape):
        raise ShardingError(f"sf.checkpoint.load: {key!r} was saved with shape {tuple(saved.size)}, "
                            f"but like asks for shape {tuple(shape)}")


def load(path: str | os.PathLike | None, like: Any, *, storage_reader: Any = None) -> Any:
    """A new pytree shaped like ``like``, read from a torch.distributed.checkpoint folder.

    A ShardedArray leaf of ``like`` gives the result's sharding, shape and dtype; a
    sharding leaf (``NamedSharding``, or ``P`` with the current mesh) the sharding, with
    shape and dtype from the checkpoint; a plain tensor leaf loads the whole value (its
    dtype and device); other leaves load the saved Python value. The saved sharding, mesh
    shape and backend need not match: each held distinct shard reads only the saved slices
    it overlaps. ``storage_reader``: any DCP ``StorageReader``, e.g.
    ``HuggingFaceStorageReader(path)`` for a Hugging Face safetensors folder.
    """
    import torch.distributed.checkpoint as dcp

    keys, leaves, spec = _flatten(like, "sf.checkpoint.load")
    reader, md = _metadata(path, storage_reader)
    targets: dict[str, Any] = {}
    finish: list[Any] = []
    meshes: list[Mesh] = []
    for key, leaf in zip(keys, leaves):
        if type(leaf) in ARRAY_TYPES or isinstance(leaf, (P, NamedSharding)):
            if type(leaf) in ARRAY_TYPES:
                saved = _tensor_meta(md, key, "an array")
                layout, shape, dtype, rg = leaf._layout, tuple(leaf.shape), leaf.dtype, leaf.requires_grad
                _check_shape(key, saved, shape)
            else:
                saved = _tensor_meta(md, key, "a sharding")
                shape, dtype, rg = tuple(saved.size), saved.properties.dtype, False
                mesh = leaf.mesh if isinstance(leaf, NamedSharding) else current_mesh()
                if mesh is None:
                    raise ShardingError(f"sf.checkpoint.load: {key!r} is given as {leaf!r} with no mesh; "
                                        f"enter one (with mesh:) or give NamedSharding(mesh, spec)")
                layout = to_layout(leaf, len(shape), mesh, arg=f"like[{key!r}]")
            meshes.append(layout.mesh)
            plain = layout.without_partial()
            target = wrap(empty_value(plain, shape, dtype), plain, shape, dtype)
            targets[key] = target
            finish.append(_Finish(layout, rg))
        elif isinstance(leaf, torch.Tensor):
            saved = _tensor_meta(md, key, "a tensor")
            _check_shape(key, saved, tuple(leaf.shape))
            device = leaf.device if not leaf.is_meta else torch.device("cpu")
            targets[key] = torch.empty(tuple(leaf.shape), dtype=leaf.dtype, device=device)
            finish.append(_Finish(None, leaf.requires_grad))
        else:
            _saved(md, key)
            targets[key] = leaf
            finish.append(None)
    no_dist = not _multi_process(meshes)
    # arrays on a meta mesh (the CPU stand-in for an accelerator) hold no data: nothing to read
    reads = {k: v for k, v in targets.items() if not (type(v) in ARRAY_TYPES and v.mesh.device_type == "meta")}
    if reads:
        with _quiet(no_dist), _own_error(no_dist):
            dcp.load(reads, checkpoint_id=_path_id(path), storage_reader=reader, no_dist=no_dist)
        targets.update(reads)  # DCP puts loaded Python values into the dict it was given
    out = [targets[key] if f is None else f(targets[key]) for key, f in zip(keys, finish)]
    return optree.tree_unflatten(spec, out)


class _Finish:
    """What a loaded tensor becomes: resharded to a layout with pending reductions where
    ``like`` asked for one, and requiring grad where ``like`` did."""

    def __init__(self, layout: Any, requires_grad: bool) -> None:
        self.layout, self.requires_grad = layout, requires_grad

    def __call__(self, value: Any) -> Any:
        if isinstance(value, ShardedArray) and self.layout is not None and self.layout != value._layout:
            value = reshard(value, self.layout)
        if self.requires_grad:
            value.requires_grad_(True)
        return value

