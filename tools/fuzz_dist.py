"""The differential fuzzer on 4 gloo processes: the dist backend against plain torch and the
simulated (local) mesh.

One world of 4 processes starts once and runs many random programs from ``tools/fuzz.py``'s
generator, drawn on 4-device meshes ((4,), (2, 2), (1, 4), (4, 1)) plus a family of shard_map
bodies using every ``sf.lax`` collective. Every rank draws the same program from the seed and
runs it on the dist backend (values, or gradients by autograd / ``torch.func``); rank 0
compares the gathered result with plain torch and with the same program on the local
backend, and checks that every rank gathered the same bits. Where torch raises, every rank
must raise the same error type. A rank that waits in a collective past the timeout, or
dies, fails the case in progress (a hang or crash, reported with its seed) and the world is
started again from the next seed.

    python tools/fuzz.py --dist --minutes 10     # prints cases run and failures
    python tools/fuzz.py --dist --replay SEED    # one case again
"""

from __future__ import annotations

import datetime
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn import P
from shardfn.backends import dist as sf_dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz  # noqa: E402  (the case generator; tools/ is not a package)

WORLD = 4
DIST_MESHES = [(4,), (2, 2), (1, 4), (4, 1)]
COLLECTIVE_TIMEOUT = 20.0  # seconds a rank waits in one collective before it counts as a hang
CASE_TIMEOUT = 90.0  # seconds without a finished case before the supervisor calls it a hang
START_TIMEOUT = 240.0  # seconds for a world to start (4 imports on a loaded machine)


# -- shard_map bodies with every sf.lax collective (each with its closed form on the plain tensor) ---


@fuzz.op("collective")
def collective(c: fuzz.Ctx, x: torch.Tensor) -> fuzz.Step | None:
    """shard_map bodies with the collectives ``transform`` leaves out: pmin, pmean, all_to_all,
    untiled all_gather, pshuffle, pbroadcast and a psum over two axes."""
    mesh, n = c.mesh, x.dim()
    if not n:
        return None
    d, a, size, even, spec_d, rep, smap = fuzz.smap_draw(c, x)  # smap's callers pass arrays only
    name = c.ch.choice(["pmin", "pmean", "all_to_all", "gather_stack", "pshuffle", "pbroadcast", "psum2"])

    def step(g: Callable, ref: Callable, desc: str) -> fuzz.Step:
        return fuzz.Step(f"smap_{name}", lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else ref(v), desc)

    desc = f"smap_{name}(axis={a!r}, dim={d})"
    flt = x.dtype.is_floating_point
    if name == "pmin" and flt and even and x.shape[d] > 0:
        return step(smap(lambda b: sf.lax.pmin(b.amin(d, keepdim=True), a), rep), lambda v: v.amin(d, keepdim=True), desc)
    if name == "pmean" and (flt or x.dtype.is_complex) and even and x.shape[d] > 0:
        return step(smap(lambda b: sf.lax.pmean(b.mean(d, keepdim=True), a), rep), lambda v: v.mean(d, keepdim=True), desc)
    if name == "all_to_all" and n >= 2 and even:
        g, e = fuzz.all_to_all_body(c, smap, a, d, tuple(x.shape), size)
        return None if g is None else step(g, lambda v: v.clone(), f"{desc[:-1]}, split={e})")
    if name == "gather_stack" and even and x.shape[d] > 0:
        blk = x.shape[d] // size
        g = smap(lambda b: sf.lax.all_gather(b, a, axis=0), P(*([None] * (n + 1))))
        return step(g, lambda v: torch.stack(torch.split(v, blk, d)), desc)
    if name == "pshuffle" and even and x.shape[d] > 0:
        pool, perm = list(range(size)), []
        while pool:
            perm.append(pool.pop(c.ch.integer(0, len(pool) - 1)))
        blk = x.shape[d] // size
        g = smap(lambda b: sf.lax.pshuffle(b, a, perm), spec_d)
        return step(g, lambda v: torch.cat([torch.split(v, blk, d)[p] for p in perm], d), f"{desc[:-1]}, perm={perm})")
    if name == "pbroadcast" and even and x.shape[d] > 0:
        src = c.ch.integer(0, size - 1)
        blk = x.shape[d] // size
        g = smap(lambda b: sf.lax.pbroadcast(b, a, src), spec_d)
        return step(g, lambda v: torch.cat([torch.split(v, blk, d)[src]] * size, d), f"{desc[:-1]}, source={src})")
    if name == "psum2" and mesh.ndim == 2 and fuzz._num(x.dtype):
        both = P(*[tuple(mesh.axis_names) if i == d else None for i in range(n)])
        g = smap(lambda b: sf.lax.psum(b.sum(d, keepdim=True), tuple(mesh.axis_names)), rep, both)
        return step(g, lambda v: v.sum(d, keepdim=True), f"smap_psum2(axes={mesh.axis_names}, dim={d})")
    return None


# -- one program: its reference, its run on a mesh, the verdict --------------------------------------


def draw(seed: int, backend: str, version: int = fuzz.GEN) -> fuzz.Case:
    """The program of ``seed`` on a 4-device mesh of ``backend`` (the same program on either),
    under the generator ``version`` (older seeds: theirs)."""
    return fuzz.draw_case(fuzz.Chooser(random.Random(seed)), seed, mesh_shapes=DIST_MESHES, backend=backend,
                          version=version)


def mesh_of(case: fuzz.Case, backend: str) -> sf.Mesh:
    return sf.Mesh(case.mesh_shape, fuzz.NAMES[: len(case.mesh_shape)], backend=backend)


def gathered(v: Any) -> Any:
    """Plain values of a result (a collective on dist: every rank calls it, in the same order)."""
    if isinstance(v, sf.ShardedArray):
        return v.full_tensor()
    if isinstance(v, (tuple, list)):
        return type(v)(gathered(t) for t in v)
    return v


def execute(case: fuzz.Case, mode: str, mesh: sf.Mesh | None) -> list[tuple[str, Any]]:
    """``case``'s program in ``mode`` on the plain tensors (``mesh`` None: the oracle) or laid
    out on ``mesh``: the named results, gathered."""
    x = case.x
    lift = (lambda a: a.plain) if mesh is None else (lambda a: a.sharded)

    def f(v: Any) -> Any:
        return fuzz._chain(case.steps, v, lift)

    def put(t: torch.Tensor, spec: P) -> Any:
        return t if mesh is None else sf.distribute(t, spec, mesh=mesh)

    X = x if mesh is None else fuzz.lay_out(x, case.spec, mesh, torch.Generator().manual_seed(7))
    tg = torch.Generator().manual_seed(8)
    if mode == "value":
        out = [("value", f(X))]
    elif mode == "grad":
        xs = x.clone().requires_grad_()
        y = f(put(xs, case.spec))
        (g,) = torch.autograd.grad(fuzz._scalar_loss(y), xs, allow_unused=True)
        out = [("value", y.detach()), ("grad", g if g is not None else torch.zeros_like(x))]
    elif mode == "func_grad":
        out = [("func.grad", torch.func.grad(lambda v: fuzz._scalar_loss(f(v)))(X)), ("value", f(X))]
    elif mode == "jvp":
        tan = fuzz.make_tensor(tuple(x.shape), x.dtype, tg)
        y, t = torch.func.jvp(f, (X,), (put(tan, case.spec),))
        out = [("jvp primal", y), ("jvp tangent", t)]
    elif mode == "vjp":
        y, back = torch.func.vjp(f, X)
        ct = fuzz.make_tensor(tuple(y.shape), y.dtype, tg)
        out = [("value", y), ("vjp cotangent", back(ct)[0])]
    elif mode == "vmap":
        xb = torch.stack([x, x * 2 if x.dtype != torch.bool else ~x])
        out = [("vmap", torch.func.vmap(f)(put(xb, P(None, *tuple(case.spec))))), ("value", f(X))]
    else:
        raise ValueError(f"mode {mode!r}")
    return [(what, gathered(v)) for what, v in out]


def reference(case: fuzz.Case) -> tuple[str, list | None, BaseException | None]:
    """The mode the case runs in (as ``fuzz.run_case`` picks it: values only where torch cannot
    transform the program) and torch's results, or torch's error."""
    try:
        value = execute(case, "value", None)[0][1]
    except Exception as e:  # noqa: BLE001
        return "value", None, e
    mode = case.mode
    if mode.startswith("compile") or not isinstance(value, torch.Tensor):
        mode = "value"
    if mode in ("grad", "func_grad") and not value.dtype.is_floating_point:
        mode = "value"
    if mode in ("jvp", "vjp") and not (value.dtype.is_floating_point or value.dtype.is_complex):
        mode = "value"
    if mode == "value":
        return mode, [("value", value)], None
    try:
        return mode, execute(case, mode, None), None
    except Exception:  # noqa: BLE001 - torch cannot transform it: values only
        return "value", [("value", value)], None


def _digest(outs: list[tuple[str, Any]]) -> str:
    h = hashlib.sha1()
    for what, v in outs:
        h.update(what.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            if t._is_zerotensor():  # torch.func's zero gradients hold no memory
                t = torch.zeros(t.shape, dtype=t.dtype)
            # fresh memory: contiguous() keeps an expanded size-1 value's 0 stride, which view(uint8) rejects
            # (seed 5791219228 --dist: the vjp cotangent of v[..., :1].sum() on a [1, 1] input)
            t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
            h.update(f"{t.dtype}{tuple(v.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}\n{fuzz._where(e)}"


def run_rank(case: fuzz.Case, mode: str) -> tuple[dict, list | None]:
    """This rank's run of ``case`` on the dist backend: a report every rank shares (its error
    type or the digest of what it gathered) and the results. A :class:`CollectiveError` (a
    timed-out or failed collective: the world is broken) propagates."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = execute(case, mode, mesh_of(case, "dist"))
        return {"err": None, "digest": _digest(outs)}, outs
    except sf_dist.CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001
        print(f"seed {case.seed}: this rank raised\n{traceback.format_exc()}", flush=True)  # the rank's log
        return {"err": type(e).__name__, "msg": _brief(e)}, None


def verdict(case: fuzz.Case, mode: str, ref: list | None, ref_err: BaseException | None, reports: list[dict],
            outs: list | None) -> str | None:
    """Rank 0's judgement of one case: None when every rank agrees with torch and with the local
    backend, else what differs."""
    prec = case.loosest or case.x.dtype
    errs = {r: rep["err"] for r, rep in enumerate(reports) if rep["err"] is not None}
    if ref_err is not None:
        if len(errs) < len(reports):
            ok = [r for r in range(len(reports)) if r not in errs]
            return f"torch raised {type(ref_err).__name__}: {str(ref_err)[:200]}; ranks {ok} returned"
        if len(set(errs.values())) > 1:
            return f"ranks raise different errors: {errs}\n" + reports[0]["msg"]
        local_err = _local(case, mode)[1]
        if local_err is None:
            return f"torch raised {type(ref_err).__name__}: {str(ref_err)[:200]}; the local backend returned"
        return None
    if errs:
        r = min(errs)
        return f"shardfn (dist) raised where torch did not on ranks {sorted(errs)}: rank {r}: {reports[r]['msg']}"
    if len({rep["digest"] for rep in reports}) > 1 and not any(st.name in fuzz.RUN_TO_RUN for st in case.steps):
        return f"ranks gathered different values: {[rep['digest'][:8] for rep in reports]}"
    try:
        got = dict(outs)
        for what, want in ref:
            mine, want = _undone(case, what, got[what], want, "dist vs torch")
            fuzz._compare(mine, want, f"dist vs torch: {what}", prec, _value_inverse(case, what))
    except fuzz.Mismatch as e:
        return str(e)
    local, local_err = _local(case, mode)
    if local_err is not None:
        return f"the local backend raised where dist and torch did not: {_brief(local_err)}"
    try:
        for (what, a), (_, b) in zip(outs, local):
            a, b = _undone(case, what, a, b, "dist vs local")
            fuzz._compare(a, b, f"dist vs local: {what}", prec, _value_inverse(case, what))
    except fuzz.Mismatch as e:
        return str(e)
    return None


def _undone(case: fuzz.Case, what: str, got: Any, want: Any, label: str) -> tuple[Any, Any]:
    """Values compared as the last step's source values where it reinterprets bits
    (``fuzz._undone_pair``, as the single-process oracle does): a ring's order of a psum's
    additions changes a float's low bits, which ``view(dtype)`` turns into whole integers
    (seeds 5846871460, 5846873704: byte views 64 apart)."""
    return fuzz._undone_pair(case, got, want, f"{label}: {what}") if what in ("value", "vmap") else (got, want)


def _value_inverse(case: fuzz.Case, what: str) -> Callable | None:
    """The last step's inverse for values (``fuzz.Step.inverse``), none for gradients."""
    return fuzz._inverse(case) if what in ("value", "vmap") else None


def _local(case: fuzz.Case, mode: str) -> tuple[list | None, BaseException | None]:
    """The same program on the local backend (drawn again from the seed, on the local twin)."""
    twin = draw(case.seed, "local")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return execute(twin, mode, mesh_of(twin, "local")), None
    except Exception as e:  # noqa: BLE001
        return None, e


# -- the world: workers and their supervisor --------------------------------------------------------


def _worker(rank: int, port: int, first: int, limit: int | None, deadline: float, out_dir: str) -> None:
    """One rank: run cases from seed ``first`` until ``deadline`` or ``limit`` cases (rank 0
    decides, so every rank stops after the same case); rank 0 appends one JSON line per case."""
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()  # a rank killed by a signal (SIGFPE, SIGSEGV) logs its Python stack
    torch.set_num_threads(1)
    sf_dist.configure(timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=2 * COLLECTIVE_TIMEOUT + 10))
    results = open(os.path.join(out_dir, "results.jsonl"), "a") if rank == 0 else None
    seed, n = first, 0
    while True:
        go = [time.time() < deadline and (limit is None or n < limit)]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        with open(os.path.join(out_dir, f"rank{rank}.seed"), "w") as f:
            f.write(str(seed))
        try:
            case = draw(seed, "dist")
            mode, ref, ref_err = reference(case)
            report, outs = run_rank(case, mode)
        except sf_dist.CollectiveError as e:
            print(f"seed {seed}: {_brief(e)}", flush=True)
            os._exit(3)  # the world is broken: the supervisor records the case and starts another
        except Exception:  # noqa: BLE001 - a harness error on this rank
            case, report, outs = None, {"err": "harness", "msg": traceback.format_exc()[-2000:]}, None
        reports: list = [None] * WORLD
        dist.all_gather_object(reports, report)
        if rank == 0:
            if case is None or any(r["err"] == "harness" for r in reports):
                res = "harness error: " + next(r["msg"] for r in reports if r["err"] == "harness")
            else:
                try:
                    res = verdict(case, mode, ref, ref_err, reports, outs)
                    if res is not None and fuzz._oracle_unsettled(case):
                        res = None  # torch's value is not one value (``fuzz.run_case``)
                except Exception:  # noqa: BLE001
                    res = "harness error in the verdict: " + traceback.format_exc()[-2000:]
            line = {"seed": seed, "fail": res, "desc": case.describe() if case else "",
                    "steps": [s.name for s in case.steps] if case else []}
            results.write(json.dumps(line) + "\n")
            results.flush()
        if len({r["err"] is None for r in reports}) > 1:
            os._exit(4)  # some ranks raised, others ran on: their collectives may not pair up any more; a fresh world
        seed, n = seed + 1, n + 1
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def supervise(first: int, *, minutes: float | None = None, cases: int | None = None, show: Callable = print,
              max_print: int = 40, log_chars: int = 600) -> tuple[int, int, dict]:
    """Run worlds from seed ``first`` for ``minutes`` or ``cases`` cases, restarting a world after
    a hang or crash (the case in progress fails). Returns (cases run, failures, failure kinds)."""
    end = time.time() + minutes * 60 if minutes is not None else float("inf")
    runs = fails = 0
    kinds: dict[str, int] = {}
    seed, empty = first, 0
    ctx = mp.get_context("fork")  # the supervisor computes nothing with torch: forking it is safe

    def record(s: int, res: str | None, desc: str, steps: list) -> None:
        nonlocal runs, fails
        runs += 1
        if not res:
            return
        fails += 1
        key = res.split(":")[0][:60] + " | " + " > ".join(steps)
        kinds[key] = kinds.get(key, 0) + 1
        if fails <= max_print:
            show(f"FAIL seed {s}  (python tools/fuzz.py --dist --replay {s})\n{desc}\n  " + res.replace("\n", "\n  "))

    while time.time() < end and (cases is None or runs < cases):
        out = tempfile.mkdtemp(prefix="shardfn-fuzzd-")
        port = _free_port()
        left = None if cases is None else cases - runs
        procs = [ctx.Process(target=_worker, args=(r, port, seed, left, end, out), daemon=True) for r in range(WORLD)]
        for p in procs:
            p.start()
        path, pos, finished = os.path.join(out, "results.jsonl"), 0, runs
        last = time.time() + START_TIMEOUT - CASE_TIMEOUT  # the first case may wait for the start-up
        broken = None
        while True:
            time.sleep(0.2)
            dead = all(not p.is_alive() for p in procs)  # then read what they wrote last
            if os.path.exists(path):
                with open(path) as f:
                    f.seek(pos)
                    chunk = f.read()
                done = chunk[: chunk.rfind("\n") + 1]
                pos += len(done.encode())
                for ln in done.splitlines():
                    r = json.loads(ln)
                    record(r["seed"], r["fail"], r["desc"], r["steps"])
                    seed, last = r["seed"] + 1, time.time()
            if dead:
                if all(p.exitcode == 4 for p in procs):  # the case is recorded: a fresh world from the next seed
                    break
                if any(p.exitcode for p in procs):
                    broken = "crashed"
                break
            if any(p.exitcode not in (0, 4) for p in procs if not p.is_alive()):
                broken = "crashed"
                break
            if time.time() - last > CASE_TIMEOUT:
                broken = "hung"
                break
        if broken is None:
            continue
        empty = empty + 1 if finished == runs else 0
        if empty >= 3:
            raise RuntimeError(f"three worlds in a row ended before finishing a case; logs in {out}")
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        logs = "\n".join(f"rank {r} log: ...{_tail(os.path.join(out, f'rank{r}.log'), log_chars)}" for r in range(WORLD)
                         if _tail(os.path.join(out, f"rank{r}.log")))
        desc = ""
        try:
            desc = draw(seed, "local").describe()
        except Exception as e:  # noqa: BLE001
            desc = f"(drawing the case raised {e!r})"
        record(seed, f"hang or crash: the world {broken} (exit codes {codes}) in seed {seed}\n{logs}", desc, ["hang"])
        seed += 1
    return runs, fails, kinds


def main(a: Any) -> int:
    """``tools/fuzz.py --dist`` (its parsed arguments ``a``)."""
    if a.replay is not None:
        print(draw(a.replay, "local").describe())
        runs, fails, _ = supervise(a.replay, cases=1, max_print=1, log_chars=6000)
        print("ok" if not fails else "")
        return 1 if fails else 0
    seed = a.seed if a.seed is not None else int(time.time()) % 10_000_000 * 1000
    runs, fails, kinds = supervise(seed, minutes=a.minutes, cases=a.cases, max_print=a.max_print,
                                   show=lambda s: print(s, flush=True))
    print(f"cases run: {runs}, failures: {fails}")
    for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {k}")
    return 1 if fails else 0
