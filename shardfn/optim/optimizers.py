"""SGD, Adam and AdamW with torch.optim's signatures, defaults and math, and
:func:`from_torch` for any other element-wise torch.optim optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._engine import TorchOptimizer

_Axes = str | Sequence[str] | None


class SGD(TorchOptimizer):
    """``torch.optim.SGD``'s update as a pure ``init``/``step`` over pytrees.

    ``shard_state_over``: mesh axes to shard the momentum buffers over (ZeRO-1)."""

    def __init__(self, lr: float | torch.Tensor = 1e-3, *, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 shard_state_over: _Axes = None) -> None:
        super().__init__(torch.optim.SGD, dict(lr=lr, momentum=momentum, dampening=dampening,
                                               weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                                               foreach=foreach, differentiable=differentiable, fused=fused),
                         shard_state_over=shard_state_over)


class Adam(TorchOptimizer):
    """``torch.optim.Adam``'s update as a pure ``init``/``step`` over pytrees.

    ``shard_state_over``: mesh axes to shard the moment buffers over (ZeRO-1)."""

    def __init__(self, lr: float | torch.Tensor = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, shard_state_over: _Axes = None) -> None:
        super().__init__(torch.optim.Adam, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                                amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                                capturable=capturable, differentiable=differentiable, fused=fused,
                                                decoupled_weight_decay=decoupled_weight_decay),
                         shard_state_over=shard_state_over)


class AdamW(TorchOptimizer):
    """``torch.optim.AdamW``'s update as a pure ``init``/``step`` over pytrees.

    ``shard_state_over``: mesh axes to shard the moment buffers over (ZeRO-1)."""

    def __init__(self, lr: float | torch.Tensor = 1e-3, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, shard_state_over: _Axes = None) -> None:
        super().__init__(torch.optim.AdamW, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                                 amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                                 capturable=capturable, differentiable=differentiable, fused=fused),
                         shard_state_over=shard_state_over)


def from_torch(optimizer_cls: type, *, shard_state_over: _Axes = None, **kwargs: Any) -> TorchOptimizer:
    """The ``init``/``step`` interface for any element-wise ``torch.optim`` optimizer class
    (Adagrad, RMSprop, Adamax, NAdam, RAdam, ...) with its constructor's keyword options:
    ``sf.optim.from_torch(torch.optim.Adagrad, lr=0.1)``."""
    return TorchOptimizer(optimizer_cls, kwargs, shard_state_over=shard_state_over)
