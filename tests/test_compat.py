"""torch version support (2.11 and newer): the version gate and the one module of differences."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest
import torch
from torch._library.opaque_object import is_opaque_value_type
from torch._opaque_base import OpaqueBaseMeta

import shardfn as sf
from shardfn.values import torch_compat as _compat
from shardfn.values.layout import Layout


@pytest.mark.parametrize("version", ["2.10.1", "2.9.0+cu128", "1.13.1", "2.10.0a0+git123"])
def test_older_torch_is_a_clear_import_error(version: str) -> None:
    with pytest.raises(ImportError, match=rf"shardfn needs torch>=2\.11; this is torch {version.replace('+', '.')}"):
        _compat.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.15.0a0+gitabc", "3.0.0"])
def test_supported_torch_imports(version: str) -> None:
    _compat.check_torch_version(version)  # no error


VALUE_TYPES = [sf.P, sf.Mesh, Layout, sf.NamedSharding, sf.Shard, sf.Replicate, sf.Partial]


@pytest.mark.parametrize("cls", VALUE_TYPES, ids=lambda c: c.__name__)
def test_value_types_pass_torch_2_11_opaque_check(cls: type) -> None:
    # torch 2.11's register_opaque_type rejects a class whose metaclass is not OpaqueBaseMeta,
    # value types included (2.13 only checks reference types)
    assert isinstance(cls, OpaqueBaseMeta)
    importlib.import_module("torch._dynamo")  # importing it registers them
    assert is_opaque_value_type(cls)


@pytest.mark.parametrize("cls", VALUE_TYPES, ids=lambda c: c.__name__)
def test_value_types_register_their_members_for_torch_2_11(cls: type) -> None:
    # torch 2.11's Dynamo reads only registered members of an opaque value (mesh.axis_names
    # inside a compiled function); 2.13 reads any, so nothing is registered there
    from torch._library.opaque_object import MemberType

    assert _compat.opaque_value_members(cls, "2.13.0") is None
    members = _compat.opaque_value_members(cls, "2.11.0+cu130")
    assert members is not None and set(members.values()) <= {MemberType.USE_REAL}
    assert not any(n.startswith("__") and n.endswith("__") for n in members)  # torch copies them onto a stand-in
    want = {sf.Mesh: {"axis_names", "shape", "device_type", "axis_size"}, sf.P: {"partial"},
            Layout: {"mesh", "dims", "partial", "spec_str"}}.get(cls, set())
    assert want <= set(members)


def test_symint_hint_reads_a_plain_int_and_a_symint() -> None:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(7, source=ConstantSource("n")), hint=7)
    assert isinstance(n, torch.SymInt)
    assert _compat.symint_hint(n) == 7 and _compat.symint_hint(5) == 5


def test_value_types_keep_plain_isinstance() -> None:
    mesh = sf.Mesh((2,), ("x",))
    p = sf.P("x")
    assert isinstance(p, sf.P) and isinstance(p, tuple) and not isinstance(("x",), sf.P)
    assert isinstance(mesh, sf.Mesh) and not isinstance(p, sf.Mesh)
    assert issubclass(sf.P, tuple) and not issubclass(tuple, sf.P)
    assert sf.P("x") == sf.P("x") and hash(sf.P("x")) == hash(sf.P("x"))


def test_funcol_names_of_both_versions() -> None:
    def gather(x, d, g):  # noqa: ANN001, ANN202
        return "gather"

    def scatter(x, op, d, g):  # noqa: ANN001, ANN202
        return "scatter"

    old = types.SimpleNamespace(all_gather_tensor=gather, reduce_scatter_tensor=scatter)  # torch 2.11
    assert _compat.funcol_gather_scatter(old) == (gather, scatter)
    new = types.SimpleNamespace(all_gather_single=gather, reduce_scatter_single=scatter,
                                all_gather_tensor=None, reduce_scatter_tensor=None)  # torch 2.13
    assert _compat.funcol_gather_scatter(new) == (gather, scatter)
    g, s = _compat.funcol_gather_scatter()
    assert callable(g) and callable(s)


def test_shardfn_calls_no_2_13_only_funcol_name_directly() -> None:
    # torch 2.11 lacks funcol.all_gather_single / reduce_scatter_single: go through values/torch_compat.py
    root = Path(sf.__file__).parent
    bad = [str(f.relative_to(root)) for f in root.rglob("*.py") if f.name != "torch_compat.py"
           and re.search(r"funcol\.(all_gather_single|reduce_scatter_single)", f.read_text())]
    assert bad == []
