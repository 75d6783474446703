"""Per-thread context stacks (the entered meshes, the running shard_map bodies and their
manual axes, the partial-manual submeshes): each thread sees its own."""

from __future__ import annotations

import threading
from typing import Any


class ThreadStack(threading.local):
    """``items``: a list per thread, empty in each new thread."""

    def __init__(self) -> None:
        self.items: list[Any] = []
