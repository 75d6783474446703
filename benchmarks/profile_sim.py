"""Where a simulated training step's device time goes: ``bench_sim``'s step under torch.profiler.

For the unsharded step and each configuration (eager, and with ``--compiled`` under inductor),
a few warm steps are profiled and the kernels' device time per step is summed by the aten op
that launched them (the top ones printed, and the difference to unsharded), so that the part of
a ratio above 1 can be named. Run on a CUDA machine; ``--device cpu`` profiles host time instead.

    python benchmarks/profile_sim.py [--size gpu|small|quick] [--device cuda|cpu] [--compiled] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim  # noqa: E402

SIZES = {
    "gpu": {"dim": 1024, "heads": 16, "hidden": 4096, "seq": 256, "batch": 32},
    "small": dict(bench_sim.FULL),
    "quick": dict(bench_sim.QUICK),
}


def op_times(run: "bench_sim._Run", steps: int, device: str) -> tuple[dict[str, float], dict[str, int], float]:
    """Per-step device (or CPU) microseconds by op name, calls per step, and the step's total."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for s in range(2):
        run.step(s)
    with profile(activities=acts) as prof:
        for s in range(steps):
            run.step(2 + s)
    times: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue
        t = ev.self_device_time_total if device == "cuda" else ev.self_cpu_time_total
        if t:
            times[ev.key] += t / steps
            calls[ev.key] += ev.count // steps
    return times, calls, sum(times.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compiled", action="store_true", help="profile the steps under torch.compile (inductor)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ns = ap.parse_args(argv)
    cfg = SIZES[ns.size]
    results = {}
    for config in (None, *bench_sim.CONFIGS):
        loss_of = torch.compile(bench_sim.loss_fn) if ns.compiled else None
        run = bench_sim._Run(cfg, config, ns.device, loss_of)
        results[config or "unsharded"] = op_times(run, ns.steps, ns.device)
    unit = "device" if ns.device == "cuda" else "CPU self"
    base, base_calls, base_total = results["unsharded"]
    print(f"{unit} time per step by aten op, size {ns.size} {cfg}, {'compiled' if ns.compiled else 'eager'}")
    print(f"unsharded: {base_total / 1e3:.2f} ms")
    for name, (times, calls, total) in results.items():
        if name == "unsharded":
            continue
        print(f"\n== {name}: {total / 1e3:.2f} ms ({total / base_total:.2f}x unsharded)")
        print(f"  {'op':44s} {'us':>8s} {'calls':>6s}   {'unsh. us':>8s} {'calls':>6s}   {'extra us':>8s}")
        keys = sorted(set(times) | set(base), key=lambda k: -abs(times.get(k, 0) - base.get(k, 0)))
        for k in keys[:ns.top]:
            print(f"  {k[:44]:44s} {times.get(k, 0):8.0f} {calls.get(k, 0):6d}   {base.get(k, 0):8.0f} "
                  f"{base_calls.get(k, 0):6d}   {times.get(k, 0) - base.get(k, 0):+8.0f}")


if __name__ == "__main__":
    main()
