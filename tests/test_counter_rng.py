"""Tests for shardfn.random.counter_rng (Philox-4x32-10 counter-based RNG)."""

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
rng = importlib.import_module("shardfn.random.counter_rng")



def _hex(words):
    return [f"{int(w.reshape(-1)[0]):08x}" for w in words]


def _signed64(u):
    return u - 2**64 if u >= 2**63 else u


def _bits(t):
    """Integer view of a tensor, for bit-for-bit comparison."""
    view = {
        torch.float32: torch.int32,
        torch.float64: torch.int64,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }.get(t.dtype)
    return t.view(view) if view is not None else t


def _assert_bit_equal(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


# --------------------------------------------------------------------------
# Known-answer tests (Random123 kat_vectors, philox4x32_10)
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ctr, key, expected",
    [
        ((0, 0, 0, 0), (0, 0), ["6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8"]),
        (
            (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
            (0xFFFFFFFF, 0xFFFFFFFF),
            ["408f276d", "41c83b0e", "a20bc7c6", "6d5451fd"],
        ),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            ["d16cfe09", "94fdcceb", "5001e420", "24126ea1"],
        ),
    ],
)
def test_philox_known_answers(ctr, key, expected):
    c0, c1, c2, c3 = ctr
    counter_lo = torch.tensor([_signed64(c0 | (c1 << 32))], dtype=torch.int64)
    out = rng.philox(key, counter_lo, counter_hi=c3, stream=c2)
    assert _hex(out) == expected
    for w in out:
        assert w.dtype == torch.int64


def test_philox_vectorised_matches_scalar_and_chunking():
    key = rng.key_from_seed(12345)
    n = 3 * rng._CPU_CHUNK + 17  # exercises the CPU chunked path
    ctr = torch.arange(n, dtype=torch.int64) * 7919 - 5
    full = rng.philox(key, ctr, counter_hi=3, stream=9)
    for i in [0, 1, rng._CPU_CHUNK - 1, rng._CPU_CHUNK, n - 1]:
        single = rng.philox(key, ctr[i : i + 1], counter_hi=3, stream=9)
        assert [int(w[i]) for w in full] == [int(w[0]) for w in single]
    for w in full:
        assert int(w.min()) >= 0 and int(w.max()) <= 0xFFFFFFFF


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------
def test_key_from_seed_edges():
    assert rng.key_from_seed(0) == (0, 0)
    assert rng.key_from_seed(2**64 - 1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert rng.key_from_seed(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError) as ei:
            rng.key_from_seed(bad)
        msg = str(ei.value)
        assert str(bad) in msg and "2**64-1" in msg
    with pytest.raises(TypeError):
        rng.key_from_seed(1.5)


def test_seed_extremes_sample():
    for seed in (0, 2**64 - 1):
        k = rng.key_from_seed(seed)
        u = rng.uniform(k, (1000,))
        assert u.shape == (1000,) and float(u.min()) >= 0 and float(u.max()) < 1
        z = rng.normal(k, (1000,), dtype=torch.float64)
        assert torch.isfinite(z).all()
    a = rng.uniform_bits(rng.key_from_seed(0), (64,))
    b = rng.uniform_bits(rng.key_from_seed(2**64 - 1), (64,))
    assert not torch.equal(a, b)


def test_different_keys_and_streams_differ():
    shape = (256,)
    base = rng.uniform_bits(rng.key_from_seed(1), shape)
    assert torch.equal(base, rng.uniform_bits(rng.key_from_seed(1), shape))  # deterministic
    for other in (rng.key_from_seed(2), rng.key_from_seed(2**32 + 1)):
        assert (rng.uniform_bits(other, shape) != base).float().mean() > 0.99
    assert (rng.uniform_bits(rng.key_from_seed(1), shape, stream=1) != base).float().mean() > 0.99


def test_split_and_fold_in():
    key = rng.key_from_seed(42)
    keys = rng.split(key, 8)
    assert len(keys) == 8 and len(set(keys)) == 8 and key not in keys
    assert keys == rng.split(key, 8)  # deterministic
    assert rng.split(key, 3) == keys[:3]  # prefix-stable
    assert rng.split(key, 0) == []
    for k in keys:
        assert all(isinstance(w, int) and 0 <= w <= 0xFFFFFFFF for w in k)
    folds = [rng.fold_in(key, d) for d in (0, 1, 2, 2**32, 2**64 - 1)]
    assert len(set(folds)) == len(folds)
    assert not set(folds) & set(keys)
    assert rng.fold_in(key, 7) == rng.fold_in(key, 7)
    assert rng.fold_in(key, 7) != rng.fold_in(rng.key_from_seed(43), 7)
    with pytest.raises(ValueError):
        rng.fold_in(key, -1)
    with pytest.raises(ValueError):
        rng.split(key, -1)
    with pytest.raises(ValueError):
        rng.philox((2**32, 0), torch.zeros(1, dtype=torch.int64))


def test_derived_keys_statistics():
    n = 10**6
    key = rng.key_from_seed(2024)
    k1, k2 = rng.split(key, 2)
    k3 = rng.fold_in(key, 1)
    draws = []
    for k in (k1, k2, k3):
        u = rng.uniform(k, (n,), dtype=torch.float64)
        assert abs(float(u.mean()) - 0.5) < 0.005
        assert abs(float(u.std()) - math.sqrt(1 / 12)) < 0.002
        hist = torch.histc(u, bins=10, min=0, max=1)
        assert float((hist / n - 0.1).abs().max()) < 0.003
        draws.append(u)
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        corr = torch.corrcoef(torch.stack([draws[a], draws[b]]))[0, 1]
        assert abs(float(corr)) < 0.01
    # neighbouring elements are uncorrelated too
    u = draws[0]
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


# --------------------------------------------------------------------------
# box indices
# --------------------------------------------------------------------------
def test_box_indices_basic():
    full = torch.arange(3 * 4 * 5).view(3, 4, 5)
    got = rng.box_indices((3, 4, 5), ((1, 3), (0, 4), (2, 4)))
    assert torch.equal(got, full[1:3, 0:4, 2:4])
    assert torch.equal(rng.box_indices((3, 4, 5)), full)
    assert torch.equal(rng.box_indices((), ()), torch.tensor(0))
    assert rng.box_indices((), ()).shape == ()
    e = rng.box_indices((3, 4), ((1, 1), (0, 4)))
    assert e.shape == (0, 4) and e.dtype == torch.int64
    assert rng.box_indices((0, 5), ((0, 0), (1, 3))).shape == (0, 2)
    for bad in [((0, 4), (0, 4)), ((0, 3),), ((2, 1), (0, 4)), ((-1, 2), (0, 4))]:
        with pytest.raises(ValueError):
            rng.box_indices((3, 4), bad)


def test_box_indices_huge_global_shape_is_lazy():
    shape = (2**40, 2**21)  # 2**61 elements: must never be materialised
    box = ((2**40 - 2, 2**40), (5, 9))
    idx = rng.box_indices(shape, box)
    expected = torch.tensor([[r * 2**21 + c for c in range(5, 9)] for r in range(2**40 - 2, 2**40)])
    assert torch.equal(idx, expected)
    # values at a huge global index use the high counter word
    key = rng.key_from_seed(3)
    bits = rng.uniform_bits(key, shape, box)
    assert torch.equal(bits, rng.philox(key, expected)[0])
    assert not torch.equal(bits, rng.philox(key, expected & 0xFFFFFFFF)[0])


# --------------------------------------------------------------------------
# sharding property: box == slice of full
# --------------------------------------------------------------------------
@st.composite
def shape_and_box(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    box = []
    for s in shape:
        a = draw(st.integers(0, s))
        b = draw(st.integers(a, s))
        box.append((a, b))
    return shape, tuple(box)


_OPS = ["uniform", "normal", "randint", "bernoulli", "bernoulli_tensor", "bits"]


def _sample(op, key, shape, box, dtype, stream):
    if op == "uniform":
        return rng.uniform(key, shape, box, dtype=dtype, low=-2.0, high=3.0, stream=stream)
    if op == "normal":
        return rng.normal(key, shape, box, dtype=dtype, mean=1.0, std=2.0, stream=stream)
    if op == "randint":
        return rng.randint(key, shape, box, -5, 1000, stream=stream)
    if op == "bernoulli":
        return rng.bernoulli(key, shape, box, 0.3, dtype=dtype, stream=stream)
    if op == "bernoulli_tensor":
        p = rng.uniform((7, 7), shape, box, dtype=torch.float64)
        return rng.bernoulli(key, shape, box, p, dtype=dtype, stream=stream)
    if op == "bits":
        return rng.uniform_bits(key, shape, box, stream=stream)
    raise AssertionError(op)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sb=shape_and_box(),
    op=st.sampled_from(_OPS),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**64 - 1),
    stream=st.integers(0, 2**32 - 1),
)
def test_box_equals_slice_of_full(sb, op, dtype, seed, stream):
    shape, box = sb
    key = rng.key_from_seed(seed)
    full = _sample(op, key, shape, None, dtype, stream)
    part = _sample(op, key, shape, box, dtype, stream)
    assert full.shape == shape
    sl = tuple(slice(a, b) for a, b in box)
    _assert_bit_equal(part, full[sl])


@settings(max_examples=40, deadline=None, database=None)
@given(sb=shape_and_box(), seed=st.integers(0, 2**64 - 1))
def test_value_depends_only_on_global_index(sb, seed):
    # each element equals the 1-element box at its position
    shape, box = sb
    key = rng.key_from_seed(seed)
    part = rng.normal(key, shape, box, dtype=torch.float64)
    idx = rng.box_indices(shape, box)
    flat = rng.normal(key, (max(1, math.prod(shape)),), None, dtype=torch.float64).reshape(-1)
    if part.numel():
        _assert_bit_equal(part.reshape(-1), flat[idx.reshape(-1)])


def test_sharded_gather_matches_full():
    key = rng.key_from_seed(99)
    shape = (37, 53)
    full = rng.normal(key, shape, dtype=torch.float32)
    rows = [(0, 10), (10, 30), (30, 37)]
    cols = [(0, 20), (20, 53)]
    gathered = torch.cat(
        [torch.cat([rng.normal(key, shape, (r, c), dtype=torch.float32) for c in cols], dim=1) for r in rows]
    )
    _assert_bit_equal(gathered, full)


# --------------------------------------------------------------------------
# distributions / ranges
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_uniform_range_and_dtype(dtype):
    key = rng.key_from_seed(5)
    for low, high in [(0.0, 1.0), (-1.0, 0.1), (10.0, 10.5)]:
        u = rng.uniform(key, (20000,), dtype=dtype, low=low, high=high)
        assert u.dtype == dtype
        assert float(u.double().min()) >= low and float(u.double().max()) < high
    # very narrow interval in low precision: only the representable value >= low
    u = rng.uniform(key, (1000,), dtype=torch.bfloat16, low=1.0, high=1.001)
    assert torch.all(u == 1.0)
    with pytest.raises(ValueError):
        rng.uniform(key, (3,), low=1.0, high=1.0)


def test_uniform_float32_uses_24_bits():
    key = rng.key_from_seed(6)
    u = rng.uniform(key, (4096,), dtype=torch.float32)
    bits = rng.uniform_bits(key, (4096,))
    assert torch.equal(u, (bits >> 8).to(torch.float32) * 2.0**-24)
    u64 = rng.uniform(key, (4096,), dtype=torch.float64)
    scaled = u64 * 2.0**53
    assert torch.equal(scaled, scaled.floor())
    assert float(scaled.max()) < 2.0**53


def test_uniform_statistics():
    key = rng.key_from_seed(7)
    u = rng.uniform(key, (1000, 1000))
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.std()) - math.sqrt(1 / 12)) < 0.002


def test_normal_statistics_and_finite():
    key = rng.key_from_seed(8)
    z = rng.normal(key, (10**6,), dtype=torch.float64)
    assert torch.isfinite(z).all()
    assert abs(float(z.mean())) < 0.005
    assert abs(float(z.std()) - 1.0) < 0.005
    assert float(z.abs().max()) <= 8.6
    # tails: P(|z| > 2) ~ 0.0455, P(z > 1) ~ 0.1587
    assert abs(float((z.abs() > 2).double().mean()) - 0.0455) < 0.002
    assert abs(float((z > 1).double().mean()) - 0.1587) < 0.002
    z2 = rng.normal(key, (1000,), dtype=torch.bfloat16, mean=3.0, std=0.5)
    assert z2.dtype == torch.bfloat16 and torch.isfinite(z2).all()
    assert abs(float(z2.float().mean()) - 3.0) < 0.1


def test_deterministic_log_and_cos_helpers():
    u = torch.cat([torch.rand(10000, dtype=torch.float64) + 1e-12, torch.tensor([2.0**-53, 0.5, 1.0])])
    ref = torch.log(u)
    got = rng._log_f64(u)
    assert float(got[-1]) == 0.0
    assert float(((got - ref).abs() / ref.abs().clamp_min(1e-300)).max()) < 1e-14
    x = torch.linspace(0, math.pi / 2, 1001, dtype=torch.float64)
    assert float((rng._cos_quarter_f64(x) - torch.cos(x)).abs().max()) < 1e-15


def test_randint():
    key = rng.key_from_seed(9)
    x = rng.randint(key, (70000,), None, -3, 4)
    assert x.dtype == torch.int64 and int(x.min()) == -3 and int(x.max()) == 3
    counts = torch.bincount(x + 3).double()
    assert float((counts / 70000 - 1 / 7).abs().max()) < 0.01
    y = rng.randint(key, (1000,), None, 10)  # [0, 10)
    assert int(y.min()) == 0 and int(y.max()) == 9
    c = rng.randint(key, (100,), None, 5, 6)
    assert torch.all(c == 5)
    i32 = rng.randint(key, (10000,), None, -(2**31), 2**31, dtype=torch.int32)
    assert i32.dtype == torch.int32
    assert (i32 < 0).double().mean().item() == pytest.approx(0.5, abs=0.03)
    full = rng.randint(key, (10000,), None, -(2**63), 2**63)
    assert (full < 0).double().mean().item() == pytest.approx(0.5, abs=0.03)
    big = rng.randint(key, (10000,), None, 2**40, 2**62)
    assert int(big.min()) >= 2**40 and int(big.max()) < 2**62
    assert float(big.double().mean()) == pytest.approx((2**40 + 2**62) / 2, rel=0.03)
    with pytest.raises(ValueError):
        rng.randint(key, (3,), None, 0, 300, dtype=torch.uint8)
    with pytest.raises(ValueError):
        rng.randint(key, (3,), None, 5, 5)


def test_bernoulli():
    key = rng.key_from_seed(10)
    for p in (0.0, 0.01, 0.3, 0.5, 0.97, 1.0):
        b = rng.bernoulli(key, (10**6,), None, p)
        assert b.dtype == torch.float32
        assert set(torch.unique(b).tolist()) <= {0.0, 1.0}
        assert abs(float(b.double().mean()) - p) < 0.003
    assert torch.all(rng.bernoulli(key, (1000,), None, 0.0) == 0)
    assert torch.all(rng.bernoulli(key, (1000,), None, 1.0) == 1)
    # tensor p (same result as scalar p when constant)
    pt = torch.full((50, 40), 0.3)
    _assert_bit_equal(rng.bernoulli(key, (50, 40), None, pt), rng.bernoulli(key, (50, 40), None, 0.3))
    pv = torch.linspace(0, 1, 40)  # broadcast across rows
    bv = rng.bernoulli(key, (20000, 40), None, pv, dtype=torch.bool)
    assert bv.dtype == torch.bool
    assert float((bv.double().mean(0) - pv.double()).abs().max()) < 0.015
    with pytest.raises(ValueError):
        rng.bernoulli(key, (3,), None, 1.5)
    with pytest.raises(ValueError):
        rng.bernoulli(key, (3,), None, torch.full((3,), -0.1))


def test_streams_decorrelate_ops():
    key = rng.key_from_seed(11)
    a = rng.uniform(key, (10**5,), stream=0)
    b = rng.uniform(key, (10**5,), stream=1)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
