"""The differential fuzzer's thread mode: random programs in several Python threads at once.

Each program (from ``tools/fuzz.py``'s generator) runs inside its own thread-local contexts:
the mesh entered with ``with mesh:``, ``sf.random.seeded(key)`` driving torch's random ops on
ShardedArrays and ``sf.randn``, and for some programs ``sf.explicit()``. Run concurrently, each
must give exactly (bit for bit, errors by type) what it gives alone: a context one thread
enters must not reach another (seeds, explicit mode, entered meshes, shard_map bodies).

    python tools/fuzz.py --threads 4 --minutes 10     # prints cases run and failures
    python tools/fuzz.py --threads 4 --replay SEED    # one program alone, then in 4 threads
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import random
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import shardfn as sf
from shardfn import P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz  # noqa: E402  (the case generator; tools/ is not a package)


def _digest(v: Any, values: bool = True) -> str:
    """A result's dtype, shape and (``values``) bits."""
    if isinstance(v, sf.ShardedArray):
        v = v.full_tensor()
    if not isinstance(v, torch.Tensor):
        return repr(v)
    if not values:
        return f"{v.dtype}{tuple(v.shape)}"
    t = v.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t._is_zerotensor():  # torch.func's zero gradients hold no memory
        t = torch.zeros(t.shape, dtype=t.dtype)
    # fresh memory: contiguous() keeps an expanded size-1 value's 0 stride, which view(uint8) rejects
    # (seed 5791219228 --dist: the vjp cotangent of v[..., :1].sum() on a [1, 1] input)
    t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():  # one NaN: its sign bit is no result (a cold and a warm path may differ in it)
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    h = hashlib.sha1(f"{t.dtype}{tuple(v.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def program(seed: int) -> list[tuple[str, str]]:
    """The program of ``seed`` in its contexts: what each part gives (a digest or an error type)."""
    case = fuzz.case_for_seed(seed)
    mesh = sf.Mesh(case.mesh_shape, fuzz.NAMES[: len(case.mesh_shape)], backend="local")
    rnd = random.Random(seed)
    explicit = rnd.random() < 0.4
    out: list[tuple[str, str]] = []

    # a kernel torch itself does not run bit for bit alike twice (``fuzz.RUN_TO_RUN``: lstsq's gelsy,
    # seed 5768831894): its program is compared by dtype and shape (and errors) only
    exact = not any(st.name in fuzz.RUN_TO_RUN for st in case.steps)

    def part(what: str, fn: Any, values: bool = True) -> None:
        try:
            out.append((what, _digest(fn(), values)))
        except Exception as e:  # noqa: BLE001 - the error type is the result
            out.append((what, f"raised {type(e).__name__}"))

    with mesh, sf.random.seeded(sf.random.fold_in(sf.random.key(seed), 1)):
        X = fuzz.lay_out(case.x, case.spec, mesh, torch.Generator().manual_seed(7))
        part("sf.randn (entered mesh, seeded key)", lambda: sf.randn((5, 3), P(mesh.axis_names[0])))
        if X.dtype.is_floating_point:
            part("rand_like", lambda: torch.rand_like(X))
        under = " under sf.explicit()" if explicit else ""
        with sf.explicit() if explicit else contextlib.nullcontext():
            part("program" + under, lambda: fuzz._chain(case.steps, X, lambda a: a.sharded), exact)
            part("implicit reshard" + under, lambda: _implicit(mesh))
        part("dropout after", lambda: torch.nn.functional.dropout(sf.ones((4, 6), P(None, mesh.axis_names[-1])), 0.5))
    return out


def _implicit(mesh: sf.Mesh) -> Any:
    """An op that needs its input moved: raises under ``sf.explicit()``, runs outside it."""
    a = sf.distribute(torch.arange(24.0).reshape(4, 6), P(mesh.axis_names[0]), mesh=mesh)
    return a @ sf.distribute(torch.ones(6, 2), P(mesh.axis_names[0]), mesh=mesh)


def _differs(alone: list, threaded: list) -> str | None:
    if alone == threaded:
        return None
    lines = [f"  {w}: alone {a}, in threads {b}" for (w, a), (_, b) in zip(alone, threaded) if a != b]
    return "differs from its single-thread run:\n" + "\n".join(lines or [f"  {alone} != {threaded}"])


def run_batch(seeds: list[int], threads: int) -> dict[int, str | None]:
    """Each seed alone, then all of them spread over ``threads`` threads at once; what differs."""
    # alone, twice: the baseline is the warm run. Caches are shared by all threads by design, and a
    # program's first (cold) run may round differently from its later ones (another kernel order)
    alone = {s: program(s) for s in seeds}
    alone = {s: program(s) for s in seeds}
    work: queue.Queue = queue.Queue()
    for s in seeds:
        work.put(s)
    got: dict[int, Any] = {}
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        while True:
            try:
                s = work.get_nowait()
            except queue.Empty:
                return
            try:
                got[s] = program(s)
            except Exception as e:  # noqa: BLE001
                got[s] = [("harness", f"raised {type(e).__name__}: {e}")]

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    res = {s: _differs(alone[s], got[s]) for s in seeds}
    # torch's program not one value from run to run (an output its kernel leaves unwritten): no check
    return {s: None if r is not None and fuzz._oracle_unsettled(fuzz.case_for_seed(s)) else r for s, r in res.items()}


def main(a: Any) -> int:
    """``tools/fuzz.py --threads N`` (its parsed arguments ``a``)."""
    torch.set_num_threads(1)  # kernels split work by thread count: one intra-op thread keeps results exact
    warnings.simplefilter("ignore")  # catch_warnings is not thread-safe: no filters changed per program
    n = a.threads
    if a.replay is not None:
        print(fuzz.case_for_seed(a.replay).describe())
        res = run_batch([a.replay + i for i in range(n)], n)[a.replay]  # with its neighbours, as the long run
        print(res or "ok")
        return 1 if res else 0
    seed = a.seed if a.seed is not None else int(time.time()) % 10_000_000 * 1000
    end = time.time() + a.minutes * 60
    runs = fails = 0
    while time.time() < end and (a.cases is None or runs < a.cases):
        seeds = list(range(seed, seed + 3 * n))
        for s, res in run_batch(seeds, n).items():
            runs += 1
            if res:
                fails += 1
                if fails <= a.max_print:
                    print(f"FAIL seed {s}  (python tools/fuzz.py --threads {n} --replay {s})")
                    print(fuzz.case_for_seed(s).describe())
                    print("  " + res.replace("\n", "\n  "), flush=True)
        seed += len(seeds)
    print(f"cases run: {runs}, failures: {fails}")
    return 1 if fails else 0
