"""Sharding whole models: regex rules -> specs (:func:`shard_params`), and
DTensor-style :func:`distribute_module`.

A model built on the meta device is materialised shard by shard: each rule may carry an
initialiser (:mod:`shardfn.nn.init`), and each device computes only its own shard::

    with torch.device("meta"):
        model = GPT(cfg)
    params = sf.nn.shard_params(model, [
        (r"\\.(q|k|v|fc1)\\.weight$", P("tp", None), sf.nn.init.normal(std=0.02)),
        (r"\\.(o|fc2)\\.weight$", P(None, "tp"), sf.nn.init.normal(std=0.02)),
    ], mesh=mesh, key=sf.random.key(0))
    out = torch.func.functional_call(model, params, (x,))
"""

from . import init as init
from .activations import ActivationHandle as ActivationHandle
from .activations import UnmatchedRulesWarning as UnmatchedRulesWarning
from .activations import shard_activations as shard_activations
from .module import distribute_module as distribute_module
from .params import UnmatchedParamsWarning as UnmatchedParamsWarning
from .params import shard_params as shard_params

__all__ = ["ActivationHandle", "UnmatchedParamsWarning", "UnmatchedRulesWarning", "distribute_module", "init",
           "shard_activations", "shard_params"]
