"""What a rule sees (:class:`OpCall`) and what it proposes (:class:`Candidate`): the
vocabulary between the rule table (``shardfn.rules``) and the dispatcher that costs and runs it."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import attrs

from ..values.layout import Layout
from ..values.mesh import Mesh


@attrs.frozen
class OpCall:
    """One op call as rules see it: the sharded inputs in argument order, and the
    global output metadata (meta tensors) computed from the global input shapes."""

    func: Any
    args: tuple
    kwargs: dict
    arrays: list  # [(path, ShardedArray)]
    out_meta: Any
    mesh: Mesh

    @property
    def layouts(self) -> list[Layout]:
        return [v._layout for _, v in self.arrays]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(v.shape) for _, v in self.arrays]

    @property
    def out_metas(self) -> list:
        o = self.out_meta
        return list(o) if isinstance(o, (tuple, list)) else [o]

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        """Positional arg ``i``, else keyword ``name``, else ``default``."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default) if name else default


@attrs.frozen
class ShardFact:
    """A fact about one device's shard that a ``local_fn`` needs, passed to it as the
    keyword ``name``: the ``offset`` (first global index) or ``size`` of input ``input``'s
    shard along dim ``dim`` (``input`` counts sharded inputs in argument order)."""

    name: str
    kind: str  # "offset" | "size"
    input: int
    dim: int


@attrs.frozen
class Candidate:
    """A strategy: the layout each sharded input must have (argument order), the layout
    of each output (None for non-tensor outputs), and declarative facts about the local
    call each device makes, in logical (unsharded-rank) terms. Backends decide how to run
    it; nothing here says how shards are stored.

    - ``local_op``/``local_args``: run this aten op instead (arguments matched by schema
      name), with the named arguments set to these values (``squeeze`` of exactly the
      dims that are size 1 globally, a view of a lazily-conjugated value materialised).
    - ``local_sizes``: (argument, output index) pairs: the argument is a shape that must
      become that output's local shape (view, reshape, expand, ``*_backward`` sizes).
    - ``local_fn``: a computation on one device's shards that is not the op itself
      (vocabulary-sharded embedding, class-range nll, mean over uneven shards); it takes
      the op's arguments plus the ``facts`` (:class:`ShardFact`) as keywords.
    - ``dense``: the local call needs contiguous tensors with conj/neg flags resolved
      (``"last"``: only a last dim of stride 1, as fused attention kernels assume;
      ``"size_one"``: only size-1 dims strided as a contiguous layout's, a view; ``"distinct"``:
      only a tensor whose elements may share memory, for kernels that keep its strides).
    - ``broadcast``: the local call is elementwise, its tensor operands broadcasting
      against each other right-aligned (pointwise ops).
    """

    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout | None, ...]
    local_op: Any = None
    local_args: tuple[tuple[str, Any], ...] = ()
    local_sizes: tuple[tuple[str, int], ...] = ()
    local_fn: Callable | None = None
    facts: tuple[ShardFact, ...] = ()
    dense: bool | str = False
    broadcast: bool = False


class Rule(Protocol):
    """A sharding rule. It may also define ``out_meta(func, args, kwargs)``: the outputs'
    global metadata from meta-tensor arguments, used instead of the op's meta kernel
    where that kernel rejects what the device kernels accept."""

    def candidates(self, call: OpCall) -> list[Candidate]: ...
