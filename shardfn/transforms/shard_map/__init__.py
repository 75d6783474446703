"""shard_map: the stacked (vmap), per-device, manual and dist forms of one body over a mesh."""
