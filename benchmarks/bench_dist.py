"""Reshard on the dist backend vs torch's functional collectives and DTensor.

4 gloo processes on 127.0.0.1, a float32 (4096, 1024) value on Mesh((4,), ('x',)), for
S0->S1, S0->R, P->S0 and P->R; and the data-parallel gradient sync of 20 and 200
parameters of mixed shapes (each a pending sum over 'x' -> replicated): one pytree
``sf.reshard`` call (coalesced, bucketed) vs one reshard per leaf vs a hand-bucketed
flat-buffer all_reduce (what DDP does). The arrays of the sync and P-> rows are built
outside the timed region, as the other variants' tensors are ("from_local only" shows
what building them costs: on dist from_local copies the local and, with its default
run_check, checks shapes across ranks with one small all_gather); the last lines print
shardfn / hand and per-leaf / shardfn. Compared with:

  (a)  the functional collectives shardfn's plan issues in the default reduction mode,
       called directly (same calls: what shardfn costs over hand-written code);
  (a') another hand-written variant: gloo's reduce_scatter for P->S0 (shardfn's default
       on CPU is an all_to_all plus a local sum, which is also faster), and for P->R the
       all_to_all + sum + all_gather of the "ordered" mode (bit-identical to the local
       backend), shown next to shardfn in that mode;
  (b)  DTensor's redistribute of the same value.

Every variant's result is waited on inside the timed region. Times are the median and
the minimum over rounds of the slowest rank's time (on a shared machine the minimum is
the steadier figure), and "cpu", the busiest rank's median main-thread CPU time per
call (what a variant costs each rank, without the waiting; 4 ranks on a 2-core machine
turn each rank's CPU into more wall time). Run ``python benchmarks/bench_dist.py`` (spawns 4
processes) or under ``torchrun --nproc-per-node 4 benchmarks/bench_dist.py``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

WORLD = 4
SHAPE = (4096, 1024)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t)


def _cases(mesh, pg, dm) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import shardfn as sf
    from shardfn import P
    from shardfn.backends import dist as backend

    g = WORLD
    torch.manual_seed(dist.get_rank())
    part = torch.randn(SHAPE)  # this rank's term of a pending sum
    shard = part[: SHAPE[0] // g].clone()  # this rank's rows
    x_s0 = sf.ShardedArray.from_local(shard, P("x"), mesh=mesh)

    def x_p():  # a fresh array each call: a pending sum is reduced once per array and target
        return sf.ShardedArray.from_local(part, P(partial="x"), mesh=mesh)

    # the P-> rows build their array outside the timed region (setup, run), as the
    # functional collectives' input exists beforehand: from_local copies the 16 MB local
    # (arrays are immutable) and checks shapes across ranks (one small all_gather); the
    # "from_local only" row shows that cost
    def to(spec):
        return lambda x: sf.reshard(x, spec)._local

    dt_s0 = DTensor.from_local(shard, dm, [Shard(0)], run_check=False)
    dt_p = DTensor.from_local(part, dm, [Partial()], run_check=False)

    def dtensor(dt, placement):
        def run():
            out = dt.redistribute(dm, [placement]).to_local()
            return _wait(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out
        return run

    def a2a_s0_s1():
        rows, cols = shard.shape
        send = shard.view(rows, g, cols // g).transpose(0, 1).contiguous().view(-1)  # one copy
        return _wait(funcol.all_to_all_single(send, None, None, pg)).view(SHAPE[0], SHAPE[1] // g)

    def ordered_scatter():  # all_to_all, then the sum in rank order
        pieces = _wait(funcol.all_to_all_single(part.view(-1), None, None, pg))
        return pieces.view(g, SHAPE[0] // g, SHAPE[1]).sum(0)

    def ordered_all_reduce():
        mine = _wait(funcol.all_to_all_single(part.view(-1), None, None, pg)).view(g, -1).sum(0)
        return _wait(funcol.all_gather_single(mine, 0, pg)).view(SHAPE)

    def mode(name, fn):
        def run(x):
            with backend.reductions(name):
                return fn(x)
        return x_p, run

    return {
        **_sync_cases(mesh, pg),
        "S0->S1": {
            "shardfn": lambda: sf.reshard(x_s0, P(None, "x"))._local,
            "(a) same funcol": a2a_s0_s1,
            "(b) DTensor": dtensor(dt_s0, Shard(1)),
        },
        "S0->R": {
            "shardfn": lambda: sf.reshard(x_s0, P())._local,
            "(a) same funcol": lambda: _wait(funcol.all_gather_single(shard, 0, pg)),
            "(b) DTensor": dtensor(dt_s0, Replicate()),
        },
        "P->S0": {
            "shardfn": (x_p, to(P("x"))),
            "(a) same funcol": ordered_scatter,
            "(a') reduce_scatter": lambda: _wait(funcol.reduce_scatter_single(part, "sum", 0, pg)),
            "shardfn native": mode("native", to(P("x"))),
            "(b) DTensor": dtensor(dt_p, Shard(0)),
            "from_local only": lambda: x_p()._local,
        },
        "P->R": {
            "shardfn": (x_p, to(P())),
            "(a) same funcol": lambda: _wait(funcol.all_reduce(part, "sum", pg)),
            "shardfn ordered": mode("ordered", to(P())),
            "(a') ordered funcol": ordered_all_reduce,
            "(b) DTensor": dtensor(dt_p, Replicate()),
            "from_local only": lambda: x_p()._local,
        },
    }


_SYNC_SHAPES = [(128, 128), (128,), (512, 64), (64,), (32, 32, 4), (1,), (96, 80), (7, 3)]


def _sync_cases(mesh, pg) -> dict[str, dict[str, Callable]]:
    """Gradient sync of 20 and 200 parameters: every variant returns the synced locals."""
    import shardfn as sf
    from shardfn import P
    from shardfn.transforms.coalesce import BUCKET_BYTES

    cases = {}
    for n in (20, 200):
        parts = [torch.randn(_SYNC_SHAPES[i % len(_SYNC_SHAPES)]) for i in range(n)]

        def fresh(parts=parts):  # new arrays each call: reduced forms are cached per array
            # run_check=False: gradients come out of backward already consistent, so the
            # cross-rank metadata all_gather a user-facing from_local does is not part of a sync
            return {f"p{i}": sf.ShardedArray.from_local(t, P(partial="x"), mesh=mesh, run_check=False)
                    for i, t in enumerate(parts)}

        # the arrays are built outside the timed region; the hand version gets their
        # local tensors, built the same way (same buffers, same setup work before the
        # timed call): a variant is (setup, run), only run timed
        def one_call(tree):
            return [v._local for v in sf.reshard(tree, P()).values()]

        def per_leaf(tree):
            return [sf.reshard(v, P())._local for v in tree.values()]

        def copies(fresh=fresh):  # the hand version's input: the same buffers, set up the same way
            return [v._local for v in fresh().values()]

        def hand_bucketed(parts):
            out, bucket, size = [], [], 0
            for t in parts + [None]:
                if t is None or (bucket and size + t.numel() * 4 > BUCKET_BYTES):
                    flat = _wait(funcol.all_reduce(torch.cat([b.reshape(-1) for b in bucket]), "sum", pg))
                    out += [c.view(b.shape) for c, b in zip(flat.split([b.numel() for b in bucket]), bucket)]
                    bucket, size = [], 0
                if t is not None:
                    bucket.append(t)
                    size += t.numel() * 4
            return out

        def build_only(fresh=fresh):  # what building the arrays costs (not in the sync rows)
            return [v._local for v in fresh().values()]

        cases[f"sync {n}"] = {"shardfn": (fresh, one_call), "per-leaf reshard": (fresh, per_leaf),
                              "(a) flat all_reduce": (copies, hand_bucketed), "from_local only": build_only}
    return cases


def _call(fn) -> Any:
    """Run a variant: a callable, or (setup, run) with setup untimed."""
    if isinstance(fn, tuple):
        return fn[1](fn[0]())
    return fn()


def _time(fns: dict[str, Callable], rounds: int, warmup: int) -> dict[str, tuple[float, float, float]]:
    """(median, min) over rounds of the slowest rank's time, and the median over rounds of
    the busiest rank's main-thread CPU time (steadier than wall time when 4 ranks share
    fewer cores: it leaves out waiting, but counts what each rank's Python and copies
    cost); variants interleaved per round; a (setup, run) variant times run only."""
    for fn in fns.values():
        for _ in range(warmup):
            _call(fn)
    samples = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:  # rotate: no position bias
            fn = fns[k]
            arg = fn[0]() if isinstance(fn, tuple) else None
            dist.barrier()
            c, t = time.thread_time(), time.perf_counter()
            fn[1](arg) if isinstance(fn, tuple) else fn()
            samples[k].append(time.perf_counter() - t)
            cpu[k].append(time.thread_time() - c)
    out = {}
    for k, ts in samples.items():
        worst = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(worst, dist.ReduceOp.MAX)
        busy = torch.tensor([statistics.median(cpu[k])], dtype=torch.float64)
        dist.all_reduce(busy, dist.ReduceOp.MAX)
        out[k] = (statistics.median(worst.tolist()), min(worst.tolist()), busy.item())
    return out


def _check(cases: dict) -> None:
    """Every variant of a case computes the same local result."""
    for name, fns in cases.items():
        ref = _flat(_call(fns["shardfn"]))
        for k, fn in fns.items():
            if k == "from_local only":
                continue
            got = _flat(_call(fn))
            if not torch.allclose(got, ref, rtol=1e-5, atol=1e-4):
                raise AssertionError(f"{name}: {k} disagrees with shardfn")


def _flat(out) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in out]) if isinstance(out, list) else out


def main(rounds: int, warmup: int) -> None:
    import shardfn as sf
    from shardfn.backends import dist as backend
    from shardfn.interop.dtensor import device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = sf.Mesh((WORLD,), ("x",), backend="dist")
    pg = backend.axis_group(mesh, ("x",)).pg
    cases = _cases(mesh, pg, device_mesh(mesh))
    _check(cases)
    rows = []
    for name, fns in cases.items():
        times = _time(fns, rounds, warmup)
        rows.append((name, times))
    if dist.get_rank() == 0:
        _report(rows, rounds)
    dist.barrier()
    dist.destroy_process_group()


def _report(rows: list, rounds: int) -> None:
    print(f"reshard of float32{SHAPE} on Mesh(x={WORLD}), {WORLD} gloo processes, {rounds} rounds "
          f"(slowest rank per round)")
    print(f"{'case':8} {'variant':20} {'median ms':>10} {'min ms':>8} {'cpu ms':>7} "
          f"{'shardfn/this (median, min, cpu)':>33}")
    for name, times in rows:
        med, low, busy = times["shardfn"]
        for k, (m, lo, c) in times.items():
            ratio = "" if k == "shardfn" else f"{med / m:15.2f} {low / lo:8.2f} {busy / c:8.2f}"
            print(f"{name:8} {k:20} {m * 1e3:10.2f} {lo * 1e3:8.2f} {c * 1e3:7.2f} {ratio}")
    for name, times in rows:
        if "per-leaf reshard" in times:
            (med, _, busy), hand = times["shardfn"], times["(a) flat all_reduce"]
            print(f"{name}: shardfn / hand-bucketed all_reduce = {med / hand[0]:.2f} (medians), "
                  f"{busy / hand[2]:.2f} (cpu); per-leaf reshard / shardfn = {times['per-leaf reshard'][0] / med:.1f}")
    print("targets: shardfn/(a) <= 1.15, shardfn/(b) <= 1.0 (ratios use the default-mode shardfn row); "
          "sync: shardfn/(a) <= 1.2 and several times faster than per-leaf reshard")


def _spawned(rank: int, port: int, rounds: int, warmup: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    main(rounds, warmup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        main(args.rounds, args.warmup)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(port, args.rounds, args.warmup), nprocs=WORLD)
