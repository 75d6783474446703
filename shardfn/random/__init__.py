"""Sharding-invariant random numbers with JAX-style keys.

Every element's value is a function of the key and its global (row-major) index only
(Philox-4x32-10, :mod:`shardfn.random.counter_rng`), so each device computes just its own
shard and the gathered result is bit-identical for every sharding, mesh and backend,
and to the unsharded call::

    k = sf.random.key(0)
    k1, k2 = sf.random.split(k)
    w = sf.random.normal(k1, (1024, 4096), P(None, "tp"), mesh=mesh)   # ShardedArray
    assert torch.equal(sf.gather(w), sf.random.normal(k1, (1024, 4096)))  # plain tensor

torch's own random ops on ShardedArrays (``F.dropout``, ``torch.rand_like``, ...; see
:mod:`shardfn.random.torch_ops`) use the same generator. Each call takes a fresh key from
torch's default generator (or the ``generator=`` passed), advancing it by the same amount
on every device, so ``torch.manual_seed(s)`` makes a step reproducible. Their draws are
the same for every mesh and sharding but differ from plain torch's unsharded draws (a
different algorithm); use this module when sharded and unsharded code must agree.
``F.scaled_dot_product_attention`` with ``dropout_p`` on arrays of 3+ dims draws its mask
through ``F.dropout`` too (torch's math formula, not CUDA's fused kernels, which would draw
a philox seed per device).
:func:`set_seed` makes a key drive those ops instead of torch's generator.
"""

from .keys import Key as Key
from .keys import KeyLike as KeyLike
from .keys import key as key
from .keys import split as split
from .keys import fold_in as fold_in
from .keys import uniform as uniform
from .keys import normal as normal
from .keys import randint as randint
from .keys import bernoulli as bernoulli
from .keys import dropout as dropout
from .keys import set_seed as set_seed
from .keys import seeded as seeded
