"""Pure optimizers and gradient clipping over pytrees of ShardedArrays (optax-style
``init``/``step``), running torch.optim's own kernels on each process's stored shards."""

from ._engine import TorchOptimizer as TorchOptimizer
from .clip import clip_grad_norm as clip_grad_norm
from .optimizers import SGD as SGD
from .optimizers import Adam as Adam
from .optimizers import AdamW as AdamW
from .optimizers import from_torch as from_torch
