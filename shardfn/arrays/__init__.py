"""ShardedArray, the dispatcher that runs an aten op on it, and the in-place policy."""

from . import array as array  # first: redistribute.py and local_shards.py import its class, it imports them last
