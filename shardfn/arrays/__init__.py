"""ShardedArray, the dispatcher that runs an aten op on it, and the in-place policy."""
