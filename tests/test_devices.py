"""The mesh owns the device: shards live on ``mesh.device_type`` (tested with meta meshes on CPU)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


def _devices(x: sf.ShardedArray) -> set[str]:
    return {s.device.type for s in x.local_shards()}


@pytest.fixture
def meta_mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")


def test_distribute_moves_a_cpu_tensor_onto_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    assert _devices(x) == {"meta"} and x.device.type == "meta" and x.spec == P("dp", "tp")
    w = sf.distribute(torch.randn(6, 8), P("tp", None), mesh=meta_mesh)
    y = torch.relu(x @ w + 1)  # ops keep the shards there
    assert _devices(y) == {"meta"} and y.shape == (4, 8)


def test_from_local_moves_shards_onto_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    shards = [torch.randn(2, 3) for _ in range(4)]
    x = sf.ShardedArray.from_local(shards, P("dp", "tp"), mesh=meta_mesh)
    assert _devices(x) == {"meta"} and x.shape == (4, 6)


def test_from_local_replicated_over_an_axis_on_a_meta_mesh(meta_mesh: sf.Mesh) -> None:
    # replicas are compared for equal values; meta shards hold none, so only shapes are checked
    for shards in ([torch.randn(2, 6) for _ in range(4)], [torch.empty(2, 6, device="meta") for _ in range(4)]):
        x = sf.ShardedArray.from_local(shards, P("dp"), mesh=meta_mesh)
        assert _devices(x) == {"meta"} and x.shape == (4, 6) and x.spec == P("dp")
    with pytest.raises(sf.ShardingError, match="shard"):
        sf.ShardedArray.from_local([torch.empty(2, 6, device="meta")] * 3 + [torch.empty(3, 6, device="meta")],
                                   P("dp"), mesh=meta_mesh)


def test_factories_and_random_on_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    for x in (sf.zeros((4, 6), sharding=P("dp", "tp"), mesh=meta_mesh),
              sf.random.normal(sf.random.key(0), (4, 6), sharding=P("dp"), mesh=meta_mesh)):
        assert _devices(x) == {"meta"}


def test_cast_keeps_layout_and_device(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (x.to(torch.float64), x.to("meta", torch.bfloat16), x.double(), x.to(device="meta")):
        assert y.spec == P("dp", "tp") and _devices(y) == {"meta"} and isinstance(y, sf.ShardedArray)
    assert x.to(torch.float64).dtype == torch.float64


def test_cast_on_cpu_mesh_values_and_grad() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh).requires_grad_()
    y = x.to("cpu", torch.float64)
    assert y.spec == P("dp", "tp") and y.dtype == torch.float64
    torch.testing.assert_close(y.full_tensor(), t.double())
    (g,) = torch.autograd.grad((y * y).sum(), (x,))
    assert g.dtype == torch.float32 and g.spec == P("dp", "tp")
    torch.testing.assert_close(g.full_tensor(), 2 * t)


def test_move_to_another_device_type_is_a_sharding_error() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    x = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"_to_copy\(device='meta'\).*mesh's device type 'cpu'.*full_tensor"):
        x.to("meta")


def test_distribute_keeps_gradients_flowing_to_a_tensor_on_its_device() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    t = torch.randn(4, 4, requires_grad=True)
    (g,) = torch.autograd.grad((sf.distribute(t, P("x"), mesh=mesh) * 3).sum().full_tensor(), (t,))
    torch.testing.assert_close(g, torch.full((4, 4), 3.0))


# -- factories, shard_map, optimizer states, checkpoints: on the mesh's device --------------------


def test_like_and_new_factories_land_on_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (torch.zeros_like(x), torch.ones_like(x), torch.empty_like(x), torch.full_like(x, 2.0),
              torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 10), torch.zeros_like(x, device="meta"),
              torch.zeros_like(x, dtype=torch.float64)):
        assert isinstance(y, sf.ShardedArray) and _devices(y) == {"meta"} and y.spec == P("dp", "tp")
    for y in (x.new_zeros((3, 3)), x.new_ones((3,)), x.new_empty((2, 2)), x.new_full((2,), 1.0)):
        assert _devices(y) == {"meta"} and y.spec == P()
    for y in (sf.ones((4, 6), sharding=P("dp"), mesh=meta_mesh), sf.full((4, 6), 3.0, sharding=P("tp"), mesh=meta_mesh),
              sf.empty((4, 6), sharding=P("dp"), mesh=meta_mesh),
              sf.random.uniform(sf.random.key(1), (4, 6), sharding=P("dp", "tp"), mesh=meta_mesh)):
        assert _devices(y) == {"meta"}


@pytest.mark.parametrize("call", [
    lambda x: torch.zeros_like(x, device="cpu"),
    lambda x: torch.randn_like(x, device="cpu"),
    lambda x: x.new_zeros((2, 2), device="cpu"),
    lambda x: x.cpu(),
    lambda x: x.to("cpu", torch.float64),
    lambda x: x.to(torch.zeros(1, dtype=torch.float16)),  # dtype and device of another tensor
    lambda x: x.type("torch.DoubleTensor"),  # a CPU tensor type
    lambda x: torch.ops.aten._to_copy(x, dtype=torch.float16, device=torch.device("cpu")),
], ids=["zeros_like", "randn_like", "new_zeros", "cpu", "to_cpu_dtype", "to_tensor", "type_str", "_to_copy"])
def test_another_device_type_is_a_sharding_error_naming_both(meta_mesh: sf.Mesh, call) -> None:  # noqa: ANN001
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    with pytest.raises(sf.ShardingError, match=r"device='cpu'.*mesh's device type 'meta'"):
        call(x)


def test_casts_keep_layout_and_device_and_match_torch() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t = torch.randn(4, 6)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh)
    casts = [lambda a: a.double(), lambda a: a.half(), lambda a: a.bfloat16(), lambda a: a.float(),
             lambda a: a.type(torch.float64), lambda a: a.to(torch.int32), lambda a: a.to("cpu", torch.float16),
             lambda a: a.to(torch.float64, non_blocking=True), lambda a: a.to(torch.zeros(1, dtype=torch.bfloat16)),
             lambda a: a.to("cpu:0", torch.float64)]
    for cast in casts:
        y = cast(x)
        assert y.spec == P("dp", "tp") and _devices(y) == {"cpu"}
        torch.testing.assert_close(y.full_tensor(), cast(t))
    assert x.to(torch.float32) is x and x.to("cpu") is x  # nothing to change: torch returns self
    y = x.to(torch.float32, copy=True)
    assert y is not x and y.spec == x.spec
    torch.testing.assert_close(y.full_tensor(), t)
    assert x.type() == t.type() and x.is_cpu and not x.is_cuda


def test_cast_to_the_meta_mesh_device_with_dtype_in_one_call(meta_mesh: sf.Mesh) -> None:
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    for y in (x.to("meta", torch.float16), x.to(device="meta", dtype=torch.bfloat16, copy=True),
              x.to(torch.empty(0, dtype=torch.float64, device="meta")), x.type(torch.float64)):
        assert _devices(y) == {"meta"} and y.spec == P("dp", "tp") and y.dtype != torch.float32


def test_memory_format_follows_torch() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t = torch.randn(2, 4, 3, 3)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh)
    for y, want in ((x.to(memory_format=torch.channels_last), t.to(memory_format=torch.channels_last)),
                    (x.contiguous(memory_format=torch.channels_last), t.contiguous(memory_format=torch.channels_last))):
        assert y.stride() == want.stride() and y.is_contiguous(memory_format=torch.channels_last)
        assert all(s.is_contiguous(memory_format=torch.channels_last) for s in y.local_shards())
        torch.testing.assert_close(y.full_tensor(), want)


def test_shard_map_outputs_move_onto_the_mesh_device(meta_mesh: sf.Mesh) -> None:
    """A body's new (CPU) tensors land on the mesh's device, even shards (vmapped body) and uneven ones."""
    mesh = sf.Mesh((2,), ("x",), backend="local", device_type="meta")
    f = sf.shard_map(lambda a: torch.zeros(a.shape[0], 2), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    for n in (4, 5):
        y = f(sf.distribute(torch.randn(n, 3), P("x"), mesh=mesh))
        assert _devices(y) == {"meta"} and y.device.type == "meta" and y.shape == (n, 2)
    g = sf.shard_map(lambda a: torch.ones(2, 3), mesh=meta_mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))
    assert _devices(g(sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh))) == {"meta"}


@pytest.mark.parametrize("kwargs", [dict(foreach=True), dict(fused=True), dict(foreach=False)],
                         ids=["foreach", "fused", "for_loop"])
@pytest.mark.parametrize("opt", ["AdamW", "Adam", "SGD"])
def test_optimizer_states_on_the_mesh_device(meta_mesh: sf.Mesh, opt: str, kwargs: dict) -> None:
    params = {"w": sf.distribute(torch.randn(8, 6), P("dp", "tp"), mesh=meta_mesh),
              "b": sf.distribute(torch.randn(5), P("tp"), mesh=meta_mesh)}  # uneven
    extra = {"momentum": 0.9} if opt == "SGD" else {}
    o = getattr(sf.optim, opt)(1e-2, **kwargs, **extra)
    state = o.init(params)
    grads = {k: v * 0.5 for k, v in params.items()}
    for _ in range(2):
        params, state = o.step(params, grads, state)
    for k, p in params.items():
        assert _devices(p) == {"meta"} and p.spec == (P("dp", "tp") if k == "w" else P("tp"))
        for v in state[k].values():
            if isinstance(v, sf.ShardedArray):
                assert _devices(v) == {"meta"} and v.spec == p.spec


def test_checkpoint_loads_onto_the_mesh_device(tmp_path, meta_mesh: sf.Mesh) -> None:  # noqa: ANN001
    cpu_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    t, b = torch.randn(4, 6), torch.randn(3)
    sf.checkpoint.save(str(tmp_path), {"w": sf.distribute(t, P("dp", "tp"), mesh=cpu_mesh), "b": b})
    out = sf.checkpoint.load(str(tmp_path), {"w": sf.NamedSharding(meta_mesh, P("tp")), "b": torch.zeros(3)})
    assert _devices(out["w"]) == {"meta"} and out["w"].spec == P("tp") and out["w"].shape == (4, 6)
    torch.testing.assert_close(out["b"], b)
    back = sf.checkpoint.load(str(tmp_path), {"w": sf.NamedSharding(cpu_mesh, P(None, "dp")), "b": b})
    torch.testing.assert_close(back["w"].full_tensor(), t)


# -- mixed devices ---------------------------------------------------------------------------------


def test_arrays_of_meshes_of_different_device_types_do_not_mix(meta_mesh: sf.Mesh) -> None:
    cpu_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    a = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    b = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=cpu_mesh)
    with pytest.raises(sf.ShardingError, match=r"different meshes.*'cpu'.*'meta'"):
        a + b


def test_plain_tensors_with_a_meta_mesh_array_follow_torch(meta_mesh: sf.Mesh) -> None:
    """As with CUDA tensors: a 0-d CPU tensor takes part, CPU indices index, a CPU tensor with
    dims is on the wrong device."""
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    y = x * torch.tensor(2.0)
    assert _devices(y) == {"meta"} and y.spec == P("dp", "tp")
    z = x[torch.tensor([0, 2])]
    assert _devices(z) == {"meta"} and z.shape == (2, 6)
    with pytest.raises(RuntimeError, match="device"):
        x + torch.randn(4, 6)


@pytest.mark.parametrize("op", ["add", "matmul", "linear", "where"])
def test_a_plain_operand_on_another_device_raises_naming_it(meta_mesh: sf.Mesh, op: str) -> None:
    """Meta kernels do not check devices (``meta @ cpu`` returns), so ``x @ cpu_tensor`` on a meta
    mesh made an array living on the CPU, off its mesh; a CUDA mesh's kernels raise torch's
    error. Either way: a ShardingError naming the argument, before any kernel runs."""
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=meta_mesh)
    calls = {"add": lambda: x + torch.randn(4, 6), "matmul": lambda: x @ torch.randn(6, 2),
             "linear": lambda: torch.nn.functional.linear(x, torch.randn(3, 6)),
             "where": lambda: torch.where(x > 0, x, torch.randn(4, 6))}
    with pytest.raises(sf.ShardingError, match=r"argument '\w+' \(position \d\) is a plain tensor on cpu.*'meta'"):
        calls[op]()
    cpu_mesh = sf.Mesh((2,), ("x",), backend="local")
    y = sf.distribute(torch.randn(4, 6), P("x"), mesh=cpu_mesh)
    with pytest.raises(sf.ShardingError, match=r"plain tensor on meta.*'cpu'"):
        y @ torch.randn(6, 2, device="meta")
    torch.testing.assert_close((y * torch.tensor(2.0)).full_tensor(), y.full_tensor() * 2)


def test_a_meta_tensor_cannot_be_distributed_onto_a_data_mesh() -> None:
    mesh = sf.Mesh((2,), ("x",), backend="local")
    with pytest.raises(sf.ShardingError, match=r"meta tensor.*no data.*'cpu'"):
        sf.distribute(torch.empty(4, 4, device="meta"), P("x"), mesh=mesh)


def test_collectives_on_a_meta_mesh_are_counted(meta_mesh: sf.Mesh) -> None:
    """Meta values are a meta mesh's data: its moves are counted as on an accelerator."""
    x = sf.distribute(torch.randn(4, 8), P(None, "tp"), mesh=meta_mesh)
    w = sf.distribute(torch.randn(8, 4), P("tp"), mesh=meta_mesh)
    with sf.debug.CommCounter() as cc:
        sf.reshard(x, P())
        sf.reshard(x @ w, P())
    assert dict(cc.counts) == {"all_gather": 1, "all_reduce": 1}
