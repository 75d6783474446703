"""Shared harness: run PyTorch OpInfo samples on sharded inputs and compare with torch.

Used by ``test_opinfo.py`` (shardfn) and ``tools/dtensor_opinfo.py`` (DTensor under
LocalTensorMode, same samples and shardings) so both pass counts are comparable.
Each op's samples are drawn with a fixed seed; every tensor input is laid out with each
sharding config below on a (2, 2) mesh; the gathered result, and the gradients of
``sum(out * cotangent)`` for ops that support autograd, must match plain torch.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

MESH_SHAPE = (2, 2)
AXES = ("x", "y")
N_SAMPLES = 2
RTOL = ATOL = 1e-4  # sharded reductions sum in another order than torch does

# One entry per mesh axis: the tensor dim it shards (None: replicated) as a function of
# the tensor's rank (-1: last dim). Both axes on one dim nest x major.
CONFIGS: dict[str, tuple[int | None, int | None]] = {
    "replicate": (None, None),
    "dim0@x": (0, None),
    "last@y": (None, -1),
    "dim0@xy": (0, 0),
    "mixed": (0, 1),
}
GRAD_CONFIGS = ("dim0@x", "mixed")

# Ops whose results are random or uninitialised: nothing to compare.
SKIP_PREFIXES = (
    "empty", "new_empty", "rand", "normal", "bernoulli", "multinomial", "uniform", "cauchy",
    "exponential", "geometric", "log_normal", "nn.functional.dropout", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "torch._refs", "_refs",
    "nn.functional.multi_head_attention_forward",  # its samples train with dropout
)


def op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return [op for op in db if not op.name.startswith(SKIP_PREFIXES)]


def op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def op_dtype(op: Any) -> torch.dtype | None:
    dtypes = op.supported_dtypes("cpu")
    for d in (torch.float32, torch.float64, torch.int64, torch.bool):
        if d in dtypes:
            return d
    return None


def samples(op: Any, dtype: torch.dtype) -> list:
    torch.manual_seed(0)
    grad = op.supports_autograd and dtype.is_floating_point
    try:
        it = op.sample_inputs("cpu", dtype, requires_grad=grad)
        return list(itertools.islice(it, N_SAMPLES))
    except Exception:
        return []


def placement_dims(config: str, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes per tensor dim for ``config`` (rank-0 tensors stay replicated)."""
    dims: list[list[str]] = [[] for _ in range(ndim)]
    if ndim == 0:
        return []
    for axis, d in zip(AXES, CONFIGS[config]):
        if d is not None:
            dims[d % ndim].append(axis)
    return [tuple(a) for a in dims]


def as_args(sample: Any) -> tuple:
    return (sample.input, *sample.args), dict(sample.kwargs)


def tensor_samples(op: Any, dtype: torch.dtype):
    """``(sample, args, kwargs)`` of the samples that pass at least one tensor (the others
    have nothing to shard)."""
    for sample in samples(op, dtype):
        args, kwargs = as_args(sample)
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves((args, kwargs))):
            yield sample, args, kwargs


def call(op: Any, args: tuple, kwargs: dict) -> Any:
    return op.op(*args, **kwargs)


def float_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


def out_tensors(out: Any) -> list:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def compare(got: Any, want: Any, to_plain: Callable[[Any], Any]) -> str | None:
    """None if ``got`` (possibly sharded) matches ``want``, else a short reason."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if len(g_leaves) != len(w_leaves):
        return f"output structure {g_spec} != {w_spec}"
    for g, w in zip(g_leaves, w_leaves):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"got {type(g).__name__}, expected a tensor"
            g = to_plain(g)
            try:
                torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, equal_nan=True, check_stride=False)
            except AssertionError as e:
                return "values differ: " + str(e).splitlines()[0]
        elif g != w and not (isinstance(w, float) and w != w and g != g):
            return f"got {g!r}, expected {w!r}"
    return None


def cotangents(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None for o in outs]


def grad_outputs(out: Any, sample: Any) -> list[torch.Tensor]:
    out = sample.output_process_fn_grad(out)
    return [o for o in out_tensors(out) if o.requires_grad and o.is_floating_point()]
