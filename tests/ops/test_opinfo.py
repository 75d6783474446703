"""PyTorch's OpInfo database on sharded inputs: every op, several shardings, values and
gradients against plain torch (see ``opinfo_common``).

An op *passes* when all its sampled inputs, in every sharding config, give the torch
result (and gradients); it passes *with rules* when no call fell back to replicating
its inputs. Ops that fail are listed in ``XFAIL`` with the reason (strict: a fixed op
must leave the list). ``python tests/ops/test_opinfo.py`` prints every op's status.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import expecttest  # noqa: E402,F401  torch.testing._internal needs it: a missing test dependency fails here, not skips

sys.path.insert(0, os.path.dirname(__file__))
import opinfo_common as oc  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402
from shardfn.arrays import entries as _entries  # noqa: E402
from shardfn.values.schema import op_name  # noqa: E402

MESH = sf.Mesh(oc.MESH_SHAPE, oc.AXES, backend="local")
OPS = oc.op_db()
RESULTS: dict[str, str] = {}

XFAIL: dict[str, str] = {
    'sparse.sampled_addmm': 'sparse layouts are not supported',
    'sparse.mm.reduce': 'sparse layouts are not supported',
    'to_sparse': 'sparse layouts are not supported',
    'tensor_split': 'tensor indices_or_sections are read with item() while shapes are propagated on meta tensors',
    'as_strided.partial_views': 'as_strided addresses storage offsets, which shards do not share',
}

# Ops whose samples write into an array the caller holds: raising ImmutableError (array
# unchanged) is the designed behaviour (see docs/architecture.md, Immutability). (OpInfo's
# ``zero_`` and ``resize_as_`` write into a clone of their input, a fresh array that takes
# writes: they compare with torch like any other op, as does ``gaussian_nll_loss``, whose
# ``var.clamp_`` writes into its own clone.)
RAISES: dict[str, str] = {
    'native_batch_norm': 'updates the running stats (arrays) in place',
    'nn.functional.batch_norm': 'updates the running stats (arrays) in place',
    '_batch_norm_with_update': 'updates the running stats (arrays) in place',
    'nn.functional.instance_norm': 'updates the running stats (arrays) in place',
}


class _FallbackCounter:
    """Counts calls that ran through the replicate-everything fallback."""

    def __init__(self) -> None:
        self.n = 0
        self.ops: set[str] = set()
        self._orig = _entries._Fallback.run

    def __enter__(self) -> "_FallbackCounter":
        counter, orig = self, self._orig

        def run(entry: Any, *a: Any, **k: Any) -> Any:
            counter.n += 1
            counter.ops.add(op_name(entry.func))
            return orig(entry, *a, **k)

        _entries._Fallback.run = run
        return self

    def __exit__(self, *exc: Any) -> None:
        _entries._Fallback.run = self._orig


def _distribute(tree: Any, config: str) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dims = oc.placement_dims(config, t.dim())
        x = sf.distribute(t.detach(), P(*dims), mesh=MESH)
        return x.requires_grad_() if t.requires_grad else x

    return pytree.tree_map(one, tree)


def _full(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, sf.ShardedArray) else x


def _grads(op: Any, sample: Any, args: tuple, kwargs: dict, gather: bool) -> list | None:
    leaves = oc.float_leaves((args, kwargs))
    out = oc.call(op, args, kwargs)
    outs = oc.grad_outputs(out, sample)
    if not leaves or not outs:
        return None
    cots = oc.cotangents(outs)
    loss = sum(((_full(o) if gather else o) * c).sum() for o, c in zip(outs, cots) if c is not None)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [None if g is None else _full(g) for g in grads]


def _check_grads(op: Any, sample: Any, args: tuple, kwargs: dict, sargs: tuple, skwargs: dict) -> str | None:
    want = _grads(op, sample, args, kwargs, gather=False)
    if want is None:
        return None
    got = _grads(op, sample, sargs, skwargs, gather=True)
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:
            continue
        g = torch.zeros_like(w) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        r = oc.compare(g, w, _full)
        if r:
            return f"grad {i}: {r}"
    return None


def run_op(op: Any) -> tuple[str, str]:
    """(status, detail): status is pass / pass-fallback / fail / skip."""
    dtype = oc.op_dtype(op)
    if dtype is None:
        return "skip", "no CPU dtype"
    tested = False
    with _FallbackCounter() as fb, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sample, args, kwargs in oc.tensor_samples(op, dtype):
            try:
                want = oc.call(op, args, kwargs)
            except Exception:
                continue
            tested = True
            for config in oc.CONFIGS:
                reason = _check_config(op, sample, args, kwargs, want, config)
                if reason:
                    return "fail", f"{config}: {reason}"
    if not tested:
        return "skip", "no sample runs in plain torch"
    return ("pass-fallback", f"fallback: {' '.join(sorted(fb.ops))}") if fb.n else ("pass", "")


def _check_config(op: Any, sample: Any, args: tuple, kwargs: dict, want: Any, config: str) -> str | None:
    try:
        sargs, skwargs = _distribute((args, kwargs), config)
        got = oc.call(op, sargs, skwargs)
        reason = oc.compare(got, want, _full)
        if reason is None and config in oc.GRAD_CONFIGS and op.supports_autograd:
            reason = _check_grads(op, sample, args, kwargs, sargs, skwargs)
        return reason
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


@pytest.mark.parametrize("op", OPS, ids=oc.op_id)
def test_op(op: Any) -> None:
    name = oc.op_id(op)
    status, detail = run_op(op)
    RESULTS[name] = status
    if status == "skip":
        pytest.skip(detail)
    if name in RAISES:
        assert status == "fail" and "ImmutableError" in detail, (
            f"{name} should raise ImmutableError ({RAISES[name]}), got {status}: {detail}")
        return
    if name in XFAIL:
        if status == "fail":
            pytest.xfail(XFAIL[name])
        pytest.fail(f"{name} is listed in XFAIL ({XFAIL[name]}) but now passes; remove it")
    assert status != "fail", detail


def test_summary(capsys: Any) -> None:
    """Prints the pass counts (run after the per-op tests)."""
    if not RESULTS:
        pytest.skip("per-op tests did not run")
    counts = {s: sum(1 for v in RESULTS.values() if v == s) for s in ("pass", "pass-fallback", "fail", "skip")}
    with capsys.disabled():
        print(
            f"\nOpInfo on a (2, 2) mesh: {counts['pass']} ops pass with sharding rules, "
            f"{counts['pass-fallback']} more pass through the replicate fallback, "
            f"{counts['fail']} xfail, {counts['skip']} skipped (of {len(RESULTS)})"
        )
    assert counts["pass"] > 0


if __name__ == "__main__":
    import time

    t0 = time.time()
    for op in OPS:
        t = time.time()
        status, detail = run_op(op)
        print(f"{status:14s} {time.time() - t:6.2f}s {oc.op_id(op)}  {detail}", flush=True)
    print(f"total {time.time() - t0:.0f}s")
