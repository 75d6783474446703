"""sf.checkpoint: save and load pytrees of ShardedArrays with torch.distributed.checkpoint."""

from ._io import load as load
from ._io import save as save
