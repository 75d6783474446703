"""Batch normalisation: ``native_batch_norm`` (CPU, and CUDA without cuDNN), ``cudnn_batch_norm``
(CUDA's ``BatchNorm`` with cuDNN) and their backwards, on inputs (N, C, *spatial).

The channels may split: weight, bias, running statistics and the saved statistics follow
them. In training the statistics span the batch and spatial dims, which stay whole (a split
batch is gathered: the global tensor's statistics, as unsharded torch computes them). In
evaluation the op is element-wise per channel, so every dim may split; its backward's weight
and bias gradients are then pending sums over the batch and spatial splits. The running
statistics' in-place update (training with arrays) is refused before any rule runs
(``arrays/inplace/policy.unannotated_batch_norm``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .base import Candidate, OpCall, _schema_info, bind, replicated
from .dims import Dims, compile_dims

aten = torch.ops.aten


def _input_letters(ndim: int, training: bool) -> tuple:
    """(N, C, *spatial): the channels lettered, the others too in evaluation only."""
    if training:
        return (None, "c") + (None,) * (ndim - 2)
    return ("n", "c") + tuple(f"s{i}" for i in range(ndim - 2))


@attrs.frozen
class BatchNorm:
    """Forward or backward. ``training``: the ``train`` flag's argument name, or the mode itself
    (always training: ``cudnn_batch_norm_backward``; never: ``_native_batch_norm_legit_no_training``);
    ``like_input``: the arguments and outputs shaped like the input; ``grads``: outputs that sum
    over the batch and spatial dims."""

    training: str | bool = "training"
    like_input: tuple[str, ...] = ("input",)
    out_like_input: tuple[int, ...] = (0,)
    grads: tuple[int, ...] = ()

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        x = b["input"]
        if x.dim() < 2:
            return []
        training = self._training(b)
        channels = x.shape[1]
        lx = _input_letters(x.dim(), training)
        names = _schema_info(call.func)[0]

        def per_channel(t: Any) -> tuple:
            return ("c",) if t.dim() == 1 and t.shape[0] == channels and channels > 0 else (None,) * t.dim()

        ins = []
        for path, v in call.arrays:
            name = names[path] if isinstance(path, int) else path
            ins.append(lx if name in self.like_input and v.dim() == x.dim() else per_channel(v))
        outs = tuple(None if not isinstance(m, torch.Tensor) else lx if i in self.out_like_input else per_channel(m)
                     for i, m in enumerate(call.out_metas))
        # outputs of no channel (cuDNN's reserve, empty saved statistics): per-call constants,
        # replicated, outside the letters (a letter an output lacks could not split at all)
        loose = {i: replicated(call.mesh, m.dim()) for i, (m, o) in enumerate(zip(call.out_metas, outs))
                 if o is not None and "c" not in o and o != lx}
        outs = tuple(None if i in loose else o for i, o in enumerate(outs))
        reduce = () if training else tuple((L, "sum") for L in lx if L not in (None, "c"))
        cands = [attrs.evolve(c, out_layouts=tuple(loose.get(i, o) for i, o in enumerate(c.out_layouts)))
                 for c in compile_dims(call, Dims(tuple(ins), outs, reduce))]
        if not training and call.func in _FORWARDS:
            cands = [attrs.evolve(c, local_fn=_EvalForward(call.func)) for c in cands]
        return cands

    def _training(self, bound: dict) -> bool:
        return self.training if isinstance(self.training, bool) else bool(bound[self.training])

    def out_meta(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The op's meta, with a forward's saved statistics empty in evaluation, as its CPU and
        CUDA kernels return them (its meta kernel gives them the channels' size)."""
        out = func(*args, **kwargs)
        return _saved_emptied(out) if func in _FORWARDS and not self._training(bind(func, args, kwargs)) else out


def _saved_emptied(out: tuple) -> tuple:
    """A forward's outputs with its saved statistics (outputs 1 and 2) empty."""
    return (out[0], out[1].new_empty((0,)), out[2].new_empty((0,)), *out[3:])


@attrs.frozen
class _EvalForward:
    """A forward in evaluation on one device's shards, its saved statistics empty on every
    device type (the meta kernel sizes them)."""

    func: Any

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        return _saved_emptied(self.func(*args, **kwargs))


# the forwards: (out, save_mean, save_invstd[, running_mean, running_var]), stats empty in evaluation
_FORWARDS = frozenset({
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit_no_training.default,
})


TABLE = {
    aten.native_batch_norm: BatchNorm(),
    aten.cudnn_batch_norm: BatchNorm(),
    # torch.export's / functionalisation's forms: with running statistics (written in place:
    # refused for arrays before any rule) or without, functional (returns the updated running
    # statistics, per channel), evaluation only
    aten._native_batch_norm_legit: BatchNorm(),
    aten._native_batch_norm_legit_functional: BatchNorm(),
    aten._native_batch_norm_legit_no_training: BatchNorm(training=False),
    # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask)
    aten.native_batch_norm_backward: BatchNorm(training="train", like_input=("input", "grad_out"), grads=(1, 2)),
    # (input, grad_output, weight, running_mean, running_var, save_mean, save_var, epsilon, reserveSpace)
    aten.cudnn_batch_norm_backward: BatchNorm(training=True, like_input=("input", "grad_output"), grads=(1, 2)),
}
