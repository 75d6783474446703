"""Time one MLP training step (forward + backward) written with sf.shard_map on the
local backend against the same step on unsharded tensors.

On the local backend every device is simulated in this process and the body runs once
for the whole mesh (vmap over the mesh axes), so the ratio measures shard_map's
overhead; the FLOPs are the same. Run: ``python benchmarks/bench_shard_map.py``.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import shardfn as sf
from shardfn import P, lax


def _mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def unsharded_step(x, y, w1, w2):
    loss = ((_mlp(x, w1, w2) - y) ** 2).mean()
    return torch.autograd.grad(loss, (w1, w2))


def make_sharded_step(mesh: sf.Mesh, dp: str, tp: str | None):
    """Data parallel over ``dp``; with ``tp``, Megatron tensor parallel over it too."""
    w1_spec, w2_spec = (P(None, tp), P(tp, None)) if tp else (P(), P())

    @functools.partial(sf.shard_map, mesh=mesh, in_specs=(P(dp), P(dp), w1_spec, w2_spec), out_specs=P())
    def loss_fn(x, y, w1, w2):
        out = torch.relu(x @ w1) @ w2
        if tp:
            out = lax.psum(out, tp)
        return lax.pmean(((out - y) ** 2).mean(), dp)

    def step(x, y, w1, w2):
        return torch.autograd.grad(loss_fn(x, y, w1, w2), (w1, w2))

    return step


def _time(fn, *args, repeat: int) -> float:
    for _ in range(3):
        fn(*args)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(a.batch, a.dim), torch.randn(a.batch, a.dim)
    w1 = torch.randn(a.dim, a.hidden, requires_grad=True)
    w2 = torch.randn(a.hidden, a.dim, requires_grad=True)
    base = _time(unsharded_step, x, y, w1, w2, repeat=a.repeat)
    print(f"MLP step (forward + backward), batch={a.batch} dim={a.dim} hidden={a.hidden}, 1 thread")
    print(f"  unsharded                        {base * 1e3:8.2f} ms")
    cases = [
        ("shard_map dp, mesh (4,)", sf.Mesh((4,), ("dp",)), "dp", None),
        ("shard_map dp x tp, mesh (2, 2)", sf.Mesh((2, 2), ("dp", "tp")), "dp", "tp"),
    ]
    for name, mesh, dp, tp in cases:
        step = make_sharded_step(mesh, dp, tp)
        got, want = step(x, y, w1, w2), unsharded_step(x, y, w1, w2)
        assert all(torch.allclose(g, r, rtol=1e-3, atol=1e-4) for g, r in zip(got, want)), name
        t = _time(step, x, y, w1, w2, repeat=a.repeat)
        print(f"  {name:<32} {t * 1e3:8.2f} ms   ratio {t / base:5.2f}x")


if __name__ == "__main__":
    main()
