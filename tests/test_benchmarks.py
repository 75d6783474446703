"""Smoke runs of the benchmarks in quick mode: they run, check their own results, print figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, SHARDFN_BENCH_QUICK="1", PYTHONPATH=str(BENCH.parent))
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("op", ["add", "mul_scalar", "addmm", "sum", "relu", "softmax"])
def test_bench_dispatch_reports_every_op(op: str, dispatch_output: str) -> None:
    rows = [line.split() for line in dispatch_output.splitlines() if line.startswith(op + " ")]
    assert len(rows) == 2  # the absolute table and the overhead table
    assert len(rows[0]) == 6 and all(float(v) > 0 for v in rows[0][1:])


@pytest.fixture(scope="module")
def dispatch_output() -> str:
    return _run("bench_dispatch.py")


def test_bench_sim_checks_losses_and_prints_ratios() -> None:
    out = _run("bench_sim.py")
    for config in ("dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)", "bare wrapper"):  # the last: the reference floor
        row = next(line for line in out.splitlines() if line.startswith(config))
        assert len(row.split()) >= 7 and all(float(v.rstrip("x")) > 0 for v in row.split()[-6:])
    assert "losses equal unsharded" in out


def test_bench_compiled_host_splits_the_compiled_step() -> None:
    out = _run("bench_compiled_host.py", "--config", "dp (8,)")
    rows = {line[16:30].strip(): line.split() for line in out.splitlines() if line.startswith("dp (8,)")}
    assert set(rows) == {"guard", "forward", "fwd graph", "fwd rewrap", "backward", "bwd graph", "bwd rewrap",
                         "bwd dispatch", "reshards", "update", "step"}
    assert float(rows["step"][-1].rstrip("x")) > 1 and float(rows["bwd rewrap"][-2]) > 0  # sharded: more calls; rewraps
    assert "losses equal unsharded" in out


def test_bench_checkpoint_checks_round_trip_and_prints_ratio() -> None:
    out = _run("bench_checkpoint.py")
    row = out.strip().splitlines()[-1].split()
    assert len(row) == 3 and row[-1].endswith("x") and all(float(v.rstrip("sx")) > 0 for v in row)


def test_bench_optim_prints_ratios_and_zero1_memory() -> None:
    out = _run("bench_optim.py")
    for run in ("torch foreach", "sf foreach", "sf fused", "sf fused zero1"):
        row = next(line for line in out.splitlines() if line.startswith(run + " "))
        assert float(row.split()[-2]) > 0 and row.split()[-1].endswith("x")
    assert "(0.50x)" in out and "results equal torch.optim.AdamW" in out


def test_bench_comm_models_counts_hf_llama_beside_megatron() -> None:
    pytest.importorskip("transformers")
    out = _run("bench_comm_models.py")
    rows = {" ".join(line.split()[:3]): line for line in out.splitlines() if line.startswith("llama ")}
    assert set(rows) == {"llama tp fwd", "llama seq fwd"}, out
    # a row-parallel layer's pending sum is reduced where it is first read (the next norm),
    # so the per-layer split can shift; the totals are Megatron's
    assert "all_reduce 4 all_reduce 4" in " ".join(rows["llama tp fwd"].split())
    assert "all_gather 2, reduce_scatter 2 all_gather 2, reduce_scatter 2" in " ".join(rows["llama seq fwd"].split())
    assert "values and gradients equal unsharded" in out
    assert "model.layers.0" in out and "FORWARD: all_reduce 1" in out  # the records tree


def test_gpu_check_runs_every_section_on_cpu() -> None:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--quick"], env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0 and "every section ran" in out, out[-3000:] + proc.stderr[-3000:]
    for title in ("1. values and gradients", "2. fallback census", "3. bench_sim", "4. per-op overhead",
                  "5. dist backend"):
        assert f"=== {title}" in out and f"--- {title}" in out
    assert "FAIL" not in out
    values = [line for line in out.splitlines() if "worst rel err" in line]
    assert len(values) >= 5 and all(line.rstrip().endswith(("ok", ")")) for line in values)
    assert "distinct ops that fell back: 0; runs that raised: 0" in out  # the CUDA kernels have rules
    assert "[compiled aot_eager, quick size] dp x tp (2, 4)" in out


def test_bench_uneven_gather_prints_both_figures() -> None:
    out = _run("bench_uneven_gather.py")
    rows = {r[0]: r for r in map(str.split, out.splitlines()) if len(r) == 6 and r[0] in ("even", "uneven")}
    assert set(rows) == {"even", "uneven"}
    even, uneven = (float(rows[c][3].rstrip("x")) for c in ("even", "uneven"))
    assert uneven <= 1.1 * even  # one copy per distinct value (issue 25)


def test_census_sim_equals_a_cpu_run_and_covers_every_configuration() -> None:
    out = _run("census_sim.py")
    assert out.startswith("meta census == CPU census")
    rows = {line[:16].strip(): line[16:].split() for line in out.splitlines()[3:] if line.strip()}
    assert set(rows) == {"unsharded", "dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)"}
    base = rows["unsharded"]
    assert int(base[0]) > 0 and int(base[1]) == 18 and float(base[4]) > 0  # kernels, 18 gemms, MB
    for config in ("dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)"):
        kernels, gemms, attn = map(int, rows[config][:3])
        assert kernels > 0 and gemms == 18 and attn == 2  # attention: one call forward, one backward
        assert float(rows[config][3]) >= float(base[3])  # flops: never fewer than unsharded


def test_count_sim_counts_every_configuration() -> None:
    out = _run("count_sim.py")
    rows = {line[:16].strip(): line[16:].split() for line in out.splitlines()[2:] if line.strip()}
    assert set(rows) == {"unsharded", "dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)"}
    assert rows["unsharded"][0] == "0" and int(rows["unsharded"][2]) > 0  # no ShardedArray, plain ops counted
    for config in ("dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)"):
        dispatches, slow, shard_ops, calls = map(int, rows[config])
        assert dispatches > 0 and 0 <= slow < dispatches and shard_ops > 0 and calls > dispatches
