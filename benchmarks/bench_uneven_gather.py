"""Gather an even and an uneven array to replicated on many simulated devices (issue 25's cliff).

A float32 value of about 8 MB sharded over both axes of a (16, 16) mesh (256 devices) is
gathered with ``full_tensor()``; the uneven one has 3 more rows (shards of 8 and 9 rows).
Prints, for each, the bytes of the new buffers the gather allocates (each distinct storage
once, counted with a dispatch mode) as a multiple of the value's size, the first call
(which includes planning, cached afterwards) and the median of later calls. The uneven
gather should hold one copy per distinct value, as the even one does (issue 25: within 1.1x).

Run: python benchmarks/bench_uneven_gather.py   (SHARDFN_BENCH_QUICK=1: a (4, 4) mesh)
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardfn as sf
from shardfn import P


class NewStorage(TorchDispatchMode):
    """Bytes of each distinct storage a non-view op returns that ``known`` does not hold
    (kept alive, so a freed address is never counted twice)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.kept: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in self.seen:
                    self.seen.add(t.untyped_storage().data_ptr())
                    self.kept.append(t.untyped_storage())
        return out

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.kept)


def measure(mesh: sf.Mesh, rows: int, cols: int, repeat: int) -> tuple[float, float, float]:
    full = torch.randn(rows, cols)
    x = sf.distribute(full, P(mesh.axis_names), mesh=mesh)
    local = list(x._local) if isinstance(x._local, tuple) else [x._local]
    t0 = time.perf_counter()
    with NewStorage(local) as rec:
        out = x.full_tensor()
    first = time.perf_counter() - t0
    assert torch.equal(out, full), "the gather is wrong"
    del out
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.full_tensor()
        times.append(time.perf_counter() - t0)
    return rec.nbytes / full.nbytes, first, statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    quick = os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    shape, cols, repeat = ((4, 4), 256, 3) if quick else ((16, 16), 1024, 5)
    mesh = sf.Mesh(shape, ("a", "b"), backend="local")
    rows = 8 * mesh.size
    print(f"full_tensor of f32[rows, {cols}] P(('a', 'b')) on a simulated {shape} mesh ({mesh.size} devices), "
          f"torch {torch.__version__}")
    print(f"{'case':>7} {'rows':>6} {'MB':>6} {'allocated':>10} {'first':>9} {'median':>9}")
    figures = {}
    for case, n in (("even", rows), ("uneven", rows + 3)):
        copies, first, median = measure(mesh, n, cols, repeat)
        figures[case] = copies
        print(f"{case:>7} {n:>6} {n * cols * 4 / 1e6:>6.1f} {copies:>9.2f}x {first:>8.3f}s {median * 1e3:>7.1f}ms")
    print(f"uneven / even allocated: {figures['uneven'] / figures['even']:.2f}x")


if __name__ == "__main__":
    main()
