"""Output layouts as torch's CPU kernels make them, where the meta kernels differ.

An array's strides are observable (``is_contiguous()``, ``view(-1)`` raising or not), and
shardfn reads an op's output strides from its meta kernel. Meta tensors have no device,
so torch's meta kernels that ask for one (``device_hint``) lay outputs out as on CUDA: the
FFTs, convolutions, SVD/eig, 2-d padding and pixel shuffle of a transposed or
channels-last input report other strides than the CPU kernels give. On a CPU mesh those
ops run on fake CPU tensors instead; a few CPU kernels that no meta kernel models are
listed with the layout they give. ``tools/stride_census.py`` finds the ops this misses.

The same difference reaches a compiled program through the shards: AOTAutograd traces
each device's call on fake CPU tensors, whose strides come from the meta kernel, and a later
view of the shard (a gather's fold of the mesh dims, a reshape) is recorded as a view where
those strides allow it; the CPU kernel's output at run time may not allow it ('view size is
not compatible', fuzzer seed 5829512817: ``mse_loss_backward`` of a column-split shard).
``traced_relayout`` gives such a call's traced outputs a layout the run will have too.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# ops whose meta kernels read the input's device (torch/_meta_registrations.py device_hint,
# torch._C._select_conv_backend): on a meta tensor they assume CUDA
_DEVICE_HINTED = frozenset({
    aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._linalg_svd.default, aten.linalg_eig.default,
    aten.reflection_pad2d.default, aten.replication_pad2d.default,
    aten.pixel_shuffle.default, aten.pixel_unshuffle.default,
})


def _contiguous(args: tuple, out: Any) -> Any:
    return _map(lambda o: o.contiguous(), out)


def _like_arg(i: int) -> Callable[[tuple, Any], Any]:
    """An output of argument ``i``'s shape allocated like it (``empty_like``: its dim order): an
    elementwise CPU kernel (TensorIterator) keeping its first input's order, binary cross
    entropy and its backward allocating like the input, where the meta kernels' are contiguous."""
    def layout(args: tuple, out: Any) -> Any:
        like = args[i]
        return _map(lambda o: torch.empty_like(like, dtype=o.dtype) if o.shape == like.shape else o, out)
    return layout


def _like_format_of(i: int) -> Callable[[tuple, Any], Any]:
    """A 4-d output allocated in argument ``i``'s suggested memory format (channels-last stays
    channels-last: 2-d padding backward, channel shuffle, max_unpool2d), where the meta
    kernel's is contiguous."""
    def layout(args: tuple, out: Any) -> Any:
        fmt = suggest_memory_format(args[i])
        return _map(lambda o: o.contiguous(memory_format=fmt) if o.dim() == 4 else o, out)
    return layout


def _like_binary(args: tuple, out: Any) -> Any:
    """A binary CPU kernel (TensorIterator) lays out as ``add`` of its two inputs does; the
    Python meta kernels of ``copysign`` and rounding division ignore a transposed operand's
    order next to a 0-d one."""
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return out
    a, b = (torch.empty_strided(t.shape, t.stride(), device="meta") for t in (a, b))
    like = torch.ops.aten.add.Tensor(a, b)
    return _map(lambda o: torch.empty_strided(o.shape, like.stride(), dtype=o.dtype, device=o.device)
                if o.shape == like.shape else o, out)


# op -> (predicate on the meta arguments, the CPU kernel's layout of the meta outputs):
# log_sigmoid_forward allocates both outputs contiguous (F.logsigmoid of a transposed input
# reported transposed strides, so view(-1) raised where torch's did not); angle of a complex
# input goes through a contiguous temporary (fuzzer seed 5807404802; a real input keeps its
# order in both); native_dropout_backward's meta kernel is contiguous, its CPU kernel an
# elementwise product; the gradients of the mse, smooth l1 and huber losses are allocated
# contiguous by the CPU kernels (the meta kernels, their decompositions, keep the input's order:
# fuzzer seed 5829512817), as are log_softmax's and layer_norm's input gradients (meta: the
# gradient's / the input's order), binary cross entropy and its gradient like the input (meta: contiguous)
_ON_CPU: dict[Any, tuple[Callable[[tuple], bool], Callable[[tuple, Any], Any]]] = {
    aten.log_sigmoid_forward.default: (lambda args: True, _contiguous),
    aten.angle.default: (lambda args: args[0].is_complex(), _contiguous),
    aten.native_dropout_backward.default: (lambda args: True, _like_arg(0)),
    aten.mse_loss_backward.default: (lambda args: True, _contiguous),
    aten.smooth_l1_loss_backward.default: (lambda args: True, _contiguous),
    aten.huber_loss_backward.default: (lambda args: True, _contiguous),
    aten._log_softmax_backward_data.default: (lambda args: True, _contiguous),
    aten.native_layer_norm_backward.default: (lambda args: True, _contiguous),
    aten.binary_cross_entropy.default: (lambda args: True, _like_arg(0)),
    aten.binary_cross_entropy_backward.default: (lambda args: True, _like_arg(1)),
    aten.reflection_pad2d_backward.default: (lambda args: True, _like_format_of(1)),
    aten.replication_pad2d_backward.default: (lambda args: True, _like_format_of(1)),
    aten.channel_shuffle.default: (lambda args: True, _like_format_of(0)),
    aten.native_channel_shuffle.default: (lambda args: True, _like_format_of(0)),
    aten.max_unpool2d.default: (lambda args: True, _like_format_of(0)),
    aten.copysign.Tensor: (lambda args: True, _like_binary),
    aten.div.Tensor_mode: (lambda args: True, _like_binary),
    aten.floor_divide.default: (lambda args: True, _like_binary),
}


# ops whose CPU kernels type their outputs otherwise than their meta kernels (CUDA's rules):
# batch norm saves the statistics of a float16 input with float16 parameters in float16
# (meta: float32), and its functional form returns the running statistics in their own dtype;
# layer norm's CPU kernel returns the mean and rstd of a bfloat16 / float16 input in its dtype
_TYPED_BY_KERNEL = frozenset({
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit_no_training.default,
    aten.native_layer_norm.default,
})


def _channel_stand_in(v: Any) -> Any:
    """One channel of a batch norm argument: (2, 1) for 2 dims or more (two values to normalise), (1,) else."""
    return torch.ones((2, 1) if v.dim() >= 2 else (1,), dtype=v.dtype) if isinstance(v, torch.Tensor) else v


def _unit_stand_in(v: Any) -> Any:
    """An argument with every size 1: a tensor of its rank, a list of sizes (``normalized_shape``) of ones."""
    if isinstance(v, torch.Tensor):
        return torch.ones((1,) * v.dim(), dtype=v.dtype)
    if isinstance(v, (list, tuple)) and v and all(isinstance(n, (int, torch.SymInt)) for n in v):
        return [1] * len(v)
    return v


def kernel_dtypes(func: Any, args: tuple, kwargs: dict) -> list[torch.dtype] | None:
    """The dtypes torch's CPU kernel gives ``func``'s outputs for these arguments' dtypes: the
    kernel on small stand-ins (batch norm: one channel; layer norm: every size 1); None where
    the stand-ins are refused (the real arguments' own error comes from the kernel)."""
    stand_in = _unit_stand_in if func is aten.native_layer_norm.default else _channel_stand_in
    out = _kernel_on_stand_ins(func, args, kwargs, stand_in)
    return None if out is None else [o.dtype for o in out]


def _kernel_on_stand_ins(func: Any, args: tuple, kwargs: dict, stand_in: Callable[[Any], Any]) -> Any:
    """``func``'s CPU kernel on ``stand_in`` of each argument, without grad; None where the
    kernel refuses them (the real arguments' own error comes from the kernel later)."""
    try:
        with torch.no_grad():
            return func(*(stand_in(a) for a in args), **{k: stand_in(v) for k, v in kwargs.items()})
    except RuntimeError:
        return None


def typed_as_on_cpu(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """The meta ``out`` of ``func`` with the dtypes torch's CPU kernel gives its outputs."""
    if func not in _TYPED_BY_KERNEL:
        return out
    dtypes = kernel_dtypes(func, args, kwargs)
    if dtypes is None or len(dtypes) != len(out):
        return out
    return type(out)(o if o.dtype == d else o.to(d) for o, d in zip(out, dtypes))


def traced_relayout(func: Any, args: tuple) -> Callable[[list], list] | None:
    """For an op of the table above (its CPU kernel lays outputs out otherwise than its meta
    kernel; ``args`` the call's arguments, arrays or meta tensors): a function of the local
    call's flat outputs (stacked values, tuples of per-device parts, non-tensors) giving each
    traced one (fake: torch.compile, export) a layout that the trace and the run agree on. The
    trace's strides are the meta kernel's, the run's the CPU kernel's, so a later view traced
    against the first could fail on the second; a contiguous copy is contiguous in both. Where
    the kernel allocates contiguous outputs and the traced one is contiguous already (static
    sizes), it stays as it is. None for other ops: their outputs need nothing, nor do eager
    ones (their strides are the kernel's own)."""
    fix = _ON_CPU.get(func)
    if fix is None or not fix[0](args):
        return None
    kept = fix[1] is _contiguous  # contiguous in the trace: contiguous in the run too

    def relaid(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor or not is_fake(t):
            return t
        if kept and not any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride())) and t.is_contiguous():
            return t
        return t.clone(memory_format=torch.contiguous_format)

    def relayout(outs: list) -> list:
        return [relaid(o) if isinstance(o, torch.Tensor)
                else tuple(relaid(p) if isinstance(p, torch.Tensor) else p for p in o) if isinstance(o, tuple)
                else o for o in outs]
    return relayout


def _map(fn: Callable[[torch.Tensor], torch.Tensor], out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    return type(out)(fn(o) if isinstance(o, torch.Tensor) else o for o in out)


_modes = threading.local()


def _fake_mode() -> FakeTensorMode:
    """One fake mode per thread (entering a mode is not thread-safe)."""
    mode = getattr(_modes, "mode", None)
    if mode is None:
        mode = _modes.mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _static(leaves: list) -> bool:
    return not any(isinstance(s, torch.SymInt) for t in leaves if isinstance(t, torch.Tensor) for s in t.shape)


def _as_meta(o: Any) -> Any:
    if not isinstance(o, torch.Tensor):
        return o
    meta = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta")
    off = o.storage_offset()
    return meta.as_strided(o.shape, o.stride(), off) if off else meta


def _fake_cpu_run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on fake CPU tensors standing for the meta ones: the CPU kernels' layouts."""
    mode = _fake_mode()
    cpu = torch.device("cpu")
    to_fake = lambda t: FakeTensor(mode, t, cpu) if isinstance(t, torch.Tensor) and t.is_meta else t  # noqa: E731
    fargs, fkwargs = pytree.tree_map(to_fake, (args, kwargs))
    with mode:
        out = func(*fargs, **fkwargs)
    return pytree.tree_map(_as_meta, out)


# ops whose CPU kernels shape their auxiliary outputs otherwise than their meta kernels (CUDA's):
# _embedding_bag's bag_size and max_indices (sum / mean: one per bag on the CPU, empty on meta;
# include_last_offset: one bag fewer on the CPU), and its offset2bag, which the CPU kernel's sum
# fast path leaves empty: a float32 / float16 / bfloat16 weight whose columns are unit-strided,
# per-sample weights unit-strided too, no padding_idx (a weight that torch.func.vmap's fallback
# selects from a batch on its last dim is not unit-strided: fuzzer seed 5829542315)
_SHAPED_BY_KERNEL = frozenset({aten._embedding_bag.default, aten._embedding_bag_forward_only.default})


def _shaped_by_kernel(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` shaped as the CPU kernel shapes it: the kernel on stand-ins of the arguments'
    sizes (zero indices and offsets, a weight of one row: the shapes follow the sizes, not the
    values) that keep whether each one's last dim is unit-strided (the kernel's fast path reads
    it); ``out`` as it is where the sizes are symbolic or the stand-ins are refused."""
    if not _static(pytree.tree_leaves((args, kwargs))):
        return out

    weight = args[0] if args else kwargs.get("weight")

    def stand_in(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (min(t.shape[0], 1), *t.shape[1:]) if t is weight else tuple(t.shape)
        fill = torch.ones if t.is_floating_point() else torch.zeros
        if t.dim() and t.stride(-1) != 1:  # last dim's stride 2: every element of a trailing pair
            return fill((*shape, 2), dtype=t.dtype)[..., 0]
        return fill(shape, dtype=t.dtype)

    got = _kernel_on_stand_ins(func, args, kwargs, stand_in)
    if got is None:
        return out
    return type(out)(o if o.shape == g.shape else torch.empty(g.shape, dtype=o.dtype, device="meta")
                     for o, g in zip(out, got))


def meta_on_cpu(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the meta ``args``: its outputs' metadata as torch's CPU kernels make it."""
    leaves = pytree.tree_leaves((args, kwargs))
    no_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    if func in _DEVICE_HINTED and no_mode and _static(leaves):
        out = _fake_cpu_run(func, args, kwargs)
    else:
        out = func(*args, **kwargs)
    fix = _ON_CPU.get(func)
    if fix is not None and out is not None and fix[0](args):
        out = fix[1](args, out)
    if func in _SHAPED_BY_KERNEL and no_mode:
        out = _shaped_by_kernel(func, args, kwargs, out)
    return out
