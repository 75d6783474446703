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
