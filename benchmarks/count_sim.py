"""Host work of one simulated training step, counted (figures independent of machine load).

``bench_sim``'s transformer-block step (forward, backward, SGD) after warm-up, unsharded and
in its three configurations; per step:

- ``dispatches``: aten ops reaching ``ShardedArray.__torch_dispatch__`` (``slow``: those taking
  ``dispatch._dispatch``, the cold path: misses, special and in-place ops);
- ``shard ops``: aten ops run on plain tensors while the step runs (the simulated devices' work
  and the batch's setup; unsharded: every op of the step), counted by a ``TorchDispatchMode``
  that lets each ShardedArray op dispatch with the mode still on. On a GPU each is a kernel
  launch or a metadata op, issued from Python;
- ``python calls``: function calls (Python and builtin) of the step under ``cProfile``.

    python benchmarks/count_sim.py [--quick] [--ops CONFIG]

``--quick`` (or ``SHARDFN_BENCH_QUICK=1``): the small model (the counts hardly depend on the
size). ``--ops CONFIG`` also lists the shard ops of one configuration by name.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim  # noqa: E402
import shardfn as sf  # noqa: E402
from shardfn.arrays import dispatch as _dispatch  # noqa: E402


class ShardOps(TorchDispatchMode):
    """Counts aten ops on plain tensors; a ShardedArray op runs its dispatch under the mode, so
    the ops it runs on the shards are counted, and the op itself in ``dispatches``."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatches = 0
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, sf.ShardedArray) for t in types):
            self.dispatches += 1
            with self:
                return sf.ShardedArray.__torch_dispatch__(func, types, args, kwargs)
        self.ops[str(func)] += 1
        return func(*args, **kwargs)


def count(cfg: dict[str, int], config: str | None, warm: int = 3) -> dict[str, Any]:
    """One step's counts of configuration ``config`` (None: unsharded) after ``warm`` steps."""
    run = bench_sim._Run(cfg, config)
    for s in range(warm):
        run.step(s)
    slow = [0]
    cold = _dispatch._dispatch

    def counting(*args: Any, **kwargs: Any) -> Any:
        slow[0] += 1
        return cold(*args, **kwargs)

    _dispatch._dispatch = counting
    try:
        mode = ShardOps()
        with mode:
            run.step(warm)
    finally:
        _dispatch._dispatch = cold
    prof = cProfile.Profile()
    prof.enable()
    run.step(warm + 1)
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())
    return {"dispatches": mode.dispatches, "slow": slow[0], "shard ops": sum(mode.ops.values()),
            "python calls": calls, "ops": mode.ops}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model")
    parser.add_argument("--ops", default=None, help="list the shard ops of this configuration")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    cfg = bench_sim.QUICK if quick else bench_sim.FULL
    print(f"one warm training step of bench_sim's block (dim {cfg['dim']}, seq {cfg['seq']}, batch {cfg['batch']}), "
          f"torch {torch.__version__}")
    print(f"{'configuration':16s}{'dispatches':>12s}{'slow':>6s}{'shard ops':>11s}{'python calls':>14s}")
    for config in (None, *bench_sim.CONFIGS):
        c = count(cfg, config)
        print(f"{config or 'unsharded':16s}{c['dispatches']:12d}{c['slow']:6d}{c['shard ops']:11d}{c['python calls']:14d}")
        if ns.ops is not None and config == ns.ops:
            for name, n in sorted(c["ops"].items()):
                print(f"    {n:4d}  {name}")


if __name__ == "__main__":
    main()
