"""Host work of bench_sim's compiled step, taken apart: a CPU proxy where host work dominates.

A tiny block (the quick size: dim 32, seq 8, batch 8) on one thread, loss under ``torch.compile``
(inductor), unsharded against each configuration. Per step, split into: Dynamo's guard check
(timed alone, on the same inputs), the compiled forward call (of which the inductor graph, the
arrays' rewrap ``__tensor_unflatten__``, and the rest: unwrap, runtime wrappers, autograd.Function),
the backward (graph, rewrap, shardfn dispatches such as the seed ``ones_like``, the rest), the
gradients' reshards, and the SGD update with the next step's ``detach().requires_grad_()``. Each time
is its fastest over the interleaved steps (wall; a second, hooked pass times the graph and rewrap
parts); ``calls`` counts Python and C function calls of one step (``sys.setprofile``), which
load does not change.

    python benchmarks/bench_compiled_host.py [--size quick|small] [--steps 150]

``--quick`` (or ``SHARDFN_BENCH_QUICK=1``): 8 steps.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim  # noqa: E402
import shardfn as sf  # noqa: E402
from shardfn.arrays import array as _array  # noqa: E402

PARTS = ("guard", "forward", "fwd graph", "fwd rewrap", "backward", "bwd graph", "bwd rewrap", "bwd dispatch",
         "reshards", "update")
_CLOCK: collections.Counter = collections.Counter()  # seconds per (part, hooked call), this step
_PART = [""]  # the part running now
_SHORT = {"forward": "fwd", "backward": "bwd"}


@contextlib.contextmanager
def _hooks() -> Iterator[None]:
    """Time the inductor graph calls, ``__tensor_unflatten__`` and shardfn's dispatch into ``_CLOCK``."""
    from torch._inductor.output_code import CompiledFxGraph

    graph_call, unflatten, dispatch = CompiledFxGraph.__call__, _array.ShardedArray.__tensor_unflatten__, _array._dispatch_fn

    def timed(fn: Callable, what: str) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _CLOCK[(_PART[0], what)] += time.perf_counter() - t
        return run

    CompiledFxGraph.__call__ = timed(graph_call, "graph")
    _array.ShardedArray.__tensor_unflatten__ = staticmethod(timed(unflatten, "rewrap"))
    _array._dispatch_fn = timed(dispatch, "dispatch")
    try:
        yield
    finally:
        CompiledFxGraph.__call__ = graph_call
        _array.ShardedArray.__tensor_unflatten__ = staticmethod(unflatten)
        _array._dispatch_fn = dispatch


def _guard_check(fn: Callable, args: dict) -> Callable[[], bool]:
    """The guard check of the compiled ``fn``'s cache entry that accepts ``args`` (the entries of the
    other run, sharing ``fn``'s code, are not counted)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    passing = [e.guard_manager.check for e in _debug_get_cache_entry_list(fn.__code__) if e.guard_manager.check(args)]
    if len(passing) != 1:
        raise AssertionError(f"{len(passing)} compiled entries of {fn.__name__} accept the step's inputs; one expected")
    check = passing[0]
    return lambda: check(args)


def _calls(fn: Callable[[Any], Any], arg: Any) -> tuple[Any, int]:
    """``fn(arg)`` and the Python and C function calls it made."""
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(prof)
    try:
        out = fn(arg)
    finally:
        sys.setprofile(None)
    return out, n


class _Run(bench_sim._Run):
    """A configuration's run, stepped part by part."""

    def parts(self, s: int, hooked: bool, count: bool) -> dict[str, float]:
        x, y = bench_sim.make_batch(self.cfg, s)
        if self.mesh is not None:
            x, y = sf.distribute(x, sf.P("dp"), mesh=self.mesh), sf.distribute(y, sf.P("dp"), mesh=self.mesh)
        heads = self.cfg["heads"]
        # the step's functions, in order; each returns its part's result
        steps: list[tuple[str, Callable[[Any], Any]]] = [
            ("update", lambda _: {k: v.detach().requires_grad_() for k, v in self.params.items()}),
            ("forward", lambda p: (p, self.loss_of(p, x, y, heads))),
            ("backward", lambda pl: (pl[0], pl[1], torch.autograd.grad(pl[1], list(pl[0].values())))),
            ("reshards", lambda plg: (plg[0], plg[1], bench_sim.sync_grads(plg[0], plg[2]))),
            ("update", lambda plg: (plg[1], {k: (p - bench_sim.LR * g).detach()
                                             for (k, p), g in zip(plg[0].items(), plg[2])})),
        ]
        out: dict[str, float] = collections.Counter()
        val: Any = None
        for name, fn in steps:
            if name == "forward" and not (hooked or count) and s >= 2:  # the guard alone, on this step's inputs (compiled)
                check = _guard_check(bench_sim.loss_fn, {"p": val, "x": x, "y": y, "heads": heads})
                t = time.perf_counter()
                check()
                out["guard"] = time.perf_counter() - t
            _PART[0] = name
            if count:
                val, n = _calls(fn, val)
                out[name] += n
                continue
            t = time.perf_counter()
            val = fn(val)
            out[name] += time.perf_counter() - t
        loss, self.params = val
        loss = loss.detach()
        self.losses.append(float(loss.full_tensor() if isinstance(loss, sf.ShardedArray) else loss))
        return out


def _interleaved(runs: dict, first: int, steps: int, hooked: bool, best: dict) -> None:
    """``steps`` steps of every run in turn from step ``first``, keeping each part's fastest time
    (steps 0 and 1 compile and fill caches: not kept); hooked: the graph, rewrap and dispatch times."""
    for s in range(first, first + steps):
        for c, run in runs.items():
            _CLOCK.clear()
            got = run.parts(s, hooked, count=False)
            if hooked:
                got = {f"{_SHORT[part]} {what}": v for (part, what), v in _CLOCK.items()
                       if part in ("forward", "backward") and (what != "dispatch" or part == "backward")}
            if s >= 2:
                for k, v in got.items():
                    best[c][k] = min(v, best[c].get(k, v))


def measure(cfg: dict, config: str, steps: int) -> dict:
    """Fastest time per part (seconds) and calls per part, for unsharded and ``config``."""
    torch._dynamo.reset()
    runs = {c: _Run(cfg, c, "cpu", torch.compile(bench_sim.loss_fn)) for c in (None, config)}
    best: dict = {c: dict.fromkeys(PARTS, float("inf")) for c in runs}
    _interleaved(runs, 0, steps + 2, False, best)
    with _hooks():
        _interleaved(runs, steps + 2, steps, True, best)
    for c in runs:
        best[c] = {k: 0.0 if v == float("inf") else v for k, v in best[c].items()}
    calls = {c: run.parts(2 * steps + 2, False, count=True) for c, run in runs.items()}
    for a, b in zip(runs[config].losses, runs[None].losses):
        if abs(a - b) > 1e-5 * abs(b):
            raise AssertionError(f"{config}: loss {a} differs from unsharded {b}")
    return {c: (best[c], calls[c]) for c in runs}


def report(cfg: dict, results: dict) -> str:
    lines = [f"compiled (inductor) step's host work by part, size {cfg}, 1 thread, torch {torch.__version__}; "
             f"us: fastest step; calls: Python+C calls of one step",
             f"{'configuration':16s}{'part':>14s}{'unsh. us':>10s}{'us':>9s}{'ratio':>9s}{'unsh. calls':>13s}"
             f"{'calls':>7s}{'ratio':>7s}"]
    for config, rows in results.items():
        (t0, n0), (t, n) = rows[None], rows[config]
        for part in PARTS:
            a, b = t0[part] * 1e6, t[part] * 1e6
            na, nb = n0.get(part), n.get(part)
            calls = f"{na:13d}{nb:7d}{nb / max(na, 1):6.2f}x" if na is not None else ""
            ratio = f"{b / a:8.2f}x" if a else f"{'-':>9s}"
            lines.append(f"{config:16s}{part:>14s}{a:10.1f}{b:9.1f}{ratio}{calls}")
        main = ("forward", "backward", "reshards", "update")
        a, b = sum(t0[p] for p in main) * 1e6, sum(t[p] for p in main) * 1e6
        na, nb = sum(n0[p] for p in main), sum(n[p] for p in main)
        lines.append(f"{config:16s}{'step':>14s}{a:10.1f}{b:9.1f}{b / a:8.2f}x{na:13d}{nb:7d}{nb / na:6.2f}x")
    lines.append("step = forward (its guard included) + backward + reshards + update; losses equal unsharded within 1e-5")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="quick", choices=("quick", "small"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", action="append", choices=list(bench_sim.CONFIGS),
                    help="a bench_sim configuration (repeatable; default: all three)")
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    cfg = bench_sim.QUICK if ns.size == "quick" else bench_sim.FULL
    steps = 8 if quick else ns.steps
    results = {}
    for config in ns.config or bench_sim.CONFIGS:
        results[config] = measure(cfg, config, steps)
    print(report(cfg, results))


if __name__ == "__main__":
    main()
