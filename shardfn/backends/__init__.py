"""Backends run plans and ops on a mesh: ``local`` (one process simulates every device) and
``dist`` (one process per device over torch.distributed)."""

from .registry import Backend as Backend
from .registry import backend_for as backend_for
from .registry import backend_named as backend_named
from .registry import execute as execute
