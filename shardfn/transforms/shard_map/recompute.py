"""Activation checkpointing inside shard_map bodies.

``torch.utils.checkpoint`` (non-reentrant) recomputes a checkpointed region during
backward, after the shard_map body has returned: the body's context (its vmap levels on
the local backend, the target of ``sf.lax`` collectives on both) is closed by then. It
re-enters the forward's ``DeviceContext`` (torch's default-device mode) around the
recomputation, so the body runs under a :class:`Recompute` (a DeviceContext keeping the
current default device) that reopens the body's context when entered again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
from torch.utils._device import DeviceContext


class Recompute(DeviceContext):
    """The default-device mode of a shard_map body; entered after the body returned, it
    reopens the body's context with ``reopen()``."""

    def __init__(self, reopen: Callable[[], ContextManager]) -> None:
        super().__init__(torch.get_default_device())
        self.reopen = reopen
        self.live = True
        self.reopened: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        if not self.live:
            stack.enter_context(self.reopen())
        self.reopened.append(stack)
        try:
            return super().__enter__()
        except BaseException:
            self.reopened.pop().close()
            raise

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.reopened.pop().close()


@contextlib.contextmanager
def body_context(reopen: Callable[[], ContextManager]) -> Iterator[None]:
    """Run a shard_map body so that checkpointed regions in it can be recomputed later
    under ``reopen()`` (only while gradients are recorded: checkpoint is inert otherwise)."""
    if not torch.is_grad_enabled():
        yield
        return
    mode = Recompute(reopen)
    try:
        with mode:
            yield
    finally:
        mode.live = False
