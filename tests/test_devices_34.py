"""The mesh owns the device, adversarially: casts, moves, factories and random draws on CPU and
meta meshes, every local shard's device and dtype against plain torch (a meta mesh stands in
for an accelerator's)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


def _shards(x: sf.ShardedArray) -> set[tuple[str, torch.dtype]]:
    return {(s.device.type, s.dtype) for s in x.local_shards()}


@pytest.fixture
def meta_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")


@pytest.fixture
def cpu_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


# -- random draws whose probabilities are tensors -----------------------------------------------


def test_bernoulli_of_tensor_probabilities_on_a_meta_mesh(meta_mesh: sf.Mesh) -> None:
    """The [0, 1] check of a tensor p read a meta shard's values (``Tensor.item() cannot be
    called on meta tensors``): torch.bernoulli / sf.random.bernoulli of an array's values
    crashed on a meta mesh. A meta p has no values to check, as in torch's meta kernels."""
    k = sf.random.key(0)
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (torch.bernoulli(x.sigmoid()), sf.random.bernoulli(k, x.sigmoid()),
              sf.random.bernoulli(k, torch.full((4, 6), 0.3), None, P("tp"), mesh=meta_mesh),
              sf.random.bernoulli(k, torch.full((4, 6), 0.3, device="meta"), None, P("dp"), mesh=meta_mesh)):
        assert y.shape == (4, 6) and _shards(y) in ({("meta", torch.float32)}, {("meta", torch.bool)})
    # unsharded, the draws are made where p lives, as torch.bernoulli(p) makes them
    y = sf.random.bernoulli(k, torch.full((4, 6), 0.3, device="meta"))
    assert type(y) is torch.Tensor and y.device.type == "meta" and y.dtype == torch.bool


def test_bernoulli_of_tensor_probabilities_on_a_cpu_mesh_equals_the_unsharded_draw(cpu_mesh: sf.Mesh) -> None:
    k = sf.random.key(7)
    p = torch.rand(5, 3)
    want = sf.random.bernoulli(k, p)
    for spec in (P("dp"), P(None, "tp"), P(("dp", "tp"))):
        y = sf.random.bernoulli(k, p, None, spec, mesh=cpu_mesh)
        assert _shards(y) == {("cpu", torch.bool)} and torch.equal(y.full_tensor(), want)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # the check still runs where p has values
        sf.random.bernoulli(k, p + 1, None, P("dp"), mesh=cpu_mesh)


def test_bernoulli_of_a_meta_p_onto_a_data_mesh_is_a_sharding_error(cpu_mesh: sf.Mesh) -> None:
    """Was torch's NotImplementedError ('Cannot copy out of meta tensor') from a shard's copy."""
    with pytest.raises(sf.ShardingError, match=r"bernoulli: p is a meta tensor.*no values.*'cpu'"):
        sf.random.bernoulli(sf.random.key(0), torch.full((4, 6), 0.3, device="meta"), None, P("dp"), mesh=cpu_mesh)


# -- moves to a device the mesh does not own: a ShardingError, rank, spelling and compile alike ---


_OTHER = {"cpu": "meta", "meta": "cpu"}


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("device_type", ["cpu", "meta"])
def test_new_factories_naming_another_device_are_sharding_errors_at_any_rank(device_type: str, ndim: int) -> None:
    """Arrays of 2 dims or fewer have no torch-function hook: ``x.new_tensor(data, device=...)``
    made a plain tensor on another device (3-d arrays raised), and ``x.new_zeros(device='cuda')``
    raised torch's 'Torch not compiled with CUDA enabled' before shardfn could check it."""
    mesh = sf.Mesh((2,), ("x",), backend="local", device_type=device_type)
    x = sf.distribute(torch.randn((4, 3, 2)[:ndim]), P("x"), mesh=mesh)
    other = _OTHER[device_type]
    for device in (other, "cuda", torch.device("cuda", 1)):
        for call in (lambda: x.new_tensor([1.0], device=device), lambda: x.new_zeros((2,), device=device),
                     lambda: x.new_ones(2, device=device), lambda: x.new_empty((2,), device=device),
                     lambda: x.new_full((2,), 1.0, device=device),
                     lambda: x.new_empty_strided((2,), (1,), device=device)):
            with pytest.raises(sf.ShardingError, match=rf"new_\w+\(device='{torch.device(device).type}.*'{device_type}'"):
                call()
    y = x.new_zeros((2,), dtype=torch.int64, device=device_type)  # the mesh's own device is fine
    assert _shards(y) == {(device_type, torch.int64)} and y.spec == P()
    t = x.new_tensor([1.0, 2.0])
    assert type(t) is torch.Tensor and t.device.type == device_type  # torch's: a plain copy on x's device


@pytest.mark.parametrize("device_type", ["cpu", "meta"])
def test_an_int_device_on_a_cpu_or_meta_mesh_is_a_sharding_error(device_type: str) -> None:
    """An int device is torch's index of the current accelerator; it was passed on unchecked and
    raised torch's 'Cannot access accelerator device when none is available'."""
    mesh = sf.Mesh((2,), ("x",), backend="local", device_type=device_type)
    for shape in ((4, 3), (4, 3, 2)):
        x = sf.distribute(torch.randn(shape), P("x"), mesh=mesh)
        for call in (lambda: x.to(0), lambda: x.to(0, torch.float64), lambda: x.to(device=1),
                     lambda: x.new_zeros((2,), device=0), lambda: x.new_tensor([1.0], device=0)):
            with pytest.raises(sf.ShardingError, match=rf"\(device=\d\): an int device means .*'{device_type}'"):
                call()
        assert _shards(x) == {(device_type, torch.float32)}  # nothing changed


@pytest.mark.parametrize(("device_type", "ndim"), [("cpu", 2), ("meta", 3)])  # a method's check, the hook's
def test_a_compiled_move_to_another_device_raises_the_sharding_error(device_type: str, ndim: int) -> None:
    """Raised from a Python method (``x.to``, ``x.new_zeros``; a 3-d array's torch-function hook)
    in Dynamo's fake run, the ShardingError became a TorchRuntimeError: ``except ShardingError``
    missed it under torch.compile, while the same check at the aten level surfaced."""
    mesh = sf.Mesh((2,), ("x",), backend="local", device_type=device_type)
    x = sf.distribute(torch.randn((4, 6, 2)[:ndim]), P("x"), mesh=mesh)
    other = _OTHER[device_type]
    for f in (lambda a: a.to(other) + 1, lambda a: a.to("cuda"), lambda a: torch.zeros_like(a, device=other),
              lambda a: a.new_zeros((2,), device=other)):
        torch._dynamo.reset()
        with pytest.raises(sf.ShardingError, match=rf"device='({other}|cuda)'.*'{device_type}'"):
            torch.compile(f, backend="eager")(x)
    torch._dynamo.reset()
    y = torch.compile(lambda a: a.to(device_type, torch.float64) * 2, backend="eager")(x)  # its own device: compiles
    assert _shards(y) == {(device_type, torch.float64)} and y.spec == x.spec


# -- local_map / shard_map outputs ---------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 5])
def test_local_map_outputs_move_onto_the_mesh_device(n: int) -> None:
    """A body's new (CPU) tensors on a meta mesh stayed on the CPU: the output array lived on
    its meta mesh with every shard on the CPU (shard_map moved them, local_map did not)."""
    mesh = sf.Mesh((2,), ("x",), backend="local", device_type="meta")
    x = sf.distribute(torch.randn(n, 3), P("x"), mesh=mesh)
    y, z = sf.local_map(lambda a: (torch.zeros(a.shape[0], 2), torch.tensor(3)), out_specs=(P("x"), P()),
                        in_specs=(P("x"),), mesh=mesh)(x)
    assert _shards(y) == {("meta", torch.float32)} and y.shape == (n, 2) and y.device.type == "meta"
    assert _shards(z) == {("meta", torch.int64)} and z.shape == ()


@pytest.mark.parametrize("transform", ["local_map", "shard_map"])
def test_devices_returning_different_dtypes_is_a_sharding_error(transform: str) -> None:
    """Was an array reporting the first device's dtype with a shard of another (float32 over a
    float64 shard): one array has one dtype."""
    mesh = sf.Mesh((2,), ("x",), backend="local")
    x = sf.distribute(torch.randn(5, 3), P("x"), mesh=mesh)

    def body(a: torch.Tensor) -> torch.Tensor:  # the device with 2 rows makes float64
        return torch.zeros(a.shape[0], 2, dtype=torch.float64 if a.shape[0] == 2 else torch.float32)

    f = (sf.local_map(body, out_specs=P("x"), in_specs=(P("x"),), mesh=mesh) if transform == "local_map"
         else sf.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    with pytest.raises(sf.ShardingError, match=r"different dtypes \(device 0: torch.float32, device 1: torch.float64\)"):
        f(x)


# -- found by the op sweep on CPU and meta meshes ------------------------------------------------


@pytest.mark.parametrize(("shapes", "spec"), [
    (((1, 3), (5, 3)), P("x")), (((5, 3), (1, 3)), P("x")), (((5, 1, 3), (5, 4, 3)), P("x")),
    (((5, 1, 3), (5, 4, 3)), P(None, "x")), (((1, 4, 3), (5, 1, 3)), P("x")), (((1, 4, 3), (5, 1, 3)), P(None, "x")),
], ids=str)
def test_cross_of_a_broadcast_dim_sharded_equals_torch(shapes: tuple, spec: P) -> None:
    """linalg_cross broadcasts a size-1 dim; its rule (the along-a-dim family) split that dim like
    the output's, so the input's piece on device 1 was empty beside the other's rows: 'The size of
    tensor a (0) must match the size of tensor b (2)'."""
    mesh = sf.Mesh((2,), ("x",), backend="local")
    a, b = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes)
    x, y = (sf.distribute(t.detach(), spec, mesh=mesh).requires_grad_() for t in (a, b))
    out, want = torch.linalg.cross(x, y), torch.linalg.cross(a, b)
    torch.testing.assert_close(out.full_tensor(), want)
    got = torch.autograd.grad((out * out).sum(), (x, y))
    for g, w in zip(got, torch.autograd.grad((want * want).sum(), (a, b))):
        torch.testing.assert_close(g.full_tensor(), w)


@pytest.mark.parametrize(("dtype", "wdtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32)], ids=str)
def test_layer_norm_statistics_on_a_cpu_mesh_have_the_cpu_kernels_dtype(dtype: torch.dtype, wdtype: torch.dtype) -> None:
    """The CPU kernel returns a bfloat16 input's mean and rstd in bfloat16, its meta kernel (CUDA's
    rule) in float32: on a CPU mesh the arrays reported float32 over bfloat16 shards."""
    mesh = sf.Mesh((2,), ("x",), backend="local")
    x, w = torch.randn(4, 2, 3, dtype=dtype), torch.randn(3, dtype=wdtype)
    want = torch.native_layer_norm(x, (3,), w, None, 1e-5)
    for spec in (P("x"), P(None, "x"), P()):
        out = torch.native_layer_norm(sf.distribute(x, spec, mesh=mesh), (3,), sf.distribute(w, P(), mesh=mesh), None, 1e-5)
        for o, t in zip(out, want):
            assert o.dtype == t.dtype and _shards(o) == {("cpu", t.dtype)}
            torch.testing.assert_close(o.full_tensor(), t)
    # through autograd: values and gradients against torch's
    xs = sf.distribute(x, P("x"), mesh=mesh).requires_grad_()
    xt = x.clone().requires_grad_()
    y, yt = torch.nn.functional.layer_norm(xs, (3,)), torch.nn.functional.layer_norm(xt, (3,))
    torch.testing.assert_close(y.full_tensor(), yt)
    (g,), (gt,) = torch.autograd.grad(y.float().pow(2).sum(), (xs,)), torch.autograd.grad(yt.float().pow(2).sum(), (xt,))
    assert g.dtype == gt.dtype and _shards(g) == {("cpu", dtype)}
    torch.testing.assert_close(g.full_tensor(), gt, rtol=2e-2, atol=2e-2)
    # under torch.compile the traced statistics are typed as the run's
    torch._dynamo.reset()
    stats = torch.compile(lambda a: torch.native_layer_norm(a, (3,), None, None, 1e-5)[1] * 2, backend="aot_eager")(
        sf.distribute(x, P("x"), mesh=mesh))
    plain = torch.native_layer_norm(x, (3,), None, None, 1e-5)[1] * 2
    assert stats.dtype == plain.dtype and _shards(stats) == {("cpu", plain.dtype)}
    torch.testing.assert_close(stats.full_tensor(), plain)


# -- the cast matrix: every spelling, dtypes of every kind, uneven shards, 0-d -------------------

_CASTS = {
    "to(dtype)": lambda a, dt, dev: a.to(dt),
    "to(device, dtype)": lambda a, dt, dev: a.to(dev, dt, non_blocking=True),
    "to(tensor)": lambda a, dt, dev: a.to(torch.empty(0, dtype=dt, device=dev)),
    "type_as": lambda a, dt, dev: a.type_as(torch.empty(0, dtype=dt, device=dev)),
    "_to_copy": lambda a, dt, dev: torch.ops.aten._to_copy(a, dtype=dt, device=torch.device(dev), layout=torch.strided),
}


def _values(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3
    return t > 0 if dtype == torch.bool else torch.complex(t, -t).to(dtype) if dtype.is_complex else t.to(dtype)


@pytest.mark.filterwarnings("ignore:Casting complex values to real")  # torch's, sharded and plain alike
@pytest.mark.parametrize("device_type", ["cpu", "meta"])
@pytest.mark.parametrize("src", [torch.float32, torch.int64, torch.bool, torch.complex64], ids=str)
def test_casts_keep_every_shard_on_the_mesh_device_and_match_torch(device_type: str, src: torch.dtype) -> None:
    """A mesh larger than the dim (8 devices, 5 rows: empty shards) and a 0-d array; each shard's
    device and dtype, the layout, and (CPU) the values against torch's cast of the whole."""
    mesh = sf.Mesh((8,), ("x",), backend="local", device_type=device_type)
    for shape, spec in (((5, 3), P("x")), ((), P())):
        t = _values(src, shape)
        x = sf.distribute(t, spec, mesh=mesh)
        for dst in (torch.float64, torch.bfloat16, torch.int32, torch.bool, torch.complex128):
            for name, cast in _CASTS.items():
                y, want = cast(x, dst, device_type), cast(t, dst, "cpu")
                assert y.dtype == want.dtype and y.spec == spec and y.device.type == device_type, name
                assert _shards(y) == {(device_type, want.dtype)}, name
                if device_type == "cpu":
                    torch.testing.assert_close(y.full_tensor(), want, msg=name)


@pytest.mark.parametrize(("src", "dst"), [(torch.bfloat16, torch.float64), (torch.float64, torch.float16),
                                          (torch.float32, torch.complex64)], ids=str)
def test_gradients_through_a_cast_reach_a_plain_source_with_its_dtype(src: torch.dtype, dst: torch.dtype) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t = torch.randn(5, 3, dtype=src, requires_grad=True)
    w = torch.randn(5, 3).to(dst)
    y = sf.distribute(t, P("dp", "tp"), mesh=mesh).to(dst)
    (g,) = torch.autograd.grad((y * sf.distribute(w, P("tp"), mesh=mesh)).abs().sum().full_tensor(), (t,))
    (want,) = torch.autograd.grad((t.to(dst) * w).abs().sum(), (t,))
    assert type(g) is torch.Tensor and g.dtype == src and g.device.type == "cpu"
    torch.testing.assert_close(g, want, rtol=1e-2, atol=1e-2)
