"""Stride census: ops whose outputs on ShardedArrays report other strides than torch's CPU kernels.

Strides are observable (``is_contiguous()``, ``view(-1)`` raising or not), and shardfn
reads an output's strides from the op's meta kernel, which for some ops lays the output
out otherwise than the CPU kernel does (``log_sigmoid``, ``angle`` of complex, ...). This
runs every OpInfo sample with its tensor inputs permuted (transposed, reversed, moved
dim 0 last) on a 1-device CPU mesh and on plain torch, and lists the ops whose output
strides differ on a dim of size > 1 (where a view's legality can change).

    python tools/stride_census.py [--ops NAME,...] [--dtypes float32,complex64]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))

import opinfo_common as oc  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402

PERMS = {
    "c_last": lambda n: [0] + list(range(2, n)) + [1],
    "t": lambda n: list(range(n - 2)) + [n - 1, n - 2],
    "rev": lambda n: list(range(n))[::-1],
    "roll": lambda n: list(range(1, n)) + [0],
}


def _permuted(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values with its memory laid out in another dim order (same shape)."""
    if t.dim() < 2 or t.layout != torch.strided:
        return t
    perm = PERMS[kind](t.dim())
    inverse = [perm.index(i) for i in range(t.dim())]
    out = t.detach().permute(perm).contiguous().permute(inverse)
    return out.requires_grad_(t.requires_grad) if t.is_leaf and t.requires_grad else out


def _strides(t: torch.Tensor) -> tuple:
    """The strides that matter: those of dims of size > 1."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _grads(out: Any, inputs: list) -> list:
    """The gradients of ``sum(out)`` (real part) for ``inputs`` (None where none flows)."""
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not inputs:
        return []
    total = sum(torch.view_as_real(o).sum() if o.is_complex() else o.sum() for o in outs)
    return list(torch.autograd.grad(total, inputs, allow_unused=True))


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_() if grad and (x.is_floating_point() or x.is_complex()) else x


def _run(op: Any, args: tuple, kwargs: dict, grad: bool) -> Any:
    """The op's output, paired with its inputs' gradients when ``grad``."""
    out = oc.call(op, args, kwargs)
    if not grad:
        return out
    return out, _grads(out, [x for x in pytree.tree_leaves((args, kwargs))
                             if isinstance(x, torch.Tensor) and x.requires_grad])


def census(ops: list, dtypes: list[torch.dtype], mesh: sf.Mesh, grad: bool = False) -> list[tuple[str, str, str, str]]:
    found = []
    for op in ops:
        for dtype in dtypes:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            for sample, args, kwargs in oc.tensor_samples(op, dtype):
                if any(isinstance(x, torch.Tensor) and x.layout != torch.strided
                       for x in pytree.tree_leaves((args, kwargs))):
                    continue
                for kind in PERMS:
                    pargs, pkwargs = pytree.tree_map(
                        lambda x: _permuted(x, kind) if isinstance(x, torch.Tensor) else x, (args, kwargs))
                    if all(not isinstance(x, torch.Tensor) or x.dim() < 2 for x in pytree.tree_leaves((pargs, pkwargs))):
                        continue
                    g_on = grad and op.supports_autograd
                    pargs, pkwargs = pytree.tree_map(
                        lambda x: _leaf(x, g_on) if isinstance(x, torch.Tensor) else x, (pargs, pkwargs))
                    sargs, skwargs = pytree.tree_map(
                        lambda x: _leaf(sf.distribute(x.detach(), P(*[None] * x.dim()), mesh=mesh), g_on)
                        if isinstance(x, torch.Tensor) else x, (pargs, pkwargs))
                    try:
                        want = _run(op, pargs, pkwargs, g_on)
                        got = _run(op, sargs, skwargs, g_on)
                    except Exception:
                        continue
                    n_out = len(pytree.tree_leaves(want[0] if g_on else want))
                    for i, (g, w) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(want))):
                        if (isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and g.shape == w.shape
                                and w.numel() > 0):
                            if _strides(g) != _strides(w):
                                shapes = [tuple(x.shape) for x in pytree.tree_leaves((pargs, pkwargs))
                                          if isinstance(x, torch.Tensor)]
                                found.append((oc.op_id(op), str(dtype).removeprefix("torch."),
                                              kind + (" grad" if i >= n_out else ""),
                                              f"inputs {shapes}: shardfn {g.stride()} torch {w.stride()}"))
                                print(" | ".join(found[-1]), flush=True)
                                break
                    else:
                        continue
                    break
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    parser.add_argument("--dtypes", default="float32,complex64")
    parser.add_argument("--samples", type=int, default=oc.N_SAMPLES, help="OpInfo samples per op and dtype")
    parser.add_argument("--grad", action="store_true", help="compare the inputs' gradients' strides too")
    a = parser.parse_args()
    oc.N_SAMPLES = a.samples
    torch.set_num_threads(1)
    ops = oc.op_db()
    if a.ops:
        keep = set(a.ops.split(","))
        ops = [op for op in ops if op.name in keep or oc.op_id(op) in keep]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    mesh = sf.Mesh((1,), ("x",))
    warnings.simplefilter("ignore")
    found = census(ops, dtypes, mesh, a.grad)
    print(f"ops scanned: {len(ops)}, stride mismatches: {len(found)}")


if __name__ == "__main__":
    main()
