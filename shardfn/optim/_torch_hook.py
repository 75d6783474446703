"""torch.optim optimizers given ShardedArray parameters fail before changing anything,
with an ImmutableError naming the sf.optim optimizer to use (a global step pre-hook,
torch.optim's documented extension point)."""

from __future__ import annotations

from typing import Any

import torch

from ..arrays.array import ShardedArray
from ..values.errors import ImmutableError

_OWN = ("SGD", "Adam", "AdamW")
_installed = False


def _replacement(opt: torch.optim.Optimizer) -> str:
    name = type(opt).__name__
    if name in _OWN and type(opt).__module__.startswith("torch.optim"):
        return f"sf.optim.{name}(...)"
    return f"sf.optim.from_torch({type(opt).__module__}.{type(opt).__qualname__}, ...)"


def _refuse_sharded(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, ShardedArray):
                cls = type(opt).__name__
                raise ImmutableError(
                    f"torch.optim.{cls}.step would update ShardedArray parameters in place, but ShardedArrays are "
                    f"immutable; use {_replacement(opt)} (the same defaults and math, pure): "
                    f"state = opt.init(params); params, state = opt.step(params, grads, state)"
                )


def install() -> None:
    """Register the pre-hook once per process."""
    global _installed
    if not _installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_sharded)
        _installed = True
