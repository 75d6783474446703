"""Debugging aids: count the communication a block issues, and show who holds what."""

from ..values.replica_checks import check_replicas as check_replicas
from .comm import CommCounter as CommCounter
from .visualize import visualize_sharding as visualize_sharding
