"""bench_sim's step with the loss under ``torch.compile``, taken apart: host time per part
(compiled forward call, backward, gradient reshards, SGD updates) and the bytes the compiled
forward saves for the backward, unsharded against each configuration.

    python benchmarks/bench_compiled_parts.py [--size quick|small] [--steps 12] [--backend inductor]

Each configuration compiles alone after ``torch._dynamo.reset()`` (with unsharded), as
gpu_check does; the runs are interleaved step by step and each part's time is its fastest
over the steps after the first. One thread (``torch.set_num_threads(1)``): on the CPU the
parts are host time plus small kernels. Losses must equal unsharded within 1e-5 relative.
``--quick`` (or ``SHARDFN_BENCH_QUICK=1``): the quick size, two steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim  # noqa: E402
import shardfn as sf  # noqa: E402

PARTS = ("forward", "backward", "reshards", "updates")


def _batch(run: Any, s: int) -> tuple:
    x, y = bench_sim.make_batch(run.cfg, s)
    if run.mesh is not None:
        x, y = sf.distribute(x, sf.P("dp"), mesh=run.mesh), sf.distribute(y, sf.P("dp"), mesh=run.mesh)
    return x, y


def timed_step(run: Any, s: int) -> list[float]:
    """One training step of ``run`` (bench_sim.train_step's parts), seconds per part."""
    x, y = _batch(run, s)
    params = {k: v.detach().requires_grad_() for k, v in run.params.items()}
    t = [time.perf_counter()]
    loss = run.loss_of(params, x, y, run.cfg["heads"])
    t.append(time.perf_counter())
    grads = torch.autograd.grad(loss, list(params.values()))
    t.append(time.perf_counter())
    grads = bench_sim.sync_grads(params, grads)
    t.append(time.perf_counter())
    run.params = {k: (p - bench_sim.LR * g).detach() for (k, p), g in zip(params.items(), grads)}
    t.append(time.perf_counter())
    run.losses.append(float(loss.detach().full_tensor() if isinstance(loss, sf.ShardedArray) else loss.detach()))
    return [b - a for a, b in zip(t, t[1:])]


def saved_bytes(run: Any) -> int:
    """Bytes of the distinct storages the compiled forward saves for the backward."""
    seen: set = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = getattr(t, "_local", t)
        for u in local if isinstance(local, tuple) else (local,):
            st = u.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return t

    x, y = _batch(run, 0)
    params = {k: v.detach().requires_grad_() for k, v in run.params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.loss_of(params, x, y, run.cfg["heads"])
    return total


def measure(cfg: dict, config: str, steps: int, backend: str) -> dict:
    torch._dynamo.reset()
    runs = {c: bench_sim._Run(cfg, c, "cpu", torch.compile(bench_sim.loss_fn, backend=backend)) for c in (None, config)}
    best: dict = {c: None for c in runs}
    for s in range(steps + 1):
        for c, run in runs.items():
            p = timed_step(run, s)
            if s:
                best[c] = p if best[c] is None else [min(a, b) for a, b in zip(best[c], p)]
    for a, b in zip(runs[config].losses, runs[None].losses):
        if abs(a - b) > 1e-5 * abs(b):
            raise AssertionError(f"{config}: loss {a} differs from unsharded {b}")
    return {c: (best[c], saved_bytes(run)) for c, run in runs.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("quick", "small"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    cfg = bench_sim.QUICK if quick or ns.size == "quick" else bench_sim.FULL
    steps = 2 if quick else ns.steps
    print(f"compiled ({ns.backend}) step by part, size {cfg}, 1 thread, fastest of {steps} steps, "
          f"torch {torch.__version__}")
    print(f"{'configuration':16s}" + "".join(f"{p + ' ms':>13s}" for p in PARTS) + f"{'total ms':>10s}{'ratio':>7s}"
          f"{'saved MiB':>11s}{'ratio':>7s}")
    for config in bench_sim.CONFIGS:
        rows = measure(cfg, config, steps, ns.backend)
        (t0, b0), (t, b) = rows[None], rows[config]
        for name, (tt, bb) in (("unsharded", (t0, b0)), (config, (t, b))):
            print(f"{name:16s}" + "".join(f"{v * 1e3:13.2f}" for v in tt) + f"{sum(tt) * 1e3:10.2f}"
                  f"{sum(tt) / sum(t0):6.2f}x{bb / 2 ** 20:11.2f}{bb / b0:6.2f}x")
    print("losses equal unsharded within 1e-5 relative in every configuration")


if __name__ == "__main__":
    main()
