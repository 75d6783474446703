"""Function transforms: shard_map in all its forms, local_map, constraints, lax collectives, smap."""
