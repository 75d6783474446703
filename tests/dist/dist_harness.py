"""Run one scenario body on the local backend and on dist with 4 gloo processes.

A test module registers scenario functions ``fn(mesh)`` with :func:`scenario` and ends
with ``test_local, test_dist = collect(globals())``. ``test_local`` runs each scenario
in-process on ``backend="local"``; ``test_dist`` spawns one world of 4 gloo processes per
module (on 127.0.0.1), which runs every scenario on every mesh and reports per-scenario
results back, so process start-up is paid once per module.

Helpers here let one body serve both backends: :func:`shards_for` builds what
``from_local`` takes, :func:`held` lists the devices this process holds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardfn as sf
from shardfn.values.layout import device_box
from shardfn.values.spec import to_layout

WORLD = 4
MESHES = {"4": ((4,), ("x",)), "2x2": ((2, 2), ("x", "y"))}
WORLD_TIMEOUT = 170.0  # seconds for a whole module's world
COLLECTIVE_TIMEOUT = "30"  # SHARDFN_DIST_TIMEOUT inside the workers

_REGISTRY: dict[str, list[Scenario]] = {}


class Scenario:
    """A registered body ``fn(mesh)``, the meshes and the backends it runs on."""

    def __init__(self, fn: Callable, meshes: tuple[str, ...], backends: tuple[str, ...]) -> None:
        self.fn, self.meshes, self.backends = fn, meshes, backends
        self.name = fn.__name__


def scenario(fn: Callable | None = None, *, meshes: tuple[str, ...] = ("4", "2x2"),
             backends: tuple[str, ...] = ("local", "dist")) -> Any:
    """Register ``fn(mesh)`` as a scenario of its module (decorator, with or without args)."""

    def deco(f: Callable) -> Callable:
        _REGISTRY.setdefault(f.__module__, []).append(Scenario(f, meshes, backends))
        return f

    return deco(fn) if fn is not None else deco


def scenarios_of(module_name: str) -> list[Scenario]:
    return _REGISTRY.get(module_name, [])


def make_mesh(name: str, backend: str) -> sf.Mesh:
    shape, names = MESHES[name]
    return sf.Mesh(shape, names, backend=backend)


# -- helpers for scenario bodies ------------------------------------------------------------------


def is_dist(mesh: sf.Mesh) -> bool:
    return mesh.backend == "dist"


def held(mesh: sf.Mesh) -> list[int]:
    """The devices whose shards this process holds (all on local, this rank on dist)."""
    return [torch.distributed.get_rank()] if is_dist(mesh) else list(range(mesh.size))


def box_slices(sharding: Any, mesh: sf.Mesh, shape: tuple[int, ...], device: int) -> tuple[slice, ...]:
    layout = to_layout(sharding, len(shape), mesh)
    return tuple(slice(lo, hi) for lo, hi in device_box(layout, tuple(shape), device))


def shards_for(full_or_parts: Any, sharding: Any, mesh: sf.Mesh) -> Any:
    """What ``from_local`` takes for the value whose device ``i`` shard is cut from
    ``full_or_parts`` (a tensor, or a list of per-device tensors for Partial values)."""
    def shard(dev: int) -> torch.Tensor:
        src = full_or_parts[dev] if isinstance(full_or_parts, list) else full_or_parts
        return src[box_slices(sharding, mesh, tuple(src.shape), dev)].clone()

    if is_dist(mesh):
        return shard(torch.distributed.get_rank())
    return [shard(d) for d in range(mesh.size)]


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Exact (bitwise) equality with a readable failure."""
    assert isinstance(got, torch.Tensor) and not isinstance(got, sf.ShardedArray), f"{what}: {type(got)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        raise AssertionError(f"{what}: values differ (max abs diff {diff})")


def assert_shards(x: sf.ShardedArray, full: torch.Tensor, what: str = "") -> None:
    """Every shard this process holds is the layout's box of ``full`` (no Partial)."""
    for dev, s in zip(held(x.mesh), x.local_shards()):
        assert_equal(s, full[box_slices(x.sharding, x.mesh, tuple(full.shape), dev)], f"{what} shard {dev}")


def local_twin(mesh: sf.Mesh) -> sf.Mesh:
    """The same mesh on the local backend (to compare dist results with, in-process)."""
    return sf.Mesh(mesh.shape, mesh.axis_names, backend="local")


# -- running ------------------------------------------------------------------------------------------


def run_one(sc: Scenario, mesh_name: str, backend: str) -> None:
    torch.manual_seed(0)
    sc.fn(make_mesh(mesh_name, backend))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_worlds: dict[str, dict] = {}


def _context() -> Any:
    """A forkserver that has imported torch and shardfn once per test session, so each
    world starts in well under a second."""
    import multiprocessing as mp

    # MKL picks gemm kernels by problem size and alignment; its compatible mode makes a
    # row block of a matmul equal the matching rows of the whole product, so dist (one
    # block per rank) and the local backend (one batched call) agree bit for bit.
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "pytest", "shardfn", "dist_harness"])
    return ctx


def _spawn_world(module_file: str) -> dict:
    """Run every dist scenario of the module in one world; {(name, mesh): error or None}."""
    out = tempfile.mkdtemp(prefix="shardfn-dist-")
    started = time.monotonic()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD),
           "SHARDFN_DIST_TIMEOUT": COLLECTIVE_TIMEOUT}
    ctx = _context()
    procs = [ctx.Process(target=_worker_main, args=(module_file, out, {**env, "RANK": str(r)})) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORLD_TIMEOUT
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if os.environ.get("SHARDFN_DIST_TIMES"):
        with open(os.path.join(out, "rank0.log")) as f:
            print(f"\n{module_file}: world took {time.monotonic() - started:.1f}s\n{f.read()}", file=sys.stderr)
    results: dict = {}
    for r in range(WORLD):
        path = os.path.join(out, f"rank{r}.json")
        ranked = {}
        if os.path.exists(path):
            with open(path) as f:
                ranked = json.load(f)
        for key, err in ranked.items():
            if err == _CRASHED:
                with open(os.path.join(out, f"rank{r}.log")) as f:
                    err = f"{err} (exit code {procs[r].exitcode}); its output:\n{f.read()[-4000:]}"
            if err is not None and results.get(key) is None:
                results[key] = f"rank {r}: {err}"
            else:
                results.setdefault(key, err)
    if results and all(err is None for err in results.values()):
        shutil.rmtree(out, ignore_errors=True)  # logs are kept when something failed
    return results


def _worker_main(module_file: str, out_dir: str, env: dict) -> None:
    """Entry of a forked rank: environment, one intra-op thread, output to a log file."""
    os.environ.update(env)
    torch.set_num_threads(1)
    log = os.open(os.path.join(out_dir, f"rank{env['RANK']}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    run_world(module_file, out_dir)


def dist_result(module_file: str, name: str, mesh_name: str) -> str | None:
    if module_file not in _worlds:
        _worlds[module_file] = _spawn_world(module_file)
    return _worlds[module_file].get(f"{name}/{mesh_name}", "not run: a rank died in an earlier scenario")


def run_world(module_file: str, out_dir: str) -> None:
    """Worker side: init gloo, run every dist scenario, write this rank's results."""
    import importlib.util
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("error", sf.FallbackWarning)
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    spec = importlib.util.spec_from_file_location("dist_scenarios", module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dist_scenarios"] = module
    spec.loader.exec_module(module)
    if os.environ.get("SHARDFN_DIST_TIMES") and rank == 0:
        print(f"init + import: {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    results: dict[str, str | None] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    broken = None
    for sc in scenarios_of("dist_scenarios"):
        if "dist" not in sc.backends:
            continue
        for m in sc.meshes:
            key = f"{sc.name}/{m}"
            if broken is not None:
                results[key] = f"not run: the world broke in {broken}"
                continue
            results[key] = _CRASHED
            _dump(results, path)  # a crash leaves this scenario marked
            try:
                t0 = time.perf_counter()
                run_one(sc, m, "dist")
                results[key] = None
                if os.environ.get("SHARDFN_DIST_TIMES") and rank == 0:
                    print(f"{key}: {time.perf_counter() - t0:.2f}s", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - reported to the parent test
                results[key] = "".join(traceback.format_exception(e))
                if isinstance(e, sf.backends.dist.CollectiveError):
                    broken = key
    _dump(results, path)
    if broken is None:
        dist.barrier()
        dist.destroy_process_group()


_CRASHED = "the process died while running this scenario"


def _dump(results: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def collect(namespace: dict) -> tuple[Callable, Callable]:
    """The two test functions of a scenario module (local and dist)."""
    module_name, module_file = namespace["__name__"], namespace["__file__"]
    scs = {sc.name: sc for sc in scenarios_of(module_name)}
    local = [pytest.param(n, m, id=f"{n}-{m}") for n, sc in scs.items() if "local" in sc.backends for m in sc.meshes]
    dist_ = [pytest.param(n, m, id=f"{n}-{m}") for n, sc in scs.items() if "dist" in sc.backends for m in sc.meshes]

    @pytest.mark.parametrize("name,mesh_name", local)
    def test_local(name: str, mesh_name: str) -> None:
        run_one(scs[name], mesh_name, "local")

    @pytest.mark.parametrize("name,mesh_name", dist_)
    def test_dist(name: str, mesh_name: str) -> None:
        err = dist_result(module_file, name, mesh_name)
        if err is not None:
            pytest.fail(f"dist scenario {name} on mesh {mesh_name} failed:\n{err}", pytrace=False)

    return test_local, test_dist


# -- sources ---------------------------------------------------------------------------------------


def reduce_mesh(per_device: torch.Tensor, mesh: sf.Mesh, partial: dict) -> torch.Tensor:
    """The global value of stacked per-device parts ``(*mesh.shape, *shape)``."""
    t = per_device
    for i, a in enumerate(mesh.axis_names):
        op = partial.get(a)
        if op is None:
            t = t.narrow(i, 0, 1)
        elif op == "sum":
            t = t.sum(i, keepdim=True)
        elif op == "avg" and (t.is_floating_point() or t.is_complex()):
            t = t.mean(i, keepdim=True)
        elif op == "avg":
            t = torch.div(t.sum(i, keepdim=True), t.shape[i], rounding_mode="floor")
        elif op == "max":
            t = t.amax(i, keepdim=True)
        else:
            t = t.amin(i, keepdim=True)
    return t.reshape(per_device.shape[mesh.ndim:])


def source(spec: Any, mesh: sf.Mesh, shape: tuple[int, ...], *, dtype: torch.dtype = torch.float64,
           integral: bool = True, requires_grad: bool = False) -> tuple[sf.ShardedArray, torch.Tensor, Any]:
    """A ShardedArray with sharding ``spec`` built with from_local (per-device parts for
    Partial specs), its expected global value, and the local tensors passed in.
    ``integral`` values make every reduction exact in any order."""
    layout = to_layout(spec, len(shape), mesh)
    keep = [a in layout.partial_ops for a in mesh.axis_names]
    base_shape = [n if k else 1 for n, k in zip(mesh.shape, keep)] + list(shape)
    base = torch.randint(-8, 8, base_shape).to(dtype) if integral else torch.randn(base_shape, dtype=dtype)
    base = base.expand(*mesh.shape, *shape)
    parts = [base[mesh.coords(d)] for d in range(mesh.size)]
    local = shards_for(parts, spec, mesh)
    if requires_grad:
        local = local.requires_grad_() if isinstance(local, torch.Tensor) else [t.requires_grad_() for t in local]
    x = sf.ShardedArray.from_local(local, spec, mesh=mesh, shape=shape)
    return x, reduce_mesh(base, mesh, layout.partial_ops), local


def _gathered(out: Any) -> list[torch.Tensor]:
    import optree

    leaves = optree.tree_leaves(out)
    return [t.full_tensor() if isinstance(t, sf.ShardedArray) else t for t in leaves]


def check_against_twin_and_torch(fn: Callable, mesh: sf.Mesh, inputs: list[tuple[torch.Tensor, Any]],
                                 *, grad: bool = False, exact: bool = True, rtol: float = 1e-5,
                                 atol: float = 1e-6, what: str = "") -> None:
    """``fn`` on ShardedArrays (inputs distributed per spec) equals the same call on the
    local twin mesh (bit for bit if ``exact``, with the dist backend's ordered reductions)
    and is close to ``fn`` on the plain tensors. With ``grad``, the gradients of the summed outputs w.r.t. the inputs are
    checked too. (The local backend runs one batched op for the whole mesh, and BLAS and
    reduction kernels may round a batch differently from its pieces; collectives are
    exact either way.)"""
    from shardfn.backends.dist import reductions

    results = []
    for m in (mesh, local_twin(mesh), None):
        leaves = [t.detach().clone().requires_grad_(grad) for t, _ in inputs]
        args = [t if m is None else sf.distribute(t, spec, mesh=m) for t, (_, spec) in zip(leaves, inputs)]
        with reductions("ordered" if exact else "auto"):
            outs = _gathered(fn(*args))
            if grad:
                sum(o.sum() for o in outs if o.is_floating_point()).backward()
        results.append((outs, [t.grad for t in leaves] if grad else []))
    (got, g_got), (twin, g_twin), (ref, g_ref) = results
    for i, (a, b, c) in enumerate(zip(got + g_got, twin + g_twin, ref + g_ref)):
        if exact:
            assert_equal(a, b, f"{what} output/grad {i} vs local backend")
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"{what} {i} vs local: {m}")
        torch.testing.assert_close(a, c, rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what} output/grad {i} vs torch: {m}")
