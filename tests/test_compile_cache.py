"""torch.compile's on-disk caches with ShardedArrays in the graph's inputs: a second process
compiling the same function hits inductor's FX graph cache and AOTAutograd's cache, and the
key of an array is its metadata, never its values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import shardfn as sf
from shardfn import P

_PROG = """
import json, torch
import shardfn as sf
from shardfn import P
from torch._dynamo.utils import counters
mesh = sf.Mesh((2, 2), ("x", "y"))
x = sf.distribute(torch.linspace(-2, 2, 32).reshape(4, 8).cos(), P("x"), mesh=mesh)
w = sf.distribute(torch.linspace(-1, 1, 48).reshape(8, 6), P(None, "y"), mesh=mesh)
f = lambda x, w: x @ w
out = torch.compile(f, backend="inductor", fullgraph=True)(x, w)
print("RESULT", json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]),
      "err": (out.full_tensor() - f(x, w).full_tensor()).abs().max().item(), "spec": str(out.spec),
      "same_mesh": out.mesh is mesh}))
"""


def _compile_in_fresh_process(cache_dir: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _PROG], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT "):])


def test_second_process_hits_the_fx_graph_cache(tmp_path):
    first = _compile_in_fresh_process(tmp_path)
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1, first
    second = _compile_in_fresh_process(tmp_path)
    for run in (first, second):
        assert run["err"] == 0.0 and run["spec"] == "P('x', 'y')", run
        # the loaded program's outputs are on the caller's mesh object (an unpickled mesh is the live one)
        assert run["same_mesh"], run
        assert run["inductor"].get("fxgraph_cache_bypass", 0) == 0, run
        assert run["aot"].get("autograd_cache_bypass", 0) == 0, run
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["aot"].get("autograd_cache_hit", 0) >= 1, second


def test_cache_key_is_metadata_not_values():
    mesh = sf.Mesh((2, 2), ("x", "y"))
    a = sf.distribute(torch.arange(24.0).reshape(4, 6), P("x", "y"), mesh=mesh)
    b = sf.distribute(-torch.arange(24.0).reshape(4, 6), P("x", "y"), mesh=mesh)
    assert a._stable_hash_for_caching() == b._stable_hash_for_caching()  # values are not part of it
    others = [
        sf.distribute(torch.arange(24.0).reshape(4, 6), P("y", "x"), mesh=mesh),  # layout
        sf.distribute(torch.arange(24.0).reshape(6, 4).t(), P("x", "y"), mesh=mesh),  # global stride
        sf.distribute(torch.arange(24.0, dtype=torch.float64).reshape(4, 6), P("x", "y"), mesh=mesh),  # dtype
        sf.distribute(torch.arange(24.0).reshape(4, 6), P("x", "y"),
                      mesh=sf.Mesh((2, 2), ("x", "y"), device_type="meta")),  # the mesh's device type
        sf.distribute(torch.arange(24.0).reshape(4, 6), P("x", "y"), mesh=sf.Mesh((2, 2), ("y", "x"))),  # axis order
        sf.distribute(torch.arange(20.0).reshape(4, 5), P("x", "y"), mesh=mesh),  # shape (uneven: parts)
        a.detach().requires_grad_(),
    ]
    keys = {x._stable_hash_for_caching() for x in [a, *others]}
    assert len(keys) == 1 + len(others)


def test_cache_key_names_shardfns_source(monkeypatch):
    """AOTAutograd keys its cache on the Dynamo graph, where an op on arrays is one node: an
    entry made by another shardfn source (another decomposition of the same call) must miss."""
    from shardfn.arrays import checkpointable

    a = sf.distribute(torch.arange(24.0).reshape(4, 6), P("x", "y"), mesh=sf.Mesh((2, 2), ("x", "y")))
    key = a._stable_hash_for_caching()
    assert checkpointable.code_fingerprint() == checkpointable.code_fingerprint()  # read once, stable
    monkeypatch.setattr(checkpointable, "code_fingerprint", lambda: "another shardfn")
    assert a._stable_hash_for_caching() != key
