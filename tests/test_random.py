"""sf.random: keys, and sharding-invariant samplers (gathered == unsharded, bit for bit)."""

from __future__ import annotations

import math

import pytest
import torch
from _alloc import Allocations, assert_shard_sized
from conftest import meshes, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P
from shardfn.values.layout import device_box

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


SAMPLERS = {
    "uniform": (lambda k, s, sh, dt, m: sf.random.uniform(k, s, sh, dtype=dt, minval=-2.0, maxval=3.0, mesh=m),
                [torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    "normal": (lambda k, s, sh, dt, m: sf.random.normal(k, s, sh, dtype=dt, mean=1.0, std=2.0, mesh=m),
               [torch.float32, torch.float64, torch.bfloat16]),
    "randint": (lambda k, s, sh, dt, m: sf.random.randint(k, s, -5, 17, sh, dtype=dt, mesh=m),
                [torch.int64, torch.int32, torch.int8]),
    "bernoulli": (lambda k, s, sh, dt, m: sf.random.bernoulli(k, 0.3, s, sh, dtype=dt, mesh=m),
                  [torch.bool, torch.float32]),
}


# -- sharding invariance -------------------------------------------------------------------


@given(st.data())
def test_gathered_equals_unsharded(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    kind = data.draw(st.sampled_from(sorted(SAMPLERS)))
    fn, dtypes = SAMPLERS[kind]
    dtype = data.draw(st.sampled_from(dtypes))
    # not "avg": the backend's mean of 3 equal floats need not be bit-equal to them
    spec = data.draw(specs(mesh, len(shape), partial_ops=("sum", "max")))
    k = sf.random.key(data.draw(st.integers(0, 2**64 - 1)))
    out = fn(k, shape, spec, dtype, mesh)
    assert isinstance(out, sf.ShardedArray)
    assert out._layout == sf.NamedSharding(mesh, spec).layout(len(shape))
    assert_bit_equal(sf.gather(out), fn(k, shape, None, dtype, None))


@given(st.data())
def test_same_values_on_every_mesh(data):
    shape = data.draw(shapes(min_dims=1))
    k = sf.random.key(data.draw(st.integers(0, 1000)))
    results = []
    for _ in range(2):
        mesh = data.draw(meshes())
        spec = data.draw(specs(mesh, len(shape), partial_ops=()))
        results.append(sf.gather(sf.random.normal(k, shape, spec, mesh=mesh)))
    assert_bit_equal(results[0], results[1])


@given(st.data())
def test_replicas_hold_identical_shards(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    x = sf.random.uniform(sf.random.key(1), shape, spec, mesh=mesh)
    by_box: dict = {}
    for dev, shard in enumerate(x.local_shards()):
        by_box.setdefault(device_box(x._layout, shape, dev), []).append(shard)
    for shards in by_box.values():
        for s in shards[1:]:
            assert_bit_equal(s, shards[0])


def test_unsharded_call_returns_plain_tensor():
    out = sf.random.normal(sf.random.key(0), (3, 4))
    assert type(out) is torch.Tensor and out.shape == (3, 4) and out.dtype == torch.float32


def test_sharding_from_current_mesh_and_placements(mesh24):
    k = sf.random.key(7)
    with mesh24:
        a = sf.random.uniform(k, (6, 8), P("y", "x"))
    b = sf.random.uniform(k, (6, 8), (sf.Shard(1), sf.Shard(0)), mesh=mesh24)
    c = sf.random.uniform(k, (6, 8), sf.NamedSharding(mesh24, P(None, ("x", "y"))))
    for t in (a, b, c):
        assert_bit_equal(sf.gather(t), sf.random.uniform(k, (6, 8)))


def test_dtype_default_follows_torch():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert sf.random.uniform(sf.random.key(0), (2,)).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)


# -- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1])
def test_seeds_up_to_2_pow_64(seed):
    k = sf.random.key(seed)
    assert (k.hi << 32 | k.lo) == seed
    u = sf.random.uniform(k, (1000,))
    assert 0.0 <= u.min() and u.max() < 1.0


def test_negative_seed_wraps_to_64_bits():
    assert sf.random.key(-1) == sf.random.key(2**64 - 1)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_range(seed):
    with pytest.raises(ValueError, match="out of range"):
        sf.random.key(seed)


@pytest.mark.parametrize("seed", [1.5, "3", True])
def test_seed_not_int(seed):
    with pytest.raises((TypeError, ValueError), match="seed"):
        sf.random.key(seed)


def test_bad_key_is_type_error():
    with pytest.raises(TypeError, match=r"sf.random.key\(seed\)"):
        sf.random.normal(3, (2,))


def test_keys_are_values():
    k = sf.random.key(5)
    assert k == sf.random.key(5) and hash(k) == hash(sf.random.key(5))
    assert repr(k) == "Key(0x00000005, 0x00000000)"
    assert sf.random.split(k) == sf.random.split(k)
    assert len(sf.random.split(k, 5)) == 5 and len(set(sf.random.split(k, 5))) == 5
    assert sf.random.fold_in(k, 3) == sf.random.fold_in(k, 3) != sf.random.fold_in(k, 4)
    assert sf.random.fold_in(k, 2**64 - 1) != k


def test_plain_pair_is_accepted_as_key():
    assert torch.equal(sf.random.uniform((5, 0), (4,)), sf.random.uniform(sf.random.key(5), (4,)))


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_different_keys_differ(a, b):
    ka, kb = sf.random.key(a), sf.random.key(b)
    same = torch.equal(sf.random.uniform(ka, (64,)), sf.random.uniform(kb, (64,)))
    assert same == (a == b)


# -- statistics (1e6 draws) --------------------------------------------------------------------

N = 1_000_000
M = 2**18  # for the tests that check many streams


def test_normal_statistics():
    z = sf.random.normal(sf.random.key(11), (N,), dtype=torch.float64)
    assert abs(z.mean().item()) < 5 / math.sqrt(N)
    assert abs(z.std().item() - 1.0) < 5 / math.sqrt(2 * N)
    assert abs((z.abs() < 1).double().mean().item() - 0.6826894921) < 0.003


def test_uniform_statistics_sharded(mesh24):
    u = sf.gather(sf.random.uniform(sf.random.key(12), (1000, 1000), P("x", "y"), mesh=mesh24, dtype=torch.float64))
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    assert 0.0 <= u.min().item() and u.max().item() < 1.0


def test_split_and_fold_in_streams_are_independent():
    k = sf.random.key(13)
    a, b = sf.random.split(k)
    c = sf.random.fold_in(k, 0)
    draws = [sf.random.uniform(x, (M,), dtype=torch.float64) - 0.5 for x in (a, b, c)]
    for i in range(3):
        for j in range(i + 1, 3):
            corr = (draws[i] * draws[j]).mean() / (draws[i].std() * draws[j].std())
            assert abs(corr.item()) < 5 / math.sqrt(M)


def test_bernoulli_and_randint_statistics():
    k1, k2 = sf.random.split(sf.random.key(14))
    assert abs(sf.random.bernoulli(k1, 0.3, (M,)).double().mean().item() - 0.3) < 0.005
    r = sf.random.randint(k2, (M,), 0, 10)
    counts = torch.bincount(r, minlength=10).double() / M
    assert r.min() == 0 and r.max() == 9 and (counts - 0.1).abs().max() < 0.004


# -- bernoulli with tensor p, dropout -----------------------------------------------------------


def test_bernoulli_sharded_p_matches_plain_p(mesh24):
    k = sf.random.key(3)
    p = sf.random.uniform(sf.random.key(4), (7, 9), P("y", "x"), mesh=mesh24)
    out = sf.random.bernoulli(k, p)
    assert out._layout == p._layout and out.dtype == torch.bool
    assert torch.equal(sf.gather(out), sf.random.bernoulli(k, sf.gather(p)))
    other = sf.random.bernoulli(k, p, None, P("x"))
    assert torch.equal(sf.gather(other), sf.gather(out))


def test_bernoulli_broadcast_p(mesh24):
    k = sf.random.key(3)
    p = torch.tensor([0.0, 1.0, 0.5])
    out = sf.random.bernoulli(k, p, (8, 3), P("x", "y"), mesh=mesh24)
    full = sf.gather(out)
    assert torch.equal(full, sf.random.bernoulli(k, p, (8, 3)))
    assert not full[:, 0].any() and full[:, 1].all()
    with pytest.raises(sf.ShardingError, match="does not broadcast"):
        sf.random.bernoulli(k, p, (8, 4))


@given(st.data())
def test_dropout_sharded_equals_unsharded(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes(min_dims=1))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    x = torch.randn(shape)
    k = sf.random.key(data.draw(st.integers(0, 99)))
    rate = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    out = sf.random.dropout(k, sf.distribute(x, spec, mesh=mesh), rate)
    assert_bit_equal(sf.gather(out), sf.random.dropout(k, x, rate))


def test_dropout_rate_scale_and_gradient(mesh24):
    x = torch.rand(200, 500) + 0.5
    xs = sf.distribute(x, P("x", "y"), mesh=mesh24).requires_grad_()
    out = sf.random.dropout(sf.random.key(0), xs, 0.25)
    full = sf.gather(out)
    kept = full != 0
    assert abs(kept.double().mean().item() - 0.75) < 0.01
    scale = torch.tensor(1.0) / 0.75  # the kept elements are x * (1 / (1 - rate))
    assert torch.equal(full[kept], x[kept] * scale)
    out.sum().backward()
    assert torch.equal(sf.gather(xs.grad), kept.float() / 0.75)


def test_dropout_rate_out_of_range():
    with pytest.raises(ValueError, match="rate"):
        sf.random.dropout(sf.random.key(0), torch.ones(3), 1.5)


# -- memory ----------------------------------------------------------------------------------------


@given(st.data())
def test_each_device_allocates_only_its_shard(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes(min_dims=1))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    kind = data.draw(st.sampled_from(sorted(SAMPLERS)))
    fn, dtypes = SAMPLERS[kind]
    with Allocations() as rec:
        out = fn(sf.random.key(0), shape, spec, dtypes[0], mesh)
    assert_shard_sized(rec, out)


def test_large_sharded_normal_never_allocates_full_size(mesh24):
    with Allocations() as rec:
        out = sf.random.normal(sf.random.key(0), (256, 512), P("x", "y"), mesh=mesh24)
    assert rec.largest_temp() == 128 * 128  # one shard (int64 counters, float64 temporaries)
    assert_shard_sized(rec, out)


# -- errors ------------------------------------------------------------------------------------------


def test_spec_longer_than_rank(mesh24):
    with pytest.raises(sf.ShardingError, match="rank 1"):
        sf.random.normal(sf.random.key(0), (4,), P("x", "y"), mesh=mesh24)


def test_bad_shape():
    with pytest.raises(sf.ShardingError, match="shape"):
        sf.random.normal(sf.random.key(0), (4, -1))


def test_no_mesh_for_bare_spec():
    with pytest.raises(sf.ShardingError, match="needs a mesh"):
        sf.random.normal(sf.random.key(0), (4,), P("x"))


def test_bad_sampler_arguments(mesh24):
    with pytest.raises(ValueError, match="low < high"):
        sf.random.uniform(sf.random.key(0), (4,), P("x"), mesh=mesh24, minval=1.0, maxval=1.0)
    with pytest.raises(TypeError, match="dtype"):
        sf.random.randint(sf.random.key(0), (4,), 0, 3, dtype=torch.float32)


@pytest.mark.parametrize("dynamic", [None, True])
def test_samplers_inside_torch_compile_draw_the_eager_values(dynamic):
    """Inside ``torch.compile`` a sampler breaks the graph and draws eagerly: the compiled
    function returns exactly the eager values (Dynamo raised tracing into the keys)."""
    mesh = sf.Mesh((2, 2), ("a", "b"), backend="local")
    x = sf.distribute(torch.randn(4, 6), P("a"), mesh=mesh)
    k = sf.random.key(3)
    rows, cols = P("a", "b"), P("b")

    def f(x):
        k1, k2 = sf.random.split(sf.random.fold_in(k, 1))
        noise = sf.random.normal(k1, x.shape, rows, mesh=mesh) * sf.random.uniform(k2, x.shape, cols, mesh=mesh)
        keep = sf.random.bernoulli(k2, 0.5, x.shape, rows, mesh=mesh)
        return torch.where(keep, x + noise, sf.random.randint(k1, x.shape, 0, 5, cols, mesh=mesh).float())

    want = f(x).full_tensor()
    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", dynamic=dynamic)(x)
    assert isinstance(got, sf.ShardedArray)
    assert torch.equal(got.full_tensor(), want)
