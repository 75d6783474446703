"""The in-place policy: an in-place / ``out=`` op on ShardedArrays refused or run functionally, by the array it writes."""

from .policy import run_mutating as run_mutating, unannotated_batch_norm as unannotated_batch_norm
