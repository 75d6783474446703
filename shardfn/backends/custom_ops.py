"""Batched products that keep every batch dim: ``torch.matmul`` / ``@`` / ``torch.einsum``
on ShardedArrays with two or more batch dims run as one op, ``shardfn::contract``.

torch's composites fold the batch dims of a 4-d ``matmul`` (or an einsum's batch
letters) into one dim before ``bmm``; a folded dim cannot hold (batch over 'dp', heads
over 'tp'), so the heads would be gathered. ``_BatchedArray.__torch_function__`` sends
such calls here instead: ``contract(equation, a, b)`` is a ``torch.library`` custom op
(einsum of two operands) whose sharding rule is the equation itself
(``rules/matrix.py``), whose autograd formula is two more ``contract`` calls (so every
order of derivative keeps the batch dims), with fake and vmap implementations, so
autograd, torch.func and torch.compile see one op. The kernel accepts extra leading
dims (broadcast like einsum's ``...``), which is how the local backend runs it once on
stacked shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.attention import SDPBackend

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _parse(eq: str) -> tuple[str, str, str]:
    """``"bhsd,bhtd->bhst"`` -> ("bhsd", "bhtd", "bhst")."""
    lhs, out = eq.replace(" ", "").split("->")
    a, b = lhs.split(",")
    return a, b, out


def _kernel(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """einsum of the two operands; dims in front of the equation's broadcast as ``...``."""
    ea, eb, eo = _parse(equation)
    if a.dim() > len(ea) or b.dim() > len(eb):
        ea, eb, eo = "..." + ea, "..." + eb, "..." + eo
    return torch.einsum(f"{ea},{eb}->{eo}", a, b)


@torch.library.custom_op("shardfn::contract", mutates_args=())
def contract(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, b)`` as one op (see the module docstring)."""
    return _kernel(equation, a, b)


@contract.register_fake
def _(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _kernel(equation, a, b)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.equation = inputs[0]
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx: Any, g: torch.Tensor) -> tuple:
    """d/da = g contracted with b (conjugated), d/db likewise: both batched contractions."""
    ea, eb, eo = _parse(ctx.equation)
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[1]:
        ga = contract(f"{eo},{eb}->{ea}", g, b.conj() if b.is_complex() else b)
    if ctx.needs_input_grad[2]:
        gb = contract(f"{ea},{eo}->{eb}", a.conj() if a.is_complex() else a, g)
    return None, ga, gb


contract.register_autograd(_backward, setup_context=_setup)


@contract.register_vmap
def _(info: Any, in_dims: tuple, equation: str, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """A vmapped operand gets a fresh letter at its front; the output has it first."""
    _, da, db = in_dims
    ea, eb, eo = _parse(equation)
    z = next(c for c in _LETTERS if c not in ea + eb + eo)
    if da is not None:
        a, ea = a.movedim(da, 0), z + ea
    if db is not None:
        b, eb = b.movedim(db, 0), z + eb
    return contract(f"{ea},{eb}->{z}{eo}", a, b), 0


# -- which calls go here ----------------------------------------------------------------


def _matmul_equation(a: Any, b: Any) -> str | None:
    """The equation of ``a @ b`` when both have the same two or more batch dims."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    n = a.dim() - 2
    if n < 2 or b.dim() != a.dim() or a.shape[:-2] != b.shape[:-2]:
        return None
    batch = _LETTERS[:n]
    m, k, o = _LETTERS[n:n + 3]
    return f"{batch}{m}{k},{batch}{k}{o}->{batch}{m}{o}"


def _einsum_equation(args: tuple) -> tuple[str, Any, Any] | None:
    """(equation, a, b) for a two-operand einsum with two or more batch letters whose
    gradient is again such a contraction (explicit output, no repeated or ``...`` letters,
    every operand letter kept in the output or the other operand)."""
    if not args or not isinstance(args[0], str):
        return None
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if len(ops) != 2 or not all(isinstance(t, torch.Tensor) for t in ops):
        return None
    eq = args[0].replace(" ", "")
    if "..." in eq or eq.count("->") != 1 or eq.count(",") != 1:
        return None
    ea, eb, eo = _parse(eq)
    if not all(s.isalpha() or s == "" for s in (ea, eb, eo)):
        return None
    if any(len(set(s)) != len(s) for s in (ea, eb, eo)) or (ops[0].dim(), ops[1].dim()) != (len(ea), len(eb)):
        return None
    if not set(eo) <= set(ea) | set(eb) or not set(ea) <= set(eo) | set(eb) or not set(eb) <= set(eo) | set(ea):
        return None
    if len(set(ea) & set(eb) & set(eo)) < 2:
        return None
    if any(ops[0].shape[ea.index(c)] != ops[1].shape[eb.index(c)] for c in set(ea) & set(eb)):
        return None  # broadcasting size-1 letters: leave it to torch
    return eq, ops[0], ops[1]


def _forward_ad() -> bool:
    """Whether forward-mode AD is on (``torch.func.jvp``/``jacfwd``/``hessian``, a
    ``forward_ad.dual_level``). A ``torch.library`` custom op has no forward-mode formula,
    and torch runs it without one, dropping the tangents it was given (a zero tangent), so
    ``contract`` and ``rms_norm`` give way to torch's composites there."""
    return torch.autograd.forward_ad._current_level >= 0


def _functorch_refuses(args: tuple, kwargs: dict | None) -> bool:
    """Whether a ``torch.library`` custom op with an autograd formula would fail here: under a
    torch.func transform (grad, vjp, vmap, ...) with an input that needs its gradient, torch
    runs the formula as an ``autograd.Function`` without ``setup_context``, which functorch
    refuses (a ShardedArray the transformed function closes over, beside a wrapped one), so
    ``contract`` and ``rms_norm`` give way to torch's composites there."""
    if not (torch._C._are_functorch_transforms_active() and torch.is_grad_enabled()):
        return False
    leaves = [*args, *(kwargs or {}).values()]
    leaves += [t for a in leaves if isinstance(a, (list, tuple)) for t in a]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def batched_call(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``contract`` for a matmul / einsum call that keeps two or more batch dims, else
    NotImplemented (the caller runs torch's composite)."""
    if func is _SDPA:
        return _attention_math(args, kwargs)
    if func in _MATH_OPS:
        return _attention_math_op(args, kwargs)
    if _forward_ad() or _functorch_refuses(args, kwargs):
        return NotImplemented
    if func in _RMS_NORMS:
        return _rms_norm_call(args, kwargs)
    if kwargs:
        return NotImplemented
    if func is torch.einsum:
        found = _einsum_equation(args)
        return NotImplemented if found is None else contract(*found)
    if len(args) != 2:
        return NotImplemented
    a, b = (args[1], args[0]) if func is torch.Tensor.__rmatmul__ else args
    eq = _matmul_equation(a, b)
    return NotImplemented if eq is None else contract(eq, a, b)


_RMS_NORMS = frozenset({torch.rms_norm, torch.nn.functional.rms_norm})
_SDPA = torch.nn.functional.scaled_dot_product_attention
_MATH_OPS = frozenset({torch.ops.aten._scaled_dot_product_attention_math,
                       torch.ops.aten._scaled_dot_product_attention_math.default})
FUNCS = _RMS_NORMS | _MATH_OPS | frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                                            torch.Tensor.__rmatmul__, torch.einsum, _SDPA})
"""The torch functions ``_BatchedArray.__torch_function__`` looks at."""


# -- RMSNorm as one op --------------------------------------------------------------------
# torch.rms_norm is a composite: its input gradient arrives as two separate pending sums
# (through x * rsqrt(...) and through x.pow(2)), and the autograd engine adds each to the
# replicated residual gradient, reducing twice. As one op, its backward gives one pending
# sum (reduced once, Megatron's count), and the weight gradient a pending sum too.


def _opmath(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _aligned_weight(w: torch.Tensor, x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """The weight broadcast against ``x`` and the number of leading (mesh) dims it has."""
    m = w.dim() - k
    if m:
        w = w.reshape(*w.shape[:m], *([1] * (x.dim() - m - k)), *w.shape[m:])
    return w, m


def _rstd(x: torch.Tensor, k: int, eps: float | None) -> torch.Tensor:
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return torch.rsqrt(x.pow(2).mean(tuple(range(-k, 0)), keepdim=True) + eps)


@torch.library.custom_op("shardfn::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """``torch.rms_norm(x, normalized_shape, weight, eps)`` as one op."""
    k = len(normalized_shape)
    xo = _opmath(x)
    y = (xo * _rstd(xo, k, eps)).to(x.dtype)
    return y * _aligned_weight(weight, x, k)[0]


@rms_norm.register_fake
def _(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    w, _ = _aligned_weight(weight, x, len(normalized_shape))
    return torch.empty(torch.broadcast_shapes(x.shape, w.shape), dtype=torch.promote_types(x.dtype, weight.dtype),
                       device=x.device)


@torch.library.custom_op("shardfn::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor,
                      eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input gradient, weight gradient) of ``rms_norm``; linear in ``grad``."""
    k = len(normalized_shape)
    w, m = _aligned_weight(weight, x, k)
    xo, go = _opmath(x), _opmath(grad)
    r = _rstd(xo, k, eps)
    gh = go * w
    gx = r * gh - xo * r.pow(3) * (gh * xo).mean(tuple(range(-k, 0)), keepdim=True)
    batch = tuple(range(m, go.dim() - k))
    gw = (go * xo * r).sum(batch) if batch else go * xo * r
    return gx.to(x.dtype), gw.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor,
      eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    k = len(normalized_shape)
    m = weight.dim() - k
    lead = torch.broadcast_shapes(grad.shape, x.shape)
    return (torch.empty(lead, dtype=x.dtype, device=x.device),
            torch.empty((*lead[:m], *lead[len(lead) - k:]), dtype=weight.dtype, device=x.device))


def _rms_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.shape, ctx.eps = inputs[1], inputs[3]
    ctx.save_for_backward(inputs[0], inputs[2])


def _rms_backward(ctx: Any, g: torch.Tensor) -> tuple:
    x, w = ctx.saved_tensors
    gx, gw = rms_norm_backward(g, x, ctx.shape, w, ctx.eps)
    return gx, None, gw, None


rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


def _by_name(names: tuple[str, ...], args: tuple, kwargs: dict | None) -> dict | None:
    """A call's arguments by parameter name, or None where a keyword is not one of ``names``
    or repeats a positional argument (the caller leaves such a call to torch)."""
    bound = dict(zip(names, args))
    for key, v in (kwargs or {}).items():
        if key not in names or key in bound:
            return None
        bound[key] = v
    return bound


def _rms_norm_call(args: tuple, kwargs: dict | None) -> Any:
    """``shardfn::rms_norm`` for ``rms_norm(input, normalized_shape, weight, eps)`` with a
    weight, all on one dtype and without torch.func wrappers, else NotImplemented."""
    names = ("input", "normalized_shape", "weight", "eps")
    bound = _by_name(names, args, kwargs)
    if bound is None:
        return NotImplemented
    x, shape, w, eps = (bound.get(n) for n in names)
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or x.dtype != w.dtype:
        return NotImplemented
    if torch._C._functorch.is_functorch_wrapped_tensor(x) or torch._C._functorch.is_functorch_wrapped_tensor(w):
        return NotImplemented
    shape = [shape] if isinstance(shape, int) else list(shape)
    if not shape or list(w.shape) != shape or list(x.shape[x.dim() - len(shape):]) != shape:
        return NotImplemented
    return rms_norm(x, shape, w, None if eps is None else float(eps))


# -- attention on torch's math path --------------------------------------------------------
# CUDA's fused attention kernels (flash, efficient, cuDNN) draw their dropout mask from a
# philox seed and offset taken per call, so each simulated device would draw its own and
# the mask would depend on the layout; torch's math path (``at::matmul``) folds the batch
# and head dims into one and gathers heads sharded over a second axis. With dropout, and
# wherever torch itself would take its math path (always for meta tensors, so on a meta
# mesh; on other devices when no fused kernel accepts the call), attention on these arrays
# runs torch's math formula here instead: batched products that keep every batch dim, and
# ``F.dropout``, whose mask shardfn draws from global indices
# (``shardfn.random.torch_ops``), the same for every layout.

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention_math(args: tuple, kwargs: dict | None) -> Any:
    """``scaled_dot_product_attention`` with ``dropout_p > 0``, or where torch would take its
    math path (:func:`_torch_takes_math_path`), as that path computes it (q and k each scaled
    by sqrt(scale), boolean and causal masks as -inf, a softmax that gives 0 on fully masked
    rows, GQA by repeating key/value heads), else NotImplemented."""
    bound = _by_name(_SDPA_ARGS, args, kwargs)
    if bound is None:
        return NotImplemented
    p = bound.get("dropout_p", 0.0)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask, scale = bound.get("attn_mask"), bound.get("scale")
    if not isinstance(p, (int, float)) or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return NotImplemented
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (q, k, v)) or q.dim() < 2:
        return NotImplemented
    if not p > 0.0 and not _torch_takes_math_path(q, k, v, mask, bound):
        return NotImplemented
    if mask is not None and bound.get("is_causal"):
        return NotImplemented  # torch raises its own error
    if bound.get("enable_gqa") and q.dim() >= 3:
        kv = _repeat_kv_heads(q, k, v)
        if kv is None:
            return NotImplemented  # torch raises its own error
        k, v = kv
    scores = _scaled_scores(q, k, scale)
    if bound.get("is_causal"):
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None and scores.numel() and v.size(-1):  # (an empty output: torch returns it, the mask unchecked)
        full = tuple(torch.broadcast_shapes(scores.shape, mask.shape))
        if full != tuple(scores.shape):  # torch's math path adds the mask in place: it may not grow the scores
            raise RuntimeError(f"output with shape {list(scores.shape)} doesn't match the broadcast shape {list(full)}")
        scores = scores.masked_fill(mask.logical_not(), float("-inf")) if mask.dtype == torch.bool else scores + mask
    attn = torch.ops.aten._safe_softmax(scores, -1)
    return torch.matmul(torch.nn.functional.dropout(attn, float(p)) if p > 0.0 else attn, v)


def _repeat_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple | None:
    """Grouped-query attention: ``k`` and ``v`` with their heads (dim -3) repeated up to
    ``q``'s; None where ``q``'s head count is not a multiple of theirs (torch raises)."""
    if k.size(-3) == q.size(-3):
        return k, v
    if k.size(-3) == 0 or q.size(-3) % k.size(-3):
        return None
    groups = q.size(-3) // k.size(-3)
    return k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``q @ k^T`` times the softmax scale, as torch's math path computes it: the square root of
    the scale applied to each side (a negative scale's sign on ``q``). A head dim of 0: torch's
    1/sqrt(0) is inf in C++ (the products over it are empty, never inf)."""
    neg = scale is not None and scale < 0
    root = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.size(-1)) if q.size(-1) else math.inf)
    return torch.matmul(q * (-root if neg else root), k.transpose(-2, -1) * root)


_MATH_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "dropout_mask", "scale", "enable_gqa")


def _attention_math_op(args: tuple, kwargs: dict | None) -> Any:
    """``aten._scaled_dot_product_attention_math`` called directly (what CUDA's SDPA runs when no
    fused kernel takes the call): its C++ composite folds batch and heads into one dim for
    ``at::matmul``, gathering heads split over a second axis; here the same formula with
    batched products, returning (output, attention weights) as it does. Its own semantics, not
    ``F.scaled_dot_product_attention``'s: a boolean ``attn_mask`` is added (True as 1), the
    causal mask is -inf above the diagonal. With a ``dropout_mask`` (a testing aid) or under
    torch.func: NotImplemented (torch's composite)."""
    bound = _by_name(_MATH_ARGS, args, kwargs)
    if bound is None or bound.get("dropout_mask") is not None:
        return NotImplemented
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask, scale, p = bound.get("attn_mask"), bound.get("scale"), bound.get("dropout_p", 0.0)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() < 3 or not isinstance(p, (int, float)):
        return NotImplemented
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (q, k, v)):
        return NotImplemented
    if bound.get("is_causal") and mask is not None:
        return NotImplemented  # torch raises its own error
    if bound.get("enable_gqa"):
        kv = _repeat_kv_heads(q, k, v)
        if kv is None:
            return NotImplemented  # torch raises its own error
        k, v = kv
    attn = _scaled_scores(q, k, scale)
    if bound.get("is_causal"):
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(keep.logical_not(), float("-inf"))
    if mask is not None:
        attn = (attn + mask).to(attn.dtype)  # torch adds in place: the scores keep their dtype
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if p > 0.0:
        attn = torch.nn.functional.dropout(attn, float(p))
    return torch.matmul(attn, v), attn


def _stand_in(t: Any, concrete: bool = False) -> Any:
    """A plain tensor with ``t``'s global shape, dtype, device and requires_grad, holding one
    row of memory (strides 0 but the last dim's 1: the kernels' choice reads metadata and the
    last dim's stride, never values); ``t`` itself if it is plain (or None). The same on every rank.
    Called with torch functions disabled (an array's metadata reads skip its hook), and made by
    one factory call (``empty_strided``, a leaf: no ``expand`` and no autograd node).
    ``concrete``: for any tensor (a fake one too), its sizes made ints, outside the tracing modes."""
    if t is None or not (concrete or hasattr(t, "_layout")):
        return t
    shape, dtype, device = tuple(int(n) for n in t.shape) if concrete else t.shape, t.dtype, t.device
    if not shape:
        return torch.empty((), dtype=dtype, device=device)
    return torch.empty_strided(shape, (0,) * (len(shape) - 1) + (1,), dtype=dtype, device=device,
                               requires_grad=t.requires_grad and (dtype.is_floating_point or dtype.is_complex))


_STAND_INS: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device, requires_grad) -> a stand-in (``_kept_stand_in``)
_STAND_INS_MAX = 64
_get_mode = torch._C._get_dispatch_mode
_FAKE, _PROXY, _FUNCTIONAL = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                              torch._C._TorchDispatchModeKey.FUNCTIONAL)


def _kept_stand_in(t: Any) -> Any:
    """:func:`_stand_in`, made once per (shape, dtype, device, requires_grad) and kept: the
    choice reads only that metadata (and the strides, fixed here), so every warm forward asked
    three ``empty_strided`` calls (three allocations on a GPU) for the same answer. Made outside
    the dispatch modes and inference mode (a plain, ordinary tensor whoever asks next); never
    handed out, never written."""
    if not hasattr(t, "_layout"):
        return t
    shape = t.shape
    if not shape:
        return _stand_in(t)
    key = (shape, t.dtype, t.device, t.requires_grad)
    kept = _STAND_INS.get(key)
    if kept is None:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.inference_mode(False):
            kept = _stand_in(t)
        if len(_STAND_INS) >= _STAND_INS_MAX:
            _STAND_INS.clear()
        _STAND_INS[key] = kept
    return kept


def _torch_takes_math_path(q: Any, k: Any, v: Any, mask: Any, bound: dict) -> bool:
    """Whether torch would run attention's math path on these arrays: always on meta tensors
    (torch has no fused meta choice), elsewhere where its own choice for the unsharded call
    is math (a disabled fused backend, an unsupported head dim or mask). Asked of the global
    shapes, so that every rank of the dist backend decides alike."""
    with torch._C.DisableTorchFunctionSubclass():  # metadata reads of 3+-d arrays: no hook call each
        if q.device.type == "meta":
            return True
        if _get_mode(_FAKE) is not None:
            return _traced_choice_is_math(q, k, v, mask, bound)
        # kept stand-ins, except while a mode traces (its ops must see tensors of its own)
        tracing = _get_mode(_PROXY) is not None or _get_mode(_FUNCTIONAL) is not None
        return _choice_is_math(q, k, v, mask, bound, _stand_in if tracing else _kept_stand_in)


def _choice_is_math(q: Any, k: Any, v: Any, mask: Any, bound: dict, stand_in: Any = None) -> bool:
    stand_in = stand_in or _stand_in
    try:
        choice = torch.ops.aten._fused_sdp_choice(
            stand_in(q), stand_in(k), stand_in(v), stand_in(mask), bound.get("dropout_p", 0.0),
            bool(bound.get("is_causal", False)), scale=bound.get("scale"),
            enable_gqa=bool(bound.get("enable_gqa", False)))
    except (RuntimeError, TypeError, ValueError):
        return False  # torch's own call raises its own error
    return int(choice) == int(SDPBackend.MATH)


def _traced_choice_is_math(q: Any, k: Any, v: Any, mask: Any, bound: dict) -> bool:
    """The choice while torch.compile traces (fake tensors): asked of real stand-ins on the
    device, as torch's own attention asks its device's chooser directly. The dispatched
    ``_fused_sdp_choice`` of fake tensors runs the meta chooser, which answers math on the CPU
    and, seeing the fake's meta device, on CUDA too: the compiled step ran attention as
    products and a softmax, saving the (batch, heads, seq, seq) probabilities for the backward
    where the unsharded compiled step saves its fused kernel's outputs. Symbolic sizes keep
    the fake's answer (a real stand-in needs concrete ones)."""
    ts = [t for t in (q, k, v, mask) if t is not None]
    if any(isinstance(n, torch.SymInt) for t in ts for n in t.shape):
        return _choice_is_math(q, k, v, mask, bound)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _choice_is_math(*(_stand_in(t, concrete=True) for t in (q, k, v, mask)), bound)
