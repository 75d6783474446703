"""Bad input gets a clear, documented error naming the culprit (issue 11): never an
AttributeError/IndexError/KeyError, a bare torch RuntimeError, or a crash."""

import copy
import subprocess
import sys

import pytest
import torch

import shardfn as sf
from shardfn import ImmutableError, NamedSharding, P, Partial, Replicate, Shard, ShardedArray, ShardingError
from shardfn.arrays import dispatch as _dispatch


# -- placements, meshes, NamedSharding ----------------------------------------------------


@pytest.mark.parametrize("dim", [1.5, "0", True, None])
def test_shard_dim_must_be_an_int(dim):
    with pytest.raises(ShardingError, match=r"Shard\(dim=.*must be an int"):
        Shard(dim)


@pytest.mark.parametrize("bad", ["m", 3, None.__class__, ("x",)])
def test_mesh_argument_must_be_a_mesh(mesh22, bad):
    t = torch.ones(4, 4)
    with pytest.raises(ShardingError, match=r"mesh= is .* not a Mesh"):
        sf.distribute(t, P("x"), mesh=bad)
    with pytest.raises(ShardingError, match=r"not a Mesh"):
        sf.zeros((4,), P("x"), mesh=bad)
    with pytest.raises(ShardingError, match=r"not a Mesh"):
        ShardedArray.from_local([t] * 4, P(), mesh=bad)
    with pytest.raises(ShardingError, match=r"not a Mesh"):
        sf.shard_map(lambda a: a, mesh=bad, in_specs=P(), out_specs=P())(t)
    with pytest.raises(ShardingError, match=r"not a Mesh"):
        sf.plan_redistribute(P("x"), P(), (4,), mesh=bad)


def test_named_sharding_checks_mesh_and_spec(mesh22):
    with pytest.raises(ShardingError, match=r"NamedSharding\(mesh=...\) is 'm' \(str\), not a Mesh"):
        NamedSharding("m", P("x"))
    with pytest.raises(ShardingError, match=r"NamedSharding\(spec=None\): spec must be a P"):
        NamedSharding(mesh22, None)
    assert NamedSharding(mesh22, ("x", None)).spec == P("x", None)


@pytest.mark.parametrize("device_type", ["cuda", "bogus", "cpu:0", 5])
def test_mesh_device_type_must_exist_here(device_type):
    if device_type == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ShardingError, match=r"device_type"):
        sf.Mesh((2,), ("x",), device_type=device_type)
    assert sf.Mesh((2,), ("x",), device_type="cpu").device_type == "cpu"


# -- plan_redistribute shapes ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [None, (-4,), "44", (4, 1.5), (True,)])
def test_plan_redistribute_rejects_non_shapes(mesh22, shape):
    src, dst = NamedSharding(mesh22, P("x")), NamedSharding(mesh22, P())
    with pytest.raises(ShardingError, match=r"plan_redistribute: shape=.* is not a shape"):
        sf.plan_redistribute(src, dst, shape)
    assert sf.plan_redistribute(src, dst, torch.Size([4, 4])).shape == (4, 4)


# -- pending reductions the dtype cannot do ----------------------------------------------------


@pytest.mark.parametrize("op", ["max", "min"])
def test_partial_max_min_on_complex_rejected_where_built(mesh22, op):
    c = torch.ones(4, dtype=torch.complex64)
    with pytest.raises(ShardingError, match=rf"Partial\('{op}'\) over mesh axis 'x' on a torch.complex64"):
        sf.distribute(c, P(partial={"x": op}), mesh=mesh22)
    with pytest.raises(ShardingError, match="complex numbers have no order"):
        ShardedArray.from_local([c] * 4, (Partial(op), Replicate()), mesh=mesh22)
    x = sf.distribute(c, P(), mesh=mesh22)
    with pytest.raises(ShardingError, match="complex numbers have no order"):
        sf.reshard(x, P(partial={"y": op}))
    with pytest.raises(ShardingError, match="complex numbers have no order"):
        sf.full((4,), 1 + 1j, P(partial={"y": op}), mesh=mesh22)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_partial_avg_needs_a_floating_dtype(mesh22, mesh24, dtype):
    """Like torch.mean: no mesh-shape-dependent integer rounding, one answer or an error."""
    parts = [torch.tensor([1]).to(dtype), torch.tensor([2]).to(dtype)] * 2
    with pytest.raises(ShardingError, match=r"Partial\('avg'\) over mesh axis 'x' .*floating"):
        ShardedArray.from_local(parts, P(partial={"x": "avg", "y": "avg"}), mesh=mesh22)
    with pytest.raises(ShardingError, match=r"Partial\('avg'\)"):
        sf.distribute(torch.ones(4, dtype=dtype), P(partial={"y": "avg"}), mesh=mesh24)
    with pytest.raises(ShardingError, match=r"Partial\('avg'\)"):
        sf.zeros((4,), P(partial="x"), mesh=mesh22, dtype=dtype).redistribute(P(partial={"y": "avg"}))
    floats = ShardedArray.from_local([p.double() for p in parts], P(partial={"x": "avg", "y": "avg"}), mesh=mesh22)
    assert floats.full_tensor().item() == torch.stack(parts).double().mean().item()


# -- methods that bypass __torch_dispatch__ ----------------------------------------------------

_CRASHERS = ["x.share_memory_()", "x.apply_(lambda v: v)", "x.map_(x, lambda a, b: a)",
             "x.map2_(x, x, lambda a, b, c: a)"]


@pytest.mark.parametrize("code", _CRASHERS)
def test_in_place_python_methods_raise_immutable_error(code):
    """These used to kill the interpreter (SIGSEGV): run them in a child process."""
    prog = (
        "import torch, shardfn as sf\n"
        "mesh = sf.Mesh((2, 2), ('x', 'y'), backend='local')\n"
        "x = sf.distribute(torch.arange(8.0), sf.P('x'), mesh=mesh)\n"
        "try:\n"
        f"    {code}\n"
        "except sf.ImmutableError as e:\n"
        "    print('ImmutableError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImmutableError") and "immutable" in out.stdout


@pytest.mark.parametrize("method", ["storage", "__dlpack__", "pin_memory"])
def test_storage_access_is_a_clear_type_error(mesh22, method):
    x = sf.distribute(torch.arange(8.0), P("x"), mesh=mesh22)
    with pytest.raises(TypeError, match="ShardedArray"):
        getattr(x, method)()


def test_numpy_and_tolist_gather(mesh22):
    t = torch.arange(8.0)
    x = sf.distribute(t, P("x"), mesh=mesh22)
    assert x.tolist() == t.tolist()
    assert (x.numpy() == t.numpy()).all()


def test_data_setter_raises_for_any_value(mesh22):
    # issue 13: x.data = ... would change an array others may hold; it raises, unchanged
    x = sf.distribute(torch.arange(8.0), P("x"), mesh=mesh22)
    with pytest.raises(ImmutableError, match=r"x.data = Tensor"):
        x.data = torch.ones(3)
    with pytest.raises(ImmutableError, match=r"x.data = ShardedArray"):
        x.data = sf.distribute(torch.ones(3), P("y"), mesh=mesh22)
    assert tuple(x.shape) == (8,) and x.spec == P("x") and torch.equal(x.full_tensor(), torch.arange(8.0))


def test_copy_copy_is_like_deepcopy(mesh22):
    t = torch.arange(8.0)
    x = sf.distribute(t, P("x"), mesh=mesh22)
    for y in (copy.copy(x), copy.deepcopy(x)):
        assert isinstance(y, ShardedArray) and y is not x and y.spec == x.spec
        assert torch.equal(y.full_tensor(), t)


# -- the dispatch cache ----------------------------------------------------------------------------


def test_cache_key_tells_true_one_and_one_point_zero_apart(mesh22):
    t = torch.tensor([True, False, True, True])
    b = sf.distribute(t, P("x"), mesh=mesh22)
    for scalar in (1, True, 1.0, True, 1):
        y = b * scalar
        want = t * scalar
        assert y.dtype == want.dtype and all(s.dtype == want.dtype for s in y.local_shards())
        assert torch.equal(y.full_tensor(), want)


def test_dispatch_cache_stays_bounded(mesh22, monkeypatch):
    monkeypatch.setattr(_dispatch, "_CACHE_MAX", 64)
    x = sf.distribute(torch.arange(8), P("x"), mesh=mesh22)
    for i in range(300):
        y = x + i
        assert len(_dispatch._cache) <= 64
    assert torch.equal(y.full_tensor(), torch.arange(8) + 299)


def test_default_cache_bound_holds_for_20000_scalars(mesh22):
    x = sf.distribute(torch.arange(8), P("x"), mesh=mesh22)
    for i in range(20_000):
        x + i
    assert len(_dispatch._cache) <= _dispatch._CACHE_MAX


# -- factories -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, dtype", [
    (1.5, torch.int64), (300, torch.uint8), (-1, torch.uint8), (2, torch.bool), (1 + 1j, torch.float32),
    (1e6, torch.float16), (float("nan"), torch.int32), (2**63, None),
])
def test_full_rejects_a_fill_value_the_dtype_cannot_hold(mesh22, value, dtype):
    with pytest.raises(ShardingError, match=r"full: fill_value=.*(does not fit|cannot be held)"):
        sf.full((4,), value, P("x"), mesh=mesh22, dtype=dtype)
    with pytest.raises(ShardingError, match=r"full: fill_value="):
        sf.full((4,), value, dtype=dtype)


def test_full_rejects_non_numbers(mesh22):
    with pytest.raises(ShardingError, match=r"fill_value='a' \(str\) is not a number"):
        sf.full((4,), "a", P("x"), mesh=mesh22)


@pytest.mark.parametrize("value, dtype", [(1.0, torch.int32), (True, torch.int64), (0.1, torch.complex64),
                                          (3, torch.float16), (1, torch.bool)])
def test_full_keeps_values_the_dtype_holds(mesh22, value, dtype):
    x = sf.full((4,), value, P("x"), mesh=mesh22, dtype=dtype)
    assert x.dtype == dtype and torch.equal(x.full_tensor(), torch.full((4,), value, dtype=dtype))


@pytest.mark.parametrize("make", [
    lambda m: sf.full((2**40, 2**20), 1.0, P("x"), mesh=m),
    lambda m: sf.zeros((2**62, 4), P("x"), mesh=m),
    lambda m: sf.empty((2**40, 2**20), P("x"), mesh=m),
    lambda m: sf.rand((2**40, 2**20), P("x"), mesh=m),
    lambda m: sf.zeros((2**40, 2**20)),
])
def test_factories_name_a_size_that_cannot_be_allocated(mesh22, make):
    with pytest.raises(ShardingError, match=r"cannot allocate an array of shape \((1099511627776|4611686018427387904)"):
        make(mesh22)


def test_factories_reject_negative_sizes(mesh22):
    with pytest.raises(ShardingError, match=r"shape=\(-1,\) is not a shape"):
        sf.zeros((-1,), P("x"), mesh=mesh22)
    with pytest.raises(ShardingError, match=r"shape=\(4, -2\) is not a shape"):
        sf.full((4, -2), 1.0, P("x"), mesh=mesh22)


# -- from_local with replicas that disagree ---------------------------------------------------------


def test_from_local_replicated_parts_must_agree(mesh22):
    parts = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([2.0]), torch.tensor([2.0])]
    with pytest.raises(ShardingError, match=r"from_local: P\(None\) replicates over mesh axes \['x', 'y'\]"
                       r".*devices 0 vs 1, 0 vs 2, 0 vs 3"):
        ShardedArray.from_local(parts, P(), mesh=mesh22)


def test_from_local_run_check_false_trusts_the_parts(mesh22):
    """DTensor's spelling: no replica comparison (the caller vouches), shapes still checked."""
    parts = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([2.0]), torch.tensor([2.0])]
    x = ShardedArray.from_local(parts, P(), mesh=mesh22, run_check=False)
    assert x.shape == (1,) and x.spec == P()
    with pytest.raises(ShardingError, match="from_local"):
        ShardedArray.from_local([torch.ones(2)] * 3 + [torch.ones(3)], P(), mesh=mesh22, run_check=False)


def test_from_local_replicas_checked_per_group(mesh22):
    """P('x') replicates over 'y': devices (0, 1) and (2, 3) form the groups."""
    a, b = torch.tensor([1.0]), torch.tensor([3.0])
    x = ShardedArray.from_local([a, a, b, b], P("x"), mesh=mesh22)
    assert torch.equal(x.full_tensor(), torch.tensor([1.0, 3.0]))
    with pytest.raises(ShardingError, match=r"axes \['y'\].*devices 2 vs 3"):
        ShardedArray.from_local([a, a, b, a], P("x"), mesh=mesh22)


def test_from_local_equal_nan_replicas_agree(mesh22):
    n = torch.tensor([float("nan"), 1.0])
    x = ShardedArray.from_local([n.clone() for _ in range(4)], P(), mesh=mesh22)
    assert torch.equal(x.full_tensor().isnan(), n.isnan())


def test_from_local_partial_parts_may_differ(mesh22):
    parts = [torch.tensor([float(i)]) for i in range(4)]
    x = ShardedArray.from_local(parts, P(partial=("x", "y")), mesh=mesh22)
    assert x.full_tensor().item() == 6.0


# -- register_sharding validates einsum rules ------------------------------------------------------

_lib = torch.library.Library("shardfn_errors_test", "FRAGMENT")
_lib.define("mm(Tensor a, Tensor b) -> Tensor")
_lib.impl("mm", lambda a, b: a @ b, "CPU")
_lib.impl("mm", lambda a, b: a.new_empty(a.shape[0], b.shape[1]), "Meta")
_lib.define("pair(Tensor a) -> Tensor[]")
_lib.impl("pair", lambda a: [a.clone(), a.clone()], "CPU")
_lib.impl("pair", lambda a: [torch.empty_like(a), torch.empty_like(a)], "Meta")
_mm = torch.ops.shardfn_errors_test.mm


@pytest.mark.parametrize("eq, match", [
    ("mk,kn", "exactly one '->'"), ("mk,kn->mn->x", "exactly one '->'"), ("m1,kn->mn", "not letters only"),
    ("mm,kn->mn", "repeats a letter"), ("mk,kn->mz", r"output letter\(s\) \['z'\]"),
    ("mk->mk", r"has 1 input\(s\) but .* takes 2"), ("mk,kn,nq->mq", r"has 3 input\(s\)"),
])
def test_register_sharding_checks_einsum_when_registered(eq, match):
    with pytest.raises(ShardingError, match=match):
        sf.register_sharding(_mm, eq)


def test_register_sharding_einsum_needs_one_tensor_output():
    with pytest.raises(ShardingError, match="returns"):
        sf.register_sharding(torch.ops.shardfn_errors_test.pair, "ab->ab")


def test_register_sharding_output_letters_checked_against_real_sizes(mesh22):
    sf.register_sharding(_mm, "mk,kn->nm")
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    xa, xb = sf.distribute(a, P("x"), mesh=mesh22), sf.distribute(b, P(), mesh=mesh22)
    with pytest.raises(ShardingError, match=r"output dim 0 is 'n' of size 4 .* output has shape \(8, 4\)"):
        _mm(xa, xb)
    sf.register_sharding(_mm, "mk,kn->mn")
    torch.testing.assert_close(_mm(xa, xb).full_tensor(), a @ b)


def test_register_sharding_misordered_output_caught_on_square_operands(mesh22):
    """Equal sizes hide a swapped output (m == n): the first call probes the op with
    distinct letter sizes and raises instead of computing a transposed result."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    xa, xb = sf.distribute(a, P("x"), mesh=mesh22), sf.distribute(b, P(), mesh=mesh22)
    sf.register_sharding(_mm, "mk,kn->nm")
    with pytest.raises(ShardingError, match=r"says the output's dims are \['n', 'm'\].* not \(4, 3\)"):
        _mm(xa, xb)
    sf.register_sharding(_mm, "mk,kn->mn")
    torch.testing.assert_close(_mm(xa, xb).full_tensor(), a @ b)


def test_register_sharding_letter_sizes_must_agree(mesh22):
    sf.register_sharding(_mm, "mk,nk->mn")
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    with pytest.raises(ShardingError, match=r"letter 'k' size 6 \(input 0 dim 1\) and size 4"):
        _mm(sf.distribute(a, P("x"), mesh=mesh22), sf.distribute(b, P(), mesh=mesh22))


# -- more arguments of the wrong type ----------------------------------------------------------------


@pytest.mark.parametrize("shape", ["22", (-2,), (2.5,)])
def test_from_local_shape_must_be_a_shape(mesh22, shape):
    with pytest.raises(ShardingError, match=r"from_local: shape=.* is not a shape"):
        ShardedArray.from_local([torch.ones(2)] * 4, P(), mesh=mesh22, shape=shape)


def test_from_local_takes_a_list_of_tensors(mesh22):
    with pytest.raises(ShardingError, match=r"takes a list of 4 tensors .* got int"):
        ShardedArray.from_local(5, P(), mesh=mesh22)


def test_make_array_from_callback_checks_the_first_shard(mesh22):
    with pytest.raises(ShardingError, match=r"data_callback returned int .* must return a tensor of shape \(2,\)"):
        sf.make_array_from_callback((4,), P("x"), lambda idx: 5, mesh=mesh22)


def test_plan_redistribute_dtype_must_be_a_dtype(mesh22):
    with pytest.raises(ShardingError, match=r"dtype='float32' is not a torch.dtype"):
        sf.plan_redistribute(NamedSharding(mesh22, P("x")), NamedSharding(mesh22, P()), (4,), dtype="float32")


def test_from_dtensor_takes_a_dtensor(mesh22):
    x = sf.distribute(torch.ones(4), P("x"), mesh=mesh22)
    with pytest.raises(ShardingError, match="from_dtensor takes a torch DTensor, got ShardedArray"):
        sf.from_dtensor(x)
