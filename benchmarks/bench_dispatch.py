"""Per-op dispatch cost: shardfn vs DTensor (LocalTensorMode) vs plain torch.

Same ops, global inputs and shardings as ``_dtensor_ref._op_inputs`` (add, mul by a
scalar, addmm, sum on 8x8 float32; none needs communication), sharding caches warm.
Overhead = time per op minus plain torch's time for the same global op; the target is
shardfn's overhead <= DTensor's.

    python benchmarks/bench_dispatch.py [--repeat 300]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _dtensor_ref as ref  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402

MESHES = [((2, 2), ("x", "y")), ((4,), ("x",))]


def _specs(op_name: str, ndim: int) -> list[P]:
    """shardfn spelling of ``_op_inputs``' placements (axis 0 'x', axis 1 'y')."""
    y = "y" if ndim > 1 else None
    xy = P("x", y)
    return {
        "add": [xy, xy],
        "mul_scalar": [xy],
        "addmm": [P(y), P("x"), P(None, y)],
        "sum": [xy],
    }[op_name]


def _median(fn: Callable[[], Any], repeat: int) -> float:
    return ref.median_time(fn, repeat, warmup=10)


def time_shardfn_op(mesh: sf.Mesh, op_name: str, repeat: int) -> float:
    fn, globals_, _ = ref._op_inputs(mesh.ndim, op_name)
    args = [sf.distribute(g, s, mesh=mesh) for g, s in zip(globals_, _specs(op_name, mesh.ndim))]
    want = fn(*globals_)
    got = fn(*args).full_tensor()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return _median(lambda: fn(*args), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    repeat = parser.parse_args().repeat
    torch.set_num_threads(1)
    head = (f"{'mesh':8s} {'op':11s} {'torch us':>9s} {'shardfn us':>11s} {'DTensor us':>11s} "
            f"{'shardfn ovh':>12s} {'DTensor ovh':>12s} {'ovh ratio':>10s} {'x torch':>8s} {'DT x torch':>10s}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for shape, names in MESHES:
        mesh = sf.Mesh(shape, names, backend="local")
        for op in ref.OP_NAMES:
            t = ref.time_torch_op(op, repeat=repeat)
            ours = time_shardfn_op(mesh, op, repeat)
            dt = ref.time_dtensor_op(shape, names, op, repeat=repeat)
            ovh, dovh = ours - t, dt - t
            ratio = ovh / dovh if dovh > 0 else float("inf")
            worst = max(worst, ratio)
            print(f"{'x'.join(map(str, shape)):8s} {op:11s} {t * 1e6:9.1f} {ours * 1e6:11.1f} {dt * 1e6:11.1f} "
                  f"{ovh * 1e6:12.1f} {dovh * 1e6:12.1f} {ratio:10.2f} {ours / t:8.1f} {dt / t:10.1f}")
    print(f"\nworst overhead ratio shardfn/DTensor: {worst:.2f} (target <= 1.00)")


if __name__ == "__main__":
    main()
