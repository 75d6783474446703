"""Smoke runs of the benchmarks in quick mode: they run, check their own results, print figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str) -> str:
    env = dict(os.environ, SHARDFN_BENCH_QUICK="1", PYTHONPATH=str(BENCH.parent))
    proc = subprocess.run([sys.executable, str(BENCH / script)], env=env, capture_output=True, text=True,
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
    for config in ("dp (8,)", "dp x tp (2, 4)", "dp of (2, 4)"):
        row = next(line for line in out.splitlines() if line.startswith(config))
        assert len(row.split()) >= 7 and all(float(v.rstrip("x")) > 0 for v in row.split()[-6:])
    assert "losses equal unsharded" in out


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
