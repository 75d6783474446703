"""Reshard P('x','y') -> P('y','x') on a simulated (2, 4) mesh: shardfn vs DTensor.

DTensor runs the same redistribute under ``torch.distributed._local_tensor.LocalTensorMode``
(every rank simulated in this process, like shardfn's local backend). Prints absolute
median times and the speed-up; both results are checked against the input first.

Run: python benchmarks/bench_local.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _dtensor_ref as ref  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402

SHAPES = [(7, 5, 3), (1024, 1024)]


def time_shardfn(shape: tuple[int, ...], repeat: int) -> float:
    mesh = sf.Mesh((2, 4), ("x", "y"), backend="local")
    full = torch.randn(shape)
    x = sf.distribute(full, P("x", "y"), mesh=mesh)
    y = sf.reshard(x, P("y", "x"))
    assert torch.equal(y.full_tensor(), full), "shardfn reshard is wrong"
    with torch.no_grad():
        return ref.median_time(lambda: sf.reshard(x, P("y", "x")), repeat)


def main() -> None:
    torch.manual_seed(0)
    print(f"reshard P('x','y') -> P('y','x'), float32, simulated (2, 4) mesh, torch {torch.__version__}")
    print(f"{'shape':>14} {'shardfn':>12} {'DTensor':>12} {'speed-up':>9}")
    for shape in SHAPES:
        repeat = 200 if len(shape) == 3 else 30
        ours = time_shardfn(shape, repeat)
        full = torch.randn(shape)
        back = ref.dtensor_redistribute_full((2, 4), ("x", "y"), full, [Shard(0), Shard(1)], [Shard(1), Shard(0)])
        assert torch.equal(back, full), "DTensor redistribute is wrong"
        theirs = ref.time_dtensor_redistribute(
            (2, 4), ("x", "y"), shape, [Shard(0), Shard(1)], [Shard(1), Shard(0)], repeat=max(repeat // 4, 10)
        )
        print(f"{str(shape):>14} {ours * 1e6:>10.1f}us {theirs * 1e6:>10.1f}us {theirs / ours:>8.1f}x")


if __name__ == "__main__":
    main()
