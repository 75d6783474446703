"""An AdamW step of sf.optim on a sharded pytree vs torch.optim.AdamW(foreach=True) unsharded.

A Llama-style parameter tree (~25M parameters: 4 layers of dim 768, MLP 2048, an embedding
of 4,000 x 768) sharded Megatron-style on a simulated (2, 4) mesh ('dp', 'tp'): q/k/v/up
and the embedding split by rows over 'tp', o/down by columns, norms replicated; everything
replicated over 'dp'. Timed, interleaved step by step (the fastest step after the first two,
which warm the allocator; ``--cpu-time`` times with the process's CPU time, for a loaded machine):

- ``torch foreach``: ``torch.optim.AdamW(foreach=True).step()`` on the unsharded tensors
  (in place; the baseline);
- ``sf foreach`` / ``sf fused``: ``sf.optim.AdamW(foreach=True / fused=True).step`` on the
  sharded tree (pure: it writes new parameters and state);
- ``sf fused zero1``: the same with ``shard_state_over="dp"`` (ZeRO-1: the state sharded
  over 'dp', the new parameters all-gathered back).

The results are checked against torch's after the timed steps. Also printed: the
optimizer state's bytes per device, replicated over 'dp' vs ZeRO-1 (target: half).

    python benchmarks/bench_optim.py [--steps 5] [--threads N] [--quick]

``--quick`` (or ``SHARDFN_BENCH_QUICK=1``) uses a small tree and two steps, for a smoke test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402

FULL = {"layers": 4, "dim": 768, "hidden": 2048, "vocab": 4000}
QUICK = {"layers": 1, "dim": 32, "hidden": 64, "vocab": 50}


def tree(cfg: dict) -> tuple[dict, dict]:
    """Full tensors and their specs."""
    d, h = cfg["dim"], cfg["hidden"]
    full: dict = {"embed": torch.randn(cfg["vocab"], d) * 0.02, "layers": []}
    specs: dict = {"embed": P("tp"), "layers": []}
    for _ in range(cfg["layers"]):
        full["layers"].append({"qkv": torch.randn(3 * d, d) * 0.02, "o": torch.randn(d, d) * 0.02,
                               "up": torch.randn(h, d) * 0.02, "down": torch.randn(d, h) * 0.02,
                               "norm": torch.ones(d)})
        specs["layers"].append({"qkv": P("tp"), "o": P(None, "tp"), "up": P("tp"), "down": P(None, "tp"),
                                "norm": P()})
    return full, specs


def state_bytes_per_device(state) -> int:
    per: list[int] | None = None
    for x in optree.tree_leaves(state):
        if isinstance(x, sf.ShardedArray):
            sizes = [s.numel() * s.element_size() for s in x.local_shards()]
            per = sizes if per is None else [a + b for a, b in zip(per, sizes)]
    return max(per or [0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time (single thread, loaded machine)")
    ns = ap.parse_args()
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    cfg, steps = (QUICK, 2) if quick else (FULL, ns.steps)
    clock = time.process_time if ns.cpu_time else time.perf_counter
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    full, specs = tree(cfg)
    leaves, treespec = optree.tree_flatten(full)
    nparams = sum(t.numel() for t in leaves)
    spec_leaves = treespec.flatten_up_to(specs)
    grads_full = [torch.randn_like(t) * 0.01 for t in leaves]
    put = lambda ts: treespec.unflatten([sf.distribute(t, s, mesh=mesh) for t, s in zip(ts, spec_leaves)])  # noqa: E731
    grads = put(grads_full)

    ref = [t.clone() for t in leaves]
    for r, g in zip(ref, grads_full):
        r.grad = g
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, foreach=True)

    runs = {"sf foreach": sf.optim.AdamW(lr=1e-3, foreach=True), "sf fused": sf.optim.AdamW(lr=1e-3, fused=True),
            "sf fused zero1": sf.optim.AdamW(lr=1e-3, fused=True, shard_state_over="dp")}
    live = {name: [put(leaves), None] for name in runs}
    for name, opt in runs.items():
        live[name][1] = opt.init(live[name][0])
    times: dict[str, list[float]] = {"torch foreach": [], **{n: [] for n in runs}}
    for _ in range(steps):
        t0 = clock()
        torch_opt.step()
        times["torch foreach"].append(clock() - t0)
        for name, opt in runs.items():
            p, s = live[name]
            t0 = clock()
            p, s = opt.step(p, grads, s)
            times[name].append(clock() - t0)
            live[name] = [p, s]
            del p, s
    for name in runs:
        got = optree.tree_leaves(live[name][0])
        err = max(((g.full_tensor() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))
        assert err < 1e-5, f"{name}: relative difference {err} from torch"
    best = {k: min(v[2:] or v[1:]) * 1e3 for k, v in times.items()}
    base = best["torch foreach"]
    print(f"AdamW step, {nparams / 1e6:.1f}M parameters, mesh (2, 4) dp x tp, {steps} steps, "
          f"{torch.get_num_threads()} threads (fastest step after the first two, "
          f"{'CPU' if ns.cpu_time else 'wall'} time)")
    print(f"{'run':<18}{'ms':>10}{'ratio':>9}")
    for k, v in best.items():
        print(f"{k:<18}{v:>10.1f}{v / base:>8.2f}x")
    rep, zero = state_bytes_per_device(live["sf fused"][1]), state_bytes_per_device(live["sf fused zero1"][1])
    print(f"state bytes per device: replicated over dp {rep / 2**20:.1f} MiB, ZeRO-1 {zero / 2**20:.1f} MiB "
          f"({zero / rep:.2f}x)")
    print("results equal torch.optim.AdamW within 1e-5")


if __name__ == "__main__":
    main()
