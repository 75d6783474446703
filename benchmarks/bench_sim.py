"""Simulated training on the local backend vs the same step unsharded.

A transformer block (dim 256, 8 heads, MLP 1024, seq 64, batch 16; pre-norm causal
attention (``scaled_dot_product_attention``) and MLP); one training step = forward +
backward (``torch.autograd.grad``) + an SGD update, timed on plain tensors and on
ShardedArrays of a simulated mesh in three configurations:

- ``dp (8,)``: data parallel on ``Mesh((8,), ('dp',))`` (batch split, params replicated);
- ``dp x tp (2, 4)``: Megatron on ``Mesh((2, 4), ('dp', 'tp'))`` (batch over 'dp',
  q/k/v/w1 split by output column over 'tp', o/w2 by input row);
- ``dp of (2, 4)``: data parallel over 'dp' of the (2, 4) mesh, replicated over 'tp'.

Every configuration's losses (several steps) must equal the unsharded losses within 1e-5
relative. Printed: unsharded ms, simulated ms, ratio (target <= 1.5), in wall time and in process
CPU time (steadier on a shared machine); the runs are interleaved step by step and each
time is the fastest step after the first.

    python benchmarks/bench_sim.py [--steps 10] [--threads N] [--quick] [--parts device|shares|both]

``--quick`` (or ``SHARDFN_BENCH_QUICK=1``) uses a small model and two steps, for a smoke test.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_dispatch

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402
from shardfn.backends.local import set_pending_parts  # noqa: E402
from bench_dispatch import BareWrapper  # noqa: E402

FULL = {"dim": 256, "heads": 8, "hidden": 1024, "seq": 64, "batch": 16}
QUICK = {"dim": 32, "heads": 4, "hidden": 64, "seq": 8, "batch": 8}
LR = 1e-2

MEGATRON = {
    "ln1": P(), "ln2": P(),
    "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
    "w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": P(),
}

CONFIGS = {
    "dp (8,)": ((8,), ("dp",), None),
    "dp x tp (2, 4)": ((2, 4), ("dp", "tp"), MEGATRON),
    "dp of (2, 4)": ((2, 4), ("dp", "tp"), None),
}
# the reference floor of any tensor subclass that runs every op through ``__torch_dispatch__``:
# bench_dispatch's bare wrapper (unwrap, run the op once on the one tensor, wrap), no sharding
BARE = "bare wrapper"


def init_params(cfg: dict[str, int], seed: int = 0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The block's parameters (drawn on the CPU, so every device gets the same values)."""
    g = torch.Generator().manual_seed(seed)
    d, h = cfg["dim"], cfg["hidden"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    params = {
        "ln1": torch.ones(d), "ln2": torch.ones(d),
        "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d),
        "w1": w(d, h), "b1": torch.zeros(h), "w2": w(h, d), "b2": torch.zeros(d),
    }
    return {k: v.to(device, dtype) for k, v in params.items()}


def make_batch(cfg: dict[str, int], step: int, device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["dim"], generator=g)
    return x.to(device, dtype), torch.roll(x, 1, dims=1).tanh().to(device, dtype)


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _attention(h: torch.Tensor, p: dict[str, Any], heads: int) -> torch.Tensor:
    b, t, d = h.shape
    hd = d // heads

    def split(z: torch.Tensor) -> torch.Tensor:  # (b, t, d) -> (b, heads, t, hd)
        return z.reshape(b, t, heads, hd).transpose(1, 2)

    q, k, v = split(h @ p["wq"]), split(h @ p["wk"]), split(h @ p["wv"])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, t, d) @ p["wo"]


def loss_fn(p: dict[str, Any], x: torch.Tensor, y: torch.Tensor, heads: int) -> torch.Tensor:
    x = x + _attention(_rms_norm(x, p["ln1"]), p, heads)
    h = torch.nn.functional.gelu(_rms_norm(x, p["ln2"]) @ p["w1"] + p["b1"])
    return (x + h @ p["w2"] + p["b2"] - y).pow(2).mean()


def train_step(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor, heads: int,
               loss_of: Any = None) -> tuple[dict, torch.Tensor]:
    """Forward, backward, SGD; gradients laid out like their parameters by one ``sf.reshard`` of
    the list (the dp all-reduces bucketed, as DDP and ``sf.optim``'s optimizers sync gradients).
    ``loss_of``: ``loss_fn`` or a compiled form of it."""
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = (loss_of or loss_fn)(params, x, y, heads)
    grads = sync_grads(params, torch.autograd.grad(loss, list(params.values())))
    new = {k: (p - LR * g).detach() for (k, p), g in zip(params.items(), grads)}
    return new, loss.detach()


def sync_grads(params: dict[str, Any], grads: Any) -> list:
    """The gradients laid out like their parameters (sharded ones; plain ones as they are), in one
    ``sf.reshard`` of the list: same-plan all-reduces run as one per bucket."""
    sharded = [i for i, p in enumerate(params.values()) if isinstance(p, sf.ShardedArray)]
    grads = list(grads)
    if sharded:
        specs = list(params.values())
        moved = sf.reshard([grads[i] for i in sharded], [specs[i].sharding for i in sharded])
        for i, g in zip(sharded, moved):
            grads[i] = g
    return grads


def _shard(cfg: dict[str, int], config: str, device: str = "cpu") -> tuple[dict, Any]:
    shape, names, specs = CONFIGS[config]
    mesh = sf.Mesh(shape, names, backend="local", device_type=device)
    params = {k: sf.distribute(v, (specs or {}).get(k, P()), mesh=mesh) for k, v in init_params(cfg, device=device).items()}
    return params, mesh


class _Run:
    """One configuration's training run (``config`` None: unsharded), stepped from outside
    so that configurations can be interleaved step by step."""

    def __init__(self, cfg: dict[str, int], config: str | None, device: str = "cpu", loss_of: Any = None) -> None:
        self.cfg, self.device, self.loss_of = cfg, device, loss_of
        self.bare = config == BARE
        if config is None or self.bare:
            self.params, self.mesh = init_params(cfg, device=device), None
            if self.bare:
                self.params = {k: BareWrapper(v) for k, v in self.params.items()}
        else:
            self.params, self.mesh = _shard(cfg, config, device)
        self.losses: list[float] = []
        self.walls: list[float] = []
        self.cpus: list[float] = []

    def step(self, s: int) -> None:
        """Step ``s`` (its own batch), timed in wall and process CPU time."""
        x, y = make_batch(self.cfg, s, self.device)
        if self.mesh is not None:
            x, y = sf.distribute(x, P("dp"), mesh=self.mesh), sf.distribute(y, P("dp"), mesh=self.mesh)
        elif self.bare:
            x, y = BareWrapper(x), BareWrapper(y)
        _sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        self.params, loss = train_step(self.params, x, y, self.cfg["heads"], self.loss_of)
        _sync(self.device)
        self.walls.append(time.perf_counter() - t0)
        self.cpus.append(time.process_time() - c0)
        self.losses.append(float(loss.full_tensor() if isinstance(loss, sf.ShardedArray) else loss))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_peak_bytes(run: "_Run", s: int) -> int:
    """CUDA memory one more step of ``run`` needs above what is allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run.step(s)
    return torch.cuda.max_memory_allocated() - before


def measure(cfg: dict[str, int], steps: int, device: str = "cpu", compile_backend: str | None = None,
            rtol: float = 1e-5, configs: tuple[str, ...] | None = None,
            peaks: dict | None = None, bare: bool = False) -> tuple[list[tuple[str, float, float, float, float]], dict]:
    """(config, unsharded wall, simulated wall, unsharded CPU, simulated CPU) seconds per
    configuration, and the losses of every run (each configuration's checked against
    unsharded within ``rtol`` relative); with ``bare``, a last row for the same step on the
    bare wrapper subclass (``BARE``). The runs advance one step at a time in turn
    (unsharded, then each configuration), so a burst of load from other processes hits
    them alike; a time is the fastest of the ``steps`` steps after the first (which fills
    the caches): the step's cost when nothing else interferes."""
    configs = tuple(configs or CONFIGS) + ((BARE,) if bare else ())
    # each run compiles its own wrapper (a shared one would count every layout as a recompile)
    runs = {config: _Run(cfg, config, device, torch.compile(loss_fn, backend=compile_backend) if compile_backend
                         else None) for config in (None, *configs)}
    for s in range(steps + 1):
        for run in runs.values():
            run.step(s)
    want = runs[None].losses
    for config in configs:
        for s, (a, b) in enumerate(zip(runs[config].losses, want)):
            if abs(a - b) > rtol * abs(b):
                raise AssertionError(f"{config}: step {s} loss {a} differs from unsharded {b}")
    if peaks is not None and device == "cuda":  # one more step each, alone, for its peak memory
        for config, run in runs.items():
            peaks[config] = step_peak_bytes(run, steps + 1)
    base = runs[None]
    rows = [(config, min(base.walls[1:]), min(runs[config].walls[1:]), min(base.cpus[1:]),
             min(runs[config].cpus[1:])) for config in configs]
    return rows, {config: run.losses[:steps + 1] for config, run in runs.items()}


def report(cfg: dict[str, int], rows: list[tuple[str, float, float, float, float]], losses: dict,
           rtol: float = 1e-5) -> str:
    lines = [
        f"training step of a transformer block (dim {cfg['dim']}, seq {cfg['seq']}, batch {cfg['batch']}; "
        f"fwd + bwd + SGD), torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"{'configuration':16s}{'unsharded ms':>14s}{'simulated ms':>14s}{'ratio':>8s}"
        f"{'CPU ms unsh.':>14s}{'CPU ms sim.':>13s}{'ratio':>8s}",
    ]
    for config, w0, w, c0, c in rows:
        lines.append(f"{config:16s}{w0 * 1e3:14.1f}{w * 1e3:14.1f}{w / w0:7.2f}x"
                     f"{c0 * 1e3:14.1f}{c * 1e3:13.1f}{c / c0:7.2f}x")
    lines.append(f"losses equal unsharded within {rtol:g} relative in every configuration (target ratio <= 1.5; "
                 "CPU time = process time, steadier on a busy machine)")
    want = losses[None]
    lines.append(f"losses over {len(want)} steps: unsharded first {want[0]:.6f}, last {want[-1]:.6f}")
    for config, got in losses.items():
        if config is not None:
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            lines.append(f"  {config:16s} first {got[0]:.6f}, last {got[-1]:.6f}, "
                         f"max relative difference {worst:.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="small model, two steps (a smoke run)")
    parser.add_argument("--parts", default="device", choices=("device", "shares", "both"),
                        help="the local backend's pending parts (set_pending_parts); both: each, in turn")
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    cfg = QUICK if quick else FULL
    for mode in (("device", "shares") if ns.parts == "both" else (ns.parts,)):
        set_pending_parts(mode)
        print(f"pending parts: {mode} (set_pending_parts)")
        print(report(cfg, *measure(cfg, 2 if quick else ns.steps, bare=True)))
    set_pending_parts("device")


if __name__ == "__main__":
    main()
