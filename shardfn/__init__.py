"""shardfn: JAX-style functional sharding for PyTorch."""

from .array import ShardedArray as ShardedArray
from .array import device_put as device_put
from .array import distribute as distribute
from .array import gather as gather
from .array import reshard as reshard
from .errors import FallbackWarning as FallbackWarning
from .errors import ImmutableError as ImmutableError
from .errors import ShardingError as ShardingError
from .mesh import Mesh as Mesh
from .mesh import current_mesh as current_mesh
from .plan import Plan as Plan
from .plan import Step as Step
from .plan import plan_redistribute as plan_redistribute
from .spec import NamedSharding as NamedSharding
from .spec import P as P
from .spec import Partial as Partial
from .spec import Replicate as Replicate
from .spec import Shard as Shard
from . import debug as debug

__version__ = "0.1.0"
