"""Debugging aids: count the communication a block issues, and show who holds what."""

from .comm import CommCounter as CommCounter
from .visualize import visualize_sharding as visualize_sharding
