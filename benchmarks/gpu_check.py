"""Device check: shardfn on one CUDA GPU, one command, every section reported on its own.

    python benchmarks/gpu_check.py                    # a CUDA machine (~4 minutes on an H100)
    python benchmarks/gpu_check.py --device cpu --quick   # a smoke run anywhere (tests run it)

Needs torch (2.11+) and optree; uses transformers when installed. Sections, each in its own
try/except (a failure prints its full traceback, chained causes included, and the next
section runs; in section 3 each eager size and each compiled run is its own such part);
``--sections 3,5`` runs only those sections; ``--pending-parts shares`` runs them with the local
backend holding pending sums of split contractions as equal shares (``set_pending_parts``):

1. values and gradients of the bench_sim transformer block in its three configurations
   (TP and DP on simulated meshes of the device), float32 and bfloat16, against the same
   block unsharded on the same device; HF Llama/Qwen2/Mistral/Gemma TP likewise; SDPA on each
   backend the device takes (flash, efficient, cuDNN, math) with heads split, and its collectives
   (plain, causal, grouped-query, masked, an uneven batch); ``sf.optim`` through torch's foreach
   and fused kernels against ``torch.optim``;
2. the fallback census (``tools/fallback_census.py``) on the device (target: no op);
3. ``bench_sim``'s three configurations at the GPU size (dim 1024, seq 256, batch 32) and the
   small size (dim 256, seq 64, batch 16), eager and under ``torch.compile``, with each step's
   peak memory (targets: <= 1.10x unsharded at GPU size, <= 2x small, compiled <= 1.10x); eager
   also on a bare wrapper subclass (no sharding: the floor of a per-op dispatch);
4. per-op overhead (``bench_dispatch``) on the device against the bare wrapper and DTensor on
   a 1-rank NCCL group (gloo on CPU);
5. the dist backend on that 1-rank world: a block's loss and gradients against unsharded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's shardfn
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

import bench_dispatch  # noqa: E402
import bench_sim  # noqa: E402
import fallback_census  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402
from shardfn.backends.local import set_pending_parts  # noqa: E402

GPU_SIZE = {"dim": 1024, "heads": 16, "hidden": 4096, "seq": 256, "batch": 32}
SMALL_SIZE = dict(bench_sim.FULL)  # dim 256, heads 8, hidden 1024, seq 64, batch 16
# ``--quick`` (a smoke run: every section's code, little of its work): this configuration only
QUICK_CONFIG = "dp x tp (2, 4)"
# relative error (norm of the difference over the norm) allowed against unsharded
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def _report_failure(kind: str, title: str, failures: list[str]) -> None:
    """The exception being handled, with its whole traceback (every frame, chained causes);
    a CUDA error is asynchronous, so where it surfaced may not be where it arose."""
    failures.append(title)
    say(f"{kind} FAILED: {title}")
    say(traceback.format_exc())
    err, chain = sys.exc_info()[1], []
    while err is not None and len(chain) < 20:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    if any("CUDA" in m for m in chain) and os.environ.get("CUDA_LAUNCH_BLOCKING") != "1":
        say("  (a CUDA error surfaces at a later call: rerun with CUDA_LAUNCH_BLOCKING=1 "
            "and --sections of the failing one to see the launch that failed)")


@contextlib.contextmanager
def section(title: str, failures: list[str]) -> Iterator[None]:
    """One section: its title, its time; an exception is printed and counted, not raised."""
    say(f"\n=== {title} ===")
    t0 = time.perf_counter()
    try:
        yield
    except Exception:  # noqa: BLE001 - report and go on with the next section
        _report_failure("SECTION", title, failures)
    say(f"--- {title}: {time.perf_counter() - t0:.1f} s")


@contextlib.contextmanager
def part(title: str, failures: list[str]) -> Iterator[None]:
    """One run inside a section: a failure is reported like a section's and the next part runs."""
    try:
        yield
    except Exception:  # noqa: BLE001 - report and go on with the next part
        _report_failure("PART", title, failures)


def rel_err(got: Any, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (got may be a ShardedArray)."""
    if isinstance(got, sf.ShardedArray):
        got = got.full_tensor()
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _verdict(err: float, dtype: torch.dtype) -> str:
    return "ok" if err <= TOL[dtype] else f"FAIL (> {TOL[dtype]:g})"


# -- 1. values and gradients ----------------------------------------------------------------------


def block_loss_and_grads(params: dict[str, Any], cfg: dict[str, int], device: str,
                         dtype: torch.dtype, mesh: sf.Mesh | None) -> tuple[Any, list]:
    x, y = bench_sim.make_batch(cfg, 0, device, dtype)
    if mesh is not None:
        x, y = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(y, P("dp"), mesh=mesh)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = bench_sim.loss_fn(params, x, y, cfg["heads"])
    return loss, list(torch.autograd.grad(loss, list(params.values())))


def check_block_values(cfg: dict[str, int], device: str, quick: bool = False) -> list[str]:
    """The block's loss and gradients in every bench_sim configuration vs unsharded
    (``quick``: bfloat16 in the Megatron configuration only)."""
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        plain = bench_sim.init_params(cfg, device=device, dtype=dtype)
        want_loss, want_grads = block_loss_and_grads(plain, cfg, device, dtype, None)
        for config, (shape, names, specs) in bench_sim.CONFIGS.items():
            if quick and dtype != torch.float32 and config != QUICK_CONFIG:
                continue
            mesh = sf.Mesh(shape, names, backend="local", device_type=device)
            params = {k: sf.distribute(v, (specs or {}).get(k, P()), mesh=mesh) for k, v in plain.items()}
            loss, grads = block_loss_and_grads(params, cfg, device, dtype, mesh)
            err = max([rel_err(loss, want_loss)] + [rel_err(g, w) for g, w in zip(grads, want_grads)])
            where = sorted({str(g.full_tensor().device) if isinstance(g, sf.ShardedArray) else str(g.device)
                            for g in grads})
            say(f"  block {config:16s} {str(dtype)[6:]:9s} loss + {len(grads)} grads: worst rel err {err:.1e} "
                f"{_verdict(err, dtype)}  (grads on {', '.join(where)})")
            if err > TOL[dtype]:
                bad.append(f"block {config} {dtype}")
    return bad


def check_hf_values(device: str, quick: bool) -> list[str]:
    """HF families TP-sharded (tp=2, local backend) vs unsharded, loss and gradients
    (``quick``: the first family in float32)."""
    families = fallback_census.hf_families()
    if quick:
        families = dict(list(families.items())[:1])
    if not families:
        say("  transformers not installed: HF families skipped")
        return []
    bad = []
    for name, build in families.items():
        for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = build().to(device=device, dtype=dtype)
            params = {n: p.detach().requires_grad_() for n, p in model.named_parameters()}
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            out = torch.func.functional_call(model, params, (ids.to(device),))
            want_loss = out.logits.float().pow(2).mean()
            want = dict(zip(params, torch.autograd.grad(want_loss, list(params.values()))))
            mesh = sf.Mesh((2,), ("tp",), backend="local", device_type=device)
            loss, grads = fallback_census._hf_step(build, mesh, device, dtype)
            err = max([rel_err(loss, want_loss)] + [rel_err(grads[n], want[n]) for n in want])
            say(f"  {name:8s} tp=2 {str(dtype)[6:]:9s} loss + {len(want)} grads: worst rel err {err:.1e} "
                f"{_verdict(err, dtype)}")
            if err > TOL[dtype]:
                bad.append(f"{name} {dtype}")
    return bad


def check_attention_values(device: str, quick: bool) -> list[str]:
    """``F.scaled_dot_product_attention`` on every backend this device takes the call on (flash,
    efficient, cuDNN, math: the kernels torch picks on CUDA), batch over dp and heads over tp:
    output and q/k/v gradients against the same backend unsharded, and the collectives counted
    (target: none, heads stay split)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=device)
    b, h, s, d = (4, 4, 8, 16) if quick else (4, 8, 128, 64)
    g = torch.Generator().manual_seed(0)
    backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                SDPBackend.MATH)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for case in ("plain", "causal", "gqa", "mask", "uneven"):  # uneven: batch 3 over 'dp', each device's own call
            bb = b - 1 if case == "uneven" else b
            q, k, v = (torch.randn(bb, 2 if case == "gqa" and i else h, s, d, generator=g).to(device, dtype)
                       for i in range(3))
            kw: dict = {"causal": {"is_causal": True}, "gqa": {"enable_gqa": True}, "uneven": {"is_causal": True},
                        "mask": {"attn_mask": torch.randn(b, 1, s, s, generator=g).to(device, dtype)}}.get(case, {})
            for backend in backends:
                plain = [t.clone().requires_grad_() for t in (q, k, v)]
                try:
                    with sdpa_kernel(backend):
                        want = F.scaled_dot_product_attention(*plain, **kw)
                        wgrads = torch.autograd.grad(want.float().pow(2).sum(), plain)
                except RuntimeError:
                    continue  # this backend does not take this call on this device: torch's business
                ins = [sf.distribute(t, P("dp", "tp"), mesh=mesh).requires_grad_() for t in (q, k, v)]
                skw = {n: sf.distribute(m, P("dp"), mesh=mesh) if isinstance(m, torch.Tensor) else m
                       for n, m in kw.items()}
                with sdpa_kernel(backend), sf.debug.CommCounter() as cc:
                    out = F.scaled_dot_product_attention(*ins, **skw)
                    grads = torch.autograd.grad(out.float().pow(2).sum(), ins)
                err = max([rel_err(out, want)] + [rel_err(a, w) for a, w in zip(grads, wgrads)])
                moved = len(cc.records)
                say(f"  sdpa {backend.name.lower():19s} {case:6s} {str(dtype)[6:]:9s} {moved} collectives; out + 3 grads: "
                    f"worst rel err {err:.1e} {_verdict(err, dtype) if not moved else 'FAIL (collectives: target 0)'}")
                if err > TOL[dtype] or moved:
                    bad.append(f"sdpa {backend.name} {case} {dtype}")
    return bad


def check_optim_values(device: str, quick: bool) -> list[str]:
    """``sf.optim`` through torch's multi-tensor kernels (``foreach=True``, and ``fused=True``, which
    reach CUDA-only ``_fused_*`` kernels) on split parameters, even and uneven, three steps,
    against the ``torch.optim`` class of the same name stepping the unsharded tensors."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=device)
    g = torch.Generator().manual_seed(0)
    shapes = {"w": ((8, 16), P("dp", "tp")), "odd": ((7, 10), P("tp", "dp")), "b": ((16,), P("tp"))}
    plain = {n: torch.randn(sh, generator=g).to(device) for n, (sh, _) in shapes.items()}
    grads = [{n: torch.randn(sh, generator=g).to(device) for n, (sh, _) in shapes.items()} for _ in range(3)]
    variants = [("AdamW", {"foreach": True}), ("Adam", {"foreach": True}), ("SGD", {"momentum": 0.9, "foreach": True})]
    if device == "cuda":  # the fused kernels are CUDA's (and CPU's in recent torch; not worth the time there)
        variants += [("AdamW", {"fused": True}), ("Adam", {"fused": True}), ("SGD", {"momentum": 0.9, "fused": True})]
    bad = []
    for name, kw in variants:
        lr = 1e-2
        ref = {n: t.clone().requires_grad_() for n, t in plain.items()}
        topt = getattr(torch.optim, name)(list(ref.values()), lr=lr, **kw)
        opt = getattr(sf.optim, name)(lr, **kw)
        params = {n: sf.distribute(plain[n], spec, mesh=mesh) for n, (_, spec) in shapes.items()}
        state = opt.init(params)
        for step in grads:
            for n, t in ref.items():
                t.grad = step[n].clone()
            topt.step()
            params, state = opt.step(params, {n: sf.distribute(step[n], shapes[n][1], mesh=mesh) for n in step}, state)
        err = max(rel_err(params[n], ref[n]) for n in ref)
        tag = ", ".join(f"{k}={v}" for k, v in kw.items())
        say(f"  sf.optim.{name}({tag}) 3 steps, even and uneven splits: worst rel err vs torch.optim {err:.1e} "
            f"{_verdict(err, torch.float32)}")
        if err > TOL[torch.float32]:
            bad.append(f"optim {name} {tag}")
    return bad


# -- 2. census --------------------------------------------------------------------------------------


def census(device: str, quick: bool) -> None:
    if device == "cuda":
        rows = fallback_census.run_census("cuda", [torch.float32, torch.bfloat16], ["auto"])
    else:  # the meta kernels stand in for CUDA's; SDPA routed to the kernel CUDA would pick
        only = ["block", "llama"] if quick else None
        rows = fallback_census.run_census("meta", [torch.float32, torch.bfloat16], ["cuda"], only)
    say(fallback_census.report(rows))


# -- 3. bench_sim -----------------------------------------------------------------------------------


def _peak_line(peaks: dict) -> str:
    if not peaks:
        return ""
    base = peaks.get(None)
    parts = [f"unsharded {base / 2**20:.0f} MB"] if base else []
    for config, b in peaks.items():
        if config is not None:
            parts.append(f"{config} {b / 2**20:.0f} MB ({b / base:.2f}x)" if base else f"{config} {b / 2**20:.0f} MB")
    return "  step peak memory above resident: " + "; ".join(parts)


def sim_runs(device: str, quick: bool, budget_s: float, start: float, failures: list[str]) -> None:
    import torch._dynamo  # noqa: F401 - its counters
    sizes = {"quick": bench_sim.QUICK} if quick else {"GPU": GPU_SIZE, "small": SMALL_SIZE}
    steps = 1 if quick else 10  # a time is the fastest step after the first
    configs = (QUICK_CONFIG,) if quick else tuple(bench_sim.CONFIGS)
    rtol = 1e-5 if device == "cpu" else 1e-3  # other kernels for other shapes on a GPU
    for label, cfg in sizes.items():
        with part(f"3. eager, {label} size", failures):
            peaks: dict = {}
            rows, losses = bench_sim.measure(cfg, steps, device=device, rtol=rtol, configs=configs, peaks=peaks,
                                              bare=True)
            say(f"[eager, {label} size] " + bench_sim.report(cfg, rows, losses, rtol))
            if peaks:
                say(_peak_line(peaks))
    backend = "inductor" if device == "cuda" else "aot_eager"
    for label, cfg in sizes.items():
        for config in configs:
            if time.perf_counter() - start > budget_s:
                say(f"[compiled, {label} size, {config}] skipped: over the --budget of {budget_s:.0f} s")
                continue
            with part(f"3. compiled {backend}, {label} size, {config}", failures):
                torch._dynamo.reset()
                peaks = {}
                rows, losses = bench_sim.measure(cfg, max(steps // 2, 2), device=device, compile_backend=backend,
                                                 rtol=rtol * 10, configs=(config,), peaks=peaks)
                (_, w0, w, c0, c), = rows
                say(f"[compiled {backend}, {label} size] {config:16s} unsharded {w0 * 1e3:.2f} ms, "
                    f"simulated {w * 1e3:.2f} ms, {w / w0:.2f}x (CPU {c / c0:.2f}x)"
                    + (_peak_line(peaks) if peaks else ""))
    counters = torch._dynamo.utils.counters
    ind, aot = counters["inductor"], counters["aot_autograd"]
    say(f"inductor FX graph cache: {ind['fxgraph_cache_hit']} hits, {ind['fxgraph_cache_miss']} misses, "
        f"{ind['fxgraph_cache_bypass']} bypasses; AOTAutograd cache: {aot['autograd_cache_hit']} hits, "
        f"{aot['autograd_cache_miss']} misses, {aot['autograd_cache_bypass']} bypasses")


# -- 4 and 5. one 1-rank process group --------------------------------------------------------------


def per_op(device: str, quick: bool, world: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = bench_dispatch.measure(20 if quick else 1000, 3 if quick else 10, device=device)
        say(bench_dispatch.report(times, world))
    finally:
        torch.set_num_threads(threads)


def dist_values(device: str, quick: bool) -> None:
    """The block on the dist backend's 1-rank world (Megatron specs on a (1, 1) mesh)."""
    cfg = bench_sim.QUICK if quick else SMALL_SIZE
    mesh = sf.Mesh((1, 1), ("dp", "tp"), backend="dist", device_type=device)
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        plain = bench_sim.init_params(cfg, device=device, dtype=dtype)
        want_loss, want_grads = block_loss_and_grads(plain, cfg, device, dtype, None)
        params = {k: sf.distribute(v, bench_sim.MEGATRON.get(k, P()), mesh=mesh) for k, v in plain.items()}
        loss, grads = block_loss_and_grads(params, cfg, device, dtype, mesh)
        err = max([rel_err(loss, want_loss)] + [rel_err(g, w) for g, w in zip(grads, want_grads)])
        say(f"  dist backend, 1-rank world, {str(dtype)[6:]:9s} loss + grads: worst rel err {err:.1e} "
            f"{_verdict(err, dtype)}")
        if dtype == torch.float32:
            timed = {}
            for name, ps in (("unsharded", plain), ("dist", params)):
                block_loss_and_grads(ps, cfg, device, dtype, mesh if name == "dist" else None)  # warm
                bench_sim._sync(device)
                t0 = time.perf_counter()
                for _ in range(3):
                    block_loss_and_grads(ps, cfg, device, dtype, mesh if name == "dist" else None)
                bench_sim._sync(device)
                timed[name] = (time.perf_counter() - t0) / 3
            say(f"  fwd+bwd step: unsharded {timed['unsharded'] * 1e3:.2f} ms, dist {timed['dist'] * 1e3:.2f} ms "
                f"({timed['dist'] / timed['unsharded']:.2f}x)")


def with_world(device: str, fns: list[tuple[str, Callable[[], None]]], failures: list[str]) -> None:
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if device == "cuda":
                torch.cuda.set_device(0)
            bench_dispatch._init_world(tmp, backend)
        except Exception:  # noqa: BLE001
            say(f"\n=== 1-rank {backend} world: could not start ===")
            _report_failure("WORLD", f"1-rank {backend} world", failures)
            return
        try:
            for title, fn in fns:
                with section(title, failures):
                    fn()
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: tiny sizes, one step timed, one configuration, bfloat16 checked once")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds after which the remaining compiled runs are skipped")
    ap.add_argument("--sections", default="1,2,3,4,5", help="the sections to run, e.g. 3 or 3,5 (default: all)")
    ap.add_argument("--pending-parts", default="device", choices=("device", "shares"),
                    help="the local backend's pending parts for the whole run (shardfn.backends.local.set_pending_parts)")
    ns = ap.parse_args(argv)
    set_pending_parts(ns.pending_parts)
    try:
        wanted = {int(n) for n in ns.sections.split(",") if n.strip()}
    except ValueError:
        ap.error(f"--sections {ns.sections!r}: numbers 1-5 separated by commas")
    if not wanted or not wanted <= {1, 2, 3, 4, 5}:
        ap.error(f"--sections {ns.sections!r}: numbers 1-5 separated by commas")
    quick = ns.quick or os.environ.get("SHARDFN_BENCH_QUICK") == "1"
    device = ns.device
    start = time.perf_counter()
    failures: list[str] = []
    say(f"shardfn gpu_check: torch {torch.__version__}, python {sys.version.split()[0]}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if device == "cuda" else "")
        + (", quick" if quick else "") + f", pending parts: {ns.pending_parts}")
    if device == "cuda" and not torch.cuda.is_available():
        say("CUDA is not available: run with --device cpu --quick for a smoke run")
        return 2
    cfg = bench_sim.QUICK if quick else SMALL_SIZE
    bad: list[str] = []
    if 1 in wanted:
        with section("1. values and gradients vs unsharded (block: bench_sim configurations; HF: TP)", failures):
            bad += check_block_values(cfg, device, quick)
            bad += check_hf_values(device, quick)
            bad += check_attention_values(device, quick)
            bad += check_optim_values(device, quick)
            if bad:
                raise AssertionError(f"values differ from unsharded: {bad}")
    if 2 in wanted:
        with section(f"2. fallback census on {'cuda' if device == 'cuda' else 'meta (CUDA kernels routed)'}"
                     " (target: none)", failures):
            census(device, quick)
    if 3 in wanted:
        with section("3. bench_sim: simulated training step vs unsharded, eager and compiled", failures):
            sim_runs(device, quick, ns.budget, start, failures)
    world = "1-rank NCCL world" if device == "cuda" else "1-rank gloo world"
    in_world = [(f"4. per-op overhead on {device} ({world})", lambda: per_op(device, quick, world)),
                (f"5. dist backend on a {world}", lambda: dist_values(device, quick))]
    in_world = [item for n, item in zip((4, 5), in_world) if n in wanted]
    if in_world:
        with_world(device, in_world, failures)
    say(f"\ngpu_check done in {time.perf_counter() - start:.0f} s; "
        + (f"sections that failed: {', '.join(failures)}" if failures else "every section ran"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
