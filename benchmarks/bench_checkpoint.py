"""Checkpoint save + load of a ~25M-parameter tree sharded on a simulated (2, 4) mesh
(sf.checkpoint) against torch.distributed.checkpoint saving and loading the same tensors
unsharded, side by side in one run.

Both write DCP's format to a fresh folder (the same default FileSystemWriter: one thread,
files synced) and load into freshly allocated values (sf.checkpoint.load returns new
arrays; the plain run allocates its tensors inside the timed region too). The loaded
values are checked against the saved ones first. Prints median seconds and the ratio
(target <= 1.5x).

Run: python benchmarks/bench_checkpoint.py   (SHARDFN_BENCH_QUICK=1: a small tree, one run)
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

import shardfn as sf
from shardfn import P

QUICK = bool(os.environ.get("SHARDFN_BENCH_QUICK"))


def tree_specs(dim: int, hidden: int, vocab: int, layers: int) -> dict[str, tuple[tuple[int, ...], P]]:
    """A Llama-style parameter tree: TP over 'tp' (columns for q/k/v/gate/up, rows for
    o/down), the embedding over both axes, norms replicated."""
    out = {"embed": ((vocab, dim), P(("dp", "tp"))), "norm": ((dim,), P())}
    for i in range(layers):
        for n in ("q", "k", "v"):
            out[f"layers.{i}.{n}"] = ((dim, dim), P("tp", None))
        out[f"layers.{i}.o"] = ((dim, dim), P(None, "tp"))
        out[f"layers.{i}.gate"] = ((hidden, dim), P("tp", None))
        out[f"layers.{i}.up"] = ((hidden, dim), P("tp", None))
        out[f"layers.{i}.down"] = ((dim, hidden), P(None, "tp"))
        out[f"layers.{i}.norm"] = ((dim,), P())
    return out


def median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dim, hidden, vocab, layers = (64, 192, 512, 2) if QUICK else (512, 1536, 8192, 6)
    repeat = 1 if QUICK else 5
    specs = tree_specs(dim, hidden, vocab, layers)
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    full = {k: torch.randn(shape) for k, (shape, _) in specs.items()}
    tree = {k: sf.distribute(full[k], spec, mesh=mesh) for k, (_, spec) in specs.items()}
    like = {k: sf.NamedSharding(mesh, spec) for k, (_, spec) in specs.items()}
    numel = sum(t.numel() for t in full.values())
    root = tempfile.mkdtemp(prefix="sf-bench-ck-")
    counter = iter(range(10**6))

    def fresh() -> str:
        return os.path.join(root, str(next(counter)))

    def sf_round() -> None:
        path = fresh()
        sf.checkpoint.save(path, tree)
        sf.checkpoint.load(path, like)

    def dcp_round() -> None:
        path = fresh()
        dcp.save(full, checkpoint_id=path, no_dist=True)
        into = {k: torch.empty_like(t) for k, t in full.items()}
        dcp.load(into, checkpoint_id=path, no_dist=True)

    try:
        path = fresh()
        sf.checkpoint.save(path, tree)
        got = sf.checkpoint.load(path, like)
        for k, t in full.items():
            assert torch.equal(got[k].full_tensor(), t), f"sf.checkpoint round trip of {k} is wrong"
            assert got[k].sharding == tree[k].sharding
        sf_round()
        dcp_round()  # warm both once
        t_sf, t_dcp = [], []
        for _ in range(repeat):  # interleaved, so load drifts hit both alike
            t_sf.append(median(sf_round, 1))
            t_dcp.append(median(dcp_round, 1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a, b = statistics.median(t_sf), statistics.median(t_dcp)
    print(f"checkpoint save + load, {numel / 1e6:.1f}M float32 parameters in {len(full)} tensors, "
          f"simulated (2, 4) mesh, torch {torch.__version__}, median of {repeat}")
    print(f"{'sf.checkpoint (sharded)':>28} {'DCP (plain tensors)':>20} {'ratio':>7}")
    print(f"{a:27.3f}s {b:19.3f}s {a / b:6.2f}x")


if __name__ == "__main__":
    main()
