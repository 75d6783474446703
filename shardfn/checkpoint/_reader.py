"""DCP's file-system reader, reading each saved tensor chunk straight into its destination.

``FileSystemReader`` reads every requested chunk with ``torch.load`` (a zip archive per
chunk, unpickled by the weights-only unpickler) into a new tensor and copies the requested
slice into the destination: a fixed cost per chunk that dominates for sharded checkpoints,
which hold a chunk per distinct shard. This reader parses the chunk's small pickle with a
restricted unpickler (it accepts only a tensor: ``_rebuild_tensor_v2`` of one storage), finds
the storage record's offset in the archive (torch.save stores records uncompressed) and
``readinto``s the bytes: into the destination itself when the request is the whole chunk and
the destination is contiguous of the same dtype, else into one buffer per chunk, kept for
the next request of the same chunk (a resharding load reads each chunk once). Anything
else (transforms, Python objects, unusual archives) goes through DCP's own path.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import sys
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from ..values.strides import dense_strides

_LITTLE = sys.byteorder == "little"


def _storage_dtypes() -> dict[str, torch.dtype]:
    """torch.save names a storage by its legacy class (``torch FloatStorage``)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy classes warn that they are deprecated
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("TypedStorage", "UntypedStorage"):
                dtype = getattr(getattr(torch, name), "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[name] = dtype
    return out


_STORAGE_DTYPES = _storage_dtypes()


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Where a saved chunk's values are in its archive."""

    key: str
    dtype: torch.dtype
    size: tuple[int, ...]


class _Storage:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


def _rebuild(storage: Any, offset: int, size: tuple, stride: tuple, requires_grad: Any, hooks: Any,
             metadata: Any = None) -> _Chunk:
    if not isinstance(storage, _Storage) or offset != 0 or tuple(stride) != dense_strides(tuple(size)) \
            or storage.numel != math.prod(size):
        raise pickle.UnpicklingError("not a tensor that is exactly its storage")
    return _Chunk(storage.key, storage.dtype, tuple(size))


class _Unpickler(pickle.Unpickler):
    """Accepts the pickle torch.save writes for one plain tensor, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError("unexpected persistent id")
        return _Storage(pid[1], str(pid[2]), int(pid[4]))


def _locate(view: Any) -> tuple[_Chunk, int] | None:
    """The chunk in the torch.save archive ``view`` (a seekable slice) and the offset of its
    values in the slice, or None where this reader does not handle it."""
    try:
        zf = torch._C.PyTorchFileReader(view)
        if zf.has_record("byteorder") and bytes(zf.get_record("byteorder")) != (b"little" if _LITTLE else b"big"):
            return None
        chunk = _Unpickler(io.BytesIO(bytes(zf.get_record("data.pkl")))).load()
        if not isinstance(chunk, _Chunk):
            return None
        return chunk, zf.get_record_offset(f"data/{chunk.key}")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError):
        return None


def _read_exact(stream: Any, start: int, into: torch.Tensor) -> None:
    """Fill contiguous CPU ``into`` with the bytes at ``start`` of ``stream``."""
    flat = into.reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return
    buf = memoryview(flat.numpy())
    stream.seek(start)
    done = 0
    while done < len(buf):
        n = stream.readinto(buf[done:])
        if not n:
            raise EOFError(f"checkpoint file ends {len(buf) - done} bytes early")
        done += n


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class DirectFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that reads chunks straight into
    their destinations (see the module docstring); the same format, the same results."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        fast: dict[str, list] = {}
        rest = []
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                rest.append(req)
            else:
                fast.setdefault(md.relative_path, []).append(req)
        for relative_path, reqs in fast.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                kept: tuple[Any, torch.Tensor] | None = None  # the last chunk read whole, for resharding
                for req in reqs:
                    md = self.storage_data[req.storage_index]
                    found = _locate(self._slice_file(stream, md))
                    target = planner.resolve_tensor(req).detach()
                    if found is None or tuple(target.shape) != tuple(req.lengths) or target.device.type != "cpu":
                        rest.append(req)
                        continue
                    chunk, rec = found
                    start = md.offset + rec
                    whole = not any(req.storage_offsets) and tuple(req.lengths) == chunk.size
                    if whole and target.dtype == chunk.dtype and target.is_contiguous():
                        _read_exact(stream, start, target)
                    else:
                        if kept is None or kept[0] != (relative_path, md.offset):
                            buf = torch.empty(chunk.size, dtype=chunk.dtype)
                            _read_exact(stream, start, buf)
                            kept = ((relative_path, md.offset), buf)
                        target.copy_(_narrow(kept[1], req.storage_offsets, req.lengths))
                    planner.commit_tensor(req, target)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut
