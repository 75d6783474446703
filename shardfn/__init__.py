"""shardfn: JAX-style functional sharding for PyTorch."""

from .values import torch_compat as _torch_compat  # noqa: F401  (first: an unsupported torch fails here, clearly)

from . import checkpoint as checkpoint
from . import debug as debug
from .transforms import lax as lax
from . import nn as nn
from . import optim as optim
from . import random as random
from .arrays.array import ShardedArray as ShardedArray
from .arrays.redistribute import device_put as device_put
from .arrays.redistribute import distribute as distribute
from .arrays.redistribute import gather as gather
from .arrays.redistribute import reshard as reshard
from .arrays.explicit import explicit as explicit
from .values.errors import FallbackWarning as FallbackWarning
from .values.errors import ImplicitReshardError as ImplicitReshardError
from .values.errors import ImplicitReshardWarning as ImplicitReshardWarning
from .values.errors import ImmutableError as ImmutableError
from .values.errors import ShardingError as ShardingError
from .values.errors import ShardingIndexError as ShardingIndexError
from .values.errors import ShardingRuntimeError as ShardingRuntimeError
from .values.errors import ShardingTypeError as ShardingTypeError
from .values.errors import SimulationWarning as SimulationWarning
from .arrays.factories import arange as arange
from .arrays.factories import empty as empty
from .arrays.factories import full as full
from .arrays.factories import make_array_from_callback as make_array_from_callback
from .arrays.factories import ones as ones
from .arrays.factories import zeros as zeros
from .random.keys import rand as rand
from .random.keys import randn as randn
from .interop.dtensor import from_dtensor as from_dtensor
from .values.mesh import Mesh as Mesh
from .values.mesh import current_mesh as current_mesh
from .plans.planner import Plan as Plan
from .plans.planner import Step as Step
from .plans.planner import plan_redistribute as plan_redistribute
from .transforms.products import einsum as einsum
from .transforms.products import matmul as matmul
from .rules.custom import register_sharding as register_sharding
from .transforms.smap import smap as smap
from .values.spec import NamedSharding as NamedSharding
from .values.spec import P as P
from .values.spec import Partial as Partial
from .values.spec import Replicate as Replicate
from .values.spec import Shard as Shard
from .transforms.local_map import local_map as local_map
from .transforms.shard_map.api import shard_map as shard_map
from .transforms.constraints import with_sharding_constraint as with_sharding_constraint

__version__ = "0.1.0"

from .arrays import dispatch as _dispatch  # noqa: E402,F401  (installs ShardedArray's op dispatcher)
from .random import torch_ops as _random_ops  # noqa: E402,F401  (fills the rule table: torch's random ops)
from .rules import builtin as _builtin_rules  # noqa: E402,F401  (fills the rule table: every op family's rules)
from .compile.dynamo import install as _install_dynamo  # noqa: E402

_install_dynamo()  # torch.compile support, registered when torch._dynamo is imported

from .arrays.observed import calibrate as _calibrate_inplace  # noqa: E402

_calibrate_inplace()  # the in-place policy's reference counts of a private array

from .optim._torch_hook import install as _install_optim_hook  # noqa: E402

_install_optim_hook()  # torch.optim given ShardedArrays: an ImmutableError naming sf.optim
