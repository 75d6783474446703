"""Shared fixtures and hypothesis strategies: simulated meshes, shapes and shardings."""

from __future__ import annotations

import importlib.util
import math
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

settings.register_profile("default", deadline=None, max_examples=60, database=None)
settings.load_profile("default")

MESH_SHAPES = [(1,), (2,), (3,), (4,), (8,), (1, 2), (2, 2), (2, 4), (4, 2), (2, 3), (2, 2, 2), (1, 2, 3)]
NAMES = ("x", "y", "z")
DIM_SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 11, 12]


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Each test draws the same random data whatever ran before it, so a failure
    reproduces alone (hypothesis still varies its own examples)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def mesh24() -> sf.Mesh:
    return sf.Mesh((2, 4), ("x", "y"), backend="local")


@pytest.fixture
def mesh22() -> sf.Mesh:
    return sf.Mesh((2, 2), ("x", "y"), backend="local")


@st.composite
def meshes(draw, max_devices: int = 8) -> sf.Mesh:
    shape = draw(st.sampled_from([s for s in MESH_SHAPES if math.prod(s) <= max_devices]))
    return sf.Mesh(shape, NAMES[: len(shape)], backend="local")


@st.composite
def shapes(draw, min_dims: int = 0, max_dims: int = 3) -> tuple[int, ...]:
    ndim = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(ndim))


@st.composite
def specs(draw, mesh: sf.Mesh, ndim: int, partial_ops=("sum",)) -> P:
    """A random spec: each mesh axis shards some dim (random nesting order), is
    replicated, or (if partial_ops) is a pending reduction."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial = {}
    for a in draw(st.permutations(mesh.axis_names)):
        choice = draw(st.integers(0, 2))
        if choice == 0 and ndim:
            dims[draw(st.integers(0, ndim - 1))].append(a)
        elif choice == 1 and partial_ops:
            partial[a] = draw(st.sampled_from(partial_ops))
    entries = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims]
    return P(*entries, partial=partial or None)


def reduce_parts(parts: list[torch.Tensor], mesh: sf.Mesh, partial: dict) -> torch.Tensor:
    """The global value of per-device parts with pending reductions, in mesh-axis order."""
    t = torch.stack(parts).reshape(*mesh.shape, *parts[0].shape)
    for i, a in enumerate(mesh.axis_names):
        op = partial.get(a)
        if op is None:
            t = t.select(i, 0).unsqueeze(i)  # replicated over a: any copy
        elif op == "sum":
            t = t.sum(i, keepdim=True)
        elif op == "avg":
            t = t.mean(i, keepdim=True)
        elif op == "max":
            t = t.amax(i, keepdim=True)
        else:
            t = t.amin(i, keepdim=True)
    return t.reshape(parts[0].shape)


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (examples are not a package)."""
    path = Path(__file__).parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
