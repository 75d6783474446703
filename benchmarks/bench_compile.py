"""Step time of examples/train_tp.py: sharded eager vs sharded compiled vs unsharded.

Run: python benchmarks/bench_compile.py [--backends aot_eager,inductor] [--steps 20]

Each configuration trains the same model on the same batches; the first steps (which
include compilation) are reported separately from the steady-state median step time.
The sharded runs simulate every device of a local (dp, tp) mesh in this process, so
they do mesh-size times the work of one device plus the resharding: the ratios measure
shardfn's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import shardfn as sf  # noqa: E402
import train_tp  # noqa: E402

WARMUP = 3


def run(name: str, mesh: sf.Mesh | None, backend: str | None, steps: int) -> dict:
    torch._dynamo.reset()
    times: list[float] = []
    t0 = time.perf_counter()
    losses = train_tp.train(WARMUP + steps, mesh, backend, timings=times)
    total = time.perf_counter() - t0
    return {"name": name, "warmup": sum(times[:WARMUP]), "step": statistics.median(times[WARMUP:]),
            "total": total, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mesh", default="2,2")
    args = ap.parse_args()
    torch.manual_seed(0)
    mesh = sf.Mesh(tuple(int(n) for n in args.mesh.split(",")), ("dp", "tp"), backend="local")
    backends = [b for b in args.backends.split(",") if b]

    rows = [run("unsharded eager", None, None, args.steps)]
    for b in backends:
        rows.append(run(f"unsharded {b}", None, b, args.steps))
    rows.append(run("sharded eager", mesh, None, args.steps))
    for b in backends:
        rows.append(run(f"sharded {b}", mesh, b, args.steps))

    base = rows[0]
    by_name = {r["name"]: r for r in rows}
    print(f"train_tp step ({args.steps} timed steps after {WARMUP} warm-up; mesh {mesh}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'configuration':<24}{'median step':>14}{'warm-up':>11}{'vs unsharded eager':>21}"
          f"{'max rel loss diff':>19}")
    for r in rows:
        rel = train_tp.max_rel_diff(r["losses"], base["losses"])
        print(f"{r['name']:<24}{r['step'] * 1e3:>11.2f} ms{r['warmup']:>10.1f}s"
              f"{r['step'] / base['step']:>20.2f}x{rel:>19.1e}")
    eager = by_name["sharded eager"]
    for b in backends:
        c = by_name[f"sharded {b}"]
        print(f"sharded eager / sharded {b}: {eager['step'] / c['step']:.2f}x "
              f"(compiled step is {c['step'] / by_name[f'unsharded {b}']['step']:.2f}x the unsharded {b} step)")


if __name__ == "__main__":
    main()
