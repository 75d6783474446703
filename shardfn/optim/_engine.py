"""A pure optimizer over pytrees that runs a torch.optim optimizer's own kernels on storage.

Each step builds the torch optimizer on aliases of the parameters' storage (each distinct
shard once, see ``_storage.py``) and of the state, steps it under copy-on-write (``_cow.py``:
the first in-place write to each goes to a buffer of its own, out of place), and wraps what
it wrote: torch's defaults, math and foreach/fused kernels, nothing passed in changed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import attrs
import optree
import torch

from ..arrays.array import ShardedArray
from ..arrays.redistribute import reshard
from ..values.errors import ShardingError
from ..values.layout import Layout
from ._cow import BufferPool, CopyOnWrite
from ._storage import from_storage, in_layout, resolved, storage, zero_layout

# torch.optim optimizers whose update is not element-wise (a shard cannot be stepped alone)
# or that need a closure
_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


@attrs.frozen
class _Keys:
    """What a torch optimizer keeps per parameter: state entries laid out like it, entries
    torch creates at the first step (``lazy``), and the rest (step counters, ...). A lazy
    entry in ``zeros`` starts as zeros (the first step gives the same result from zeros as
    from none, e.g. SGD without dampening), so the state's structure never changes; the
    other lazy entries are None until the first step."""

    buffers: tuple[str, ...]
    lazy: tuple[str, ...]
    scalars: tuple[str, ...]
    zeros: tuple[str, ...] = ()


def _fresh_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict]:
    """The state ``opt`` keeps for ``params`` before their first update (made by torch's own
    initialisation: ``__init__`` for some optimizers, ``_init_group`` for the rest)."""
    missing = [p for p in params if not opt.state.get(p)]
    init = getattr(opt, "_init_group", None)
    if missing and init is not None:
        for p in missing:
            p.grad = torch.zeros_like(p)
        group = opt.param_groups[0]
        sig = inspect.signature(init)
        extra = len(sig.parameters) - 3  # after (group, params_with_grad, grads)
        init(group, [], [], *([] for _ in range(extra)))
        for p in missing:
            p.grad = None
    return [dict(opt.state.get(p, {})) for p in params]


@functools.lru_cache(maxsize=256)
def _keys(cls: type, frozen_kwargs: tuple) -> _Keys:
    """Which state entries ``cls`` keeps, found on a small probe parameter."""
    kwargs = dict(frozen_kwargs)
    p = torch.zeros(3)
    opt = cls([p], **kwargs)
    first = _fresh_state(opt, [p])[0]
    p.grad = torch.ones_like(p)
    opt.step()
    after = opt.state[p]
    like = lambda v: isinstance(v, torch.Tensor) and tuple(v.shape) == (3,)  # noqa: E731
    buffers = tuple(k for k, v in first.items() if like(v))
    lazy = tuple(k for k, v in after.items() if k not in first and like(v))
    scalars = tuple(k for k in first if k not in buffers)
    zeros = tuple(k for k in lazy if _zeros_equivalent(cls, kwargs, k))
    return _Keys(buffers, lazy, scalars, zeros)


def _zeros_equivalent(cls: type, kwargs: dict, key: str) -> bool:
    """Whether two steps from a zero ``key`` entry equal two from none, bit for bit."""
    results = []
    for start in (None, 0.0):
        p = torch.tensor([0.5, -1.25, 3.0])
        opt = cls([p], **kwargs)
        _fresh_state(opt, [p])
        if start is not None:
            opt.state[p][key] = torch.zeros_like(p)
        for g in ([0.25, -2.0, 1.5], [-0.75, 0.5, 2.25]):
            p.grad = torch.tensor(g)
            opt.step()
        results.append((p.detach().clone(), opt.state[p][key].clone()))
    return all(torch.equal(a, b) for a, b in zip(*results))


def _freeze(kwargs: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


class TorchOptimizer:
    """``init(params) -> state`` / ``step(params, grads, state, *, lr=None) -> (params, state)``
    for an element-wise ``torch.optim`` optimizer class: equal to that optimizer stepping the
    unsharded tensors, run on each process's stored shards (each distinct shard once).

    ``shard_state_over``: mesh axes (typically the data-parallel one) over which the state is
    sharded further than its parameter (ZeRO-1): each device keeps and updates 1/k of the
    state of a parameter replicated over an axis of size k; the gradient arrives by a
    reduce-scatter (a slice when it is already reduced) and the new parameter is
    all-gathered back to its own layout.

    Memory: a step writes new parameters and state (the inputs stay valid). On CPU the
    optimizer reuses the buffers of earlier steps' outputs once nothing references them, so
    it keeps up to one spare generation of parameters and state between steps.
    """

    def __init__(self, optimizer_cls: type, kwargs: dict, *, shard_state_over: str | Sequence[str] | None = None) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if optimizer_cls.__name__ in _NOT_ELEMENTWISE:
            raise ShardingError(
                f"torch.optim.{optimizer_cls.__name__} is not an element-wise optimizer (its update of one element "
                f"depends on others, or it needs a closure), so it cannot step shards independently; "
                f"sf.optim.from_torch takes element-wise ones such as Adam, AdamW, SGD, Adagrad, RMSprop, NAdam"
            )
        self.optimizer_cls = optimizer_cls
        self.kwargs = dict(kwargs)
        if isinstance(shard_state_over, str):
            shard_state_over = (shard_state_over,)
        self.shard_state_over = tuple(shard_state_over or ())
        self._frozen = _freeze(self.kwargs)
        self._keys = _keys(optimizer_cls, self._frozen)  # also checks the options, as torch's constructor does
        self._pool = BufferPool()
        self._fused = bool(self.kwargs.get("fused"))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        zero = f", shard_state_over={self.shard_state_over!r}" if self.shard_state_over else ""
        return f"sf.optim[{self.optimizer_cls.__name__}]({opts}{zero})"

    def _torch_optimizer(self, parts: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer over ``parts``. On a meta mesh (the CPU stand-in for an
        accelerator, where no value is computed) ``fused=True`` steps with the foreach
        kernels: torch's fused optimizers refuse meta tensors (its device check), and the
        layouts, shapes and dtypes of the results are the same."""
        if not (self._fused and parts and parts[0].device.type == "meta"):
            return self.optimizer_cls(parts, **self.kwargs)
        return self.optimizer_cls(parts, **{**self.kwargs, "fused": None, "foreach": True})

    # -- layouts -------------------------------------------------------------------------------
    def _update_layout(self, p: torch.Tensor) -> Layout | None:
        if not isinstance(p, ShardedArray):
            return None
        return zero_layout(p._layout, tuple(p.shape), self.shard_state_over)

    # -- init ----------------------------------------------------------------------------------
    def init(self, params: Any) -> Any:
        """The optimizer state for ``params`` (a pytree of ShardedArrays and/or tensors): the
        same pytree with each parameter replaced by a dict of its torch.optim state entries;
        those laid out like the parameter are ShardedArrays in its (update) layout. An entry
        torch creates at the first step starts as zeros where that gives torch's results
        (SGD's ``momentum_buffer`` without dampening), else None until then."""
        leaves, spec, _ = _flatten(params, "params")
        states = []
        for p in leaves:
            layout = self._update_layout(p)
            pu = reshard(p.detach(), layout) if layout is not None else p.detach()
            parts = [s.clone(memory_format=torch.contiguous_format) for s in storage(pu, layout)]
            opt = self._torch_optimizer(parts)
            fresh = _fresh_state(opt, parts)
            states.append(self._wrap_state(fresh, layout, p, parts))
        return optree.tree_unflatten(spec, states)

    def _wrap_state(self, per_part: list[dict], layout: Layout | None, p: torch.Tensor,
                    parts: list[torch.Tensor] | None = None) -> dict:
        out: dict[str, Any] = {}
        first = per_part[0]
        for k in first:
            v = first[k]
            if k in self._keys.buffers or k in self._keys.lazy:
                out[k] = None if v is None else from_storage([s[k] for s in per_part], layout, p.shape, v.dtype)
            else:
                out[k] = v  # the same for every shard (a step count, a running product)
        for k in self._keys.lazy:
            if out.get(k) is None:
                out[k] = (from_storage([torch.zeros_like(t) for t in parts], layout, p.shape, p.dtype)
                          if k in self._keys.zeros and parts is not None else None)
        return out

    # -- step ----------------------------------------------------------------------------------
    def step(self, params: Any, grads: Any, state: Any, *, lr: float | torch.Tensor | None = None) -> tuple[Any, Any]:
        """One update: ``(new params, new state)``, nothing passed in changed. A None gradient
        leaves its parameter and state as they are; ``lr`` overrides the learning rate for
        this step."""
        leaves, spec, paths = _flatten(params, "params")
        try:
            gleaves = spec.flatten_up_to(grads)
        except (ValueError, TypeError) as e:
            raise ShardingError(f"grads must have the structure of params ({spec}): {e}") from None
        try:
            sleaves = spec.flatten_up_to(state)
        except (ValueError, TypeError) as e:
            raise ShardingError(f"state must be what init(params) returned, with params' structure ({spec}): {e}") from None

        live = [i for i, g in enumerate(gleaves) if g is not None]
        layouts = {i: self._update_layout(leaves[i]) for i in live}
        # gradients (and, under ZeRO-1, parameters) to the update layout, moved together
        sharded = [i for i in live if layouts[i] is not None]
        for i in live:
            _check_grad(leaves[i], gleaves[i], paths[i])
        gs = {i: in_layout(gleaves[i].detach(), layouts[i], f"grads{paths[i]}") for i in live}
        moved = reshard([gs[i] for i in sharded], [layouts[i] for i in sharded]) if sharded else []
        gs.update(zip(sharded, moved))
        ps = {i: leaves[i].detach() for i in live}
        zero = [i for i in sharded if layouts[i] != leaves[i]._layout]
        if zero:
            ps.update(zip(zero, reshard([ps[i] for i in zero], [layouts[i] for i in zero])))

        # one torch optimizer over every live parameter's storage: tensors aliasing the
        # caller's (no copies), which the first in-place write moves to a buffer of their own
        parts: list[torch.Tensor] = []
        owner: list[tuple[int, int]] = []  # part -> (leaf, how many parts it has)
        opt_state: list[dict] = []
        protected: list[torch.Tensor] = []
        for i in live:
            st = self._state_in(sleaves[i], layouts[i], paths[i])
            pparts = storage(ps[i], layouts[i])
            gparts = storage(gs[i], layouts[i])
            bparts = {k: (None if v is None else storage(v, layouts[i])) for k, v in st.items()
                      if k in self._keys.buffers or k in self._keys.lazy}
            for j, (pp, gp) in enumerate(zip(pparts, gparts)):
                new = pp.detach()
                # fused kernels read gradients laid out like the (contiguous, once written) parameter
                new.grad = (gp.contiguous() if self._fused else gp).detach()
                protected += (new, new.grad)
                parts.append(new)
                owner.append((i, len(pparts)))
                entry = {}
                for k, v in st.items():
                    if k in bparts:
                        if bparts[k] is not None:
                            entry[k] = bparts[k][j].detach()
                            protected.append(entry[k])
                    else:
                        entry[k] = _copy(v)
                opt_state.append(entry)
        if parts:
            opt = self._torch_optimizer(parts)
            if lr is not None:
                opt.param_groups[0]["lr"] = lr
            for t, entry in zip(parts, opt_state):
                opt.state[t] = entry  # replaces what a constructor initialised (Adagrad)
            with CopyOnWrite(protected, self._pool):
                opt.step()
            self._pool.end_step()

        new_leaves = list(leaves)
        new_states = list(sleaves)
        pos = 0
        for i in live:
            n = owner[pos][1]
            chunk = parts[pos:pos + n]
            pos += n
            p = leaves[i]
            for t in chunk:
                t.grad = None
            new_p = from_storage([t.detach() for t in chunk], layouts[i], p.shape, p.dtype)
            new_leaves[i] = new_p
            new_states[i] = self._wrap_state([opt.state[t] for t in chunk], layouts[i], p)
        # back to the parameter's own layout (a parameter pending a reduction comes back reduced)
        back = [i for i in sharded if new_leaves[i]._layout != resolved(leaves[i]._layout)]
        if back:
            new_leaves_back = reshard([new_leaves[i] for i in back], [resolved(leaves[i]._layout) for i in back])
            for i, v in zip(back, new_leaves_back):
                new_leaves[i] = v
        for i in live:
            if leaves[i].requires_grad:
                new_leaves[i] = new_leaves[i].detach().requires_grad_(True)
        return optree.tree_unflatten(spec, new_leaves), optree.tree_unflatten(spec, new_states)

    def _state_in(self, st: Any, layout: Layout | None, path: str) -> dict:
        """A parameter's state with its buffers in ``layout`` (a state loaded in another
        layout is resharded)."""
        if not isinstance(st, dict):
            raise ShardingError(f"state{path} is {type(st).__name__}, not the dict init(params) makes for a parameter")
        missing = [k for k in (*self._keys.buffers, *self._keys.scalars) if k not in st]
        if missing:
            raise ShardingError(f"state{path} lacks {missing}: pass the state init(params) or step returned")
        out = dict(st)
        for k in (*self._keys.buffers, *self._keys.lazy):
            v = st.get(k)
            if v is None:
                continue
            if layout is not None:
                v = in_layout(v, layout, f"state{path}[{k!r}]")
                if v._layout != layout:
                    v = reshard(v, layout)
            elif isinstance(v, ShardedArray):
                v = v.full_tensor()
            out[k] = v
        return out


def _flatten(tree: Any, what: str) -> tuple[list, Any, list[str]]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree)
    names = ["".join(f"[{k!r}]" for k in path) for path in paths]
    for x, name in zip(leaves, names):
        if not isinstance(x, torch.Tensor):
            raise ShardingError(f"{what}{name} is {type(x).__name__}; parameters must be ShardedArrays or tensors")
    return leaves, spec, names


def _check_grad(p: torch.Tensor, g: Any, path: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise ShardingError(f"grads{path} is {type(g).__name__}; a gradient must be a tensor, a ShardedArray or None")
    if tuple(g.shape) != tuple(p.shape):
        raise ShardingError(f"grads{path} has shape {tuple(g.shape)} but its parameter has shape {tuple(p.shape)}")
