"""Counter-based random numbers (Philox-4x32-10) built from torch integer ops.

Why
---
For a sharded tensor every device should be able to generate *only its own
shard* of a random tensor, and the gathered result must be bit-identical to
generating the whole (unsharded) tensor at once.  A counter-based generator
makes this trivial: the value of every element is a pure function of

    (key, global flat row-major index of the element in the logical tensor, stream)

and nothing else -- not the shard/box it is computed in, not the device, not
the order of evaluation.

Arithmetic model
----------------
Philox works on uint32 words.  torch has poor uint32 support, so every word is
held in an ``int64`` tensor with a value in ``[0, 2**32)``.  Only integer
operations whose results never leave the int64 range are used (32x32->64
multiplies are split into 16-bit halves so no intermediate exceeds 2**49), so
there is no reliance on signed-overflow behaviour and the bits are identical on
CPU and CUDA.

The floating point transforms (uniform / normal) use only IEEE operations that
are correctly rounded (``+ - * /``, ``sqrt``, ``frexp``, conversions), applied
as separate torch ops (so no FMA contraction).  In particular ``normal`` does
*not* call ``torch.log`` / ``torch.cos`` (whose results differ between CPU and
CUDA and between library versions); it evaluates its own fixed polynomials.
Hence floating point results are bit-identical across devices as well.

Counter layout
--------------
Philox-4x32 has a 128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit key
``(k0, k1)``.  This module uses

    c0 = low 32 bits of ``counter_lo`` (the element's global flat index)
    c1 = high 32 bits of ``counter_lo``
    c2 = ``stream``      (uint32, chosen by the caller to decorrelate op kinds)
    c3 = ``counter_hi``  (uint32; 0 for all sampling functions, non-zero
                          domain tags for :func:`split` / :func:`fold_in`)

so sampled values never share a counter with key derivation.  Each element
consumes one full counter (four output words); ``uniform_bits`` / float32
``uniform`` / ``bernoulli`` use word 0, float64 ``uniform`` and ``randint``
words 0-1, ``normal`` words 0-3.

Boxes
-----
A *box* is a tuple with one ``(start, stop)`` pair per dimension of
``global_shape`` (``None`` means the whole tensor).  Only box-sized tensors are
ever created.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "MASK32",
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "key_from_seed",
    "philox",
    "split",
    "fold_in",
    "box_indices",
    "uniform_bits",
    "uniform",
    "normal",
    "randint",
    "bernoulli",
]

MASK32 = 0xFFFFFFFF
MASK16 = 0xFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

# Domain tags placed in counter word c3 for key derivation (sampling uses 0).
_SPLIT_TAG = 0x53504C54  # "SPLT"
_FOLD_TAG = 0x464F4C44  # "FOLD"

Key = Tuple[int, int]
Box = Optional[Sequence[Tuple[int, int]]]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _check_u32(value, name: str) -> int:
    v = _as_int(value, name)
    if not 0 <= v <= MASK32:
        raise ValueError(f"{name}={v} out of range: must be in [0, 2**32-1]")
    return v


def _check_key(key) -> Key:
    try:
        k0, k1 = key
    except (TypeError, ValueError):
        raise TypeError(f"key must be a pair of uint32 ints (lo, hi), got {key!r}") from None
    return _check_u32(k0, "key[0]"), _check_u32(k1, "key[1]")


# --------------------------------------------------------------------------
# Philox-4x32-10
# --------------------------------------------------------------------------
def key_from_seed(seed: int) -> Key:
    """Map an integer seed in ``[0, 2**64-1]`` to a Philox key ``(lo, hi)``."""
    s = _as_int(seed, "seed")
    if not 0 <= s <= 2**64 - 1:
        raise ValueError(f"seed={s} out of range: must be in [0, 2**64-1]")
    return s & MASK32, s >> 32


def _mulhilo(m: int, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of ``m * b`` for uint32 const ``m`` and uint32-valued int64 ``b``.

    ``b`` is split into 16-bit halves so no intermediate exceeds 2**49.
    """
    p_lo = torch.bitwise_and(b, MASK16).mul_(m)  # < 2**48
    t = torch.bitwise_right_shift(b, 16).mul_(m)  # < 2**48
    t.add_(torch.bitwise_right_shift(p_lo, 16))  # < 2**48 + 2**32
    hi = torch.bitwise_right_shift(t, 16)  # < 2**32
    lo = t.bitwise_and_(MASK16).bitwise_left_shift_(16).bitwise_or_(p_lo.bitwise_and_(MASK16))
    return hi, lo


def philox(
    key: Key,
    counter_lo: torch.Tensor,
    counter_hi: int = 0,
    stream: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 block function, elementwise over ``counter_lo``.

    Counter layout (``c0, c1, c2, c3``)::

        c0 = counter_lo & 0xFFFFFFFF          (int64 tensor, read as uint64)
        c1 = (counter_lo >> 32) & 0xFFFFFFFF
        c2 = stream                            (uint32 int)
        c3 = counter_hi                        (uint32 int)

    Returns the four output words ``(x0, x1, x2, x3)`` as int64 tensors of
    ``counter_lo``'s shape with values in ``[0, 2**32)``; these are exactly the
    words of the Random123 ``philox4x32(ctr={c0,c1,c2,c3}, key={k0,k1})``.
    """
    k0, k1 = _check_key(key)
    counter_hi = _check_u32(counter_hi, "counter_hi")
    stream = _check_u32(stream, "stream")
    if not isinstance(counter_lo, torch.Tensor):
        counter_lo = torch.as_tensor(counter_lo, dtype=torch.int64)
    if counter_lo.dtype != torch.int64:
        if counter_lo.is_floating_point() or counter_lo.is_complex() or counter_lo.dtype == torch.bool:
            raise TypeError(f"counter_lo must be an integer tensor, got {counter_lo.dtype}")
        counter_lo = counter_lo.to(torch.int64)

    n = counter_lo.numel()
    if counter_lo.device.type == "cpu" and n > 2 * _CPU_CHUNK:
        # Cache blocking on CPU: run the ~250 elementwise ops chunk by chunk.
        flat = counter_lo.reshape(-1)
        outs = [torch.empty(n, dtype=torch.int64) for _ in range(4)]
        for s in range(0, n, _CPU_CHUNK):
            ws = _philox_rounds(k0, k1, flat[s : s + _CPU_CHUNK], counter_hi, stream)
            for o, w in zip(outs, ws):
                o[s : s + _CPU_CHUNK] = w
        return tuple(o.view(counter_lo.shape) for o in outs)
    return _philox_rounds(k0, k1, counter_lo, counter_hi, stream)


_CPU_CHUNK = 1 << 16


def _philox_rounds(k0, k1, counter_lo, counter_hi, stream):
    x0 = torch.bitwise_and(counter_lo, MASK32)
    # arithmetic shift then mask == the high word of the two's complement uint64
    x1 = torch.bitwise_right_shift(counter_lo, 32).bitwise_and_(MASK32)

    # Round 1: c2, c3 are scalars -> do the scalar half in Python.
    hi0, lo0 = _mulhilo(PHILOX_M0, x0)
    p = PHILOX_M1 * stream
    hi1, lo1 = p >> 32, p & MASK32
    x0, x1, x2, x3 = (
        x1.bitwise_xor_(hi1 ^ k0),
        torch.full_like(counter_lo, lo1),
        hi0.bitwise_xor_(counter_hi ^ k1),
        lo0,
    )
    for _ in range(PHILOX_ROUNDS - 1):
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, x0)
        hi1, lo1 = _mulhilo(PHILOX_M1, x2)
        x0, x1, x2, x3 = (
            hi1.bitwise_xor_(x1).bitwise_xor_(k0),
            lo1,
            hi0.bitwise_xor_(x3).bitwise_xor_(k1),
            lo0,
        )
    return x0, x1, x2, x3


def _derive_key(key: Key, value: int, tag: int) -> Key:
    k = _check_key(key)
    ctr = torch.tensor([value - 2**64 if value >= 2**63 else value], dtype=torch.int64)
    w = philox(k, ctr, counter_hi=tag, stream=0)
    return int(w[0].item()), int(w[1].item())


def split(key: Key, num: int = 2) -> list:
    """Derive ``num`` new keys from ``key`` (like ``jax.random.split``).

    Key ``i`` is words 0-1 of ``philox(key, counter=(i, 0, 0, SPLIT_TAG))``.
    """
    k = _check_key(key)
    n = _as_int(num, "num")
    if n < 0:
        raise ValueError(f"num={n} must be >= 0")
    if n == 0:
        return []
    w = philox(k, torch.arange(n, dtype=torch.int64), counter_hi=_SPLIT_TAG, stream=0)
    return list(zip(w[0].tolist(), w[1].tolist()))


def fold_in(key: Key, data: int) -> Key:
    """Derive a new key from ``key`` and an integer ``data`` in ``[0, 2**64-1]``.

    The new key is words 0-1 of ``philox(key, counter=(data lo, data hi, 0, FOLD_TAG))``.
    """
    d = _as_int(data, "data")
    if not 0 <= d <= 2**64 - 1:
        raise ValueError(f"data={d} out of range: must be in [0, 2**64-1]")
    return _derive_key(key, d, _FOLD_TAG)


# --------------------------------------------------------------------------
# boxes
# --------------------------------------------------------------------------
def _normalize_box(global_shape, box) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int], ...]]:
    try:
        shape = tuple(_as_int(s, "global_shape entry") for s in global_shape)
    except TypeError:
        raise TypeError(f"global_shape must be a sequence of ints, got {global_shape!r}") from None
    for s in shape:
        if s < 0:
            raise ValueError(f"global_shape={shape} has a negative size")
    if math.prod(shape) > 2**63:
        raise ValueError(f"global_shape={shape} has more than 2**63 elements")
    if box is None:
        return shape, tuple((0, s) for s in shape)
    box = tuple(box)
    if len(box) != len(shape):
        raise ValueError(f"box {box!r} has {len(box)} dims but global_shape {shape} has {len(shape)}")
    out = []
    for d, (b, size) in enumerate(zip(box, shape)):
        try:
            start, stop = b
        except (TypeError, ValueError):
            raise TypeError(f"box[{d}]={b!r} must be a (start, stop) pair") from None
        start, stop = _as_int(start, f"box[{d}] start"), _as_int(stop, f"box[{d}] stop")
        if not 0 <= start <= stop <= size:
            raise ValueError(
                f"box[{d}]=({start}, {stop}) invalid for dim of size {size}: need 0 <= start <= stop <= size"
            )
        out.append((start, stop))
    return shape, tuple(out)


def box_indices(global_shape, box: Box = None, device=None) -> torch.Tensor:
    """Global flat row-major indices (int64) of the elements of ``box``.

    The result has the box's shape.  Only box-sized tensors are created.
    A 0-d ``global_shape`` has the single index 0 (and the box is ``()``).
    """
    shape, nbox = _normalize_box(global_shape, box)
    bshape = tuple(stop - start for start, stop in nbox)
    if math.prod(bshape) == 0:
        return torch.empty(bshape, dtype=torch.int64, device=device)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    nd = len(shape)
    for d in range(nd - 1, -1, -1):
        start, stop = nbox[d]
        view = [1] * nd
        view[d] = stop - start
        if stop - start > 1 or start:
            r = torch.arange(start * stride, stop * stride, stride, dtype=torch.int64, device=device)
            idx = idx + r.view(view)
        stride *= shape[d]
    return idx.expand(bshape).contiguous() if idx.shape != bshape else idx


def _words(key, global_shape, box, stream, device):
    idx = box_indices(global_shape, box, device=device)
    return philox(key, idx, counter_hi=0, stream=stream)


# --------------------------------------------------------------------------
# samplers
# --------------------------------------------------------------------------
def uniform_bits(key: Key, global_shape, box: Box = None, stream: int = 0, device=None) -> torch.Tensor:
    """Uniform uint32 values (int64 tensor of the box's shape): word 0 of each element's counter."""
    return _words(key, global_shape, box, stream, device)[0]


def _u53(wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """53-bit integer from two uint32 words (27 top bits of wa, 26 top bits of wb)."""
    return wa.bitwise_right_shift(5).bitwise_left_shift_(26).bitwise_or_(wb.bitwise_right_shift(6))


def _float_bounds(dtype: torch.dtype, low: float, high: float) -> Tuple[float, float]:
    """Smallest ``dtype`` value >= low and largest ``dtype`` value < high."""
    lo_t = torch.tensor(low, dtype=torch.float64).to(dtype)
    if float(lo_t) < low:
        lo_t = torch.nextafter(lo_t, torch.tensor(math.inf, dtype=dtype))
    hi_t = torch.tensor(high, dtype=torch.float64).to(dtype)
    while float(hi_t) >= high:
        hi_t = torch.nextafter(hi_t, torch.tensor(-math.inf, dtype=dtype))
    lo_v, hi_v = float(lo_t), float(hi_t)
    if not (math.isfinite(lo_v) and math.isfinite(hi_v)) or lo_v > hi_v:
        raise ValueError(f"no {dtype} value in [low={low}, high={high})")
    return lo_v, hi_v


def _check_float_dtype(dtype):
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")


def uniform(
    key: Key,
    global_shape,
    box: Box = None,
    dtype: torch.dtype = torch.float32,
    low: float = 0.0,
    high: float = 1.0,
    stream: int = 0,
    device=None,
) -> torch.Tensor:
    """Uniform floats in ``[low, high)`` for the elements of ``box``.

    float64: 53 bits from words 0-1, computed in float64.  float32 / float16 /
    bfloat16: top 24 bits of word 0, computed in float32 (float64 if
    ``high - low`` overflows float32), then cast and clamped so that every
    value is ``>= low`` and ``< high``.
    """
    _check_float_dtype(dtype)
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)) or not low < high:
        raise ValueError(f"need finite low < high, got low={low}, high={high}")
    lo_v, hi_v = _float_bounds(dtype, low, high)
    w = _words(key, global_shape, box, stream, device)
    if dtype == torch.float64:
        u = _u53(w[0], w[1]).to(torch.float64).mul_(2.0**-53)
    else:
        u = w[0].bitwise_right_shift(8).to(torch.float32).mul_(2.0**-24)
        if not math.isfinite(float(torch.tensor(high - low, dtype=torch.float32))) or abs(low) > 3e38:
            u = u.to(torch.float64)
    scale = high - low
    if scale != 1.0:
        u = u.mul_(scale)
    if low != 0.0:
        u = u.add_(low)
    return u.to(dtype).clamp_(lo_v, hi_v)


# Taylor / atanh coefficients for the deterministic log and cos used by `normal`.
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(13)]  # 2*atanh(s) = 2 s sum s^2k/(2k+1)
_COS_COEFFS = [(-1.0) ** k / math.factorial(2 * k) for k in range(13)]  # cos(x) = sum c_k x^2k


def _horner(t: torch.Tensor, coeffs) -> torch.Tensor:
    acc = torch.full_like(t, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc.mul_(t).add_(c)
    return acc


def _log_f64(u: torch.Tensor) -> torch.Tensor:
    """Natural log of positive finite float64 values using only correctly rounded ops."""
    m, e = torch.frexp(u)  # u = m * 2**e, m in [0.5, 1)
    e = e.to(torch.float64)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # exact
    e = e.sub_(small.to(torch.float64))  # m in [sqrt(.5), sqrt(2))
    s = (m - 1.0).div_(m + 1.0)  # |s| <= 0.1716
    poly = _horner(s * s, _ATANH_COEFFS)
    return poly.mul_(s).mul_(2.0).add_(e.mul_(_LN2))


def _cos_quarter_f64(x: torch.Tensor) -> torch.Tensor:
    """cos(x) for x in [0, pi/2] (Taylor series, abs error < 1e-16)."""
    return _horner(x * x, _COS_COEFFS)


def normal(
    key: Key,
    global_shape,
    box: Box = None,
    dtype: torch.dtype = torch.float32,
    mean: float = 0.0,
    std: float = 1.0,
    stream: int = 0,
    device=None,
) -> torch.Tensor:
    """Normal samples via Box-Muller from the four words of each element's counter.

    ``u1 = (53 bits of words 0-1 + 1) / 2**53`` lies in ``(0, 1]`` so ``log(u1)``
    is finite; the angle uses 53 bits of words 2-3 plus a sign bit (bit 0 of
    word 3): ``z = sign * sqrt(-2 log u1) * cos(pi/2 * v)``, which has the
    distribution of ``sqrt(-2 log u1) * cos(2 pi u2)``.  Computed in float64
    with a fixed polynomial log/cos (device independent), then
    ``mean + std * z`` is cast to ``dtype``.  ``|z| <= 8.58``.
    """
    _check_float_dtype(dtype)
    mean, std = float(mean), float(std)
    if not (math.isfinite(mean) and math.isfinite(std)) or std < 0:
        raise ValueError(f"need finite mean and finite std >= 0, got mean={mean}, std={std}")
    w0, w1, w2, w3 = _words(key, global_shape, box, stream, device)
    u1 = _u53(w0, w1).add_(1).to(torch.float64).mul_(2.0**-53)
    sign = w3.bitwise_and(1).mul_(-2).add_(1).to(torch.float64)
    v = _u53(w2, w3).to(torch.float64).mul_(2.0**-53 * (math.pi / 2))
    del w0, w1, w2, w3
    r = _log_f64(u1).mul_(-2.0).clamp_min_(0.0).sqrt_()
    z = r.mul_(_cos_quarter_f64(v)).mul_(sign)
    if std != 1.0:
        z = z.mul_(std)
    if mean != 0.0:
        z = z.add_(mean)
    return z.to(dtype)


_INT_DTYPES = {
    torch.uint8: (0, 2**8 - 1),
    torch.int8: (-(2**7), 2**7 - 1),
    torch.int16: (-(2**15), 2**15 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
    torch.int64: (-(2**63), 2**63 - 1),
}


def randint(
    key: Key,
    global_shape,
    box: Box = None,
    low: int = 0,
    high: int = None,
    dtype: torch.dtype = torch.int64,
    stream: int = 0,
    device=None,
) -> torch.Tensor:
    """Integers in ``[low, high)`` (``randint(key, shape, box, high)`` means ``[0, high)``).

    A 64-bit uniform ``x`` (words 0-1) is mapped to ``low + floor(x * n / 2**64)``
    with ``n = high - low`` (Lemire multiply-shift without rejection; the
    relative bias is at most ``n / 2**64``).  The 64x64->128 product is done
    exactly in 16/32-bit limbs.  Ranges up to the full int64 range are supported.
    """
    if high is None:
        low, high = 0, low
    low, high = _as_int(low, "low"), _as_int(high, "high")
    if dtype not in _INT_DTYPES:
        raise TypeError(f"dtype must be one of {tuple(_INT_DTYPES)}, got {dtype}")
    dmin, dmax = _INT_DTYPES[dtype]
    if not low < high:
        raise ValueError(f"need low < high, got low={low}, high={high}")
    if low < dmin or high - 1 > dmax:
        raise ValueError(f"[low={low}, high={high}) does not fit in {dtype} range [{dmin}, {dmax}]")
    n = high - low  # 1 <= n <= 2**64
    w = _words(key, global_shape, box, stream, device)
    xh, xl = w[0], w[1]
    del w
    if n == 2**64:
        # full range: the 64-bit word pair itself
        rh, rl = xh, xl
    else:
        nh, nl = n >> 32, n & MASK32
        # high 64 bits of (xh*2**32 + xl) * (nh*2**32 + nl)
        h0, _ = _mulhilo(nl, xl)
        h1, l1 = _mulhilo(nh, xl)
        h2, l2 = _mulhilo(nl, xh)
        h3, l3 = _mulhilo(nh, xh)
        c1 = h0.add_(l1).add_(l2).bitwise_right_shift_(32)
        s2 = h1.add_(h2).add_(l3).add_(c1)
        rl = torch.bitwise_and(s2, MASK32)
        rh = h3.add_(s2.bitwise_right_shift_(32))  # < 2**32 since result < n <= 2**64
    # (low mod 2**64) + r, as two's complement int64 without overflow
    lw = low & (2**64 - 1)
    lo = rl.add_(lw & MASK32)
    hi = rh.add_(lw >> 32).add_(lo.bitwise_right_shift(32)).bitwise_and_(MASK32)
    lo = lo.bitwise_and_(MASK32)
    hi = torch.where(hi >= 2**31, hi - 2**32, hi)  # signed high word
    return hi.mul_(2**32).add_(lo).to(dtype)  # in [-2**63, 2**63): no overflow


def bernoulli(
    key: Key,
    global_shape,
    box: Box = None,
    p: Union[float, torch.Tensor] = 0.5,
    dtype: torch.dtype = torch.float32,
    stream: int = 0,
    device=None,
) -> torch.Tensor:
    """0/1 samples with ``P(1) = p``: ``1`` iff ``word0 < p * 2**32`` (exact comparison).

    ``p`` is a float in ``[0, 1]`` or a tensor broadcastable to the box's shape
    (compared in float64, giving the same result as the scalar form).
    """
    w = uniform_bits(key, global_shape, box, stream, device=device)
    if isinstance(p, torch.Tensor):
        pt = p.to(device=w.device, dtype=torch.float64)
        # a meta p (a meta mesh's shard) holds no values to check; torch's meta kernels skip it too
        if pt.numel() and not pt.is_meta and not bool(((pt >= 0) & (pt <= 1)).all()):
            raise ValueError("tensor p must have all values in [0, 1]")
        try:
            torch.broadcast_shapes(pt.shape, w.shape)
        except RuntimeError:
            raise ValueError(f"p of shape {tuple(pt.shape)} does not broadcast to box shape {tuple(w.shape)}") from None
        out = w.to(torch.float64) < pt.mul(2.0**32)
        if out.shape != w.shape:
            raise ValueError(f"p of shape {tuple(pt.shape)} does not broadcast to box shape {tuple(w.shape)}")
    else:
        pf = float(p)
        if not 0.0 <= pf <= 1.0:
            raise ValueError(f"p={p!r} must be in [0, 1]")
        out = w < math.ceil(pf * 2.0**32)
    return out.to(dtype)
