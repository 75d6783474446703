"""torch's casting rule for in-place and ``out=`` writes, asked of torch on meta stand-ins."""

from __future__ import annotations

from typing import Any

import torch

from ...values.schema import functional_args, functional_overload, is_inplace

_CASTS: dict = {}  # (op, operand dtypes and kinds) -> the error torch raises, or None


def check_cast(func: Any, args: tuple, kwargs: dict, targets: list) -> None:
    """torch's rule for pointwise in-place and ``out=`` ops (TensorIterator's): the computed
    result type must cast safely to the written tensor's dtype (``int.mul_(1.5)``,
    ``torch.add(i, 0.5, out=i)`` raise). The functional update casts whatever it computes, so
    the rule is asked of torch: the op on meta stand-ins of the operands' dtypes and ranks
    (values and shapes play no part in it), once per such signature."""
    if torch.Tag.pointwise not in func.tags:
        return
    flat = [*args, *kwargs.values()]
    key = (func, tuple((a.dtype, a.dim() == 0) if isinstance(a, torch.Tensor) else type(a) for a in flat))
    if key not in _CASTS:
        _CASTS[key] = _cast_error(func, args, kwargs, targets)
    if _CASTS[key] is not None:
        raise RuntimeError(_CASTS[key])


def _cast_error(func: Any, args: tuple, kwargs: dict, targets: list) -> str | None:
    """The message of torch's unsafe-cast error for this call, or None where the cast is safe."""
    def meta(a: Any) -> Any:
        return torch.empty((1,) * a.dim(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a

    margs, mkw = tuple(meta(a) for a in args), {k: meta(v) for k, v in kwargs.items()}
    written = [a for a in targets if isinstance(a, torch.Tensor)]
    if not written:
        return None
    try:
        if is_inplace(func) and args and args[0] is written[0]:
            op = functional_overload(func)  # ``pow_.Scalar`` -> ``pow.Tensor_Scalar``
            if op is None:
                return None
            fargs, fkw = functional_args(func, op, margs, mkw)
            out = op(*fargs, **fkw)
            if not isinstance(out, torch.Tensor):
                return None
            result, want = out.dtype, written[0].dtype
        else:
            func(*margs, **mkw)  # an out= op's meta checks its outputs' dtypes
            return None
    except RuntimeError as e:
        return str(e) if "can't be cast" in str(e) else None
    except Exception:  # noqa: BLE001 - the stand-ins are not the op's business: the op itself decides
        return None
    if result == want or torch.can_cast(result, want):
        return None
    return f"result type {_dtype_name(result)} can't be cast to the desired output type {_dtype_name(want)}"


def _dtype_name(d: torch.dtype) -> str:
    """torch's C++ name of a dtype (``Float``, ``Long``, ``ComplexDouble``)."""
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
            torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}.get(d, str(d))
