"""A dispatch mode recording the aten ops run on plain tensors (tests of what ShardedArray
ops compute on their shards)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf


class TorchCalls(TorchDispatchMode):
    """Records the aten ops run on plain tensors; a ShardedArray op runs its dispatch with
    the mode still on, so what it computes on the shards is recorded, not the op itself."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, sf.ShardedArray) for t in types):
            with self:
                return sf.ShardedArray.__torch_dispatch__(func, types, args, kwargs)
        self.calls.append(func)
        return func(*args, **kwargs)
