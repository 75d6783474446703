"""DTensor's pass count on the same OpInfo samples and shardings as tests/ops/test_opinfo.py.

Runs DTensor under ``LocalTensorMode`` on a (2, 2) fake-world mesh (see
``benchmarks/_dtensor_ref.py``), distributes each sample's tensors with the placements
matching ``opinfo_common.CONFIGS`` and compares values and gradients with plain torch
exactly as the shardfn test does. An op passes when every sample and config does.

    python tools/dtensor_opinfo.py            # prints one line per op and the totals
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import opinfo_common as oc  # noqa: E402
from _dtensor_ref import make_mesh  # noqa: E402
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402


def _placements(config: str, ndim: int) -> tuple:
    if ndim == 0:
        return (Replicate(), Replicate())
    return tuple(Replicate() if d is None else Shard(d % ndim) for d in oc.CONFIGS[config])


def _full(x: Any) -> Any:
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return x.reconcile() if isinstance(x, LocalTensor) else x


def _distribute(tree: Any, config: str, mesh: Any) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        d = distribute_tensor(t.detach(), mesh, _placements(config, t.dim()))
        return d.requires_grad_() if t.requires_grad else d

    return pytree.tree_map(one, tree)


def _loss_grads(outs: list, cots: list, leaves: list, gather: bool) -> list:
    # full_tensor() stays differentiable (a LocalTensor); reconciling it would detach
    loss = sum(((o.full_tensor() if gather and isinstance(o, DTensor) else o) * c).sum()
               for o, c in zip(outs, cots) if c is not None)
    return [None if g is None else _full(g) for g in torch.autograd.grad(loss, leaves, allow_unused=True)]


def _plain_grads(op: Any, sample: Any, args: tuple, kwargs: dict) -> tuple | None:
    """(cotangents, gradients) of plain torch, made outside LocalTensorMode (inside it
    every rank would draw its own cotangent)."""
    leaves = oc.float_leaves((args, kwargs))
    outs = oc.grad_outputs(oc.call(op, args, kwargs), sample)
    if not leaves or not outs:
        return None
    cots = oc.cotangents(outs)
    return cots, _loss_grads(outs, cots, leaves, gather=False)


def _check(op: Any, sample: Any, sargs: tuple, skwargs: dict, want: Any, config: str, plain: Any) -> str | None:
    try:
        reason = oc.compare(oc.call(op, sargs, skwargs), want, _full)
        if reason is None and config in oc.GRAD_CONFIGS and plain is not None:
            cots, want_g = plain
            outs = oc.grad_outputs(oc.call(op, sargs, skwargs), sample)
            got_g = _loss_grads(outs, cots, oc.float_leaves((sargs, skwargs)), gather=True)
            for gi, wi in zip(got_g, want_g):
                if gi is None or wi is None:
                    if (gi is None) != (wi is None) and not torch.all((gi if wi is None else wi) == 0):
                        return "gradient missing"
                    continue
                reason = reason or oc.compare(gi, wi, _full)
        return reason
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def run_op(op: Any, mesh: Any) -> tuple[str, str]:
    dtype = oc.op_dtype(op)
    if dtype is None:
        return "skip", "no CPU dtype"
    tested = False
    for sample, args, kwargs in oc.tensor_samples(op, dtype):
        try:
            want = oc.call(op, args, kwargs)
            plain = _plain_grads(op, sample, args, kwargs) if op.supports_autograd else None
        except Exception:
            continue
        tested = True
        for config in oc.CONFIGS:
            with LocalTensorMode(mesh.size()):
                try:
                    sargs, skwargs = _distribute((args, kwargs), config, mesh)
                except Exception as e:
                    return "fail", f"{config}: distribute: {type(e).__name__}"
                reason = _check(op, sample, sargs, skwargs, want, config, plain)
            if reason:
                return "fail", f"{config}: {reason}"
    return ("pass", "") if tested else ("skip", "no sample runs in plain torch")


def main() -> None:
    """``python tools/dtensor_opinfo.py [START [STOP]]``: ops START..STOP of the database
    (slices can run in parallel processes; concatenate their outputs). DTensor crashes
    the process (segfault) on ``sgn``: resume after it with START."""
    warnings.simplefilter("ignore")
    mesh = make_mesh(oc.MESH_SHAPE, oc.AXES)
    counts: dict[str, int] = {}
    t0 = time.time()
    start = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    stop = int(sys.argv[2]) if len(sys.argv) > 2 else None
    for op in oc.op_db()[start:stop]:
        t = time.time()
        status, detail = run_op(op, mesh)
        counts[status] = counts.get(status, 0) + 1
        print(f"{status:5s} {time.time() - t:6.1f}s {oc.op_id(op)}  {detail}", flush=True)
    print(f"DTensor (LocalTensorMode, (2, 2) mesh): {counts.get('pass', 0)} ops pass, "
          f"{counts.get('fail', 0)} fail, {counts.get('skip', 0)} skipped; {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
