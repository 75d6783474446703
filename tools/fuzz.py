"""Differential fuzzer: random programs on ShardedArrays checked against plain torch.

A case is a simulated mesh (up to 8 devices), an input tensor (dtypes incl. complex, int,
bool, half; uneven and zero-size dims) laid out with a random spec (sharded, nested,
replicated or a pending sum), and a chain of 1-4 ops (pointwise, reductions, views,
matmul/einsum, indexing, nn ops, losses; auxiliary operands laid out at random too). The
chain runs on the plain tensor (the oracle) and on the ShardedArray; values, dtypes and
shapes must agree, and where torch raises shardfn must raise. Real floating chains also
compare gradients by autograd and by ``torch.func.grad``; ``--compile`` adds
``torch.compile`` cases (slow: a few seconds each).

    python tools/fuzz.py --minutes 10            # prints cases run and failures
    python tools/fuzz.py --replay 12345          # one case again, with its trace
    python tools/fuzz.py --minutes 10 --modes compile,compile_dynamic   # compiled cases only

Each failure prints its seed (``--replay SEED`` reruns it) and the program. The same
generator drives ``tests/test_fuzz.py`` through hypothesis (a ``Chooser`` over
``data.draw``), so hypothesis shrinks failures there.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import logging
import random
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn import P

MESH_SHAPES = [(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 4), (4, 2), (2, 3), (2, 2, 2), (1, 2, 3)]
NAMES = ("x", "y", "z")
SIZES = [0, 1, 2, 3, 4, 5, 7, 8]
# The generator's version: a seed replays the same program only under the version that drew it
# (``--gen``); version 2 adds meshes with size-1 axes, dims of 6 and 9, the "extra" and "random"
# op families and the vmap_grad / vmap_last modes.
# Version 3 adds meshes larger than 8 devices and more uneven ones, dims of 12, the "wide" and
# "smap3" op families and the jacrev / jacfwd / vmap_mid / hessian modes.
# Version 4 (``--gen 4``) adds adversarial input values: some inputs hold inf, -inf, nan, -0.0
# or large values (``sprinkle``) where no pending sum holds them.
# Version 5 (``--gen 5``) adds 6- and 7-device meshes (more uneven and zero-size shards), uint8
# and int16 inputs, the "model" op family (writes into fresh buffers, attention variants, rotary
# embeddings, MoE routing, ...) and the vmap_sharded (the batch dim split over a mesh axis) and
# compile_marked (``torch._dynamo.maybe_mark_dynamic`` on the input) modes; it draws version 4's
# adversarial values too.
GEN = 3
MESH_SHAPES_2 = MESH_SHAPES + [(1, 8), (8, 1), (2, 1, 4), (4, 1, 2), (3, 2)]
SIZES_2 = SIZES + [6, 9]
MESH_SHAPES_3 = MESH_SHAPES_2 + [(3, 3), (16,), (2, 2, 3), (5,), (4, 4), (1, 1)]
SIZES_3 = SIZES_2 + [12]
MESH_SHAPES_5 = MESH_SHAPES_3 + [(6,), (7,), (1, 7), (3, 2, 1), (6, 1)]
# a chain stops drawing steps once its value holds more elements than this: products (inner,
# outer, tensordot) of a 4-d value grow it to 10 dims (seed 5780222639: 26.9M elements, then a
# random draw of that shape), and one such case took minutes in every pass (generation, torch,
# shardfn, the transform), a cost, not a check
MAX_NUMEL = 2**20
# no step is drawn whose outputs or intermediates would hold more elements than this (sized on
# fake tensors first, ``_step_numel``): one step on a value at the cap (outer, kron, tensordot,
# cdist, x @ x.T, a square mask) made billions of elements, which the generator, torch's oracle,
# shardfn's shards and a batched transform each held at once (a fuzz run was OOM-killed at 21.7 GB)
STEP_NUMEL = 2**22
# steps on values of at most this many elements are not sized: a product of two such (outer, kron,
# x @ x.T, a mask of a dim squared) stays within STEP_NUMEL, and sizing costs a case ~0.1 s
SIZED_FROM = 2**11
FLOATS = [torch.float64, torch.float32, torch.complex128]
DTYPES = FLOATS * 3 + [torch.complex64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.bool]
DTYPES_5 = DTYPES + [torch.uint8, torch.int16]


# ops whose CPU kernel is not bit-reproducible run to run on the same input (checked on torch 2.13,
# MKL 2024.2): replicas computed by each rank may differ in the last bits, so the dist fuzzer compares
# them with the tolerance, not bit for bit (seeds 96000779, 96001052: lstsq's default driver gelsy
# gave 1 of 20 calls the same bits, single-threaded, up to 6e-15 apart; gelsd, gelss, gels are exact)
RUN_TO_RUN = {"lstsq": "LAPACK gelsy (torch.linalg.lstsq's CPU default) is not bit-reproducible"}


class Chooser:
    """Random choices: from a ``random.Random`` (the command) or hypothesis's ``data.draw``."""

    def __init__(self, rng: random.Random | None = None, data: Any = None) -> None:
        self.rng, self.data = rng, data

    def choice(self, seq: Sequence[Any]) -> Any:
        seq = list(seq)
        if self.data is not None:
            from hypothesis import strategies as st

            return seq[self.data.draw(st.integers(0, len(seq) - 1))]
        return seq[self.rng.randrange(len(seq))]

    def integer(self, lo: int, hi: int) -> int:
        return self.choice(range(lo, hi + 1))

    def chance(self, p: float) -> bool:
        if self.data is not None:
            from hypothesis import strategies as st

            return self.data.draw(st.integers(0, 99)) < p * 100
        return self.rng.random() < p


# -- tensors and layouts ------------------------------------------------------------------------


def make_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, *, positive: bool = False) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        lo = 0 if positive else -5
        return torch.randint(lo, 6, tuple(shape), generator=gen).to(dtype)
    if dtype.is_complex:
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.complex128)
    else:
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.float64)
    if positive:
        t = t.abs() + 0.5
    return t.to(dtype)


SPECIALS = [float("inf"), -float("inf"), float("nan"), -0.0, 0.0, 1e4, -1e4, 1e-30]


def sprinkle(ch: Chooser, t: torch.Tensor) -> torch.Tensor:
    """``t`` with one to three elements set to special values (``SPECIALS``; a complex element's
    real or imaginary part): adversarial inputs for ops, reductions, products and gradients."""
    t = t.clone()
    flat = torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)
    for _ in range(ch.integer(1, 3)):
        flat[ch.integer(0, flat.numel() - 1)] = ch.choice(SPECIALS)
    return t


def _special(t: torch.Tensor) -> bool:
    """Whether a floating ``t`` holds inf, nan or -0.0 (a ``sprinkle``d input)."""
    if not (t.is_floating_point() or t.is_complex()):
        return False
    r = torch.view_as_real(t) if t.is_complex() else t
    return not bool(torch.isfinite(r).all()) or bool(torch.signbit(r[r == 0]).any())


def draw_spec(ch: Chooser, mesh: sf.Mesh, ndim: int, partial: bool) -> P:
    dims: list[list[str]] = [[] for _ in range(ndim)]
    pend: dict[str, str] = {}
    names = list(mesh.axis_names)
    order = [names.pop(ch.integer(0, len(names) - 1)) for _ in range(len(names))]
    for a in order:
        c = ch.integer(0, 3)
        if c <= 1 and ndim:
            dims[ch.integer(0, ndim - 1)].append(a)
        elif c == 2 and partial:
            pend[a] = "sum"
    entries = [None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims]
    return P(*entries, partial=pend or None)


def on_grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to multiples of 2**-10: sums of a few such values (|v| < 2**10) are exact in
    float32 and wider, so a pending sum's parts add up to the value exactly, in any order (else
    the parts' rounding decides results such as ``x/0`` of a total that should be 0)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        if t.is_complex():
            return torch.complex(on_grid(t.real), on_grid(t.imag))
        # + 0.0: no negative zeros. Exactly cancelling parts add up to +0 in any order (IEEE
        # round-to-nearest), so a pending total cannot be -0; a -0 in torch's value would meet
        # the array's +0 at ``o / x`` as -inf against inf (seed 5738221152: rdiv, sigmoid)
        return (t * 1024).round() / 1024 + 0.0
    return t


def lay_out(t: torch.Tensor, spec: P, mesh: sf.Mesh, gen: torch.Generator) -> sf.ShardedArray:
    """``t`` laid out as ``spec``; a pending sum holds random parts adding up to ``t`` (the
    same part on devices that differ only along other axes, as a real pending sum would).
    A pending ``t`` must be ``on_grid`` (its parts are, so they add up exactly)."""
    pend = dict(spec.partial) if getattr(spec, "partial", None) else {}
    if not pend or t.dtype == torch.bool:
        return sf.distribute(t, P(*tuple(spec)) if pend else spec, mesh=mesh)
    whole = P(*tuple(spec))
    axes = [mesh.axis_names.index(a) for a in pend]
    combos = list(itertools.product(*(range(mesh.shape[i]) for i in axes)))
    noise = {k: on_grid(make_tensor(t.shape, t.dtype, gen)) for k in combos[1:]}
    first = t - sum(noise.values()) if noise else t
    fulls = {combos[0]: first, **noise}
    shards = {k: sf.distribute(v, whole, mesh=mesh).local_shards() for k, v in fulls.items()}
    # the devices this process holds: all on the local backend, its own rank's on dist
    held = [torch.distributed.get_rank()] if mesh.backend == "dist" else range(mesh.size)
    parts = []
    for k, dev in enumerate(held):
        coords = list(itertools.product(*(range(n) for n in mesh.shape)))[dev]
        parts.append(shards[tuple(coords[i] for i in axes)][k])
    return _from_parts(parts, spec, mesh, t)


def _from_parts(parts: list[torch.Tensor], spec: P, mesh: sf.Mesh, t: torch.Tensor) -> sf.ShardedArray:
    local = parts[0] if mesh.backend == "dist" else parts
    return sf.ShardedArray.from_local(local, spec, mesh=mesh, shape=tuple(t.shape), run_check=False)


# -- the op table ---------------------------------------------------------------------------------


@dataclass
class Aux:
    """An auxiliary operand: the plain tensor and its laid-out twin."""

    plain: Any
    sharded: Any = None
    desc: str = ""


@dataclass
class Step:
    name: str
    fn: Callable[[Any, Callable[[Aux], Any]], Any]
    desc: str
    # a bit reinterpretation of a float value ends the chain, and its result is compared as the
    # source values (view back, the source's tolerance): another summation order legitimately
    # changes the low bits, which a bitwise comparison of the integers would call wrong
    undo: Callable[[torch.Tensor], torch.Tensor] | None = None
    # an elementwise step that multiplies its input's rounding error (exp: the output's relative
    # error is the input's absolute error, |x| times its relative one): a 16-bit result that
    # misses the tolerance is compared as the step's input (``log`` of exp's outputs), the units
    # its rounding is in (seed 5749668960: bfloat16 84.0 against torch's 84.5, one ulp, is a
    # factor e^0.5 after exp)
    inverse: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a write into a buffer (``clone``/``zeros_like`` then an in-place op, ``x[i] = v``, ``out=``)
    mutates: bool = False


@dataclass
class Ctx:
    ch: Chooser
    mesh: sf.Mesh
    gen: torch.Generator
    aux_partial: bool = False
    version: int = 1

    def aux(self, t: Any, partial: bool = False) -> Aux:
        if not isinstance(t, torch.Tensor):
            return Aux(t, t, repr(t))
        if self.ch.chance(0.25):
            return Aux(t, t, f"plain {tuple(t.shape)}")
        spec = draw_spec(self.ch, self.mesh, t.dim(), partial and t.dtype in (torch.float64, torch.complex128, torch.int64))
        special = ""
        if getattr(spec, "partial", None):
            t = on_grid(t)
        elif self.version >= 4 and t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex) and self.ch.chance(0.2):
            t, special = sprinkle(self.ch, t), " (specials)"
        return Aux(t, lay_out(t, spec, self.mesh, self.gen), f"{_dt(t.dtype)}{list(t.shape)} {spec}{special}")


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _real(d: torch.dtype) -> bool:
    return d.is_floating_point


def _num(d: torch.dtype) -> bool:
    return d != torch.bool


OpMaker = Callable[[Ctx, torch.Tensor], "Step | None"]
OPS: dict[str, tuple[str, OpMaker]] = {}
SINCE: dict[str, int] = {}  # the generator version an op family joined in (1 when absent)


def op(family: str, since: int = 1) -> Callable[[OpMaker], OpMaker]:
    def reg(f: OpMaker) -> OpMaker:
        OPS[f.__name__] = (family, f)
        if since > 1:
            SINCE[family] = since
        return f

    return reg


def _pw(name: str, f: Callable, ok: Callable[[torch.dtype], bool] = lambda d: True) -> None:
    def make(c: Ctx, x: torch.Tensor) -> Step | None:
        inverse = torch.log if name == "exp" and not x.dtype.is_complex else None  # complex log: branch cuts
        return Step(name, lambda v, A: f(v), name, inverse=inverse) if ok(x.dtype) else None

    make.__name__ = name
    op("pointwise")(make)


def _gelu_settled(v: Any) -> Any:
    """``F.gelu(v)`` computed in float64 and rounded back, with +inf where ``v`` is +inf. torch's CPU
    kernel answers by where the element sits in the tensor (its vectorized loop, or its scalar one
    for a lone or strided element or a run's tail): nan or inf for +inf (bool / bool gave inf, then
    gelu: seed 5854495492), and up to 0.2% apart near its zero crossing, which a reciprocal then
    makes large (dist seed 5863046631: each rank's shard sits elsewhere than in the whole). In
    float64 the two loops agree to far below a float32's rounding."""
    wide = v.to(torch.float64) if v.dtype in (torch.float32, torch.float16, torch.bfloat16) else v
    return F.gelu(wide).to(v.dtype).where(v != float("inf"), float("inf"))


for _n, _f, _ok in [
    ("neg", torch.neg, _num),
    ("abs", torch.abs, lambda d: True),
    ("exp", torch.exp, lambda d: d.is_floating_point or d.is_complex),
    ("sin", torch.sin, lambda d: d.is_floating_point),
    ("tanh", torch.tanh, lambda d: d.is_floating_point),
    ("sigmoid", torch.sigmoid, _real),
    ("relu", torch.relu, lambda d: _real(d) or d in (torch.int64, torch.int32)),
    ("sqrt", torch.sqrt, _real),
    ("log", torch.log, _real),
    ("reciprocal", torch.reciprocal, _real),
    ("square", torch.square, _num),
    ("sign", torch.sign, lambda d: not d.is_complex and _num(d)),
    ("conj", torch.conj, lambda d: True),
    ("real", torch.real, lambda d: d.is_complex),
    ("imag", torch.imag, lambda d: d.is_complex),
    ("angle", torch.angle, lambda d: d.is_complex or _real(d)),
    ("isnan", torch.isnan, lambda d: True),
    ("logical_not", torch.logical_not, lambda d: True),
    ("bitwise_not", torch.bitwise_not, lambda d: not d.is_floating_point and not d.is_complex),
    ("gelu", lambda v: _gelu_settled(v), _real),
    ("silu", F.silu, _real),
    ("softplus", F.softplus, _real),
    ("x*2", lambda v: v * 2, _num),
    ("x+1", lambda v: v + 1, _num),
    ("x/2", lambda v: v / 2, _num),
    ("x/0", lambda v: v / 0, _num),
    ("x//2", lambda v: v // 2, lambda d: _num(d) and not d.is_complex),
    ("x*0.5j", lambda v: v * 0.5j, _num),
    ("pow2", lambda v: v**2, _num),
    ("x>0", lambda v: v > 0, lambda d: not d.is_complex),
    ("float", lambda v: v.float(), lambda d: not d.is_complex),
    ("to_int8", lambda v: v.to(torch.int8), lambda d: not d.is_complex),
    ("double", lambda v: v.double(), lambda d: not d.is_complex),
    ("half", lambda v: v.half(), lambda d: not d.is_complex),
    ("to_cfloat", lambda v: v.to(torch.complex64), lambda d: True),
    ("long", lambda v: v.long(), lambda d: not d.is_complex),
    ("clamp", lambda v: v.clamp(-1, 1), lambda d: _num(d) and not d.is_complex),
    ("nan_to_num", torch.nan_to_num, lambda d: True),
    ("detach", lambda v: v.detach(), lambda d: True),
    ("clone", lambda v: v.clone(), lambda d: True),
    ("contiguous", lambda v: v.contiguous(), lambda d: True),
    ("cumsum-1", lambda v: v.cumsum(-1), lambda d: True),
]:
    _pw(_n, _f, _ok)


@op("binary")
def binary(c: Ctx, x: torch.Tensor) -> Step | None:
    shape = list(x.shape)
    if shape and c.ch.chance(0.3):  # broadcast: drop leading dims or make some 1
        shape = [1 if c.ch.chance(0.5) else n for n in shape][c.ch.integer(0, len(shape)) :]
    dt = c.ch.choice([x.dtype, x.dtype, torch.float64, torch.int64, torch.float32, torch.bool, torch.complex64])
    o = c.aux(make_tensor(shape, dt, c.gen), partial=c.ch.chance(0.3))
    name, f = c.ch.choice(
        [
            ("add", torch.add),
            ("sub", torch.sub),
            ("mul", torch.mul),
            ("div", torch.div),
            ("maximum", torch.maximum),
            ("where", None),
            ("eq", torch.eq),
            ("atan2", torch.atan2),
            ("rdiv", lambda a, b: b / a),
            ("pow", torch.pow),
            ("logical_and", torch.logical_and),
        ]
    )
    if name == "where":
        return Step(
            name,
            lambda v, A: torch.where(
                A(o) > 0 if o.plain.dtype != torch.bool and not o.plain.dtype.is_complex else A(o).bool(), v, A(o)
            ),
            f"where(o>0, x, o) o={o.desc}",
        )
    return Step(name, lambda v, A: f(v, A(o)), f"{name}(x, o) o={o.desc}")


def _dim(c: Ctx, x: torch.Tensor) -> int | None:
    return c.ch.integer(-x.dim(), x.dim() - 1) if x.dim() else None


@op("reduction")
def reduction(c: Ctx, x: torch.Tensor) -> Step | None:
    d = _dim(c, x)
    kd = c.ch.chance(0.3)
    name = c.ch.choice(
        [
            "sum",
            "sum_dim",
            "mean",
            "mean_dim",
            "amax",
            "max",
            "min",
            "max_dim",
            "prod",
            "argmax",
            "std",
            "var",
            "norm",
            "logsumexp",
            "all",
            "any",
            "count_nonzero",
            "cumprod",
            "aminmax",
            "nansum",
        ]
    )
    fns: dict[str, Callable] = {
        "sum": lambda v: v.sum(),
        "sum_dim": lambda v: v.sum(d, keepdim=kd),
        "mean": lambda v: v.mean(),
        "mean_dim": lambda v: v.mean(d, keepdim=kd),
        "amax": lambda v: v.amax(d, keepdim=kd),
        "max": lambda v: v.max(),
        "min": lambda v: v.min(),
        "max_dim": lambda v: v.max(d, keepdim=kd)[0],
        "prod": lambda v: v.prod(d) if d is not None else v.prod(),
        "argmax": lambda v: v.argmax(d),
        "std": lambda v: v.std(d),
        "var": lambda v: v.var(),
        "norm": lambda v: torch.linalg.vector_norm(v),
        "logsumexp": lambda v: torch.logsumexp(v, d if d is not None else 0),
        "all": lambda v: v.all(),
        "any": lambda v: v.any(d) if d is not None else v.any(),
        "count_nonzero": lambda v: torch.count_nonzero(v),
        "cumprod": lambda v: v.cumprod(d if d is not None else 0),
        "aminmax": lambda v: torch.aminmax(v)[1],
        "nansum": lambda v: v.nansum(),
    }
    f = fns[name]
    return Step(name, lambda v, A: f(v), f"{name}(dim={d}, keepdim={kd})")


@op("view")
def view(c: Ctx, x: torch.Tensor) -> Step | None:
    n = x.dim()
    d0, d1 = _dim(c, x), _dim(c, x)
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = c.ch.integer(0, i)
        perm[i], perm[j] = perm[j], perm[i]
    k = c.ch.integer(0, 3)
    name = c.ch.choice(
        [
            "t",
            "transpose",
            "permute",
            "reshape-1",
            "flatten",
            "unsqueeze",
            "squeeze",
            "slice",
            "narrow",
            "select",
            "expand",
            "view_as_real",
            "mT",
            "flip",
            "roll",
            "repeat",
            "cat",
            "stack",
            "chunk0",
            "view-1",
            "unflatten",
            "diagonal",
            "tril",
            "movedim",
            "index_step",
            "view_dtype",
            "as_strided",
            "unfold",
            "is_contiguous",
        ]
    )
    fns: dict[str, Callable] = {
        "t": lambda v: v.t(),
        "transpose": lambda v: v.transpose(d0, d1),
        "permute": lambda v: v.permute(perm),
        "reshape-1": lambda v: v.reshape(-1),
        "flatten": lambda v: v.flatten(),
        "unsqueeze": lambda v: v.unsqueeze(k % (n + 1)),
        "squeeze": lambda v: v.squeeze(),
        "slice": lambda v: v[..., k:],
        "narrow": lambda v: v.narrow(d0, 0, min(k, v.shape[d0])),
        "select": lambda v: v.select(d0, k - 2),
        "expand": lambda v: v.unsqueeze(0).expand(2, *v.shape),
        "view_as_real": torch.view_as_real,
        "mT": lambda v: v.mT,
        "flip": lambda v: v.flip(d0),
        "roll": lambda v: v.roll(k, d0),
        "repeat": lambda v: v.repeat(*([2] + [1] * (n - 1))),
        "cat": lambda v: torch.cat([v, v], d0),
        "stack": lambda v: torch.stack([v, v], k % (n + 1)),
        "chunk0": lambda v: v.chunk(2, d0)[0],
        "view-1": lambda v: v.view(-1),
        "unflatten": lambda v: v.unflatten(d0, (1, v.shape[d0])),
        "diagonal": lambda v: v.diagonal(),
        "tril": lambda v: v.tril(),
        "movedim": lambda v: v.movedim(d0, d1),
        "index_step": lambda v: v[::2],
        # (an empty tensor's strides are arbitrary, and torch checks stride(-1) == 1: fresh strides first)
        "view_dtype": lambda v: (v.clone(memory_format=torch.contiguous_format) if v.numel() == 0 else v).view(
            torch.int32 if v.element_size() == 4 else torch.int64 if v.element_size() == 8 else torch.uint8
        ),
        # reads elements offset..offset+3 of the storage: only where those are the value's own
        # (torch's op outputs may sit in larger buffers, e.g. a 0-d mse_loss in 224 bytes)
        "as_strided": lambda v: v.as_strided((2, 2), (1, 2)) if v.is_contiguous() and v.numel() >= 4 else v,
        "unfold": lambda v: v.unfold(d0, 2, 1),
        "is_contiguous": lambda v: (
            torch.tensor([v.t().is_contiguous(), v.is_contiguous(), v.mT.is_contiguous()]) if n == 2
            # an empty tensor's strides are arbitrary (torch's TensorIterator gives (0, 1, 0) for x + 1)
            else torch.tensor(v.stride()) if v.numel() else torch.tensor(v.shape)
        ),
    }
    f = fns[name]
    src = x.dtype
    undo = (lambda t: _view_back(t, src)) if name == "view_dtype" and (src.is_floating_point or src.is_complex) else None
    return Step(name, lambda v, A: f(v), f"{name}(d0={d0}, d1={d1}, k={k}, perm={perm})", undo)


def _view_back(t: torch.Tensor, src: torch.dtype) -> torch.Tensor:
    """The bits of ``t`` read as ``src`` again (an empty one: its shape only)."""
    if t.numel() == 0:
        shape = (*t.shape[:-1], t.shape[-1] * t.element_size() // src.itemsize) if t.dim() else ()
        return torch.empty(shape, dtype=src)
    return t.contiguous().view(src)


@op("matmul")
def matmul(c: Ctx, x: torch.Tensor) -> Step | None:
    if not _num(x.dtype):
        return None
    n = x.dim()
    name = c.ch.choice(["xxT", "x@w", "einsum", "dot", "vdot", "inner", "outer", "mv", "tensordot", "vecdot", "sf.einsum"])
    m = x.shape[-1] if n else 1
    w = c.aux(make_tensor((m, c.ch.choice([0, 1, 3, 4])), x.dtype, c.gen), partial=c.ch.chance(0.2))
    fns: dict[str, Callable] = {
        "xxT": lambda v, A: v @ v.mT,
        "x@w": lambda v, A: v @ A(w),
        "einsum": lambda v, A: torch.einsum("...j,jk->...k", v, A(w)),
        "dot": lambda v, A: torch.dot(v, v.conj()),
        "vdot": lambda v, A: torch.vdot(v, v * 2),
        "inner": lambda v, A: torch.inner(v, v),
        "outer": lambda v, A: torch.outer(v, v),
        "mv": lambda v, A: torch.mv(v, v[0]),
        "tensordot": lambda v, A: torch.tensordot(v, v, dims=1),
        "vecdot": lambda v, A: torch.linalg.vecdot(v, v),
        "sf.einsum": lambda v, A: _sf_einsum(v, A(w)),
    }
    f = fns[name]
    return Step(name, f, f"{name} w={w.desc}")


def _sf_einsum(a: Any, b: Any) -> Any:
    eq = "...j,jk->...k"
    return sf.einsum(eq, a, b) if isinstance(a, sf.ShardedArray) else torch.einsum(eq, a, b)


@op("indexing")
def indexing(c: Ctx, x: torch.Tensor) -> Step | None:
    if not x.dim():
        return None
    d = _dim(c, x)
    size = x.shape[d]
    hi = max(size, 1) + (2 if c.ch.chance(0.2) else 0)
    lo = -size if c.ch.chance(0.2) else 0
    idx_shape = [c.ch.choice([0, 1, 2, 3])]
    idx = c.aux(torch.randint(lo, hi, idx_shape, generator=c.gen))
    name = c.ch.choice(
        ["index_select", "getitem", "gather", "take", "index_add", "scatter", "masked_fill", "embedding", "nonzero_like"]
    )
    if name == "index_select":
        return Step(name, lambda v, A: v.index_select(d, A(idx)), f"index_select(d={d}, idx={idx.plain.tolist()} {idx.desc})")
    if name == "getitem":
        return Step(name, lambda v, A: v[A(idx)], f"v[idx={idx.plain.tolist()} {idx.desc}]")
    if name == "gather":
        gi = c.aux(torch.randint(lo, hi, tuple(x.shape), generator=c.gen))
        return Step(name, lambda v, A: v.gather(d, A(gi)), f"gather(d={d}, {gi.desc})")
    if name == "take":
        return Step(name, lambda v, A: torch.take(v, A(idx)), f"take(idx={idx.plain.tolist()} {idx.desc})")
    if name == "index_add":
        src = c.aux(make_tensor([*x.shape[: d % x.dim()], idx_shape[0], *x.shape[d % x.dim() + 1 :]], x.dtype, c.gen))
        return Step(
            name, lambda v, A: v.index_add(d, A(idx), A(src)), f"index_add(d={d}, idx={idx.plain.tolist()}, src={src.desc})"
        )
    if name == "scatter":
        gi = c.aux(torch.randint(lo, hi, tuple(x.shape), generator=c.gen))
        return Step(name, lambda v, A: v.scatter(d, A(gi), 1), f"scatter(d={d}, {gi.desc})")
    if name == "masked_fill":
        mk = c.aux(torch.rand(tuple(x.shape), generator=c.gen) > 0.5)
        return Step(name, lambda v, A: v.masked_fill(A(mk), 3), f"masked_fill({mk.desc})")
    if name == "embedding":
        if x.dim() != 2:
            return None
        ii = c.aux(torch.randint(lo, hi, (c.ch.integer(0, 3), 2), generator=c.gen))
        return Step(name, lambda v, A: F.embedding(A(ii), v), f"embedding(x as weight, idx={ii.plain.tolist()} {ii.desc})")
    return Step(name, lambda v, A: v[..., :1].sum(), "v[..., :1].sum()")


@op("nn")
def nn(c: Ctx, x: torch.Tensor) -> Step | None:
    if not _real(x.dtype):
        return None
    n = x.dim()
    d = _dim(c, x)
    name = c.ch.choice(
        [
            "softmax",
            "log_softmax",
            "layer_norm",
            "rms_norm",
            "pad_const",
            "pad_circ",
            "pad_reflect",
            "avg_pool1d",
            "max_pool1d",
            "group_norm",
            "dropout0",
            "linear",
            "conv1d",
            "sdpa",
            "normalize",
            "adaptive_avg_pool1d",
        ]
    )
    if name in ("softmax", "log_softmax") and n:
        f = getattr(F, name)
        return Step(name, lambda v, A: f(v, d), f"{name}(dim={d})")
    if name == "layer_norm" and n:
        return Step(name, lambda v, A: F.layer_norm(v, v.shape[-1:]), name)
    if name == "rms_norm" and n:
        return Step(name, lambda v, A: F.rms_norm(v, v.shape[-1:]), name)
    if name == "pad_const" and n:
        return Step(name, lambda v, A: F.pad(v, (1, 2)), name)
    if name in ("pad_circ", "pad_reflect") and n in (2, 3):
        mode = "circular" if name == "pad_circ" else "reflect"
        return Step(name, lambda v, A: F.pad(v, (1, 1), mode=mode), name)
    if name in ("avg_pool1d", "max_pool1d", "adaptive_avg_pool1d") and n in (2, 3):
        f = {
            "avg_pool1d": lambda v: F.avg_pool1d(v, 2),
            "max_pool1d": lambda v: F.max_pool1d(v, 2),
            "adaptive_avg_pool1d": lambda v: F.adaptive_avg_pool1d(v, 2),
        }[name]
        return Step(name, lambda v, A: f(v), name)
    if name == "group_norm" and n >= 2:
        return Step(name, lambda v, A: F.group_norm(v, 1), name)
    if name == "dropout0":
        return Step(name, lambda v, A: F.dropout(v, 0.0), name)
    if name == "linear" and n:
        w = c.aux(make_tensor((3, x.shape[-1]), x.dtype, c.gen))
        b = c.aux(make_tensor((3,), x.dtype, c.gen))
        return Step(name, lambda v, A: F.linear(v, A(w), A(b)), f"linear w={w.desc} b={b.desc}")
    if name == "conv1d" and n == 3:
        w = c.aux(make_tensor((2, x.shape[1], 2), x.dtype, c.gen))
        return Step(name, lambda v, A: F.conv1d(v, A(w)), f"conv1d w={w.desc}")
    if name == "sdpa" and n == 4:
        return Step(name, lambda v, A: F.scaled_dot_product_attention(v, v * 0.5, v), name)
    if name == "normalize" and n:
        return Step(name, lambda v, A: F.normalize(v, dim=d), f"normalize(dim={d})")
    return None


@op("more")
def more(c: Ctx, x: torch.Tensor) -> Step | None:
    """Sorting, cumulative, scatter/gather, masked, norm and windowed ops (torch's own arguments)."""
    n = x.dim()
    d = _dim(c, x)
    dd = d if d is not None else 0
    k = c.ch.integer(0, 3)
    name = c.ch.choice(
        ["sort", "argsort", "topk", "cummax", "logcumsumexp", "cumsum_dim", "kthvalue", "median_dim", "diff",
         "scatter_add", "scatter_reduce", "index_put", "index_fill", "masked_scatter", "where_scalar", "masked_select",
         "vector_norm_dim", "matrix_norm", "norm_p1", "var_mean", "std_keep", "sum_dtype", "mean_keep", "amin_multi",
         "conv2d", "max_pool2d", "avg_pool2d", "interpolate", "tril_k", "triu", "trace", "renorm", "clamp_t",
         "lerp", "addcmul", "complex_polar", "sgn", "nansum_keep", "prod_keep", "all_dim", "searchsorted", "bucketize",
         "histc", "unique", "nonzero", "flip_multi", "rot90", "kron", "cross", "cdist", "baddbmm", "fmod", "remainder",
         "hypot", "logaddexp", "copysign", "heaviside", "isin", "bitwise_and", "shift"]
    )
    real, cplx, num = x.dtype.is_floating_point, x.dtype.is_complex, _num(x.dtype)
    y = c.aux(make_tensor(tuple(x.shape), x.dtype, c.gen), partial=c.ch.chance(0.2))
    fns: dict[str, tuple[bool, Callable]] = {
        "sort": (n > 0 and not cplx, lambda v, A: v.sort(dd, descending=k % 2 == 1, stable=True)[0]),
        "argsort": (n > 0 and not cplx and not real, lambda v, A: v.argsort(dd, stable=True)),
        "topk": (n > 0 and not cplx, lambda v, A: v.topk(min(k, v.shape[dd]), dd)[0]),
        "cummax": (n > 0 and not cplx and num, lambda v, A: v.cummax(dd)[0]),
        "logcumsumexp": (n > 0 and real, lambda v, A: torch.logcumsumexp(v, dd)),
        "cumsum_dim": (n > 0 and num, lambda v, A: v.cumsum(dd, dtype=torch.float64 if real else None)),
        "kthvalue": (n > 0 and real, lambda v, A: v.kthvalue(1, dd, keepdim=k % 2 == 1)[0]),
        "median_dim": (n > 0 and real, lambda v, A: v.median(dd)[0]),
        "diff": (n > 0 and num, lambda v, A: torch.diff(v, dim=dd)),
        "scatter_add": (n > 0 and num, None),
        "scatter_reduce": (n > 0 and real, None),
        "index_put": (n > 0 and num, None),
        "index_fill": (n > 0 and num, None),
        "masked_scatter": (n > 0, None),
        "where_scalar": (num and not cplx, lambda v, A: torch.where(v > 0, v, 0)),
        "masked_select": (num, lambda v, A: v.masked_select(A(y) > 0 if not cplx else A(y).real > 0)),
        "vector_norm_dim": (
            n > 0 and (real or cplx),
            lambda v, A: torch.linalg.vector_norm(v, ord=[2, 1, float("inf"), 3][k], dim=dd, keepdim=k % 2 == 0),
        ),
        "matrix_norm": (n >= 2 and (real or cplx), lambda v, A: torch.linalg.matrix_norm(v, ord=["fro", 1, float("inf"), -1][k])),
        "norm_p1": (real or cplx, lambda v, A: v.norm(p=1)),
        "var_mean": (n > 0 and (real or cplx), lambda v, A: torch.var_mean(v, dd, correction=k % 2, keepdim=True)[1 - k % 2]),
        "std_keep": (n > 0 and real, lambda v, A: v.std(dd, keepdim=True, correction=0)),
        "sum_dtype": (num, lambda v, A: v.sum(dtype=torch.float64 if not cplx else torch.complex128)),
        "mean_keep": (n > 0 and (real or cplx), lambda v, A: v.mean(dd, keepdim=True)),
        "amin_multi": (n >= 2 and not cplx, lambda v, A: v.amin((0, -1), keepdim=k % 2 == 0)),
        "conv2d": (n == 4 and real, None),
        "max_pool2d": (n in (3, 4) and real, lambda v, A: F.max_pool2d(v, 2, ceil_mode=k % 2 == 1)),
        "avg_pool2d": (n in (3, 4) and real, lambda v, A: F.avg_pool2d(v, 2, count_include_pad=False, padding=k % 2)),
        "interpolate": (n == 3 and real, lambda v, A: F.interpolate(v, scale_factor=2, mode=["nearest", "linear"][k % 2])),
        "tril_k": (n >= 2, lambda v, A: v.tril(k - 1)),
        "triu": (n >= 2, lambda v, A: v.triu(1 - k)),
        "trace": (n == 2 and num, lambda v, A: v.trace()),
        "renorm": (n >= 1 and real, lambda v, A: v.renorm(2, dd, 1.0)),
        "clamp_t": (real, lambda v, A: v.clamp(min=A(y))),
        "lerp": (real or cplx, lambda v, A: torch.lerp(v, A(y), 0.25)),
        "addcmul": (num, lambda v, A: torch.addcmul(v, v, A(y), value=2)),
        "complex_polar": (x.dtype in (torch.float32, torch.float64), lambda v, A: torch.polar(v.abs(), A(y))),
        "sgn": (num, lambda v, A: v.sgn()),
        "nansum_keep": (n > 0 and real, lambda v, A: v.nansum(dd, keepdim=True)),
        "prod_keep": (n > 0 and num, lambda v, A: v.prod(dd, keepdim=True)),
        "all_dim": (n > 0, lambda v, A: v.all(dd)),
        "searchsorted": (n > 0 and real, lambda v, A: torch.searchsorted(torch.tensor([-1.0, 0.0, 1.0], dtype=v.dtype), v)),
        "bucketize": (real, lambda v, A: torch.bucketize(v, torch.tensor([-1.0, 0.0, 1.0], dtype=v.dtype))),
        "histc": (real and x.dtype in (torch.float32, torch.float64), lambda v, A: torch.histc(v, 4, -2, 2)),
        # floats on a grid of 1/64: a contraction summed in another order may differ in its last
        # bit, which splits or merges values of torch.unique (a count, not a value, would differ)
        "unique": (not cplx and x.dtype not in (torch.float16, torch.bfloat16),
                   lambda v, A: torch.unique(torch.round(v * 64) / 64 if v.is_floating_point() else v)),
        "nonzero": (True, lambda v, A: torch.nonzero(v)),
        "flip_multi": (n >= 2, lambda v, A: v.flip(0, -1)),
        "rot90": (n >= 2, lambda v, A: torch.rot90(v, k, (0, 1))),
        "kron": (n <= 2 and num, lambda v, A: torch.kron(v, A(y))),
        "cross": (n > 0 and num and 3 in x.shape, lambda v, A: torch.linalg.cross(v, A(y), dim=list(v.shape).index(3))),
        "cdist": (n in (2, 3) and real and x.dtype in (torch.float32, torch.float64), lambda v, A: torch.cdist(v, A(y))),
        "baddbmm": (n == 3 and num, lambda v, A: torch.baddbmm(v, v, v.mT @ v, alpha=0.5)),
        "fmod": (num and not cplx, lambda v, A: torch.fmod(v, 3)),
        "remainder": (num and not cplx, lambda v, A: torch.remainder(v, A(y))),
        "hypot": (real, lambda v, A: torch.hypot(v, A(y))),
        "logaddexp": (real, lambda v, A: torch.logaddexp(v, A(y))),
        "copysign": (real, lambda v, A: torch.copysign(v, A(y))),
        "heaviside": (real, lambda v, A: torch.heaviside(v, A(y))),
        "isin": (not cplx, lambda v, A: torch.isin(v, torch.tensor([0, 1], dtype=v.dtype))),
        "bitwise_and": (not real and not cplx, lambda v, A: v & A(y)),
        "shift": (not real and not cplx and x.dtype != torch.bool, lambda v, A: v << 1),
    }
    ok, f = fns[name]
    if not ok:
        return None
    if f is not None:
        return Step(name, f, f"{name}(d={d}, k={k}, y={y.desc})")
    hi = max(x.shape[dd], 1) + (1 if c.ch.chance(0.1) else 0)
    if name in ("scatter_add", "scatter_reduce"):
        gi = c.aux(torch.randint(0, hi, tuple(x.shape), generator=c.gen))
        red = c.ch.choice(["sum", "prod", "mean", "amax", "amin"])
        if name == "scatter_add":
            return Step(name, lambda v, A: v.scatter_add(dd, A(gi), A(y)), f"scatter_add(d={dd}, {gi.desc}, src={y.desc})")
        return Step(name, lambda v, A: v.scatter_reduce(dd, A(gi), A(y), red, include_self=k % 2 == 0),
                    f"scatter_reduce(d={dd}, {gi.desc}, {red}, src={y.desc}, include_self={k % 2 == 0})")
    if name == "index_put":
        ii = c.aux(torch.randint(0, max(x.shape[0], 1) + (1 if c.ch.chance(0.1) else 0), (k,), generator=c.gen))
        vals = c.aux(make_tensor((k, *x.shape[1:]), x.dtype, c.gen))
        acc = c.ch.chance(0.5)
        return Step(name, lambda v, A: v.index_put((A(ii),), A(vals), accumulate=acc),
                    f"index_put(idx={ii.plain.tolist()} {ii.desc}, vals={vals.desc}, accumulate={acc})")
    if name == "index_fill":
        ii = c.aux(torch.randint(0, hi, (k,), generator=c.gen))
        return Step(name, lambda v, A: v.index_fill(dd, A(ii), 2), f"index_fill(d={dd}, idx={ii.plain.tolist()} {ii.desc})")
    if name == "masked_scatter":
        mk = c.aux(torch.rand(tuple(x.shape), generator=c.gen) > 0.5)
        return Step(name, lambda v, A: v.masked_scatter(A(mk), A(y)), f"masked_scatter({mk.desc}, src={y.desc})")
    if name == "conv2d":
        w = c.aux(make_tensor((2, x.shape[1], 2, 2), x.dtype, c.gen))
        st, pd = c.ch.choice([1, 2]), c.ch.choice([0, 1])
        return Step(name, lambda v, A: F.conv2d(v, A(w), stride=st, padding=pd), f"conv2d(w={w.desc}, stride={st}, padding={pd})")
    return None


def smap_draw(c: Ctx, x: torch.Tensor) -> tuple:
    """What a shard_map body family draws first (``x`` not 0-d): a dim ``d`` and a mesh axis
    ``a`` (its ``size``; ``even``: d divides over it), ``spec_d`` (d split over a), ``rep``
    (replicated), and ``smap(body, out_specs, in_specs=spec_d)``: the body mapped over the
    mesh, an array input resharded to ``in_specs`` first."""
    mesh, n = c.mesh, x.dim()
    d = c.ch.integer(0, n - 1)
    a = c.ch.choice(mesh.axis_names)
    size = mesh.shape[mesh.axis_names.index(a)]
    spec_d = P(*[a if i == d else None for i in range(n)])

    def smap(body: Callable, out_specs: P, in_specs: P = spec_d) -> Callable:
        def run(v: Any) -> Any:
            if isinstance(v, sf.ShardedArray):
                v = sf.reshard(v, in_specs)
            return sf.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs)(v)

        return run

    return d, a, size, x.shape[d] % size == 0, spec_d, P(*([None] * n)), smap


def _copies_sum(v: torch.Tensor, n: int) -> torch.Tensor:
    """torch.sum of ``n`` copies of ``v`` (the psum of a value the same on every device)."""
    return v.unsqueeze(0).expand(n, *v.shape).sum(0, dtype=v.dtype)


def all_to_all_body(c: Ctx, smap: Callable, a: str, d: int, shape: tuple, size: int) -> tuple[Any, int]:
    """A shard_map of ``all_to_all`` over axis ``a`` (split over ``a`` along ``d`` in, along a
    drawn other dim ``e`` out: the value is unchanged), and ``e``; None where ``e``'s size
    does not split over the axis."""
    n = len(shape)
    e = c.ch.choice([i for i in range(n) if i != d])
    if shape[e] % size:
        return None, e
    out = P(*[a if i == e else None for i in range(n)])
    return smap(lambda b: sf.lax.all_to_all(b, a, split_axis=e, concat_axis=d, tiled=True), out), e


@op("transform")
def transform(c: Ctx, x: torch.Tensor) -> Step | None:
    """Layout changes mid-program (reshard, constraints) and shard_map bodies with collectives,
    each with its closed form on the plain tensor (the oracle)."""
    mesh = c.mesh
    n = x.dim()
    name = c.ch.choice(["reshard", "constraint", "smap_gather", "smap_psum", "smap_pmax", "smap_ppermute",
                        "smap_psum_scatter", "smap_axis_index", "smap_pointwise"])
    if name in ("reshard", "constraint"):
        spec = draw_spec(c.ch, mesh, n, partial=False)
        f = sf.reshard if name == "reshard" else sf.with_sharding_constraint
        return Step(name, lambda v, A: f(v, spec) if isinstance(v, sf.ShardedArray) else v, f"{name}({spec})")
    if not n:
        return None
    d, a, size, even, spec_d, rep, smap = smap_draw(c, x)
    desc = f"{name}(axis={a!r}, dim={d})"
    if name == "smap_gather" and even:
        g = smap(lambda b: sf.lax.all_gather(b, a, axis=d, tiled=True), rep)
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else v, desc)
    if name == "smap_psum" and _num(x.dtype):
        g = smap(lambda b: sf.lax.psum(b.sum(d, keepdim=True), a), rep)
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else v.sum(d, keepdim=True), desc)
    if name == "smap_pmax" and x.dtype.is_floating_point and even and x.shape[d] > 0:
        g = smap(lambda b: sf.lax.pmax(b.amax(d, keepdim=True), a), rep)
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else v.amax(d, keepdim=True), desc)
    if name == "smap_ppermute" and even:
        perm = [(i, (i + 1) % size) for i in range(size)]
        g = smap(lambda b: sf.lax.ppermute(b, a, perm), spec_d)
        blk = x.shape[d] // size
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else v.roll(blk, d), desc)
    if name == "smap_psum_scatter" and even and _num(x.dtype):
        g = smap(lambda b: sf.lax.psum_scatter(b, a, scatter_dimension=d, tiled=True), spec_d, rep)
        # the sum of the size copies (torch.sum's: complex component by component, (inf+0j) * 4 is inf+nanj)
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else _copies_sum(v, size), desc)
    if name == "smap_axis_index" and even and _num(x.dtype) and x.dtype != torch.bool:
        g = smap(lambda b: b + sf.lax.axis_index(a).to(b.dtype), spec_d)
        idx = (torch.arange(x.shape[d]) // max(x.shape[d] // size, 1)).to(x.dtype)
        shape = [x.shape[d] if i == d else 1 for i in range(n)]
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else v + idx.reshape(shape), desc)
    if name == "smap_pointwise" and (x.dtype.is_floating_point or x.dtype.is_complex):
        g = smap(lambda b: torch.exp(b) * 2, spec_d)
        inverse = (lambda t: torch.log(t / 2)) if not x.dtype.is_complex else None  # 16-bit: compared as exp's input
        return Step(name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else torch.exp(v) * 2, desc, inverse=inverse)
    return None


@op("loss")
def loss(c: Ctx, x: torch.Tensor) -> Step | None:
    if not _real(x.dtype) or not x.dim():
        return None
    name = c.ch.choice(["mse", "l1", "smooth_l1", "huber", "kl_div", "bce_logits", "cross_entropy", "nll", "ce_probs"])
    red = c.ch.choice(["mean", "sum", "none"])
    if name in ("cross_entropy", "nll"):
        if x.dim() < 2 and c.ch.chance(0.5):
            return None
        ncls = x.shape[1] if x.dim() >= 2 else x.shape[0]
        tshape = (x.shape[0], *x.shape[2:]) if x.dim() >= 2 else ()
        hi = ncls + (3 if c.ch.chance(0.15) else 0)
        lo = -2 if c.ch.chance(0.1) else 0
        t = c.aux(torch.randint(lo, max(hi, 1), tshape, generator=c.gen))
        f = F.cross_entropy if name == "cross_entropy" else F.nll_loss
        return Step(name, lambda v, A: f(v, A(t), reduction=red), f"{name}(target={t.plain.tolist()} {t.desc}, reduction={red})")
    y = c.aux(make_tensor(tuple(x.shape), x.dtype, c.gen, positive=name == "kl_div"))
    if name == "ce_probs" and x.dim() >= 1:
        return Step(
            name, lambda v, A: F.cross_entropy(v, A(y).softmax(1 if v.dim() > 1 else 0), reduction=red), f"ce_probs y={y.desc}"
        )
    fns = {
        "mse": F.mse_loss,
        "l1": F.l1_loss,
        "smooth_l1": F.smooth_l1_loss,
        "huber": F.huber_loss,
        "kl_div": lambda a, b, reduction: F.kl_div(a, b, reduction=reduction),
        "bce_logits": lambda a, b, reduction: F.binary_cross_entropy_with_logits(a, b.sigmoid(), reduction=reduction),
    }
    f = fns.get(name)
    if f is None:
        return None
    return Step(name, lambda v, A: f(v, A(y), reduction=red), f"{name}(y={y.desc}, reduction={red})")


@op("extra", since=2)
def extra(c: Ctx, x: torch.Tensor) -> Step | None:
    """Generator 2: linalg, nan-reductions, corrections, tensor bounds and weights, type
    promotion with 0-d tensors and Python scalars, bool/bitwise ops, sorted lookups."""
    n = x.dim()
    d = _dim(c, x)
    dd = d if d is not None else 0
    k = c.ch.integer(0, 3)
    real, cplx, num = x.dtype.is_floating_point, x.dtype.is_complex, _num(x.dtype)
    wide = x.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128)
    intg = not real and not cplx and num
    name = c.ch.choice(
        ["take_along_dim", "nanmean", "nanmedian", "median_all", "var_corr", "std_all", "clamp_both", "clamp_max_t",
         "lerp_t", "addcdiv", "where_scalars", "where_x_scalar", "add_0d", "mul_0d_int", "add_0d_complex", "py_scalar",
         "int_true_div", "bool_arith", "logical_xor", "bitwise_or", "count_nonzero_dim", "aminmax_dim",
         "logsumexp_multi", "softmax_dtype", "sum_int", "searchsorted_rows", "searchsorted_right", "bucketize_right",
         "index_reduce", "inv", "det", "slogdet", "solve", "cholesky", "qr_r", "eigvalsh", "svdvals", "matrix_power",
         "matrix_exp", "pinv", "diag_embed", "tile", "repeat_interleave", "split_sizes", "one_hot", "expm1_log1p",
         "round_dec", "trunc_frac", "floor_divide_t", "cummin", "einsum_trace", "nan_inject", "inf_inject"]
    )
    y = c.aux(make_tensor(tuple(x.shape), x.dtype, c.gen), partial=c.ch.chance(0.2))
    sq = min(x.shape[-2:]) if n >= 2 else 0

    def square(v: Any) -> Any:  # the leading square block of the last two dims, made well conditioned
        # entries scaled below 1 first: B B^H + n I of a large B (a float32 product of 8 rows:
        # eigenvalues 16 to 6.6e5) is known to float32 only to eps * |A| = 0.08, and a
        # sharded contraction's other rounding moved its smallest eigenvalue by 3e-3 (seed
        # 5738230791); scaled, its eigenvalues lie in [n, n + n^2]
        b = v[..., :sq, :sq]
        b = b / (1 + b.abs().amax()) if b.numel() else b
        return b @ b.mT.conj() + torch.eye(sq, dtype=v.dtype) * sq

    def full_rank(v: Any) -> Any:
        # QR's gradient exists only at full rank (torch's docs): a rank-deficient input (a reflect
        # pad repeats columns) gives gradients of 1e17 whose last bits decide the result (dist seed
        # 5801638); entries scaled below 1 and a diagonal of n + 1 make the leading block dominant
        m, nn = v.shape[-2:]
        return (v / (1 + v.abs().amax()) if v.numel() else v) + torch.eye(m, nn, dtype=v.dtype) * (nn + 1)

    fns: dict[str, tuple[bool, Callable]] = {
        "nanmean": (n > 0 and real, lambda v, A: v.nanmean(dd, keepdim=k % 2 == 0)),
        "nanmedian": (n > 0 and real, lambda v, A: v.nanmedian(dd)[0]),
        "median_all": (real or intg, lambda v, A: v.median()),
        "var_corr": (n > 0 and (real or cplx), lambda v, A: v.var(dd, correction=k)),
        "std_all": (real or cplx, lambda v, A: v.std(correction=k % 3)),
        "clamp_both": (real or intg, lambda v, A: torch.clamp(v, A(y) - 1, A(y) + 1)),
        "clamp_max_t": (real or intg, lambda v, A: v.clamp(max=A(y))),
        "lerp_t": (real or cplx, lambda v, A: torch.lerp(v, A(y), A(y).abs().clamp(max=1) if not cplx else A(y))),
        "addcdiv": (real or cplx, lambda v, A: torch.addcdiv(v, A(y), A(y).abs() + 0.5, value=0.5)),
        "where_scalars": (num and not cplx, lambda v, A: torch.where(v > 0, 1.5, -2)),
        "where_x_scalar": (num and not cplx, lambda v, A: torch.where(A(y) > 0, 2.5, v)),
        "add_0d": (num, lambda v, A: v + A(z0)),
        "mul_0d_int": (num, lambda v, A: v * A(i0)),
        "add_0d_complex": (num, lambda v, A: v + A(c0)),
        "py_scalar": (True, lambda v, A: [v + True, v * 2.5, v - 3, v / 3, v**2, 2**v if not v.dtype == torch.bool else v][k]),
        "int_true_div": (intg, lambda v, A: torch.true_divide(v, A(y))),
        "bool_arith": (True, lambda v, A: ((v != 0) & (A(y) != 0)).sum(dd) if n else (v != 0) | (A(y) != 0)),
        "logical_xor": (True, lambda v, A: torch.logical_xor(v, A(y))),
        "bitwise_or": (intg or x.dtype == torch.bool, lambda v, A: v | A(y) if k % 2 else v ^ A(y)),
        "count_nonzero_dim": (n > 0, lambda v, A: torch.count_nonzero(v, dd)),
        "aminmax_dim": (n > 0 and not cplx and num, lambda v, A: torch.aminmax(v, dim=dd, keepdim=k % 2 == 0)[k % 2]),
        "logsumexp_multi": (n >= 2 and real, lambda v, A: torch.logsumexp(v, (0, -1), keepdim=k % 2 == 0)),
        "softmax_dtype": (n > 0 and real, lambda v, A: F.softmax(v, dd, dtype=torch.float64)),
        "sum_int": (intg or x.dtype == torch.bool, lambda v, A: v.sum(dd) if n else v.sum()),
        "searchsorted_rows": (n > 0 and real, lambda v, A: torch.searchsorted(v.sort(-1)[0], A(y), right=k % 2 == 1)),
        "searchsorted_right": (real, lambda v, A: torch.searchsorted(torch.tensor([-1.0, 0.0, 0.5], dtype=v.dtype), v,
                                                                     right=True)),
        "bucketize_right": (real or intg, lambda v, A: torch.bucketize(v, torch.tensor([-2, 0, 3], dtype=v.dtype), right=True)),
        "inv": (n >= 2 and wide and sq > 0, lambda v, A: torch.linalg.inv(square(v))),
        "det": (n >= 2 and wide, lambda v, A: torch.linalg.det(square(v))),
        "slogdet": (n >= 2 and wide, lambda v, A: torch.linalg.slogdet(square(v))[1]),
        "solve": (n >= 2 and wide, lambda v, A: torch.linalg.solve(square(v), A(y)[..., :sq, :])),
        "cholesky": (n >= 2 and wide, lambda v, A: torch.linalg.cholesky(square(v))),
        "qr_r": (n >= 2 and wide, lambda v, A: torch.linalg.qr(full_rank(v))[1].abs()),
        "eigvalsh": (n >= 2 and wide, lambda v, A: torch.linalg.eigvalsh(square(v))),
        "svdvals": (n >= 2 and wide, lambda v, A: torch.linalg.svdvals(v)),
        "matrix_power": (n >= 2 and wide, lambda v, A: torch.linalg.matrix_power(v[..., :sq, :sq], k)),
        "matrix_exp": (n >= 2 and wide, lambda v, A: torch.linalg.matrix_exp(v[..., :sq, :sq] * 0.25)),
        "pinv": (n >= 2 and wide and min(x.shape[-2:]) > 0, lambda v, A: torch.linalg.pinv(square(v), hermitian=k % 2 == 0)),
        "diag_embed": (n in (1, 2), lambda v, A: torch.diag_embed(v, offset=k - 1)),
        "tile": (True, lambda v, A: v.tile((2,) + (1,) * max(n - 1, 0)) if n else v.tile(2)),
        "repeat_interleave": (n > 0, lambda v, A: v.repeat_interleave(2, dd)),
        "split_sizes": (n > 0 and x.shape[dd] >= 1, lambda v, A: torch.split(v, [1, v.shape[dd] - 1], dd)[k % 2]),
        "one_hot": (x.dtype == torch.int64, lambda v, A: F.one_hot(v.clamp(0, 5), 6)),
        "expm1_log1p": (real, lambda v, A: torch.log1p(torch.expm1(v).abs())),
        "round_dec": (real, lambda v, A: torch.round(v, decimals=k - 1)),
        "trunc_frac": (real, lambda v, A: torch.trunc(v * 3) + torch.frac(v * 3)),
        "floor_divide_t": (intg or real, lambda v, A: torch.floor_divide(v, A(y))),
        "cummin": (n > 0 and not cplx and num, lambda v, A: v.cummin(dd)[k % 2]),
        "einsum_trace": (n == 2 and num, lambda v, A: torch.einsum("ii->", v[:sq, :sq])),
        "nan_inject": (real, lambda v, A: torch.where(A(y) > 1, float("nan"), v)),
        "inf_inject": (real, lambda v, A: torch.where(A(y) > 1, float("-inf"), v)),
        "take_along_dim": (n > 0, None),
        "index_reduce": (n > 0 and real, None),
    }
    z0 = c.aux(make_tensor((), torch.float64 if k % 2 else torch.float32, c.gen))
    i0 = c.aux(torch.tensor(3))
    c0 = c.aux(torch.tensor(0.5 + 1j, dtype=torch.complex64))
    ok, f = fns[name]
    if not ok:
        return None
    if f is not None:
        return Step(name, f, f"{name}(d={d}, k={k}, y={y.desc}, z0={z0.desc})")
    size = x.shape[dd]
    if name == "take_along_dim":
        gi = c.aux(torch.randint(-size if size and k == 3 else 0, max(size, 1), tuple(x.shape), generator=c.gen))
        return Step(name, lambda v, A: torch.take_along_dim(v, A(gi), dd), f"take_along_dim(d={dd}, {gi.desc})")
    m = c.ch.integer(0, 3)
    ii = c.aux(torch.randint(0, max(size, 1), (m,), generator=c.gen))
    src = c.aux(make_tensor([*x.shape[:dd], m, *x.shape[dd + 1:]], x.dtype, c.gen))
    red = c.ch.choice(["prod", "mean", "amax", "amin"])
    return Step(name, lambda v, A: v.index_reduce(dd, A(ii), A(src), red, include_self=k % 2 == 0),
                f"index_reduce(d={dd}, idx={ii.plain.tolist()} {ii.desc}, src={src.desc}, {red}, include_self={k % 2 == 0})")


@op("random", since=2)
def random_ops(c: Ctx, x: torch.Tensor) -> Step | None:
    """Generator 2: ``sf.random`` draws laid out at random are bit-identical to the unsharded
    draw (the API's invariance), added to the value so the chain goes on."""
    if not (x.dtype.is_floating_point or x.dtype.is_complex) or x.dtype in (torch.float16, torch.bfloat16):
        return None
    key = sf.random.fold_in(sf.random.key(c.ch.integer(0, 99)), c.ch.integer(0, 3))
    spec = draw_spec(c.ch, c.mesh, x.dim(), partial=False)
    kind = c.ch.choice(["normal", "uniform", "randint", "bernoulli", "split"])
    dt = x.dtype if x.dtype.is_floating_point else (torch.float64 if x.dtype == torch.complex128 else torch.float32)

    def draw(shape: tuple, sharding: Any) -> torch.Tensor:
        kw = {} if sharding is None else {"mesh": c.mesh}
        if kind == "normal":
            return sf.random.normal(key, shape, sharding, dtype=dt, **kw)
        if kind == "uniform":
            return sf.random.uniform(key, shape, sharding, dtype=dt, minval=-1.0, maxval=2.0, **kw)
        if kind == "randint":
            return sf.random.randint(key, shape, -3, 4, sharding, **kw).to(dt)
        if kind == "bernoulli":
            return sf.random.bernoulli(key, 0.3, shape, sharding, **kw).to(dt)
        return sf.random.normal(sf.random.split(key, 3)[1], shape, sharding, dtype=dt, **kw)

    def fn(v: Any, A: Any) -> Any:
        sharded = isinstance(v, sf.ShardedArray)
        return v + draw(tuple(v.shape), spec if sharded else None)

    return Step("random_" + kind, fn, f"x + sf.random.{kind}(key, x.shape, {spec})")


def _eigvals(m: Any) -> Any:
    """``torch.linalg.eigvals`` as torch runs it on a ShardedArray: by ``linalg_eig`` (its branch for
    subclass-like inputs), which raises on a matrix holding inf or nan. On a plain CPU tensor torch
    calls its values-only kernel, which does not check and crashes there (torch 2.13, MKL: "Parameter
    3 was incorrect on entry to SGEBAL", then a segfault; a torch bug): the oracle takes eig's branch."""
    return torch.linalg.eigvals(m) if isinstance(m, sf.ShardedArray) else torch.linalg.eig(m)[0]


@op("wide", since=3)
def wide(c: Ctx, x: torch.Tensor) -> Step | None:
    """Generator 3: the rule table's ops the older families never reach (activations, padding
    and upsampling modes, scatter-views, LU/triangular linalg, pooling in 2-d/3-d, unique
    variants, like-factories, foreach lists, norms with weights, distances)."""
    n = x.dim()
    d = _dim(c, x)
    dd = d if d is not None else 0
    k = c.ch.integer(0, 3)
    real, cplx, num = x.dtype.is_floating_point, x.dtype.is_complex, _num(x.dtype)
    wide_ = x.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128)
    intg = not real and not cplx and num
    name = c.ch.choice(
        ["argmin", "mode", "std_mean", "addbmm", "addmv", "addr", "bincount", "celu", "elu", "hardsigmoid", "hardswish",
         "hardtanh", "leaky_relu", "relu6", "mish", "selu", "threshold", "logsigmoid", "hardshrink", "softshrink",
         "logit", "glu", "index_copy", "put", "diagonal_scatter", "select_scatter", "slice_scatter", "pixel_shuffle",
         "pixel_unshuffle", "replicate_pad", "reflect_pad2d", "upsample2d", "adaptive_max_pool2d", "adaptive_avg_pool2d",
         "avg_pool3d", "max_pool3d", "unique_consecutive", "unique_dim", "lstsq", "lu_factor", "lu_solve",
         "solve_triangular", "eigvals", "cholesky_solve", "cholesky_inverse", "logdet", "unbind", "view_as_complex",
         "zeros_like", "full_like", "new_full", "rsub", "resolve", "foreach", "layer_norm_w", "group_norm_g",
         "batch_norm", "instance_norm", "cosine_similarity", "pairwise_distance", "embedding_bag", "conv_transpose1d",
         "f_unfold", "amax_neg", "min_dim", "nanquantile", "cumsum_rev", "var_unbiased_dim", "max_unpool", "gumbel0",
         "xlogy", "clamp_int", "signbit", "frexp", "ldexp", "float_power", "lgamma", "erfinv", "i0", "sinc", "deg2rad",
         "allclose", "equal", "isclose", "movedim_multi", "swapaxes", "narrow_copy", "as_strided_scatter", "block_diag",
         "cartesian_prod", "tensor_split", "hsplit", "atleast_3d", "vander", "cummax_idx", "trapz", "kl_div_log",
         "triplet", "margin_ranking", "multi_margin", "poisson_nll", "gaussian_nll", "soft_margin", "hinge", "ctc_free"]
    )
    y = c.aux(make_tensor(tuple(x.shape), x.dtype, c.gen), partial=c.ch.chance(0.2))
    sq = min(x.shape[-2:]) if n >= 2 else 0
    last = x.shape[-1] if n else 0
    fl = real and x.dtype in (torch.float32, torch.float64)

    def square(v: Any) -> Any:  # a well-conditioned square block
        b = v[..., :sq, :sq]
        return b @ b.mT.conj() + torch.eye(sq, dtype=v.dtype) * sq

    w1 = c.aux(make_tensor((last,), x.dtype, c.gen)) if n else None
    fns: dict[str, tuple[bool, Callable]] = {
        "argmin": (n > 0 and not cplx and num, lambda v, A: v.argmin(dd, keepdim=k % 2 == 0)),
        "mode": (n > 0 and (real or intg), lambda v, A: torch.mode(v, dd)[k % 2]),
        "std_mean": (n > 0 and (real or cplx), lambda v, A: torch.std_mean(v, dd, correction=k % 2)[k % 2]),
        "addbmm": (n == 3 and num and x.dtype != torch.bool, lambda v, A: torch.addbmm(v[0] @ v[0].mT, v, v.mT, beta=0.5)),
        "addmv": (n == 2 and num and x.dtype != torch.bool, lambda v, A: torch.addmv(v[:, 0], v, A(y)[0], alpha=2)),
        "addr": (n == 1 and num and x.dtype != torch.bool, lambda v, A: torch.addr(torch.outer(v, A(y)), v, A(y))),
        # its length is the largest value's (data-dependent: fake tensors cannot size it)
        "bincount": (n == 1 and x.dtype in (torch.int64, torch.int32, torch.int8)
                     and (x.numel() == 0 or int(x.abs().max()) < STEP_NUMEL),
                     lambda v, A: torch.bincount(v.abs(), minlength=k)),
        "celu": (real, lambda v, A: F.celu(v, 0.5)),
        "elu": (real, lambda v, A: F.elu(v, 1.5)),
        "hardsigmoid": (real, lambda v, A: F.hardsigmoid(v * 4)),
        "hardswish": (real, lambda v, A: F.hardswish(v * 4)),
        "hardtanh": (real or intg, lambda v, A: F.hardtanh(v, -0.5 if real else -1, 0.5 if real else 1)),
        "leaky_relu": (real, lambda v, A: F.leaky_relu(v, 0.1)),
        "relu6": (real or intg, lambda v, A: F.relu6(v * 4)),
        "mish": (real, lambda v, A: F.mish(v)),
        "selu": (real, lambda v, A: F.selu(v)),
        "threshold": (real or intg, lambda v, A: F.threshold(v, 0.25 if real else 1, -7)),
        "logsigmoid": (real, lambda v, A: F.logsigmoid(v)),
        "hardshrink": (real, lambda v, A: F.hardshrink(v, 0.5)),
        # + 0.0: torch's CPU softshrink gives -0 in its scalar tail and +0 in its vector body (float64
        # length 5: -0; 8: +0), so a zero's sign depends on the tensor's length (seed 32001396, --families wide)
        "softshrink": (real, lambda v, A: F.softshrink(v, 0.5) + 0.0),
        "logit": (real, lambda v, A: torch.logit(v.sigmoid(), eps=1e-3 if k % 2 else None)),
        "glu": (n > 0 and real and x.shape[dd] % 2 == 0, lambda v, A: F.glu(v, dd)),
        "index_copy": (n > 0, None),
        "put": (num, None),
        "diagonal_scatter": (n >= 2, lambda v, A: torch.diagonal_scatter(v, A(y).diagonal(), 0)),
        "select_scatter": (n > 0 and x.shape[dd] > 0, lambda v, A: torch.select_scatter(v, A(y).select(dd, -1), dd, -1)),
        "slice_scatter": (n > 0, lambda v, A: torch.slice_scatter(v, A(y)[(slice(None),) * (dd % n) + (slice(1, None, 2),)],
                                                                  dd % n, 1, None, 2)),
        "pixel_shuffle": (n in (3, 4) and x.shape[-3] % 4 == 0, lambda v, A: F.pixel_shuffle(v, 2)),
        "pixel_unshuffle": (n in (3, 4) and x.shape[-1] % 2 == 0 and x.shape[-2] % 2 == 0, lambda v, A: F.pixel_unshuffle(v, 2)),
        "replicate_pad": (n in (2, 3, 4) and real,
                          lambda v, A: F.pad(v, (1, 2) if n < 4 or k % 2 else (1, 0, 2, 1), mode="replicate")),
        "reflect_pad2d": (n in (3, 4) and real, lambda v, A: F.pad(v, (1, 1, 1, 0), mode="reflect")),
        "upsample2d": (n == 4 and real, lambda v, A: F.interpolate(
            v, scale_factor=2, mode=["bilinear", "bicubic", "nearest", "nearest-exact"][k],
            **({"align_corners": True} if k < 2 else {}))),
        "adaptive_max_pool2d": (n in (3, 4) and real, lambda v, A: F.adaptive_max_pool2d(v, (2, 1))),
        "adaptive_avg_pool2d": (n in (3, 4) and real, lambda v, A: F.adaptive_avg_pool2d(v, (1, 2))),
        "avg_pool3d": (n == 4 and real, lambda v, A: F.avg_pool3d(v, (1, 2, 2))),
        "max_pool3d": (n == 4 and real, lambda v, A: F.max_pool3d(v, (2, 1, 2), ceil_mode=k % 2 == 1)),
        "unique_consecutive": (not cplx and x.dtype not in (torch.float16, torch.bfloat16) and (intg or x.dtype == torch.bool),
                               lambda v, A: torch.unique_consecutive(v)),
        "unique_dim": ((intg or x.dtype == torch.bool) and n > 0, lambda v, A: torch.unique(v, dim=dd)),
        "lstsq": (n >= 2 and wide_ and sq > 0, lambda v, A: torch.linalg.lstsq(square(v), A(y)[..., :sq, :]).solution),
        "lu_factor": (n >= 2 and wide_, lambda v, A: torch.linalg.lu_factor(square(v))[0]),
        "lu_solve": (n >= 2 and wide_, lambda v, A: torch.linalg.lu_solve(*torch.linalg.lu_factor(square(v)),
                                                                        A(y)[..., :sq, :])),
        "solve_triangular": (n >= 2 and wide_, lambda v, A: torch.linalg.solve_triangular(
            square(v).triu(), A(y)[..., :sq, :], upper=True)),
        "eigvals": (n >= 2 and wide_, lambda v, A: _eigvals(square(v)).abs().sort(-1)[0]),
        "cholesky_solve": (n >= 2 and wide_,
                           lambda v, A: torch.cholesky_solve(A(y)[..., :sq, :], torch.linalg.cholesky(square(v)))),
        "cholesky_inverse": (n == 2 and wide_, lambda v, A: torch.cholesky_inverse(torch.linalg.cholesky(square(v)))),
        "logdet": (n >= 2 and fl, lambda v, A: torch.logdet(square(v))),
        "unbind": (n > 0 and x.shape[dd] > 0, lambda v, A: v.unbind(dd)[-1]),
        "view_as_complex": (n > 0 and x.shape[-1] == 2 and x.dtype in (torch.float32, torch.float64),
                            lambda v, A: torch.view_as_complex(v.contiguous() if k % 2 else v)),
        "zeros_like": (True, lambda v, A: torch.zeros_like(v) + torch.ones_like(v)),
        "full_like": (True, lambda v, A: torch.full_like(v, 3) if v.dtype != torch.bool else torch.full_like(v, True)),
        "new_full": (True, lambda v, A: v + v.new_full(tuple(v.shape), 2) if num else v.new_ones(tuple(v.shape))),
        "rsub": (num and x.dtype != torch.bool, lambda v, A: torch.rsub(v, 2)),
        "resolve": (True, lambda v, A: (v.conj() if cplx else v.neg() if num and x.dtype != torch.bool else v)
                    .resolve_conj().resolve_neg()),
        "foreach": (num and x.dtype != torch.bool, lambda v, A: torch._foreach_add([v, A(y)], [A(y), v], alpha=2)[k % 2]),
        "layer_norm_w": (n > 0 and real, lambda v, A: F.layer_norm(v, (last,), A(w1), A(w1) if k % 2 else None)),
        "group_norm_g": (n >= 2 and real and x.shape[1] % 2 == 0 and x.shape[1] > 0, lambda v, A: F.group_norm(v, 2)),
        "batch_norm": (n in (2, 3) and real, lambda v, A: F.batch_norm(v, None, None, training=True) if k % 2 else F.batch_norm(
            v, torch.zeros(v.shape[1], dtype=v.dtype), torch.ones(v.shape[1], dtype=v.dtype), training=False)),
        "instance_norm": (n == 3 and real, lambda v, A: F.instance_norm(v)),
        "cosine_similarity": (n > 0 and real, lambda v, A: F.cosine_similarity(v, A(y), dim=dd)),
        "pairwise_distance": (n > 0 and real, lambda v, A: F.pairwise_distance(v, A(y))),
        "embedding_bag": (n == 2 and real and x.shape[0] > 0, None),
        "conv_transpose1d": (n == 3 and real, None),
        "f_unfold": (n == 4 and real, lambda v, A: F.unfold(v, (2, 1), stride=(1, 2) if k % 2 else 1)),
        "amax_neg": (n >= 1 and not cplx and num, lambda v, A: v.amax(-1)),
        "min_dim": (n > 0 and not cplx and num, lambda v, A: v.min(dd, keepdim=k % 2 == 0)[k // 2]),
        "nanquantile": (n > 0 and fl, lambda v, A: torch.nanquantile(v, 0.25 * k, dd) if v.shape[dd] else v.sum(dd)),
        "cumsum_rev": (n > 0 and num, lambda v, A: v.flip(dd).cumsum(dd).flip(dd)),
        "var_unbiased_dim": (n >= 2 and (real or cplx), lambda v, A: v.var((0, 1), unbiased=k % 2 == 0)),
        "max_unpool": (n == 3 and real and x.shape[-1] >= 2,
                       lambda v, A: F.max_unpool1d(*F.max_pool1d(v, 2, return_indices=True), 2)),
        "gumbel0": (real and x.dtype != torch.bfloat16 and n > 0, lambda v, A: F.softmax(v / 0.5, dd)),
        "xlogy": (real, lambda v, A: torch.xlogy(v.abs(), A(y).abs() + 0.1)),
        "clamp_int": (intg, lambda v, A: v.clamp(min=-2) if k % 2 else v.clamp(max=A(y))),
        "signbit": (not cplx and num, lambda v, A: torch.signbit(v)),
        "frexp": (fl, lambda v, A: torch.frexp(v)[k % 2]),
        "ldexp": (fl, lambda v, A: torch.ldexp(v, torch.tensor(k))),
        "float_power": (num and not cplx, lambda v, A: torch.float_power(v, 2)),
        "lgamma": (fl, lambda v, A: torch.lgamma(v.abs() + 0.5)),
        "erfinv": (fl, lambda v, A: torch.erfinv(v.tanh() * 0.9)),
        "i0": (fl, lambda v, A: torch.i0(v)),
        "sinc": (fl, lambda v, A: torch.sinc(v)),
        "deg2rad": (real, lambda v, A: torch.deg2rad(v)),
        "allclose": (real or cplx, lambda v, A: torch.tensor(torch.allclose(v, v + 0))),
        "equal": (True, lambda v, A: torch.tensor(torch.equal(v, A(y)))),
        "isclose": (num, lambda v, A: torch.isclose(v, A(y)) if not intg else v == A(y)),
        "movedim_multi": (n >= 3, lambda v, A: torch.movedim(v, (0, 1), (-1, 0))),
        "swapaxes": (n >= 2, lambda v, A: v.swapaxes(0, -1).contiguous()),
        "narrow_copy": (n > 0, lambda v, A: v.narrow_copy(dd, min(1, v.shape[dd]), max(v.shape[dd] - 1, 0))),
        "as_strided_scatter": (n == 2 and x.is_contiguous() and x.numel() >= 4,
                               lambda v, A: torch.as_strided_scatter(v, torch.ones(2, 2, dtype=v.dtype), (2, 2), (1, 2))),
        "block_diag": (n <= 2, lambda v, A: torch.block_diag(v, A(y))),
        "cartesian_prod": (n == 1 and x.shape[0] <= 6, lambda v, A: torch.cartesian_prod(v, A(y))),
        "tensor_split": (n > 0, lambda v, A: torch.tensor_split(v, 3, dd)[k % 3]),
        "hsplit": (n >= 2 and x.shape[1] % 2 == 0, lambda v, A: torch.hsplit(v, 2)[k % 2]),
        "atleast_3d": (True, lambda v, A: torch.atleast_3d(v)),
        "vander": (n == 1 and num and x.dtype != torch.bool, lambda v, A: torch.linalg.vander(v, N=3)),
        "cummax_idx": (n > 0 and not cplx and num, lambda v, A: v.cummax(dd)[1]),
        "trapz": (n > 0 and real, lambda v, A: torch.trapezoid(v, dim=dd)),
        "kl_div_log": (real, lambda v, A: F.kl_div(F.log_softmax(v.reshape(-1), 0), A(y).reshape(-1).log_softmax(0),
                                                   reduction="batchmean", log_target=True)),
        "triplet": (n == 2 and real, lambda v, A: F.triplet_margin_loss(v, A(y), v.flip(0))),
        "margin_ranking": (n > 0 and real, lambda v, A: F.margin_ranking_loss(v, A(y), torch.sign(A(y)))),
        # of an empty batch torch's CPU kernel returns its output unwritten (uninitialised memory, a
        # different value each call: seed 5788801577): no value to compare
        "multi_margin": (n == 2 and fl and x.shape[0] > 0 and x.shape[1] > 0, None),
        "poisson_nll": (real, lambda v, A: F.poisson_nll_loss(v, A(y).abs(), reduction=["mean", "sum", "none", "mean"][k])),
        "gaussian_nll": (real and n > 0, lambda v, A: F.gaussian_nll_loss(v, A(y), v.abs() + 0.5)),
        "soft_margin": (real, lambda v, A: F.soft_margin_loss(v, torch.sign(A(y)))),
        "hinge": (real, lambda v, A: F.hinge_embedding_loss(v, torch.sign(A(y)))),
        # log(sum(softmax)) is 0 up to rounding, whose sign a later log or reciprocal turns into nan or
        # +-inf in any summation order (seeds 5764622825, 5764623352): offset it away from 0
        "ctc_free": (real and n > 0, lambda v, A: F.log_softmax(v, -1).logsumexp(-1) + 1),
    }
    ok, f = fns[name]
    if not ok:
        return None
    if f is not None:
        return Step(name, f, f"{name}(d={d}, k={k}, y={y.desc}{'' if w1 is None else ', w=' + w1.desc})")
    size = x.shape[dd] if n else 0
    if name == "index_copy":
        m = c.ch.integer(0, min(size, 3))
        ii = c.aux(torch.randperm(max(size, 1), generator=c.gen)[:m])
        src = c.aux(make_tensor([*x.shape[:dd], m, *x.shape[dd + 1:]], x.dtype, c.gen))
        return Step(name, lambda v, A: v.index_copy(dd, A(ii), A(src)),
                    f"index_copy(d={dd}, idx={ii.plain.tolist()} {ii.desc}, src={src.desc})")
    if name == "put":
        m = c.ch.integer(0, 3)
        hi = max(x.numel(), 1) + (2 if c.ch.chance(0.15) else 0)
        ii = c.aux(torch.randint(-max(x.numel(), 1) if k == 3 else 0, hi, (m,), generator=c.gen))
        src = c.aux(make_tensor((m,), x.dtype, c.gen))
        acc = k % 2 == 1
        return Step(name, lambda v, A: v.put(A(ii), A(src), accumulate=acc),
                    f"put(idx={ii.plain.tolist()} {ii.desc}, src={src.desc}, accumulate={acc})")
    if name == "embedding_bag":
        hi = x.shape[0] + (2 if c.ch.chance(0.15) else 0)
        ii = c.aux(torch.randint(0, hi, (c.ch.integer(1, 3), 2), generator=c.gen))
        mode = ["sum", "mean", "max", "sum"][k]
        return Step(name, lambda v, A: F.embedding_bag(A(ii), v, mode=mode),
                    f"embedding_bag(x as weight, idx={ii.plain.tolist()} {ii.desc}, mode={mode})")
    if name == "conv_transpose1d":
        w = c.aux(make_tensor((x.shape[1], 2, 3), x.dtype, c.gen))
        st = c.ch.choice([1, 2])
        return Step(name, lambda v, A: F.conv_transpose1d(v, A(w), stride=st), f"conv_transpose1d(w={w.desc}, stride={st})")
    if name == "multi_margin":
        t = c.aux(torch.randint(0, x.shape[1] + (2 if c.ch.chance(0.15) else 0), (x.shape[0],), generator=c.gen))
        return Step(name, lambda v, A: F.multi_margin_loss(v, A(t)), f"multi_margin(target={t.plain.tolist()} {t.desc})")
    return None


@op("model", since=5)
def model(c: Ctx, x: torch.Tensor) -> Step | None:
    """Generator 5: what model code does that the older families do not: writes into a fresh
    buffer (``clone`` / ``zeros_like`` then ``add_``, ``x[i] = v``, ``masked_fill_``,
    ``index_put_``, ``copy_``, ``out=``; torch's in-place type rules), attention variants
    (causal, masks, GQA), rotary embeddings, manual RMSNorm, MoE routing, label smoothing and
    ignore_index, padding_idx, batched products, and the unary/binary ops models use."""
    n = x.dim()
    d = _dim(c, x)
    dd = d if d is not None else 0
    k = c.ch.integer(0, 3)
    real, cplx, num = x.dtype.is_floating_point, x.dtype.is_complex, _num(x.dtype)
    intg = not real and not cplx and num
    fl = x.dtype in (torch.float32, torch.float64)
    name = c.ch.choice(
        ["add_", "mul_scalar_", "copy_", "fill_", "zero_", "masked_fill_", "clamp_", "setitem_slice", "setitem_index",
         "setitem_mask", "index_put_", "narrow_mul_", "select_add_", "t_add_", "scatter_", "index_add_", "out_add",
         "lerp_", "addcmul_", "div_", "zeros_like_add_", "rsqrt", "erf", "cos", "log1p", "expm1", "floor", "ceil",
         "trunc", "asinh", "atan", "gelu_tanh", "minimum", "fmax", "lt", "ne", "logical_or", "bitwise_xor", "bmm",
         "matmul_batched", "addmm", "baddbmm_t", "sdpa_causal", "sdpa_mask", "sdpa_gqa", "ce_smooth", "ce_ignore",
         "embedding_pad", "rope_complex", "rotate_half", "repeat_kv", "causal_softmax", "masked_softmax", "rmsnorm",
         "silu_mul", "moe_route", "upcast_softmax", "arange_add", "type_as", "einsum_attn", "max_idx", "where_finfo",
         "cumsum_positions", "dropout_eval", "clamp_min", "pow_half", "norm_keep", "mean_neg"]
    )
    y = c.aux(make_tensor(tuple(x.shape), x.dtype, c.gen), partial=c.ch.chance(0.2))
    o_dt = c.ch.choice([x.dtype, torch.float32, torch.int64, torch.bool])
    o = c.aux(make_tensor(tuple(x.shape), o_dt, c.gen))
    mk = c.aux(torch.rand(tuple(x.shape), generator=c.gen) > 0.5)
    size = x.shape[dd] if n else 0
    hi = max(size, 1) + (2 if c.ch.chance(0.15) else 0)
    ii = c.aux(torch.randint(-size if size and k == 3 else 0, hi, (c.ch.integer(0, 3),), generator=c.gen))
    last = x.shape[-1] if n else 0

    def up(v: Any) -> Any:
        return v.float() if v.dtype in (torch.float16, torch.bfloat16) else v

    def fresh(v: Any) -> Any:  # a buffer nothing has read yet (torch code writes into such)
        return v.clone()

    def then(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def g(w: Any) -> Any:
            f(w)
            return w
        return g

    def inplace(f: Callable[[Any, Any], Any]) -> Callable:
        return lambda v, A: then(lambda w: f(w, A))(fresh(v))

    def rope(v: Any) -> Any:
        h = v.shape[-1] // 2
        ang = torch.arange(h, dtype=torch.float64) * 0.3 + 0.1
        freqs = torch.polar(torch.ones(h, dtype=torch.float64), ang).to(torch.complex128 if v.dtype == torch.float64
                                                                          else torch.complex64)
        z = torch.view_as_complex(v.reshape(*v.shape[:-1], h, 2)) * freqs
        return torch.view_as_real(z).flatten(-2)

    def rotate_half(v: Any) -> Any:
        a, b = v.chunk(2, -1)
        cos = torch.cos(torch.arange(v.shape[-1], dtype=v.dtype))
        return v * cos + torch.cat((-b, a), -1) * torch.sin(torch.arange(v.shape[-1], dtype=v.dtype))

    def causal(v: Any) -> Any:
        s = v.shape[-1]
        mask = torch.full((s, s), float("-inf"), dtype=v.dtype).triu(1)
        return (v[..., :s, :] + mask[: v.shape[-2]] if v.shape[-2] <= s else v[..., :s, :] + mask).softmax(-1)

    def moe(v: Any) -> Any:
        probs = v.softmax(-1)
        top, idx = probs.topk(min(2, v.shape[-1]), -1)
        return torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))

    sdpa_mask = c.aux(torch.rand(tuple(x.shape[-2:]) if n >= 2 else (), generator=c.gen) > 0.3)
    odd = k % 2 == 1
    fns: dict[str, tuple[bool, Callable]] = {
        "add_": (num, inplace(lambda w, A: w.add_(A(o)))),
        "mul_scalar_": (num, inplace(lambda w, A: w.mul_(2.5 if real or cplx else 3))),
        "copy_": (True, inplace(lambda w, A: w.copy_(A(o)))),
        "fill_": (True, inplace(lambda w, A: w.fill_(True if x.dtype == torch.bool else 3))),
        "zero_": (True, inplace(lambda w, A: w.zero_())),
        "masked_fill_": (True, inplace(lambda w, A: w.masked_fill_(A(mk), float("-inf") if real or cplx else 1))),
        "clamp_": (num and not cplx, inplace(lambda w, A: w.clamp_(-1, 1))),
        "setitem_slice": (n > 0, inplace(lambda w, A: w.__setitem__((slice(None),) * (dd % n) + (slice(k, None, 2),),
                                                                    A(o)[(slice(None),) * (dd % n) + (slice(k, None, 2),)]))),
        "setitem_index": (n > 0, inplace(lambda w, A: w.__setitem__(A(ii), A(o)[0] if x.shape[0] else 1))),
        "setitem_mask": (True, inplace(lambda w, A: w.__setitem__(A(mk), 0))),
        # (accumulate a Python bool drawn here: ``k % 2 == 1`` computed in the traced call is a SymBool under
        # dynamic=True, which index_put_ refuses: a graph break in torch, with or without shardfn)
        "index_put_": (n > 0, inplace(lambda w, A: w.index_put_((A(ii),), torch.ones((), dtype=w.dtype), accumulate=odd))),
        "narrow_mul_": (n > 0 and num, inplace(lambda w, A: w.narrow(dd, min(1, size), max(size - 1, 0)).mul_(3))),
        "select_add_": (n > 0 and size > 0 and num, inplace(lambda w, A: w.select(dd, -1).add_(A(o).select(dd, 0)))),
        "t_add_": (n == 2 and num, inplace(lambda w, A: w.t().add_(A(o).t()))),
        "scatter_": (n > 0 and size > 0, None),
        "index_add_": (n > 0 and num, None),
        "out_add": (num, lambda v, A: torch.add(v, A(o), out=torch.empty_like(v))),
        "lerp_": (real or cplx, inplace(lambda w, A: w.lerp_(A(y), 0.3))),
        "addcmul_": (num and x.dtype != torch.bool, inplace(lambda w, A: w.addcmul_(A(y), A(y), value=2))),
        "div_": (num, inplace(lambda w, A: w.div_(2))),
        "zeros_like_add_": (num, lambda v, A: then(lambda z: z.add_(v))(torch.zeros_like(v))),
        "rsqrt": (real, lambda v, A: torch.rsqrt(v.abs() + 0.5)),
        "erf": (real, lambda v, A: torch.erf(v)),
        "cos": (real or cplx, lambda v, A: torch.cos(v)),
        "log1p": (real, lambda v, A: torch.log1p(v.abs())),
        "expm1": (real or cplx, lambda v, A: torch.expm1(v)),
        "floor": (num and not cplx, lambda v, A: torch.floor(v * 2)),
        "ceil": (num and not cplx, lambda v, A: torch.ceil(v * 2)),
        "trunc": (num and not cplx, lambda v, A: torch.trunc(v * 2)),
        "asinh": (real or cplx, lambda v, A: torch.asinh(v)),
        "atan": (real, lambda v, A: torch.atan(v)),
        "gelu_tanh": (real, lambda v, A: F.gelu(v, approximate="tanh")),
        "minimum": (not cplx, lambda v, A: torch.minimum(v, A(o))),
        "fmax": (real, lambda v, A: torch.fmax(v, A(y))),
        "lt": (not cplx, lambda v, A: v < A(o)),
        "ne": (True, lambda v, A: v != A(o)),
        "logical_or": (True, lambda v, A: torch.logical_or(v, A(o))),
        "bitwise_xor": (intg or x.dtype == torch.bool, lambda v, A: torch.bitwise_xor(v, A(y))),
        "bmm": (n == 3 and num and x.dtype != torch.bool, lambda v, A: torch.bmm(v, A(y).mT)),
        "matmul_batched": (n >= 3 and num and x.dtype != torch.bool, lambda v, A: v @ A(y).mT),
        "addmm": (n == 2 and num and x.dtype != torch.bool, lambda v, A: torch.addmm(A(y)[:, :1], v, A(y).mT[:, :1],
                                                                                       beta=0.5)),
        "baddbmm_t": (n == 3 and num and x.dtype != torch.bool, lambda v, A: torch.baddbmm(A(y) @ A(y).mT, v, v.mT)),
        "sdpa_causal": (n == 4 and real, lambda v, A: F.scaled_dot_product_attention(v, A(y), A(y), is_causal=True)),
        "sdpa_mask": (n == 4 and real, lambda v, A: F.scaled_dot_product_attention(v, A(y), v, attn_mask=A(sdpa_mask))),
        "sdpa_gqa": (n == 4 and real and x.shape[1] % 2 == 0 and x.shape[1] > 0,
                     lambda v, A: F.scaled_dot_product_attention(v, A(y)[:, ::2], A(y)[:, 1::2], enable_gqa=True)),
        "ce_smooth": (n in (1, 2) and real, None),
        "ce_ignore": (n in (2, 3) and real, None),
        "embedding_pad": (n == 2 and real and x.shape[0] > 0, None),
        "rope_complex": (n > 0 and fl and last % 2 == 0, lambda v, A: rope(v)),
        "rotate_half": (n > 0 and real and last % 2 == 0, lambda v, A: rotate_half(v)),
        "repeat_kv": (n == 4, lambda v, A: v[:, :, None].expand(v.shape[0], v.shape[1], 2, *v.shape[2:]).reshape(
            v.shape[0], v.shape[1] * 2, *v.shape[2:])),
        "causal_softmax": (n >= 2 and real, lambda v, A: causal(v)),
        "masked_softmax": (n > 0 and real, lambda v, A: v.masked_fill(A(mk), torch.finfo(v.dtype).min).softmax(-1)),
        # (upcasts: 16-bit to float32 only, as model code does; float64 stays, its tolerance is float64's)
        "rmsnorm": (n > 0 and real, lambda v, A: (up(v) * torch.rsqrt(up(v).pow(2).mean(-1, keepdim=True) + 1e-6))
                    .to(v.dtype) * A(y)),
        "silu_mul": (real, lambda v, A: F.silu(v) * A(y)),
        "moe_route": (n > 0 and real and last > 0, lambda v, A: moe(v)),
        "upcast_softmax": (n > 0 and real, lambda v, A: up(v).softmax(-1).to(v.dtype)),
        "arange_add": (n > 0 and num and x.dtype != torch.bool, lambda v, A: v + torch.arange(last).to(v.dtype)),
        "type_as": (True, lambda v, A: v.type_as(A(o)) + A(o) if o_dt != torch.bool else v.type_as(A(o))),
        "einsum_attn": (n == 4 and num and x.dtype != torch.bool, lambda v, A: torch.einsum("bhqd,bhkd->bhqk", v, A(y))),
        "max_idx": (n > 0 and size > 0 and not cplx and num, lambda v, A: v.max(dd)[1]),
        "where_finfo": (real, lambda v, A: torch.where(A(mk), v, torch.finfo(v.dtype).min)),
        "cumsum_positions": (n > 0, lambda v, A: (v != 0).long().cumsum(-1) - 1),
        "dropout_eval": (real, lambda v, A: F.dropout(v, 0.5, training=False)),
        "clamp_min": (real or intg, lambda v, A: v.clamp_min(0.5 if real else 1)),
        "pow_half": (real, lambda v, A: v.abs().pow(0.5)),
        "norm_keep": (n > 0 and (real or cplx), lambda v, A: v.norm(dim=-1, keepdim=True)),
        "mean_neg": (n > 0 and (real or cplx), lambda v, A: v.mean(-1, keepdim=True)),
    }
    ok, f = fns[name]
    if not ok:
        return None
    desc = f"{name}(d={d}, k={k}, y={y.desc}, o={o.desc}, mask={mk.desc}, idx={ii.plain.tolist()} {ii.desc})"
    if f is not None:
        return Step(name, f, desc, mutates=name.endswith("_") or name.startswith("setitem") or name == "out_add")
    if name == "scatter_":
        gi = c.aux(torch.randint(0, hi, tuple(x.shape), generator=c.gen))
        return Step(name, inplace(lambda w, A: w.scatter_(dd, A(gi), A(y))), f"scatter_(d={dd}, {gi.desc}, src={y.desc})",
                    mutates=True)
    if name == "index_add_":
        m = c.ch.integer(0, 3)
        jj = c.aux(torch.randint(0, hi, (m,), generator=c.gen))
        src = c.aux(make_tensor([*x.shape[:dd], m, *x.shape[dd + 1:]], x.dtype, c.gen))
        return Step(name, lambda v, A: then(lambda z: z.index_add_(dd, A(jj), A(src)))(torch.zeros_like(v)) + v,
                    f"zeros_like(x).index_add_(d={dd}, idx={jj.plain.tolist()} {jj.desc}, src={src.desc}) + x", mutates=True)
    if name == "ce_smooth":
        ncls = x.shape[-1]
        t = c.aux(torch.randint(0, max(ncls, 1) + (1 if c.ch.chance(0.1) else 0), x.shape[:-1], generator=c.gen))
        smooth = 0.1 * (k + 1)
        return Step(name, lambda v, A: F.cross_entropy(v, A(t), label_smoothing=smooth),
                    f"cross_entropy(target={t.plain.tolist()} {t.desc}, label_smoothing={smooth:.1f})")
    if name == "ce_ignore":
        ncls = x.shape[1]
        tshape = (x.shape[0], *x.shape[2:])
        tt = torch.randint(0, max(ncls, 1), tshape, generator=c.gen)
        tt = torch.where(torch.rand(tshape, generator=c.gen) > 0.6, -100, tt)
        t = c.aux(tt)
        red = ["mean", "sum", "none", "mean"][k]
        return Step(name, lambda v, A: F.cross_entropy(v, A(t), ignore_index=-100, reduction=red),
                    f"cross_entropy(target={t.plain.tolist()} {t.desc}, ignore_index=-100, reduction={red})")
    if name == "embedding_pad":
        jj = c.aux(torch.randint(0, x.shape[0], (c.ch.integer(1, 3), 2), generator=c.gen))
        pad = c.ch.integer(0, x.shape[0] - 1)
        return Step(name, lambda v, A: F.embedding(A(jj), v, padding_idx=pad),
                    f"embedding(x as weight, idx={jj.plain.tolist()} {jj.desc}, padding_idx={pad})")
    return None


@op("smap3", since=3)
def smap3(c: Ctx, x: torch.Tensor) -> Step | None:
    """Generator 3: shard_map in its other spellings (in_specs=None, axis_names subsets, smap,
    local_map, check_vma=False, pcast, all_gather_invariant, nested bodies, axis_size, pmean/pmin,
    untiled psum_scatter, all_to_all), each with its closed form on the plain tensor."""
    mesh, n = c.mesh, x.dim()
    if not n:
        return None
    d, a, size, even, spec_d, rep, smap = smap_draw(c, x)
    name = c.ch.choice(["in_specs_none", "axis_names", "sf_smap", "local_map", "no_vma", "pcast", "ag_invariant",
                        "nested", "axis_size", "pmean", "pmin", "psum_scatter_untiled", "all_to_all", "psum_tuple",
                        "ppermute_partial", "gather_untiled"])
    flt, cplx = x.dtype.is_floating_point, x.dtype.is_complex
    desc = f"smap3_{name}(axis={a!r}, dim={d})"

    def step(g: Callable, ref: Callable, extra: str = "") -> Step:
        return Step("smap3_" + name, lambda v, A: g(v) if isinstance(v, sf.ShardedArray) else ref(v), desc + extra)

    if name == "in_specs_none" and (flt or cplx):
        def g(v: Any) -> Any:
            return sf.shard_map(lambda b: b * 3, mesh=mesh, in_specs=None, out_specs=v.spec)(v)
        return step(g, lambda v: v * 3)
    if name == "axis_names" and mesh.ndim >= 2 and _num(x.dtype) and x.dtype != torch.bool:
        def g(v: Any) -> Any:  # manual over a only: the body sees arrays over the other axes
            v = sf.reshard(v, spec_d)
            return sf.shard_map(lambda b: sf.lax.psum(b.sum(d, keepdim=True), a), mesh=mesh, in_specs=spec_d,
                                out_specs=rep, axis_names={a})(v)
        return step(g, lambda v: v.sum(d, keepdim=True))
    if name == "sf_smap" and even and (flt or cplx):
        def g(v: Any) -> Any:
            return sf.smap(lambda b: b.sin() if flt else b * 2, in_axes=d, out_axes=d, axis_name=a, mesh=mesh)(v)
        return step(g, lambda v: v.sin() if flt else v * 2)
    if name == "local_map" and flt:
        def g(v: Any) -> Any:
            return sf.local_map(lambda b: b.exp(), v.spec, in_specs=(v.spec,), mesh=mesh)(v) if not getattr(
                v.spec, "partial", None) else v.exp()
        return step(g, lambda v: v.exp())
    if name == "no_vma" and even and _num(x.dtype):
        g = smap(lambda b: b * 2 if x.dtype != torch.bool else b, spec_d)

        def g2(v: Any) -> Any:
            v = sf.reshard(v, spec_d)
            return sf.shard_map(lambda b: b.flip(d), mesh=mesh, in_specs=(spec_d,), out_specs=spec_d, check_vma=False)(v)
        blk = x.shape[d] // size
        return step(g2, lambda v: torch.cat([t.flip(d) for t in torch.split(v, blk, d)], d) if blk else v.clone())
    if name == "pcast" and (flt or cplx):
        def body(b: Any) -> Any:
            return sf.lax.pcast(b.sum(d, keepdim=True), a, to="varying")
        g = smap(body, P(*[a if i == d else None for i in range(n)]), rep)
        return step(g, lambda v: torch.cat([v.sum(d, keepdim=True)] * size, d))
    if name == "ag_invariant" and even:
        g = smap(lambda b: sf.lax.all_gather_invariant(b, a, axis=d, tiled=True), rep)
        return step(g, lambda v: v.clone())
    if name == "nested" and mesh.ndim >= 2 and (flt or cplx):
        other = [o for o in mesh.axis_names if o != a][0]

        def g(v: Any) -> Any:
            v = sf.reshard(v, spec_d)
            inner = lambda b: sf.shard_map(lambda t: t * 2, mesh=mesh, in_specs=(P(),), out_specs=P(),  # noqa: E731
                                           axis_names={other})(b)
            return sf.shard_map(inner, mesh=mesh, in_specs=(spec_d,), out_specs=spec_d, axis_names={a})(v)
        return step(g, lambda v: v * 2)
    if name == "axis_size" and _num(x.dtype) and x.dtype != torch.bool:
        g = smap(lambda b: b * sf.lax.axis_size(a), spec_d)
        return step(g, lambda v: v * size)
    if name == "pmean" and (flt or cplx) and x.shape[d] > 0 and even:
        g = smap(lambda b: sf.lax.pmean(b.mean(d, keepdim=True), a), rep)
        return step(g, lambda v: v.mean(d, keepdim=True))
    if name == "pmin" and flt and x.shape[d] > 0 and even:
        g = smap(lambda b: sf.lax.pmin(b.amin(d, keepdim=True), a), rep)
        return step(g, lambda v: v.amin(d, keepdim=True))
    if name == "psum_scatter_untiled" and _num(x.dtype) and x.dtype != torch.bool and x.shape[d] == size:
        g = smap(lambda b: sf.lax.psum_scatter(b, a, scatter_dimension=d, tiled=False).unsqueeze(d), spec_d, rep)
        return step(g, lambda v: _copies_sum(v, size))
    if name == "all_to_all" and n >= 2 and even:
        g, e = all_to_all_body(c, smap, a, d, tuple(x.shape), size)
        return None if g is None else step(g, lambda v: v.clone(), f" split={e}")
    if name == "psum_tuple" and mesh.ndim >= 2 and _num(x.dtype) and x.dtype != torch.bool:
        both = P(*[tuple(mesh.axis_names) if i == d else None for i in range(n)])
        g = smap(lambda b: sf.lax.psum(b.sum(d, keepdim=True), tuple(mesh.axis_names)), rep, both)
        return step(g, lambda v: v.sum(d, keepdim=True))
    if name == "ppermute_partial" and even and size >= 2 and _num(x.dtype):
        perm = [(0, size - 1)]  # devices no one sends to get zeros
        blk = x.shape[d] // size

        def ref(v: torch.Tensor) -> torch.Tensor:
            parts = [torch.zeros_like(t) for t in torch.split(v, blk, d)] if blk else [v.clone()]
            if blk:
                parts[size - 1] = torch.split(v, blk, d)[0].clone()
            return torch.cat(parts, d)
        return step(smap(lambda b: sf.lax.ppermute(b, a, perm), spec_d), ref)
    if name == "gather_untiled" and even and x.shape[d] > 0:
        blk = x.shape[d] // size
        g = smap(lambda b: sf.lax.all_gather(b, a, axis=0), P(*([None] * (n + 1))))
        return step(g, lambda v: torch.stack(torch.split(v, blk, d)))
    return None


# -- cases ----------------------------------------------------------------------------------------


@dataclass
class Case:
    seed: int | None
    mesh_shape: tuple
    x: torch.Tensor
    spec: P
    steps: list[Step]
    mode: str  # "value", "grad", "func_grad", "jvp", "vjp", "vmap", "vmap_last", "vmap_grad", "compile", "compile_dynamic"
    lines: list[str] = field(default_factory=list)
    loosest: torch.dtype | None = None  # the least precise dtype along the program (tolerances)

    def describe(self) -> str:
        special = " (specials)" if _special(self.x) else ""
        head = f"mesh {self.mesh_shape}, x {_dt(self.x.dtype)}{list(self.x.shape)}{special} {self.spec}, mode {self.mode}"
        return "\n".join([head] + [f"  {i}. {s.desc}" for i, s in enumerate(self.steps)])


MODES = ("value", "grad", "func_grad", "jvp", "vjp", "vmap", "vmap_last", "vmap_grad", "compile", "compile_dynamic",
         "vmap_mid", "jacrev", "jacfwd", "hessian", "vmap_sharded", "compile_marked")


def draw_case(ch: Chooser, seed: int | None = None, *, compile_rate: float = 0.0,
              mesh_shapes: Sequence[tuple] | None = None, backend: str = "local",
              modes: Sequence[str] | None = None, version: int = GEN,
              families: Sequence[str] | None = None) -> Case:
    """A random program; ``mesh_shapes`` and ``backend`` pick its mesh (``tools/fuzz_dist.py``
    draws the same program on a 4-rank dist mesh and on its local twin); ``modes`` (default:
    all, compiled ones at ``compile_rate``) restricts how it runs to those of them the program
    allows ("value" where none does); ``version`` is the generator's (``GEN``: older seeds
    replay under the version that found them)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else ch.integer(0, 2**31))
    mshape = ch.choice(mesh_shapes or (MESH_SHAPES_5 if version >= 5 else MESH_SHAPES_3 if version >= 3
                                       else MESH_SHAPES_2 if version >= 2 else MESH_SHAPES))
    mesh = sf.Mesh(mshape, NAMES[: len(mshape)], backend=backend)
    ndim = ch.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])
    shape = tuple(ch.choice(SIZES_3 if version >= 3 else SIZES_2 if version >= 2 else SIZES) for _ in range(ndim))
    dtype = ch.choice(DTYPES_5 if version >= 5 else DTYPES)
    x = make_tensor(shape, dtype, gen)
    # pending sums of random parts: in 16-bit floats the parts' rounding alone exceeds any tolerance
    spec = draw_spec(ch, mesh, ndim, partial=dtype not in (torch.bool, torch.float16, torch.bfloat16) and ch.chance(0.3))
    if getattr(spec, "partial", None):
        x = on_grid(x)
    elif version >= 4 and x.numel() and (x.dtype.is_floating_point or x.dtype.is_complex) and ch.chance(0.3):
        x = sprinkle(ch, x)
    ctx = Ctx(ch, mesh, gen, version=version)
    steps: list[Step] = []
    meta = x
    loosest = x.dtype  # the least precise dtype the program computes in: its rounding bounds the agreement
    for _ in range(ch.integer(1, 4)):
        if meta.numel() > MAX_NUMEL:
            break  # the chain ends where its value grew too large to check in reasonable time
        family = ch.choice(sorted({f for f, _ in OPS.values() if SINCE.get(f, 1) <= version
                                   and (families is None or f in families)}))
        makers = [m for f, m in OPS.values() if f == family]
        st = ch.choice(makers)(ctx, meta)
        if st is None or meta.numel() > SIZED_FROM and _step_numel(st, meta) > STEP_NUMEL:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = st.fn(meta, lambda a: a.plain)
        except Exception:  # noqa: BLE001 - torch raises here: the chain ends with this step
            steps.append(st)
            break
        if not isinstance(out, torch.Tensor):
            break
        if out.numel() > STEP_NUMEL:
            continue  # a step fake tensors could not size (data-dependent shapes) grew past the cap
        meta = out
        steps.append(st)
        loosest = _looser(loosest, meta.dtype)
        if st.undo is not None:
            break
    grads = x.dtype in (torch.float64, torch.complex128) and not (getattr(spec, "partial", None))
    choices = ["value"] * 5 + (["grad", "grad", "func_grad", "jvp", "vjp"] if grads else [])
    choices += ["vmap"] if not getattr(spec, "partial", None) else []
    if version >= 2 and backend == "local" and not getattr(spec, "partial", None):
        choices += ["vmap_last"] + (["vmap_grad"] if grads else [])
    if version >= 3 and backend == "local" and not getattr(spec, "partial", None):
        choices += ["vmap_mid"] + (["jacrev", "jacfwd", "hessian"] if grads else [])
    if version >= 5 and backend == "local" and not getattr(spec, "partial", None):
        choices += ["vmap_sharded"]
    modes_here = set(choices)
    mode = ch.choice(choices)
    if compile_rate and ch.chance(compile_rate):
        mode = ch.choice(["compile", "compile_dynamic"] + (["compile_marked"] if version >= 5 else []))
    if modes is not None and mode not in modes:
        allowed = [m for m in modes if m in modes_here or m.startswith("compile")]
        mode = ch.choice(allowed) if allowed else "value"
    return Case(seed, mshape, x, spec, steps, mode, loosest=loosest)


class _Sizes(TorchDispatchMode):
    """The largest output (in elements) of the ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def _step_numel(st: Step, meta: torch.Tensor) -> int:
    """The most elements any tensor of step ``st`` on ``meta`` holds, sized on fake tensors (no
    memory); 0 where it cannot be sized so (data-dependent shapes: nonzero, unique, ``.item()``),
    whose outputs are no larger than their input's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sizes, log = _Sizes(), logging.getLogger("torch._subclasses.fake_tensor")  # it logs each meta kernel's error
    was, log.disabled = log.disabled, True  # (a level set directly would meet isEnabledFor's cache)
    try:
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True), sizes:
            warnings.simplefilter("ignore")
            st.fn(meta, lambda a: a.plain)
    except Exception:  # noqa: BLE001 - torch raises (or cannot size it): the real run decides
        pass
    finally:
        log.disabled = was
    return sizes.most


def _looser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """Of two dtypes, the one with the looser comparison tolerance (floating ones only count)."""
    if not (b.is_floating_point or b.is_complex):
        return a
    return b if _tolerance(b)["atol"] > _tolerance(a)["atol"] else a


def _tolerance(dtype: torch.dtype) -> dict:
    if dtype in (torch.float16, torch.bfloat16):
        return dict(rtol=2e-2, atol=5e-2)
    if dtype in (torch.float32, torch.complex64):
        return dict(rtol=1e-4, atol=1e-4)
    return dict(rtol=1e-7, atol=1e-7)


class Mismatch(AssertionError):
    pass


def _compare(got: Any, ref: Any, what: str, input_dtype: torch.dtype,
             inverse: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """``got`` against torch's ``ref``; ``inverse``: the last step's (``Step.inverse``), for values."""
    if isinstance(ref, (tuple, list)):
        for i, (g, r) in enumerate(zip(got, ref)):
            _compare(g, r, f"{what}[{i}]", input_dtype, inverse)
        return
    if not isinstance(ref, torch.Tensor):
        if got != ref:
            raise Mismatch(f"{what}: {got!r} != {ref!r}")
        return
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: got {type(got).__name__}, torch gives a tensor")
    if isinstance(got, sf.ShardedArray):
        got = got.full_tensor()
    if got.dtype != ref.dtype:
        raise Mismatch(f"{what}: dtype {got.dtype} != torch's {ref.dtype}")
    if tuple(got.shape) != tuple(ref.shape):
        raise Mismatch(f"{what}: shape {tuple(got.shape)} != torch's {tuple(ref.shape)}")
    # the loosest of the input's and the result's precision (a float16 product stays rounded in float64)
    tols = [_tolerance(input_dtype), _tolerance(ref.dtype)]
    tol = max(tols, key=lambda t: t["atol"])
    if not (ref.dtype.is_floating_point or ref.dtype.is_complex):
        if input_dtype in (torch.float16, torch.bfloat16, torch.float32, torch.complex64):
            return  # rounding of the inputs decides integer results (argmax, casts, comparisons)
        tol = dict(rtol=0, atol=0)
    if ref.is_complex() and got.is_complex() and not bool(torch.isfinite(ref).all()):
        # |a - b| of complex values with an infinite component is nan: compare the components
        # (seed 35001673, --gen 4: -inf + 0.52...13j against -inf + 0.52...12j)
        got, ref = torch.view_as_real(got.detach().resolve_conj()), torch.view_as_real(ref.detach().resolve_conj())
        # an entry non-finite in both with a nan component in either: products of infinite
        # complex values are kernel-dependent (torch's own matmul gives -inf+infj for one shape
        # and nan+nanj for a slice of it; seed 50001804 --gen 5 --families model)
        loose = (~torch.isfinite(got).all(-1) & ~torch.isfinite(ref).all(-1)
                 & (torch.isnan(got).any(-1) | torch.isnan(ref).any(-1))).unsqueeze(-1)
        got, ref = got.masked_fill(loose, 0), ref.masked_fill(loose, 0)
    try:
        torch.testing.assert_close(got.detach(), ref.detach(), equal_nan=True, check_dtype=False, **tol)
    except AssertionError as e:
        rtol = 6e-2 if torch.bfloat16 in (input_dtype, ref.dtype) else 2e-2  # ~15 rounding units of each
        if _half(input_dtype, ref.dtype) and _normwise_close(got.detach(), ref.detach(), rtol):
            return
        if _half(input_dtype, ref.dtype) and inverse is not None and _normwise_close(
                inverse(got.detach()), inverse(ref.detach()), rtol):
            return
        raise Mismatch(f"{what}: {str(e).splitlines()[0]} ({'; '.join(str(e).splitlines()[1:4])})") from None


def _half(*dtypes: torch.dtype) -> bool:
    return any(d in (torch.float16, torch.bfloat16, torch.complex32) for d in dtypes)


def _same_non_finite(got: torch.Tensor, ref: torch.Tensor, fin: torch.Tensor) -> bool:
    """``got`` is non-finite where ``ref`` is (``fin``: ``ref``'s finite mask), with the same inf / nan."""
    return torch.equal(fin, torch.isfinite(got)) and torch.equal(ref[~fin].nan_to_num(), got[~fin].nan_to_num())


def _normwise_close(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> bool:
    """16-bit floats: a split contraction rounds each partial sum to 16 bits before adding them
    (torch's one kernel accumulates in float32), so an element that cancels (small against its
    terms) may differ by far more than its own size; compare the whole value's error against its
    size instead (as low-precision matmul tests do), with the same non-finite entries."""
    g, r = got.to(torch.complex128 if got.is_complex() else torch.float64), ref.to(
        torch.complex128 if ref.is_complex() else torch.float64)
    fin = torch.isfinite(r)
    if not _same_non_finite(g, r, fin):
        return False
    return bool(torch.linalg.vector_norm(g[fin] - r[fin]) <= rtol * torch.linalg.vector_norm(r[fin]))


def _compare_grad(g: torch.Tensor, ref: torch.Tensor, case: Case, prec: torch.dtype, what: str = "grad") -> None:
    """An autograd gradient against torch's, where torch has two answers. Several of torch's
    backward formulas take another branch for subclass-like tensors (ShardedArray, DTensor,
    functorch's wrappers) and for CUDA tensors: ``evenly_distribute_backward`` (``max()``,
    ``min()``, ``median()``) gives ``mask * (grad / count)``, nan off the selected elements
    when ``grad`` is not finite, where the plain CPU branch fills zeros around them; ``prod``'s
    backward always takes its zero-safe path (other values where the input holds inf or nan).
    ``torch.func.grad`` of the same plain program runs that branch: a gradient equal to either
    of torch's answers agrees with torch."""
    try:
        _compare(g, ref, what, prec)
    except Mismatch as plain_branch:
        try:
            alt = torch.func.grad(lambda v: _scalar_loss(_chain(case.steps, v, lambda a: a.plain)))(case.x)
            _compare(g, alt, what, prec)
        except Exception:  # noqa: BLE001 - neither answer (or torch.func cannot run the program)
            if not _close_to_the_largest(g, ref):
                raise plain_branch from None


def _close_to_the_largest(got: torch.Tensor, ref: torch.Tensor, units: int = 64) -> bool:
    """Double-precision values whose every error is a few rounding units of the largest element
    (the normwise bound of a matrix computation), with the same non-finite entries. A gradient
    spanning 1e17 to 1e-3 (QR of a wide complex matrix, then std and pow: seed 5845060164
    --modes compile,...) holds small elements made by cancelling terms of 1e15: another
    (equally exact) order of the sums moves them by 0.05, far past an elementwise tolerance."""
    if isinstance(got, sf.ShardedArray):
        got = got.full_tensor()
    if ref.dtype not in (torch.float64, torch.complex128) or got.dtype != ref.dtype or got.shape != ref.shape:
        return False
    got, ref = got.detach(), ref.detach()
    fin = torch.isfinite(ref)
    if not _same_non_finite(got, ref, fin):
        return False
    if not bool(fin.any()):
        return True
    scale = ref[fin].abs().max()
    return bool((got[fin] - ref[fin]).abs().max() <= units * torch.finfo(torch.float64).eps * scale)


def _compare_either(got: Any, ref: Any, alt: Callable[[], Any], what: str, prec: torch.dtype) -> None:
    """A reverse-mode result (``vjp``, ``jacrev``) against torch's, where torch has two answers (see
    ``_compare_grad``): ``alt`` runs the same plain program by ``torch.func.grad``, whose wrapped
    input is subclass-like, so torch takes the branch ShardedArrays always take (seed 5770475284
    --gen 4: ``jacrev`` of ``prod`` of ``[inf]`` is nan by torch's ``grad * result / input`` on a
    plain tensor and 1 by its zero-safe path)."""
    try:
        _compare(got, ref, what, prec)
    except Mismatch as plain_branch:
        try:
            _compare(got, alt(), what, prec)
        except Exception:  # noqa: BLE001 - neither answer (or torch.func cannot run the program)
            raise plain_branch from None


def _grad_rows(case: Case, cts: torch.Tensor) -> torch.Tensor:
    """``v -> Re(conj(ct) . f(v))`` differentiated by ``torch.func.grad`` for each row of ``cts``:
    torch's other branch of a vector-Jacobian product, one row at a time (complex outputs too:
    that real part's gradient is torch's vjp; a complex sum was no loss, so vjp of a complex
    ``prod`` had only the plain branch to match, seed 5792283956 --gen 5)."""
    f = lambda v: _chain(case.steps, v, lambda a: a.plain)  # noqa: E731
    return torch.stack([torch.func.grad(lambda v, c=c: (f(v).reshape(-1) * c.reshape(-1).conj()).sum().real)(case.x)
                        for c in cts])


# steps whose torch CPU kernel misreads an input with a dim of stride 0 (an ``expand``): median
# and nanmedian along such a dim give values from other positions (``x.expand(3, 9).median(0)``
# is not ``x``; torch 2.13; kthvalue, mode, sort and the all-dims overloads read it right). The
# plain program takes their input contiguous, torch's own value for it (seed 5829536839)
_MISREAD_STRIDE_0 = frozenset({"median_dim", "nanmedian"})
# torch's CPU matrix_exp views its input as a batch of matrices (``view(-1, n, n)``) and raises
# "view size is not compatible" for batch dims in another order (a rot90 over a batch dim and
# a matrix dim, then a product: seed 5847902119); shardfn's per-device kernels compute it
_RAISES_ON_BATCH_STRIDES = frozenset({"matrix_exp"})
_CONTIGUOUS_FOR_TORCH = _MISREAD_STRIDE_0 | _RAISES_ON_BATCH_STRIDES
_PLAIN_PROBE = Aux(plain=True, sharded=False)


def _run_step(s: Step, v: Any, lift: Callable[[Aux], Any]) -> Any:
    # (the plain program is the one that lifts auxiliaries to their plain tensors)
    if s.name in _CONTIGUOUS_FOR_TORCH and lift(_PLAIN_PROBE) is True:
        v = v.contiguous()
    return s.fn(v, lift)


def _chain(steps: list[Step], v: Any, lift: Callable[[Aux], Any]) -> Any:
    for s in steps:
        v = _run_step(s, v, lift)
    return v


def _scalar_loss(out: torch.Tensor) -> torch.Tensor:
    if out.is_complex():
        out = torch.view_as_real(out)
    return (out * out).sum() if out.dtype.is_floating_point else out.sum() * 0.0


def run_case(case: Case, mesh: sf.Mesh | None = None) -> str | None:
    """None when shardfn agrees with torch, else what differs."""
    res = _run_case(case, mesh)
    if res is not None and _oracle_unsettled(case):
        return None  # torch's value is not one value: nothing to compare with
    return res


def _oracle_unsettled(case: Case) -> bool:
    """Whether torch's program on the plain input gives values beyond the tolerance apart when
    glibc fills fresh allocations with one byte, then another (``mallopt(M_PERTURB)``): a kernel
    returning its output unwritten (multi_margin_loss of an empty batch, seed 5788801577) has no
    value shardfn could match. False where glibc's malloc is not there to ask."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for byte in (0x11, 0x7C):
            if not mallopt(-6, byte):  # M_PERTURB
                return False
            try:
                outs.append(_chain(case.steps, case.x, lambda a: a.plain))
            except Exception:  # noqa: BLE001 - raising is settled
                return False
            finally:
                mallopt(-6, 0)
    try:
        _compare(outs[1], outs[0], "torch again", case.loosest or case.x.dtype)
    except Mismatch:
        return True
    return False


def _run_case(case: Case, mesh: sf.Mesh | None = None) -> str | None:
    mesh = mesh or sf.Mesh(case.mesh_shape, NAMES[: len(case.mesh_shape)], backend="local")
    plain = lambda a: a.plain  # noqa: E731
    shard = lambda a: a.sharded  # noqa: E731
    x = case.x
    prec = case.loosest or x.dtype  # tolerances: a float64 input computed in float16 carries float16's rounding
    gen = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = _chain(case.steps, x, plain)
            ref_err = None
        except Exception as e:  # noqa: BLE001
            ref, ref_err = None, e
        try:
            X = lay_out(x, case.spec, mesh, gen)
        except Exception as e:  # noqa: BLE001
            return f"laying out the input raised {type(e).__name__}: {e}"
        run = case.mode
        if (
            ref_err is not None
            or not isinstance(ref, torch.Tensor)
            or not ref.dtype.is_floating_point
            and run in ("grad", "func_grad", "vmap_grad")
            or not (ref.dtype.is_floating_point or ref.dtype.is_complex)
            and run in ("jvp", "vjp")
        ):
            run = "value" if run in ("grad", "func_grad", "jvp", "vjp", "vmap", "vmap_last", "vmap_grad", "vmap_mid",
                                     "jacrev", "jacfwd", "hessian", "vmap_sharded") else run
        if run in ("jacrev", "jacfwd", "hessian") and (
            not ref.dtype.is_floating_point or x.numel() > 48 or ref.numel() > 48 or x.dim() == 0 and run == "hessian"
        ):
            run = "func_grad" if ref.dtype.is_floating_point else "value"  # a Jacobian of that size: its gradient
        if run == "vmap_mid" and x.dim() == 0:
            run = "vmap"
        rg = None
        tan = make_tensor(tuple(x.shape), x.dtype, gen) if run in ("jvp", "vjp") else None
        ct = make_tensor(tuple(ref.shape), ref.dtype, gen) if run == "vjp" else None
        xb = None
        if run.startswith("vmap"):  # a batch of two: vmap_last batches the last dim (a dim behind the sharded ones)
            at = -1 if run == "vmap_last" else 1 if run == "vmap_mid" else 0
            xb = torch.stack([x, x * 2 if x.dtype != torch.bool else ~x], at)
        loss_of = lambda lift: lambda v: _scalar_loss(_chain(case.steps, v, lift))  # noqa: E731
        try:  # torch's transform first: where torch cannot transform the program, compare values only
            if run == "jvp":
                rg = torch.func.jvp(lambda v: _chain(case.steps, v, plain), (x,), (tan,))
            elif run == "vjp":
                rout, rfn = torch.func.vjp(lambda v: _chain(case.steps, v, plain), x)
                rg = (rout, rfn(ct)[0])
            elif run in ("vmap", "vmap_sharded"):
                rg = torch.func.vmap(lambda v: _chain(case.steps, v, plain))(xb)
            elif run == "vmap_last":
                rg = torch.func.vmap(lambda v: _chain(case.steps, v, plain), in_dims=-1)(xb)
            elif run == "vmap_grad":
                rg = torch.func.vmap(torch.func.grad(loss_of(plain)))(xb)
            elif run == "vmap_mid":
                rg = torch.func.vmap(lambda v: _chain(case.steps, v, plain), in_dims=1)(xb)
            elif run == "jacrev":
                rg = torch.func.jacrev(lambda v: _chain(case.steps, v, plain))(x)
            elif run == "jacfwd":
                rg = torch.func.jacfwd(lambda v: _chain(case.steps, v, plain))(x)
            elif run == "hessian":
                rg = torch.func.hessian(loss_of(plain))(x)
            elif run == "grad":
                xl = x.clone().requires_grad_()
                (rg,) = torch.autograd.grad(_scalar_loss(_chain(case.steps, xl, plain)), xl, allow_unused=True)
                rg = rg if rg is not None else torch.zeros_like(x)
            elif run == "func_grad":
                rg = torch.func.grad(lambda v: _scalar_loss(_chain(case.steps, v, plain)))(x)
        except Exception:  # noqa: BLE001
            run = "value"
        if xb is not None and run.startswith("vmap"):
            ex = (lambda v: _chain(case.steps, v, plain)) if run != "vmap_grad" else torch.func.grad(loss_of(plain))
            rg = _Either(rg, _per_example(rg, ex, xb, -1 if run == "vmap_last" else 1 if run == "vmap_mid" else 0, prec))
        got2, stage = None, ""
        try:
            if run == "value":
                got = _chain(case.steps, X, shard)
            elif run.startswith("compile"):
                # "compile": torch's default (static, then automatic dynamic sizes on a recompile)
                # "compile_marked": torch._dynamo.maybe_mark_dynamic on the input's dims of size >= 2
                torch._dynamo.reset()
                f = torch.compile(lambda v: _chain(case.steps, v, shard), backend="aot_eager",
                                  dynamic=True if run == "compile_dynamic" else None)
                got = f(_marked(X, x) if run == "compile_marked" else X)
                # the same value in another layout: the guards on the layout recompile the program
                X2 = _relaid(case, x, mesh)
                stage = "after a sharding change (recompiled) "
                got2 = f(_marked(X2, x) if run == "compile_marked" else X2) if X2 is not None else None
                stage = ""
            elif run == "grad":
                xs = x.clone().requires_grad_()
                got = _chain(case.steps, sf.distribute(xs, case.spec, mesh=mesh), shard)
                (g,) = torch.autograd.grad(_scalar_loss(got), xs, allow_unused=True)
                _compare_grad(g if g is not None else torch.zeros_like(x), rg, case, prec)
            elif run == "jvp":
                T = sf.distribute(tan, case.spec, mesh=mesh)
                got, gt = torch.func.jvp(lambda v: _chain(case.steps, v, shard), (X,), (T,))
                _compare(gt, rg[1], "jvp tangent", prec)
                _compare(got, rg[0], "jvp primal", prec)
            elif run == "vjp":
                got, gfn = torch.func.vjp(lambda v: _chain(case.steps, v, shard), X)
                _compare_either(gfn(ct)[0], rg[1], lambda: _grad_rows(case, ct[None]).reshape(x.shape), "vjp cotangent", prec)
            elif run == "vmap":
                XB = sf.distribute(xb, P(None, *tuple(case.spec)), mesh=mesh)
                got = torch.func.vmap(lambda v: _chain(case.steps, v, shard))(XB)
                _compare_vmap(case, got, rg, "vmap", prec, (XB, xb, 0))
                got = _chain(case.steps, X, shard)
            elif run == "vmap_last":
                XB = sf.distribute(xb, P(*tuple(case.spec), *([None] * (x.dim() - len(case.spec))), None), mesh=mesh)
                got = torch.func.vmap(lambda v: _chain(case.steps, v, shard), in_dims=-1)(XB)
                _compare_vmap(case, got, rg, "vmap(in_dims=-1)", prec, (XB, xb, -1))
                got = _chain(case.steps, X, shard)
            elif run == "vmap_sharded":
                # the batch dim split over a mesh axis the example's layout leaves free (if any)
                used = {a for e in case.spec for a in ((e,) if isinstance(e, str) else (e or ()))}
                free = [a for a in mesh.axis_names if a not in used]
                XB = sf.distribute(xb, P(free[0] if free else None, *tuple(case.spec)), mesh=mesh)
                got = torch.func.vmap(lambda v: _chain(case.steps, v, shard))(XB)
                _compare_vmap(case, got, rg, "vmap(batch sharded)", prec, (XB, xb, 0))
                got = _chain(case.steps, X, shard)
            elif run == "vmap_mid":
                ents = list(case.spec) + [None] * (x.dim() - len(case.spec))
                XB = sf.distribute(xb, P(ents[0], None, *ents[1:]), mesh=mesh)
                got = torch.func.vmap(lambda v: _chain(case.steps, v, shard), in_dims=1)(XB)
                _compare_vmap(case, got, rg, "vmap(in_dims=1)", prec, (XB, xb, 1))
                got = _chain(case.steps, X, shard)
            elif run in ("jacrev", "jacfwd", "hessian"):
                jf = {"jacrev": torch.func.jacrev, "jacfwd": torch.func.jacfwd}.get(run)
                jac = jf(lambda v: _chain(case.steps, v, shard))(X) if jf else torch.func.hessian(loss_of(shard))(X)
                if run == "jacrev":
                    _compare_either(jac, rg, lambda: _grad_rows(case, torch.eye(rg.numel() // max(x.numel(), 1), dtype=rg.dtype))
                                    .reshape(rg.shape), run, prec)
                else:
                    _compare(jac, rg, run, prec)
                got = _chain(case.steps, X, shard)
            elif run == "vmap_grad":
                XB = sf.distribute(xb, P(None, *tuple(case.spec)), mesh=mesh)
                g = torch.func.vmap(torch.func.grad(loss_of(shard)))(XB)
                try:
                    _compare(g, rg.batched, "vmap(grad)", prec)
                except Mismatch:
                    if rg.looped is None:
                        raise
                    _compare(g, rg.looped, "vmap(grad) (the per-example run)", prec)
                got = _chain(case.steps, X, shard)
            else:
                g = torch.func.grad(lambda v: _scalar_loss(_chain(case.steps, v, shard)))(X)
                _compare(g, rg, "func.grad", prec)
                got = _chain(case.steps, X, shard)
        except Mismatch as e:
            return str(e)
        except Exception as e:  # noqa: BLE001
            if ref_err is not None:
                return None  # both raise
            if run.startswith("compile") and _compiled_plain(
                    case.steps, x, run == "compile_dynamic", run == "compile_marked")[1] is not None:
                return None  # torch.compile fails on the plain program too
            if run.startswith("compile") and isinstance(e, sf.ImmutableError) and "torch.compile'd region returned" in str(e):
                # documented: a buffer made in a compiled region and written after a graph break is a
                # graph output, never fresh (API.md, immutability; seed 52000311 --gen 5 --families model)
                return None
            alt_err = _subclass_branch(case.steps, x)[1]
            if not stage and alt_err is not None and type(alt_err) is type(e):
                return None  # torch raises too on the branch ShardedArrays take (``_SubclassLike``)
            if not stage and _bare_branch_raises(case.steps, x, e):
                return None  # torch raises too on any tensor subclass (``_Bare``)
            return f"shardfn raised {stage}where torch did not: {type(e).__name__}: {str(e)[:300]}\n{_where(e)}"
        if ref_err is not None and run.startswith("compile"):
            # torch.compile on plain tensors skips some eager kernels' checks too (its decompositions:
            # an empty F.interpolate(mode="linear") returns): the oracle is then the compiled program
            ref, ref_err = _compiled_plain(case.steps, x, run == "compile_dynamic", run == "compile_marked")
        if ref_err is not None and not run.startswith("compile"):
            alt, alt_err = _subclass_branch(case.steps, x)
            if alt_err is None:  # torch computes on the branch ShardedArrays take (``_SubclassLike``)
                ref, ref_err = alt, None
        if ref_err is not None:
            return f"torch raised {type(ref_err).__name__}: {str(ref_err)[:200]}; shardfn returned {got!r}"[:600]
        raw_got, raw_ref = got, ref
        try:
            got, ref = _undone_pair(case, got, ref, "value")
        except Mismatch as e:
            return str(e)
        if run.startswith("compile"):
            bad = _compiled_grad(case, x, mesh, ref, prec, dynamic=True if run == "compile_dynamic" else None)
            if bad:
                return bad
        alt: list = []  # torch's compiled answer, once asked for

        def compiled_alt() -> Any:
            # torch.compile of the plain program is torch's other answer: its decompositions
            # differ from the eager kernels (complex pinv of a well-conditioned matrix: 0.39
            # apart, then divided into 2e7; seed 5805265943): shardfn's compiled program may
            # match either
            if not alt:
                alt.append(_compiled_plain(case.steps, x, run == "compile_dynamic", run == "compile_marked"))
            return alt[0]

        def either(value: Any, what: str, check: Callable[[Any, Any, str], None]) -> None:
            try:
                check(value, raw_ref, what)
            except Mismatch:
                if not run.startswith("compile") or compiled_alt()[1] is not None:
                    raise
                check(value, compiled_alt()[0], what + " (against torch's compiled program)")

        try:
            either(raw_got, "value", lambda g, r, w: _compare_program(
                case, g, r, w, prec, None if run.startswith("compile") else (X, x, None)))
            if got2 is not None:
                either(got2, f"value in layout {_relaid_spec(case, x, mesh)} (recompiled)",
                       lambda g, r, w: _compare(*_undone_pair(case, g, r, w), w, prec, _inverse(case)))
        except Mismatch as e:
            return str(e)
    return None


def _per_example(batched: Any, f: Callable[[torch.Tensor], Any], xb: torch.Tensor, at: int, prec: torch.dtype) -> Any:
    """``f`` run on each example and stacked (vmap's definition) where torch's ``vmap`` result
    ``batched`` disagrees with it, else None. torch's vmap is not always its definition: an op
    without a batching rule runs its kernel per example, and some kernels leave an output
    unwritten (``multi_margin_loss`` of an empty batch, seed 5784032229); some batching rules
    are wrong (``roll`` of a 0-d value rolls across the batch, seed 5794753488). Either answer is
    accepted (``_Either``): shardfn runs torch's batching rules, so it may match either."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    try:
        outs = [tree_flatten(f(xb.select(at, i))) for i in range(xb.shape[at])]
        looped = tree_unflatten([torch.stack(ls) for ls in zip(*(o[0] for o in outs))], outs[0][1])
    except Exception:  # noqa: BLE001 - not stackable: torch's vmap stays the oracle
        return None
    try:
        _compare(batched, looped, "torch's vmap against its per-example run", prec)
    except Mismatch:
        return looped
    except Exception:  # noqa: BLE001
        return None
    return None


class _Either:
    """A vmap mode's oracle: torch's vmap, or where that differs the per-example run."""

    def __init__(self, batched: Any, looped: Any) -> None:
        self.batched, self.looped = batched, looped


def _compare_vmap(case: "Case", got: Any, ref: "_Either", what: str, prec: torch.dtype, inputs: tuple) -> None:
    """``got`` against torch's vmap, else against the per-example run where that differs."""
    try:
        _compare_program(case, got, ref.batched, what, prec, inputs)
    except Mismatch:
        if ref.looped is None:
            raise
        _compare_program(case, got, ref.looped, what + " (the per-example run)", prec, inputs)


def _compare_program(case: Case, got: Any, ref: Any, what: str, prec: torch.dtype,
                     inputs: tuple[Any, torch.Tensor, int | None] | None = None) -> None:
    """The chain's result against torch's; where it misses the tolerance, ``inputs`` (the
    laid-out input, the plain one, vmap's ``in_dims`` or None) judge the chain step by step
    (``_steps_agree``)."""
    try:
        _compare(*_undone_pair(case, got, ref, what), what, prec, _inverse(case))
    except Mismatch:
        if inputs is None or len(case.steps) < 2 or not _steps_agree(case, *inputs):
            raise


def _chain_outputs(steps: list[Step], v: Any, lift: Callable[[Aux], Any]) -> tuple:
    """Every step's output along the chain."""
    outs = []
    for s in steps:
        v = _run_step(s, v, lift)
        outs.append(v)
    return tuple(outs)


def _steps_agree(case: Case, X: Any, x: torch.Tensor, in_dims: int | None) -> bool:
    """Whether each step of shardfn's chain agrees with torch's op run on shardfn's own input to
    that step (the oracle's tolerances, each step at its own dtypes). A program's rounding is
    legitimately another one where a contraction or sum is split (each device's partial sum
    rounded to the dtype before they are added: a 16-bit one an ulp or more off where its terms
    cancel, which ``_normwise_close`` accepts), and a later step can amplify that difference
    without bound (a negative power or a reciprocal of a small cancelled value; seed 5772895398:
    float16 ``x @ x.mT`` with the contraction split, 0.0039 against torch's 0.0043, then ``pow``
    by -1.8 gives 22672 against 19040). Torch's op given the same input amplifies it the same
    way, so the amplification is not shardfn's; a wrong step still misses against its own input.
    ``in_dims``: the chain ran under ``vmap`` (its outputs are batched at dim 0)."""
    shard, plain = (lambda a: a.sharded), (lambda a: a.plain)

    def call(f: Callable, v: Any, dims: int | None) -> Any:
        return f(v) if dims is None else torch.func.vmap(f, in_dims=dims)(v)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outs = call(lambda v: _chain_outputs(case.steps, v, shard), X, in_dims)
        except Exception:  # noqa: BLE001 - not the same program: no step-by-step verdict
            return False
        v, dims = x, in_dims
        for k, st in enumerate(case.steps):
            last = k == len(case.steps) - 1
            try:
                ref = call(lambda u, st=st: _run_step(st, u, plain), v, dims)
                got = outs[k]
                pair = _undone_pair(case, got, ref, st.name) if last else (got, ref)
                try:
                    _compare(*pair, f"step {k} ({st.name})", v.dtype, st.inverse if st.undo is None else None)
                except Mismatch:
                    if (last and st.undo is not None) or not _as_accurate(
                            got, ref, lambda u, st=st: call(lambda w: _run_step(st, w, plain), u, dims), v):
                        raise
            except Exception:  # noqa: BLE001 - a step torch cannot run on it, or one that misses
                return False
            if last:
                return True
            if not isinstance(got, torch.Tensor):
                return False
            v = (got.full_tensor() if isinstance(got, sf.ShardedArray) else got).detach()
            dims = None if in_dims is None else 0
    return True


def _as_accurate(got: Any, ref: Any, op: Callable[[torch.Tensor], Any], v: torch.Tensor) -> bool:
    """Whether a float16 / bfloat16 / float32 / complex64 step's result is as accurate as torch's own: both measured
    against the step run in float64 on the same input, shardfn's error (normwise) at most 4
    times torch's, with the same non-finite entries. A sum whose terms cancel (1e4 - 1e4 +
    small) is known to float32 only to eps times its terms, far past the tolerance on a small
    result; another summation order (a replicated value's rows reduced in the stacked
    simulation's layout, torch's kernel in its own) lands elsewhere within that error (seed
    5824103705 --gen 5: vmap(in_dims=-1) of a sum over 6 rows holding 2e4 and -2e4, -4.38477
    against torch's -4.38672, float64 -4.38581; seed 5836686776: a float16 kl_div summed over 5
    devices, parts 629.5 and -526, 13.875 against torch's 14.242, float64 13.305). False where
    the step has no float64 form."""
    narrow = (torch.float16, torch.bfloat16, torch.float32, torch.complex64)
    if v.dtype not in narrow or not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        return False
    if isinstance(got, sf.ShardedArray):
        got = got.full_tensor()
    if ref.dtype not in narrow or got.dtype != ref.dtype or got.shape != ref.shape:
        return False
    try:
        wide = op(v.to(torch.complex128 if v.is_complex() else torch.float64))
    except Exception:  # noqa: BLE001 - no float64 form of this step
        return False
    if not isinstance(wide, torch.Tensor) or wide.shape != ref.shape or wide.dtype not in (torch.float64, torch.complex128):
        return False  # (a step that casts back, type_as or .to: its float64 run is not wider)
    g, r, w = (t.detach().to(wide.dtype) for t in (got, ref, wide))
    fin = torch.isfinite(w) & torch.isfinite(r)
    if (not torch.equal(torch.isfinite(g), torch.isfinite(r)) or not torch.equal(fin, torch.isfinite(r))
            or not torch.equal(g[~fin].nan_to_num(), r[~fin].nan_to_num())):
        return False  # the same non-finite entries, as _normwise_close asks
    err_torch = torch.linalg.vector_norm(r[fin] - w[fin])
    return bool(err_torch > 0 and torch.linalg.vector_norm(g[fin] - w[fin]) <= 4 * err_torch)


def _inverse(case: Case) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The chain's last step's ``Step.inverse`` (values compared as its input where 16-bit rounding
    misses the tolerance); None after a bit reinterpretation (``undo``)."""
    last = case.steps[-1] if case.steps else None
    return last.inverse if last is not None and last.undo is None else None


def _undone_pair(case: Case, got: Any, ref: Any, what: str) -> tuple[Any, Any]:
    """A result and torch's as the chain's last step's source values (``Step.undo``: a bit
    reinterpretation of a float value is compared with the source's tolerance, as another
    summation order changes its low bits), after their own dtypes and shapes agree. A batched
    result's batch dim is its first, so its last dim is the example's."""
    undo = case.steps[-1].undo if case.steps else None
    if undo is None or not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return got, ref
    if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
        raise Mismatch(f"{what}: {got.dtype}{tuple(got.shape)} != torch's {ref.dtype}{tuple(ref.shape)}")
    return undo(got.full_tensor() if isinstance(got, sf.ShardedArray) else got), undo(ref)


def _compiled_grad(case: Case, x: torch.Tensor, mesh: sf.Mesh, ref: Any, prec: torch.dtype, dynamic: Any) -> str | None:
    """A real program's gradient through the compiled program (AOTAutograd's backward, its
    tangents' layouts) against torch's eager gradient; None when they agree or torch has none."""
    if (x.dtype not in (torch.float64, torch.complex128) or getattr(case.spec, "partial", None)
            or not isinstance(ref, torch.Tensor) or not ref.dtype.is_floating_point):
        return None
    try:
        xl = x.clone().requires_grad_()
        (rg,) = torch.autograd.grad(_scalar_loss(_chain(case.steps, xl, lambda a: a.plain)), xl, allow_unused=True)
    except Exception:  # noqa: BLE001 - torch cannot differentiate it: values only
        return None
    rg = rg if rg is not None else torch.zeros_like(x)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda v: _scalar_loss(_chain(case.steps, v, lambda a: a.sharded)), backend="aot_eager",
                          dynamic=dynamic)
        xs = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(sf.distribute(xs, case.spec, mesh=mesh)), xs, allow_unused=True)
        # torch's two answers, as in eager (torch.compile of the plain program takes the
        # subclass-like branch too: seed 5738218702, min() then std of one element, nan)
        _compare_grad(g if g is not None else torch.zeros_like(x), rg, case, prec, "compiled grad")
    except Mismatch as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        torch._dynamo.reset()
        try:  # torch.compile's own backward fails on some (an empty group_norm's decomposition divides by 0)
            xp = x.clone().requires_grad_()
            fp = torch.compile(lambda v: _scalar_loss(_chain(case.steps, v, lambda a: a.plain)), backend="aot_eager",
                               dynamic=dynamic)
            torch.autograd.grad(fp(xp), xp, allow_unused=True)
        except Exception:  # noqa: BLE001
            return None  # both raise
        return f"shardfn raised in a compiled backward where torch did not: {type(e).__name__}: {str(e)[:300]}\n{_where(e)}"
    return None


def _relaid_spec(case: Case, x: torch.Tensor, mesh: sf.Mesh) -> P:
    """Another layout for the case's input, drawn from its seed (a pending sum only where the
    input is on the grid, as the first one's)."""
    ch = Chooser(random.Random((case.seed or 0) * 7919 + 17))
    return draw_spec(ch, mesh, x.dim(), partial=bool(getattr(case.spec, "partial", None)))


def _relaid(case: Case, x: torch.Tensor, mesh: sf.Mesh) -> Any:
    """The input laid out as ``_relaid_spec`` says, or None where that is its layout already."""
    spec = _relaid_spec(case, x, mesh)
    if spec == case.spec and getattr(spec, "partial", None) == getattr(case.spec, "partial", None):
        return None
    return lay_out(x, spec, mesh, torch.Generator().manual_seed(11))


def _marked(v: Any, x: torch.Tensor) -> Any:
    """``v`` with ``torch._dynamo.maybe_mark_dynamic`` on the dims where ``x`` has 2 or more
    elements (Dynamo specializes sizes 0 and 1): traced with symbolic sizes from the first
    call. (Not the strict ``mark_dynamic``: shardfn specializes the sizes of uneven layouts,
    shard_map bodies and fallbacks, documented in docs/architecture.md, and Dynamo reports
    that as a ConstraintViolationError.)"""
    for i, s in enumerate(x.shape):
        if s >= 2:
            torch._dynamo.maybe_mark_dynamic(v, i)
    return v


def _compiled_plain(steps: list[Step], x: torch.Tensor, dynamic: bool,
                    marked: bool = False) -> tuple[Any, Exception | None]:
    """The program compiled as the ShardedArray one was, on the plain tensor: (value, None),
    or (None, what it raised)."""
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda v: _chain(steps, v, lambda a: a.plain), backend="aot_eager", dynamic=dynamic)
        return f(_marked(x.clone(), x) if marked else x), None
    except Exception as e:  # noqa: BLE001
        return None, e


class _SubclassLike(TorchDispatchMode):
    """A pass-through dispatch mode: while one is active torch's composites take the branch
    they take for subclass-like tensors (``isTensorSubclassLike``), as they do for every
    ShardedArray (``linalg.svdvals`` computes U and V too, and gesdd raises on a non-finite
    matrix where the values-only call returns nan: seed 5777989087 --modes
    jvp,jacfwd,hessian,vmap_grad; a plain input requiring grad raises the same)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


def _subclass_branch(steps: list[Step], x: torch.Tensor) -> tuple[Any, Exception | None]:
    """The plain program on torch's subclass-like branch (``_SubclassLike``): (value, None), or
    (None, what it raised)."""
    try:
        with _SubclassLike():
            return _chain(steps, x, lambda a: a.plain), None
    except Exception as e:  # noqa: BLE001
        return None, e


class _Bare(torch.Tensor):
    """A wrapper subclass with no behaviour of its own. Some composites branch on the tensor's
    own dispatch keys, which a mode cannot set: ``F.one_hot`` of a tensor with the Python key
    takes ``eq(x.unsqueeze(-1), arange(n))``, whose result's strides follow the input's where
    the eager kernel's are contiguous (so ``one_hot(x.t(), 6).view(-1)`` raises on every
    subclass, fake tensors included, but not on plain tensors: seed 5838865705)."""

    @staticmethod
    def __new__(cls, t: torch.Tensor) -> "_Bare":
        return torch.Tensor._make_wrapper_subclass(cls, t.shape, strides=t.stride(), storage_offset=t.storage_offset(),
                                                   dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)

    def __init__(self, t: torch.Tensor) -> None:
        self.inner = t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        import optree

        unwrap = lambda a: a.inner if isinstance(a, _Bare) else a  # noqa: E731
        out = func(*optree.tree_map(unwrap, args), **optree.tree_map(unwrap, kwargs or {}))
        return optree.tree_map(lambda o: _Bare(o) if type(o) is torch.Tensor else o, out)


def _bare_branch_raises(steps: list[Step], x: torch.Tensor, e: Exception) -> bool:
    """Whether the plain program on a ``_Bare`` input raises a type ``e`` is an instance of, with its message
    inside ``e``'s (shardfn quotes torch's message where torch's check fails on its shapes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _chain(steps, _Bare(x), lambda a: a.plain)
    except Exception as alt:  # noqa: BLE001
        return isinstance(e, type(alt)) and str(alt).split("\n")[0][:60] in str(e)
    return False


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "shardfn" in f.filename]
    f = (ours or tb)[-1]
    return f"  at {f.filename.split('/')[-1]}:{f.lineno} {f.name}"


def case_for_seed(seed: int, compile_rate: float = 0.0, modes: Sequence[str] | None = None,
                  version: int = GEN, families: Sequence[str] | None = None) -> Case:
    return draw_case(Chooser(random.Random(seed)), seed, compile_rate=compile_rate, modes=modes, version=version,
                     families=families)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: from the clock)")
    ap.add_argument("--replay", type=int, default=None, help="rerun one seed and print its trace")
    ap.add_argument("--gen", type=int, default=GEN, help=f"the generator version (default {GEN}; older seeds: theirs)")
    ap.add_argument("--compile", type=float, default=0.02, help="share of cases under torch.compile (0 to skip)")
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated run modes to keep (of {','.join(MODES)}; default: all); "
                         "a replay needs the run's --modes")
    ap.add_argument("--families", default=None,
                    help="comma-separated op families to draw from (default: all); a replay needs the run's --families")
    ap.add_argument("--max-print", type=int, default=40)
    ap.add_argument("--dist", action="store_true", help="4 gloo processes against the simulated mesh (tools/fuzz_dist.py)")
    ap.add_argument("--threads", type=int, default=0, help="programs in N threads at once (tools/fuzz_threads.py)")
    ap.add_argument("--cases", type=int, default=None, help="stop after this many cases (--dist, --threads)")
    a = ap.parse_args(argv)
    if a.dist or a.threads:  # modes of their own modules, which import this one as `fuzz`
        sys.modules.setdefault("fuzz", sys.modules[__name__])
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
        mode = __import__("fuzz_dist" if a.dist else "fuzz_threads")
        return mode.main(a)
    modes = None if a.modes is None else tuple(m.strip() for m in a.modes.split(",") if m.strip())
    bad = [m for m in modes or () if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown mode(s) {bad}; known: {', '.join(MODES)}")
    fams = None if a.families is None else tuple(f.strip() for f in a.families.split(",") if f.strip())
    known = sorted({f for f, _ in OPS.values()})
    if fams is not None and (not fams or any(f not in known for f in fams)):
        ap.error(f"--families: unknown or no family in {a.families!r}; known: {', '.join(known)}")
    again = (f" --modes {','.join(modes)}" if modes else "") + ("" if a.gen == GEN else f" --gen {a.gen}")
    again += f" --families {','.join(fams)}" if fams else ""
    again += f" --compile {a.compile}" if a.compile != ap.get_default("compile") else ""
    if a.replay is not None:
        case = case_for_seed(a.replay, a.compile, modes, a.gen, fams)
        print(case.describe())
        res = run_case(case)
        print(res or "ok")
        return 1 if res else 0
    seed = a.seed if a.seed is not None else int(time.time()) % 10_000_000 * 1000
    end = time.time() + a.minutes * 60
    runs, fails, kinds = 0, 0, {}
    while time.time() < end:
        try:
            case = case_for_seed(seed, a.compile, modes, a.gen, fams)
            res = run_case(case)
        except Exception as e:  # noqa: BLE001 - the harness itself must not stop the run
            res = f"harness error {type(e).__name__}: {e}"
            case = None
        runs += 1
        if res:
            fails += 1
            key = res.split(":")[0][:60] + " | " + (" > ".join(st.name for st in case.steps) if case else "")
            kinds[key] = kinds.get(key, 0) + 1
            if fails <= a.max_print:
                print(f"FAIL seed {seed}  (python tools/fuzz.py --replay {seed}{again})")
                print(case.describe() if case else "")
                print("  " + res.replace("\n", "\n  "), flush=True)
        seed += 1
    print(f"cases run: {runs}, failures: {fails}")
    for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {k}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
