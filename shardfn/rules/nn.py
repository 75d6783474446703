"""Neural-network ops and their backward ops (DTensor's ``_math_ops``/``_attention``).

Most of them are *batched*: some leading dims (batch, sequence, heads) are independent
and may stay sharded, the rest (normalized dims, classes, head dims) must be whole.
Weight gradients lack the batch dims, so sharding those leaves them Partial(sum) —
exactly what data parallelism needs. Activations (gelu, silu, relu, ...) are pointwise.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch

from ..values.layout import local_shapes
from .base import Candidate, OpCall, ShardFact, _schema_info, bind, letters, out_of_range, replicated
from .dims import LINEAR_OPS, Dims, compile_dims
from .loss import ClassSharded, RowsOfLoss

aten = torch.ops.aten

LeadFn = Callable[[dict], tuple[int, bool]]


@attrs.frozen
class Leading:
    """The first ``lead`` dims of the ``batched`` arguments and outputs (all outputs, or
    those in ``batched_outs``) share letters (a dim of another size, e.g. a broadcast
    mask dim, is whole); all other dims are whole.
    ``lead_fn(bound_args) -> (lead, reduce)``: with ``reduce``, outputs lacking the
    batch dims are Partial(sum) over them. ``linear``: arguments a pending sum may
    pass through, where the ``factors`` that multiply them are known finite (``Dims.factors``:
    ``sum(parts) * inf`` is not ``sum(parts * inf)``)."""

    batched: tuple[str, ...]
    lead_fn: LeadFn
    linear: tuple[str, ...] = ()
    batched_outs: tuple[int, ...] | None = None
    grouped: tuple[str, ...] = ()
    grouped_outs: tuple[int, ...] = ()
    loose_outs: tuple[int, ...] = ()  # outputs that are replicated unless they carry every leading dim
    factors: tuple[str, ...] = ()
    broadcast_outs: tuple[int, ...] = ()  # outputs shaped like a broadcast input (a bias gradient): right-aligned

    def _loose(self, i: int, lettered: tuple, ls: tuple[str, ...]) -> bool:
        return i in self.loose_outs and not set(ls) <= set(lettered)

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        lead, reduce = self.lead_fn(b)
        names = _schema_info(call.func)[0]
        by_name = [names[p] if isinstance(p, int) else p if isinstance(p, str) else names[p[0]]
                   for p, _ in call.arrays]
        ref = max((tuple(v.shape) for n, (_, v) in zip(by_name, call.arrays) if n in self.batched),
                  key=len, default=None)
        if ref is None or len(ref) < lead:
            return []
        ls = letters(lead)
        ins = tuple(_right_lettered(tuple(v.shape), ref, ls) if n in _BROADCAST
                    else _lettered(tuple(v.shape), ref, ls, n in self.grouped) if n in self.batched
                    else (None,) * v.ndim
                    for n, (_, v) in zip(by_name, call.arrays))
        outs = tuple(
            None if not isinstance(m, torch.Tensor)
            else _right_lettered(tuple(m.shape), ref, ls) if i in self.broadcast_outs
            else _lettered(tuple(m.shape), ref, ls, i in self.grouped_outs)
            if self.batched_outs is None or i in self.batched_outs
            else (None,) * m.dim()
            for i, m in enumerate(call.out_metas))
        loose = {i for i, o in enumerate(outs) if o is not None and self._loose(i, o, ls)}
        outs = tuple(None if i in loose else o for i, o in enumerate(outs))
        partial_ins = tuple(i for i, n in enumerate(by_name) if n in self.linear)
        factors = tuple(i for i, n in enumerate(by_name) if n in self.factors)
        spec = Dims(ins, outs, tuple((L, "sum") for L in ls) if reduce else (),
                    LINEAR_OPS if partial_ins else (), partial_ins=partial_ins, factors=factors)
        cands = compile_dims(call, spec)
        if not loose:
            return cands
        # per-call constants (RNG state, sequence offsets, empty placeholders): replicated
        fill = {i: replicated(call.mesh, call.out_metas[i].dim()) for i in loose}
        return [attrs.evolve(c, out_layouts=tuple(fill.get(i, o) for i, o in enumerate(c.out_layouts)))
                for c in cands]


_BROADCAST = ("attn_mask", "attn_bias")  # broadcast against the scores (batch, heads, seq_q, seq_k): right-aligned


def _right_lettered(shape: tuple[int, ...], ref: tuple[int, ...], ls: tuple[str, ...]) -> tuple:
    """Letters for a tensor broadcast against ``ref`` (a mask or bias, or its gradient): its dims
    align with ``ref``'s last ones, so a (heads, seq_q, seq_k) bias carries the heads letter; a
    broadcast (size-1) or absent leading dim carries none."""
    off = len(ref) - len(shape)
    return tuple(ls[i + off] if 0 <= i + off < len(ls) and shape[i] == ref[i + off] else None
                 for i in range(len(shape)))


def _lettered(shape: tuple[int, ...], ref: tuple[int, ...], ls: tuple[str, ...], grouped: bool = False) -> tuple:
    """Letters for the leading dims of the same size as ``ref``'s; with ``grouped`` the
    last leading dim (grouped-query kv heads) is lettered whatever its size."""
    k = len(ls)
    if len(shape) < k:
        return (None,) * len(shape)
    return tuple(L if shape[i] == ref[i] or (grouped and i == k - 1) else None
                 for i, L in enumerate(ls)) + (None,) * (len(shape) - k)


def _layer_norm_lead(reduce: bool) -> LeadFn:
    def lead(b: dict) -> tuple[int, bool]:
        x = b["input"]
        return x.dim() - len(b["normalized_shape"]), reduce

    return lead


def _nll_lead(b: dict) -> tuple[int, bool]:
    x = b["self"]
    if x.dim() < 2 or b.get("reduction", 1) == 1 and "grad_output" not in b:
        return 0, False  # "mean" divides by the global total weight: rows must be whole
    return 1, True


def _margin_lead(b: dict) -> tuple[int, bool]:
    return (1 if b["self"].dim() == 2 else 0), True


def _heads_lead(b: dict) -> tuple[int, bool]:
    return 2, False


def _heads_reduce(b: dict) -> tuple[int, bool]:
    """Backward with a bias gradient: a bias broadcast over batch/heads gets a pending sum."""
    return 2, True


@attrs.frozen
class Attention:
    """Fused attention (and its backward) with grouped-query kv heads: query head ``h``
    reads kv head ``h // (Hq // Hkv)``, so kv heads are split like query heads, over the
    same axes. That pairs every query head with its own kv head exactly when the number
    of pieces divides ``Hkv`` (contiguous blocks then line up); other splits of the heads
    are dropped (the heads stay whole: a correct, costlier plan). One kv head (multi-query)
    serves every query head: the query heads split over any axes, key and value whole."""

    forward: bool
    loose_outs: tuple[int, ...] = ()  # see Leading: RNG state, cumulative sequence lengths, debug mask
    reduce: bool = False  # a bias gradient among the outputs (pending sum where the bias broadcasts)
    dense_gqa: bool = False  # grouped-query calls need dense inputs (the CPU kernel)

    def candidates(self, call: OpCall) -> list[Candidate]:
        b = bind(call.func, call.args, call.kwargs)
        q, k = b["query"], b["key"]
        fn = _EmptyProblems(call.func)
        base = Leading(_ATTN, _heads_reduce if self.reduce else _heads_lead, loose_outs=self.loose_outs,
                       broadcast_outs=(3,) if self.reduce else ())
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] == k.shape[1]:
            cands = base.candidates(call)
        else:
            hq, hkv = q.shape[1], k.shape[1]
            if hkv == 0 or hq % hkv:
                return []
            if hkv == 1:
                # multi-query: every query head reads the one kv head, so the query heads split
                # with key and value whole (Megatron's plan: k/v projections replicated); the
                # backward's key and value gradients are then pending sums over the heads' axes.
                # Only as the query comes: splitting a whole query here would trade a gather for
                # pending kv gradients, which a fused [Q | K | V] projection cannot take as they come
                cands = (base if self.forward else attrs.evolve(base, lead_fn=_heads_reduce)).candidates(call)
                qi = 0 if self.forward else 1
                cands = [c for c in cands if c.in_layouts[qi].dims[1] in ((), q._layout.dims[1])]
            else:
                rule = attrs.evolve(base, grouped=("key", "value"), grouped_outs=() if self.forward else (1, 2))
                qi = 0 if self.forward else 1
                mesh = call.mesh
                cands = [c for c in rule.candidates(call)
                         if hkv % math.prod(mesh.axis_size(a) for a in c.in_layouts[qi].dims[1]) == 0]
        # the CPU kernel misreads grouped-query heads from transposed strides (which gathers
        # produce): those calls need dense inputs; others a last dim of stride 1 (torch's front-end
        # checks it before picking the kernel; a gathered shard may lack it)
        grouped = self.dense_gqa and q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1]
        return [attrs.evolve(c, dense=True if grouped else "last", local_fn=fn if _empty_somewhere(call, c) else None)
                for c in cands]


def _empty_somewhere(call: OpCall, c: Candidate) -> bool:
    """Whether some device's query/key/value shard holds no batch rows or no heads (more pieces
    than rows or heads) of a call that has some."""
    names = _schema_info(call.func)[0]
    return any(
        (s[0] == 0 < v.shape[0]) or (s[1] == 0 < v.shape[1])
        for (p, v), lay in zip(call.arrays, c.in_layouts)
        if (names[p] if isinstance(p, int) else p) in ("query", "key", "value") and v.ndim == 4
        for s in local_shapes(lay, tuple(v.shape))
    )


@attrs.frozen
class _EmptyProblems:
    """``op`` on one device's shards, giving zero results shaped as its meta kernel's on a
    device holding no (batch, head) problems -- more pieces than batch rows or heads. The kernels
    reject such a piece (flash checks "batch size must be positive", others divide by the head
    count), or return a gradient of another shape for an empty bias; its share is empty anyway
    (a bias gradient's, a pending sum, is zeros)."""

    op: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.op, args, kwargs)
        q, k = b["query"], b["key"]
        if q.shape[0] and q.shape[1] and k.shape[0] and k.shape[1]:
            return self.op(*args, **kwargs)
        meta = self.op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
                       **{n: a.to("meta") if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
        # an undefined output (None: a gradient nobody asked for) or an int stays as it is
        return tuple(torch.zeros(m.shape, dtype=m.dtype, device=q.device) if isinstance(m, torch.Tensor) else m
                     for m in meta)


@attrs.frozen
class EmbeddingBackward:
    """``embedding_dense_backward(grad_output, indices, num_weights, ...)``: the weight's gradient,
    a sum of ``grad_output`` rows by index. The index dims shard as a batch (the gradient pending
    a sum over their axes, as data parallelism needs; whole where ``scale_grad_by_freq`` counts
    every index), and the embedding dim (``grad_output``'s last) keeps its sharding in the
    gradient's columns: T5's and MPNet's relative position biases, looked up with the heads as
    the embedding dim and added to head-split scores, get head-split gradients (before, they were
    gathered over the heads' axis). A pending ``grad_output`` passes (BERT's position embeddings,
    broadcast over a batch split over dp: their gradient stays pending, as DDP's)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if [p for p, _ in call.arrays] != [0, 1]:
            return []
        (_, grad), (_, idx) = call.arrays
        if grad.ndim != idx.ndim + 1:
            return []
        lead = 0 if call.arg(4, "scale_grad_by_freq", False) else idx.ndim
        ls = letters(lead) + (None,) * (idx.ndim - lead)
        spec = Dims((ls + ("D",), ls), ((None, "D"),), tuple((L, "sum") for L in ls if L), LINEAR_OPS,
                    partial_ins=(0,))
        return compile_dims(call, spec)


@attrs.frozen
class Embedding:
    """embedding(weight, indices): the output follows the indices' sharding and the
    weight's embedding dim; a vocabulary-sharded weight gives a Partial(sum) output
    (each device looks up the rows it holds, zeros elsewhere)."""

    def candidates(self, call: OpCall) -> list[Candidate]:
        if [p for p, _ in call.arrays] != [0, 1]:
            return []
        (_, w), (_, idx) = call.arrays
        if w.ndim != 2:
            return []
        ls = letters(idx.ndim, start=2)
        spec = Dims((("V", "D"), ls), (ls + ("D",),), (("V", "sum"),))
        out = []
        for c in compile_dims(call, spec):
            axes = c.in_layouts[0].dims[0]
            if axes:
                c = attrs.evolve(c, local_fn=_VocabEmbedding(w.shape[0]), facts=_VOCAB_FACTS)
            out.append(c)
        return out


_VOCAB_FACTS = (ShardFact("lo", "offset", 0, 0), ShardFact("rows", "size", 0, 0))


@attrs.frozen
class _VocabEmbedding:
    """One device's lookup in its vocabulary rows ``[lo, lo + rows)``: zeros for the
    indices outside (the output is a pending sum over the vocabulary axes); an index
    outside the whole vocabulary raises IndexError, as torch does."""

    vocab: int

    def __call__(self, weight: torch.Tensor, indices: torch.Tensor, *rest: Any, lo: Any, rows: Any) -> torch.Tensor:
        if out_of_range(indices, self.vocab) is not None:
            raise IndexError("index out of range in self")
        return _vocab_embedding(weight, indices, lo, rows)


def _vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, lo: Any, rows: Any) -> torch.Tensor:
    inside = (indices >= lo) & (indices < lo + rows)
    local = torch.where(inside, indices - lo, torch.zeros_like(indices))
    if weight.shape[0] == 0:
        return torch.zeros(*indices.shape, weight.shape[1], dtype=weight.dtype, device=weight.device)
    # where, not a multiply by the mask: the row looked up in place of an outside index may hold
    # inf or nan, and inf * 0 is nan (vmap_last fuzzer seed 5809141)
    looked_up = torch.nn.functional.embedding(local, weight)
    return torch.where(inside.unsqueeze(-1), looked_up, torch.zeros((), dtype=weight.dtype, device=weight.device))


@attrs.frozen
class GroupedConv:
    """``convolution`` / ``convolution_backward`` (not transposed): the batch dim as ``Leading``
    (weight and bias gradients pending a sum over its axes), and the channels split in whole
    groups: input and output channels, the weight's and bias's output channels share a letter
    where each device holds ``groups / n`` of the ``groups`` (``groups`` divisible by the
    ``n`` devices splitting them), the local call taking ``groups / n``. A depthwise
    convolution (LFM2's and the gated-delta / Mamba short convolutions over head-split
    channels) stays split as Megatron runs it; before, its input and weight were gathered."""

    backward: bool = False

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = _schema_info(call.func)[0]
        got = {names[p] if isinstance(p, int) else p: v for p, v in call.arrays}
        x, w = got.get("input"), got.get("weight")
        if x is None or w is None or call.arg(6 if not self.backward else 7, "transposed", False):
            return []
        groups = call.arg(8 if not self.backward else 9, "groups", 1)
        batch = ("n",) if x.dim() == w.dim() else ()
        act = batch + ("C",) + (None,) * (w.dim() - 2)
        letters_of = {"input": act, "grad_output": act, "weight": ("C",) + (None,) * (w.dim() - 1), "bias": ("C",)}
        ins = tuple(letters_of[names[p] if isinstance(p, int) else p] for p, _ in call.arrays)
        kinds = (act, letters_of["weight"], ("C",)) if self.backward else (act,)
        outs = tuple(k if isinstance(m, torch.Tensor) else None for k, m in zip(kinds, call.out_metas))
        spec = Dims(ins, outs, (("n", "sum"),) if batch else ())
        sizes = dict(zip(call.mesh.axis_names, call.mesh.shape))
        out = []
        for c in compile_dims(call, spec):
            n = math.prod(sizes[a] for a in c.in_layouts[0].dims[len(batch)])
            if n == 1:
                out.append(c)
            elif groups % n == 0:
                c = attrs.evolve(c, local_args=(("groups", groups // n),),
                                 local_sizes=(("bias_sizes", 2),) if self.backward and outs[2] is not None else ())
                out.append(c)
        return out


def _first_dim(b: dict) -> tuple[int, bool]:
    x = b.get("self", b.get("input"))
    return (1 if x is not None and x.dim() >= 3 else 0), False  # unbatched inputs reject empty dim 0


def _batch_of(rank: int) -> LeadFn:
    """Lead 1 where the input has ``rank`` dims (batched), else 0 (unbatched: all whole)."""
    return lambda b: ((1 if b["self"].dim() == rank else 0), False)


def _sampler_lead(b: dict) -> tuple[int, bool]:
    return 1, False  # (batch, ...) input, grid and gradient alike


def _pixel_lead(b: dict) -> tuple[int, bool]:
    return b["self"].dim() - 3, False


_SPATIAL = ("self", "input", "grad_output", "indices")
_POOL = Leading(_SPATIAL, _first_dim)
_POOL_OPS = (
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "max_pool3d_with_indices",
    "max_pool3d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "avg_pool3d",
    "avg_pool3d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d", "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "reflection_pad1d_backward",
    "reflection_pad2d_backward", "reflection_pad3d_backward", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "replication_pad1d_backward",
    "replication_pad2d_backward", "replication_pad3d_backward", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    "max_unpool2d", "max_unpool3d", "channel_shuffle",
)

_LN = Leading(("input",), _layer_norm_lead(False))


def _channels_lead(b: dict) -> tuple[int, bool]:
    g = b["grad_output"]
    return (2 if g.dim() >= 3 else 0), False  # (batch, channels, *spatial): each (batch, channel) plane apart


@attrs.frozen
class _Sized:
    """``rule``'s candidates, with size arguments that name an output's shape made local
    (``local_sizes``: an upsampling backward's ``input_size``)."""

    rule: Any
    sizes: tuple[tuple[str, int], ...]

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [attrs.evolve(c, local_sizes=self.sizes) for c in self.rule.candidates(call)]


# the upsampling backwards: each (batch, channel) plane's gradient from its own plane
_UPSAMPLE_BWD = _Sized(Leading(("grad_output",), _channels_lead), (("input_size", 0),))
_UPSAMPLE_BWD_OPS = (
    "upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward", "_upsample_nearest_exact3d_backward",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward", "_upsample_bicubic2d_aa_backward",
)


@attrs.frozen
class GroupNorm:
    """native_group_norm and its backward: rows (dim 0) independent, a group's channels and
    positions whole; the weight and bias gradients are pending sums over split rows. The op
    takes the row count ``N`` as an argument: a device whose rows are split runs it with its own
    (``_LocalRows``)."""

    rule: Any

    def candidates(self, call: OpCall) -> list[Candidate]:
        names = [_arg_name(call.func, p) for p, _ in call.arrays]
        if "input" not in names:
            return []
        i = names.index("input")
        fn = _LocalRows(call.func)
        return [attrs.evolve(c, local_fn=fn) if c.in_layouts[i].dims[0] else c for c in self.rule.candidates(call)]


def _arg_name(func: Any, path: Any) -> str:
    return _schema_info(func)[0][path] if isinstance(path, int) else path


@attrs.frozen
class _LocalRows:
    """The op on one device's rows, its ``N`` (row count) argument the shard's."""

    func: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        b = bind(self.func, args, kwargs)
        b["N"] = b["input"].shape[0]
        return self.func(*(b[a.name] for a in self.func._schema.arguments))


def _rows_lead(reduce: bool) -> LeadFn:
    return lambda b: ((1 if b["input"].dim() >= 2 else 0), reduce)


@attrs.frozen
class _AnyOf:
    """The candidates of several rules."""

    rules: tuple

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [c for r in self.rules for c in r.candidates(call)]


_NLL = _AnyOf((Leading(("self", "target"), _nll_lead, batched_outs=(0,)), ClassSharded(backward=False)))
@attrs.frozen
class _Dense:
    """A rule whose local calls need contiguous inputs. A device's operand may be a view with
    any strides (a shard, a gathered or reduced value on the stacked local backend, a value
    torch.func has permuted), where torch's composite front-ends hand these kernels contiguous
    tensors and their CPU kernels rely on it: ``nll_loss*_backward`` allocates ``grad_input``
    like ``self`` and rejects it unless contiguous, layer norm's and group norm's backwards
    read their statistics by flat index (wrong values), and ``native_group_norm`` checks its
    input is contiguous ("Expected X.is_contiguous(memory_format)")."""

    rule: Any

    def candidates(self, call: OpCall) -> list[Candidate]:
        return [attrs.evolve(c, dense=True) for c in self.rule.candidates(call)]


# torch's CPU layer-norm backward reads mean / rstd by flat index (as contiguous): a shard cut
# along a leading dim other than the first (heads of Persimmon's per-head q/k LayerNorm,
# whose gradient arrives head-split) is a strided view and gave wrong input gradients
_LN_BWD = _Dense(Leading(("grad_out", "input", "mean", "rstd"), _layer_norm_lead(True), batched_outs=(0,)))
_NLL_BWD = _Dense(_AnyOf((Leading(("grad_output", "self", "target"), _nll_lead, linear=("grad_output",), batched_outs=(0,),
                                  factors=("weight",)),
                          ClassSharded(backward=True))))
# margin losses: rows (dim 0 of a 2-D input) may be sharded, classes whole; a 1-D input is one row
_MARGIN = RowsOfLoss(Leading(("self", "target", "is_target"), _margin_lead, batched_outs=(0, 1)))
_MARGIN_BWD = RowsOfLoss(_Dense(Leading(("grad_output", "self", "target", "is_target"), _margin_lead, batched_outs=(0,))))
# the efficient kernel's backward names its gradient grad_out_
_ATTN = ("query", "key", "value", "attn_mask", "grad_out", "grad_out_", "out", "logsumexp", "attn_bias")
# CUDA's fused kernels: outputs beyond (output, logsumexp) are per-call constants -- cumulative
# sequence lengths, the dropout RNG's philox seed/offset (drawn per device: a direct call with
# dropout is not sharding-invariant; F.scaled_dot_product_attention with dropout on arrays of
# 3+ dims does not come here, see backends/custom_ops.py), an empty or (batch, heads)-led debug mask
_FLASH_LOOSE = (1, 2, 3, 6, 7, 8)
ATTENTION_RULES = {
    aten._scaled_dot_product_flash_attention_for_cpu: Attention(forward=True, dense_gqa=True),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: Attention(forward=False, dense_gqa=True),
    aten._scaled_dot_product_flash_attention: Attention(forward=True, loose_outs=_FLASH_LOOSE),
    aten._scaled_dot_product_flash_attention_backward: Attention(forward=False),
    aten._scaled_dot_product_efficient_attention: Attention(forward=True, loose_outs=(1, 2, 3)),
    aten._scaled_dot_product_efficient_attention_backward: Attention(forward=False, reduce=True),
    aten._scaled_dot_product_cudnn_attention: Attention(forward=True, loose_outs=_FLASH_LOOSE),
    aten._scaled_dot_product_cudnn_attention_backward: Attention(forward=False),
    aten._scaled_dot_product_fused_attention_overrideable: Attention(forward=True, loose_outs=_FLASH_LOOSE),
    aten._scaled_dot_product_fused_attention_overrideable_backward: Attention(forward=False, reduce=True),
}
_GN = GroupNorm(_Dense(Leading(("input",), _rows_lead(False))))
_GN_BWD = GroupNorm(_Dense(Leading(("grad_out", "input", "mean", "rstd"), _rows_lead(True), batched_outs=(0,))))
_RMS = Leading(("input",), _layer_norm_lead(False))
_RMS_BWD = _Dense(Leading(("grad_out", "input", "rstd"), _layer_norm_lead(True), batched_outs=(0,)))

TABLE = {
    aten.native_layer_norm: _LN,
    aten.native_layer_norm_backward: _LN_BWD,
    aten.nll_loss_forward: _NLL,
    aten.nll_loss2d_forward: _NLL,
    aten.nll_loss_backward: _NLL_BWD,
    aten.nll_loss2d_backward: _NLL_BWD,
    aten.multi_margin_loss: _MARGIN,
    aten.multi_margin_loss_backward: _MARGIN_BWD,
    aten.multilabel_margin_loss_forward: _MARGIN,
    aten.multilabel_margin_loss_backward: _MARGIN_BWD,
    **{op: rule for op, rule in ATTENTION_RULES.items()},
    aten._fused_rms_norm: _RMS,
    aten.native_group_norm: _GN,
    aten.native_group_norm_backward: _GN_BWD,
    **{getattr(aten, n): _UPSAMPLE_BWD for n in _UPSAMPLE_BWD_OPS if hasattr(aten, n)},
    # unfold / fold: each batch row's patches from its own image
    aten.im2col: Leading(("self",), _batch_of(4)),
    aten.col2im: Leading(("self",), _batch_of(3)),
    # grid_sample: each batch row samples its own image at its own grid
    **{getattr(aten, n): Leading(("input", "grid", "grad_output"), _sampler_lead) for n in (
        "grid_sampler_2d", "grid_sampler_2d_backward", "grid_sampler_3d", "grid_sampler_3d_backward")},
    aten._fused_rms_norm_backward: _RMS_BWD,
    aten.embedding: Embedding(),
    aten.convolution: GroupedConv(),
    aten.convolution_backward: GroupedConv(backward=True),
    aten.pixel_shuffle: Leading(("self",), _pixel_lead),
    aten.pixel_unshuffle: Leading(("self",), _pixel_lead),
    **{getattr(aten, n): _POOL for n in _POOL_OPS if hasattr(aten, n)},
    aten.embedding_dense_backward: EmbeddingBackward(),
}
