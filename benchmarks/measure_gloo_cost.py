"""Measure gloo's per-collective latency (alpha) and bandwidth (beta) on this machine,
for ``shardfn.plans.planner.COST_MODELS["gloo"]``.

4 gloo processes over loopback run all_reduce and all_gather of 1 B .. 16 MB (float32
elements, 1 B rounds up to one element); each point is the minimum over repeats (of the
slowest rank), so background load inflates it least. Sizes are converted to the bytes the
busiest device sends, as the planner counts them (ring: all_reduce 2(n-1)/n x size,
all_gather (n-1) x shard), and ``time = alpha + bytes / beta`` is fitted by least squares
over both collectives. Run ``python benchmarks/measure_gloo_cost.py``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
SIZES = [1 << k for k in range(0, 25, 2)]  # bytes: 1 B .. 16 MB
REPEATS = 15


def _time(fn) -> float:
    """Slowest rank's time of one call, minimum over repeats (after a warm-up)."""
    best = float("inf")
    for i in range(REPEATS + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 2:
            best = min(best, t.item())
    return best


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows = []
    for size in SIZES:
        n = max(1, size // 4)
        x = torch.ones(n)
        rows.append(("all_reduce", size, 2 * (WORLD - 1) * n * 4 // WORLD, _time(lambda x=x: dist.all_reduce(x))))
        shard = torch.ones(max(1, n // WORLD))
        out = [torch.empty_like(shard) for _ in range(WORLD)]
        gathered = _time(lambda out=out, shard=shard: dist.all_gather(out, shard))
        rows.append(("all_gather", size, (WORLD - 1) * shard.numel() * 4, gathered))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def fit(rows: list) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (bytes/s) of ``t = alpha + bytes / beta``."""
    xs = torch.tensor([float(b) for _, _, b, _ in rows], dtype=torch.float64)
    ts = torch.tensor([t for *_, t in rows], dtype=torch.float64)
    a = torch.stack([torch.ones_like(xs), xs], 1)
    # relative errors: weight each point by 1/t, so latency-bound points count as much
    w = 1 / ts
    sol = torch.linalg.lstsq(a * w[:, None], (ts * w)[:, None]).solution.flatten()
    return sol[0].item(), 1 / sol[1].item()


def main() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    print(f"{'collective':11} {'size':>10} {'bytes sent':>11} {'time (us)':>10}")
    for kind, size, sent, t in rows:
        print(f"{kind:11} {size:>10} {sent:>11} {t * 1e6:>10.1f}")
    alpha, beta = fit(rows)
    print(f"fit: alpha = {alpha * 1e6:.1f} us, beta = {beta / 1e9:.3f} GB/s  ({WORLD} gloo processes)")


if __name__ == "__main__":
    main()
