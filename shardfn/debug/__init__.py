"""Debugging aids: count and attribute the communication a block issues, check replicas,
and show who holds what."""

from ..values.replica_checks import check_replicas as check_replicas
from .comm import CommCounter as CommCounter
from .comm import CommRecord as CommRecord
from .visualize import visualize_sharding as visualize_sharding

__all__ = ["CommCounter", "CommRecord", "check_replicas", "visualize_sharding"]
