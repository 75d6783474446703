"""A device-free proxy of one simulated training step's GPU time: the kernels it runs, counted.

``bench_sim``'s transformer-block step (forward, backward, SGD), unsharded and in its three
configurations, run on ``device_type="meta"`` meshes (torch's meta kernels: no data, any size,
seconds on a CPU) at the GPU size of ``gpu_check`` (dim 1024, seq 256, batch 32). A
``TorchDispatchMode`` sees every aten op the step runs on plain tensors (the simulated devices'
work; composite ops such as ``matmul`` are decomposed, so their copies show) and sums per step:

- ``kernels``: ops that launch a kernel (not views, not allocations);
- ``bytes``: bytes read + written by the kernels that are not gemms or attention (memory-bound on
  a GPU; a broadcast input counts its distinct elements once);
- ``gemms`` and ``GFLOP``: mm / bmm / addmm / baddbmm calls and their flops (2 * batch * M * N * K);
  ``attn``: attention kernel calls;
- ``peak MB``: the largest total of the storages created during the step that are alive at once
  (what ``gpu_check``'s peak memory measures above the memory held before the step);
- ``est ms``: gemm flops at 50 TFLOP/s + attention flops at 25 TFLOP/s + bytes at 2.5 TB/s (about
  an H100's fp32 rates for this step's kernels; no launch cost: the step is GPU-bound there).

SDPA runs as CUDA's kernel ``_scaled_dot_product_efficient_attention`` (``--sdpa efficient``, the
default; on a meta tensor torch itself would choose the math path), or as a math formula on plain
ops (``--sdpa math``), which ``--check`` uses to confirm that the meta census equals a CPU run's.

    python benchmarks/census_sim.py [--size gpu|small|quick] [--sdpa efficient|math] [--ops CONFIG] [--check]
                                    [--parts device|shares|both]

``SHARDFN_BENCH_QUICK=1``: the quick size and ``--check``. ``--ops CONFIG`` lists one configuration's
kernels by op (calls, MB) and its gemm shapes.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's shardfn
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim  # noqa: E402
import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402
from shardfn.backends.local import set_pending_parts  # noqa: E402
from shardfn.backends.local_values import shares  # noqa: E402

aten = torch.ops.aten
SIZES = {
    "gpu": {"dim": 1024, "heads": 16, "hidden": 4096, "seq": 256, "batch": 32},
    "small": dict(bench_sim.FULL),
    "quick": dict(bench_sim.QUICK),
}
GEMMS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}
ATTENTION = {aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_efficient_attention_backward.default}
ALLOCS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
          aten.new_empty_strided.default}
GEMM_FLOPS, ATTN_FLOPS, BANDWIDTH = 50e12, 25e12, 2.5e12


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` reads (a broadcast, stride-0 dim counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _composite(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class Census(TorchDispatchMode):
    """Kernels, bytes, gemm shapes and the live set of the ops run on plain tensors; a
    ShardedArray op dispatches with the mode still on, so its shards' ops are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.gemms: collections.Counter = collections.Counter()  # (op, batch, M, N, K) -> calls
        self.gemm_flops = 0
        self.attn_flops = 0
        self.attn = 0
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, out: list[torch.Tensor]) -> None:
        for t in out:
            st = t.untyped_storage()
            key = st._cdata
            if key in self._seen:
                continue
            self._seen.add(key)
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key, st.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, sf.ShardedArray) for t in types):
            with self:
                return sf.ShardedArray.__torch_dispatch__(func, types, args, kwargs)
        if _composite(func) and func not in ATTENTION:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        ins = _tensors(args) + _tensors(list(kwargs.values()))
        outs = _tensors(out)
        in_storages = {t.untyped_storage()._cdata for t in ins}
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if func in ALLOCS:
            self._track(outs)
            return out
        if not mutates and outs and all(t.untyped_storage()._cdata in in_storages for t in outs):
            return out  # a view or an alias: no kernel
        name = str(func)
        self.calls[name] += 1
        self._track([t for t in outs if t.untyped_storage()._cdata not in in_storages])
        if func in GEMMS:
            a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            self.gemms[(name.split(".")[1], batch, m, n, k)] += 1
            self.gemm_flops += 2 * batch * m * n * k
            return out
        if func in ATTENTION:
            q, k = args[0], args[1]
            if "backward" in name:
                q, k = args[1], args[2]
            b, h, s, d = q.shape
            flops = 4 * b * h * s * k.shape[-2] * d  # two gemms, ~half under the causal mask
            self.attn_flops += flops * (2.5 if "backward" in name else 1) / 2
            self.attn += 1
            return out
        written = outs if not mutates else [a for a, s in zip(args, func._schema.arguments)
                                            if isinstance(a, torch.Tensor) and s.alias_info is not None
                                            and s.alias_info.is_write]
        read = [t for t in ins if not any(t is w for w in written)] if mutates else ins
        if func in (aten.copy_.default,):
            read = [args[1]]
        self.bytes[name] += sum(_distinct_bytes(t) for t in read) + sum(t.numel() * t.element_size() for t in written)
        return out

    def summary(self) -> dict[str, float]:
        nbytes = sum(self.bytes.values())
        est = self.gemm_flops / GEMM_FLOPS + self.attn_flops / ATTN_FLOPS + nbytes / BANDWIDTH
        return {"kernels": sum(self.calls.values()), "gemms": sum(self.gemms.values()), "attn": self.attn,
                "GFLOP": self.gemm_flops / 1e9, "MB": nbytes / 1e6, "peak MB": self.peak / 1e6, "est ms": est * 1e3}


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if is_causal:
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal)[0]


def census(cfg: dict[str, int], config: str | None, device: str = "meta", sdpa: str = "efficient",
           warm: int = 2) -> Census:
    """The census of one training step of ``config`` (None: unsharded) after ``warm`` steps."""
    attention = _efficient_attention if sdpa == "efficient" else _math_attention
    saved = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        params = bench_sim.init_params(cfg, device=device)
        mesh = None
        if config is not None:
            shape, names, specs = bench_sim.CONFIGS[config]
            mesh = sf.Mesh(shape, names, backend="local", device_type=device)
            params = {k: sf.distribute(v, (specs or {}).get(k, P()), mesh=mesh) for k, v in params.items()}
        for s in range(warm + 1):
            x, y = bench_sim.make_batch(cfg, s, device=device)
            if mesh is not None:
                x, y = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(y, P("dp"), mesh=mesh)
            if s < warm:
                params, _ = bench_sim.train_step(params, x, y, cfg["heads"])
                continue
            mode = Census()
            with mode:
                params, _ = bench_sim.train_step(params, x, y, cfg["heads"])
            del params, x, y, _
        return mode
    finally:
        torch.nn.functional.scaled_dot_product_attention = saved


COLUMNS = ("kernels", "gemms", "attn", "GFLOP", "MB", "peak MB", "est ms")


def table(cfg: dict[str, int], device: str = "meta", sdpa: str = "efficient") -> tuple[str, dict]:
    """The census of every configuration as a table (ratios to unsharded), and the censuses."""
    res = {config: census(cfg, config, device, sdpa) for config in (None, *bench_sim.CONFIGS)}
    base = res[None].summary()
    lines = [f"one training step of bench_sim's block (dim {cfg['dim']}, heads {cfg['heads']}, hidden {cfg['hidden']}, "
             f"seq {cfg['seq']}, batch {cfg['batch']}), {device} tensors, SDPA {sdpa}, torch {torch.__version__}, "
             f"pending parts: {'shares' if shares() else 'device'}",
             f"{'configuration':16s}" + "".join(f"{c:>10s}" for c in COLUMNS) + f"{'est x':>8s}{'peak x':>8s}{'MB x':>7s}"]
    for config, c in res.items():
        s = c.summary()
        lines.append(f"{config or 'unsharded':16s}" + "".join(
            f"{s[col]:10d}" if isinstance(s[col], int) else f"{s[col]:10.1f}" for col in COLUMNS)
            + f"{s['est ms'] / base['est ms']:7.2f}x{s['peak MB'] / max(base['peak MB'], 1e-9):7.2f}x"
            f"{s['MB'] / base['MB']:6.2f}x")
    return "\n".join(lines), res


def details(c: Census) -> str:
    lines = ["    kernels by op (calls, MB read + written):"]
    for name in sorted(c.calls, key=lambda n: -c.bytes.get(n, 0)):
        lines.append(f"    {c.calls[name]:5d}  {c.bytes.get(name, 0) / 1e6:9.1f}  {name}")
    lines.append("    gemms (calls  op  batch x M x N x K):")
    for (op, b, m, n, k), cnt in sorted(c.gemms.items()):
        lines.append(f"    {cnt:5d}  {op:8s} {b:3d} x {m:6d} x {n:6d} x {k:6d}")
    return "\n".join(lines)


def check(cfg: dict[str, int]) -> str:
    """The meta census equals a CPU run's (math SDPA, which runs on both)."""
    for config in (None, *bench_sim.CONFIGS):
        a, b = census(cfg, config, "meta", "math"), census(cfg, config, "cpu", "math")
        for what in ("calls", "bytes", "gemms"):
            if getattr(a, what) != getattr(b, what):
                diff = {k: (getattr(a, what).get(k), getattr(b, what).get(k))
                        for k in set(getattr(a, what)) | set(getattr(b, what))
                        if getattr(a, what).get(k) != getattr(b, what).get(k)}
                raise AssertionError(f"{config}: meta and CPU censuses differ in {what}: {diff}")
    return f"meta census == CPU census at dim {cfg['dim']} in every configuration (math SDPA)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default=None, choices=sorted(SIZES), help="gpu (default), small, or quick")
    parser.add_argument("--sdpa", default="efficient", choices=("efficient", "math"))
    parser.add_argument("--ops", default=None, help="list the kernels and gemms of this configuration ('unsharded' too)")
    parser.add_argument("--check", action="store_true", help="first check meta == CPU at the quick size")
    parser.add_argument("--parts", default="device", choices=("device", "shares", "both"),
                        help="the local backend's pending parts (set_pending_parts); both: one table each")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    if ns.parts == "both":
        for mode in ("device", "shares"):
            main([a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--parts", "both")]
                 + ["--parts", mode])
        return
    set_pending_parts(ns.parts)
    quick = os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    size = ns.size or ("quick" if quick else "gpu")
    if ns.check or quick:
        print(check(SIZES["quick"]))
    text, res = table(SIZES[size], "meta", ns.sdpa)
    print(text)
    if ns.ops is not None:
        key = None if ns.ops == "unsharded" else ns.ops
        print(f"{ns.ops}:")
        print(details(res[key]))


if __name__ == "__main__":
    main()
