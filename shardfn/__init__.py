"""shardfn: JAX-style functional sharding for PyTorch."""

from . import _compat as _compat  # first: an unsupported torch fails here, clearly

from . import checkpoint as checkpoint
from . import debug as debug
from . import lax as lax
from . import nn as nn
from . import optim as optim
from . import random as random
from .array import ShardedArray as ShardedArray
from .array import device_put as device_put
from .array import distribute as distribute
from .array import gather as gather
from .array import reshard as reshard
from ._explicit import explicit as explicit
from .errors import FallbackWarning as FallbackWarning
from .errors import ImplicitReshardError as ImplicitReshardError
from .errors import ImplicitReshardWarning as ImplicitReshardWarning
from .errors import ImmutableError as ImmutableError
from .errors import ShardingError as ShardingError
from .errors import SimulationWarning as SimulationWarning
from .factory import empty as empty
from .factory import full as full
from .factory import make_array_from_callback as make_array_from_callback
from .factory import ones as ones
from .factory import rand as rand
from .factory import randn as randn
from .factory import zeros as zeros
from .interop import from_dtensor as from_dtensor
from .mesh import Mesh as Mesh
from .mesh import current_mesh as current_mesh
from .plan import Plan as Plan
from .products import einsum as einsum
from .products import matmul as matmul
from .plan import Step as Step
from .plan import plan_redistribute as plan_redistribute
from .rules.custom import register_sharding as register_sharding
from .smap import smap as smap
from .spec import NamedSharding as NamedSharding
from .spec import P as P
from .spec import Partial as Partial
from .spec import Replicate as Replicate
from .spec import Shard as Shard
from .transforms import local_map as local_map
from .transforms import shard_map as shard_map
from .transforms import with_sharding_constraint as with_sharding_constraint

__version__ = "0.1.0"

from ._dynamo import install as _install_dynamo  # noqa: E402

_install_dynamo()  # torch.compile support, registered when torch._dynamo is imported

from ._inplace import calibrate as _calibrate_inplace  # noqa: E402

_calibrate_inplace()  # the in-place policy's reference counts of a private array

from .optim._torch_hook import install as _install_optim_hook  # noqa: E402

_install_optim_hook()  # torch.optim given ShardedArrays: an ImmutableError naming sf.optim
