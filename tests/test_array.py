import optree
import pytest
import torch

import shardfn as sf
from shardfn import ImmutableError, P, Replicate, Shard, ShardedArray, ShardingError
from shardfn.debug import CommCounter


def test_distribute_and_full_tensor(mesh24):
    t = torch.randn(7, 5)
    x = sf.distribute(t, P("x", "y"), mesh=mesh24)
    assert isinstance(x, ShardedArray) and x.shape == (7, 5) and x.dtype == t.dtype
    assert x.spec == P("x", "y") and x.placements == (Shard(0), Shard(1)) and x.mesh == mesh24
    out = x.full_tensor()
    assert type(out) is torch.Tensor and out.is_contiguous() and torch.equal(out, t)
    assert torch.equal(sf.gather(x), t) and torch.equal(sf.device_put(t, P(), mesh=mesh24).full_tensor(), t)
    assert [tuple(s.shape) for s in x.local_shards()] == [(4, 2), (4, 2), (4, 1), (4, 0), (3, 2), (3, 2), (3, 1), (3, 0)]


def test_sharding_from_current_mesh_and_placements(mesh22):
    t = torch.arange(8.0).reshape(4, 2)
    with mesh22:
        x = sf.distribute(t, (Replicate(), Shard(-2)))
    assert x.spec == P("y") and torch.equal(x.local_shards()[1], t[2:])


def test_even_values_are_stacked_and_uneven_ones_listed(mesh24):
    even = sf.distribute(torch.randn(8, 8), P("x", "y"), mesh=mesh24)
    uneven = sf.distribute(torch.randn(7, 8), P("x", "y"), mesh=mesh24)
    assert isinstance(even._local, torch.Tensor) and even._local.shape == (2, 4, 4, 2)
    assert isinstance(uneven._local, tuple) and len(uneven._local) == 8
    rep = sf.distribute(torch.randn(3, 3), P(), mesh=mesh24)
    assert rep._local.shape == (1, 1, 3, 3)  # each distinct shard stored once
    half = sf.distribute(torch.randn(8, 3), P("x"), mesh=mesh24)
    assert half._local.shape == (2, 1, 4, 3)  # the same on every device of 'y'
    assert [s.shape for s in half.local_shards()] == [(4, 3)] * 8


def test_ops_on_compact_values_match_torch(mesh24):
    """Mixed compact layouts broadcast over the mesh dims and give the unsharded values."""
    a, b, w = torch.randn(8, 6), torch.randn(6), torch.randn(6, 4)
    xa = sf.distribute(a, P("x"), mesh=mesh24)
    xb = sf.distribute(b, P(), mesh=mesh24)
    xw = sf.distribute(w, P(None, "y"), mesh=mesh24)
    mm = (xa + xb).relu() @ xw
    assert mm._local.shape == (2, 4, 4, 1)
    out = mm.softmax(-1)
    torch.testing.assert_close(out.full_tensor(), ((a + b).relu() @ w).softmax(-1))
    s = (xa * 2).sum(0)
    torch.testing.assert_close(s.full_tensor(), (a * 2).sum(0))
    r = xa.reshape(2, 4, 6).transpose(0, 1)
    torch.testing.assert_close(r.full_tensor(), a.reshape(2, 4, 6).transpose(0, 1))


def test_distribute_into_partial_keeps_the_value(mesh24):
    t = torch.randn(4, 4)
    for op in ("sum", "avg", "max", "min"):
        x = sf.distribute(t, P(partial={"y": op}), mesh=mesh24)
        torch.testing.assert_close(x.full_tensor(), t)


def test_from_local_infers_uneven_global_shape(mesh24):
    t = torch.randn(7, 5)
    shards = [s.clone() for s in sf.distribute(t, P("x", "y"), mesh=mesh24).local_shards()]
    x = ShardedArray.from_local(shards, P("x", "y"), mesh=mesh24)
    assert x.shape == (7, 5) and torch.equal(x.full_tensor(), t)
    y = ShardedArray.from_local(shards, P("x", "y"), mesh=mesh24, shape=(7, 5), stride=(5, 1))
    assert y.stride() == (5, 1)


def test_from_local_rejects_shards_that_do_not_fit(mesh24):
    shards = [torch.zeros(4, 2) for _ in range(8)]
    with pytest.raises(ShardingError, match="shard 2 .* has shape \\(4, 2\\).* shard of shape \\(4, 1\\)"):
        ShardedArray.from_local(shards, P("x", "y"), mesh=mesh24, shape=(7, 5))
    shards = [s.clone() for s in sf.distribute(torch.zeros(7, 5), P("x", "y"), mesh=mesh24).local_shards()]
    shards[3] = torch.zeros(4, 3)
    with pytest.raises(ShardingError, match=r"shard 2 .*\(4, 1\).*inferred.*pass shape="):
        ShardedArray.from_local(shards, P("x", "y"), mesh=mesh24)
    # replicated dims must agree across devices
    bad = [torch.zeros(2, 3) for _ in range(7)] + [torch.zeros(2, 4)]
    with pytest.raises(ShardingError, match="shard 7"):
        ShardedArray.from_local(bad, P("x"), mesh=mesh24)


def test_from_local_needs_a_mesh():
    with pytest.raises(ShardingError, match="from_local needs a mesh"):
        ShardedArray.from_local([torch.zeros(2)], P("x"))


def test_from_local_wrong_number_of_shards(mesh24):
    with pytest.raises(ShardingError, match="got 3 local shards but .* has 8 devices"):
        ShardedArray.from_local([torch.zeros(1)] * 3, P(), mesh=mesh24)
    with pytest.raises(ShardingError, match="list of 8 tensors"):
        ShardedArray.from_local(torch.zeros(3), P(), mesh=mesh24)


def test_to_local_from_local_of_partial_is_a_noop_for_values_and_grads(mesh24):
    parts = [torch.randn(3, 2, requires_grad=True) for _ in range(8)]
    x = ShardedArray.from_local(parts, P(partial=("x", "y")), mesh=mesh24)
    y = ShardedArray.from_local(x.to_local(), x.sharding)
    assert y.spec == x.spec
    torch.testing.assert_close(y.full_tensor(), sum(p.detach() for p in parts))
    w = torch.randn(3, 2)
    (y.full_tensor() * w).sum().backward()
    for p in parts:
        torch.testing.assert_close(p.grad, w)  # replicate gradient, no division


def test_from_local_partial_avg_and_max_gradients(mesh22):
    # replicated over 'x': devices 0/2 and 1/3 hold equal parts (from_local checks that)
    parts = [torch.tensor([float(i % 2), 5.0 - i % 2], requires_grad=True) for i in range(4)]
    x = ShardedArray.from_local(parts, P(partial={"y": "avg"}), mesh=mesh22)
    x.full_tensor().sum().backward()
    assert all(torch.equal(p.grad, torch.full((2,), 0.5)) for p in parts)
    parts = [torch.tensor([float(i % 2), 5.0 - i % 2], requires_grad=True) for i in range(4)]
    x = ShardedArray.from_local(parts, P(partial={"y": "max"}), mesh=mesh22)
    torch.testing.assert_close(x.full_tensor(), torch.tensor([1.0, 5.0]))
    x.full_tensor().sum().backward()
    assert [p.grad.tolist() for p in parts] == [[0, 1], [1, 0], [0, 1], [1, 0]]


def test_to_local_grad_sharding(mesh22):
    t = torch.randn(4, 4, requires_grad=True)
    x = sf.distribute(t, P("x"), mesh=mesh22)
    locals_ = x.to_local(grad_sharding=P("x", partial="y"))
    sum(l.sum() for l in locals_).backward()
    # each device contributes a ones gradient; summed over 'y' (2 devices) -> 2
    torch.testing.assert_close(t.grad, torch.full((4, 4), 2.0))


def test_tensor_flatten_round_trip(mesh24):
    for shape in [(8, 8), (7, 5)]:
        x = sf.distribute(torch.randn(shape), P("x", "y"), mesh=mesh24)
        names, ctx = x.__tensor_flatten__()
        inner = {n: getattr(x, n) for n in names}
        y = ShardedArray.__tensor_unflatten__(inner, ctx, x.shape, x.stride())
        assert y.spec == x.spec and torch.equal(y.full_tensor(), x.full_tensor())


def test_optree_leaf_by_default_and_node_in_the_shardfn_namespace(mesh24):
    x = sf.distribute(torch.randn(8, 8), P("x", "y"), mesh=mesh24)
    params = {"w": x, "b": torch.ones(2)}
    assert optree.tree_leaves(params)[1] is x
    doubled = optree.tree_map(lambda a: a * 2, params)
    torch.testing.assert_close(doubled["w"].full_tensor(), 2 * x.full_tensor())
    leaves, spec = optree.tree_flatten(x, namespace="shardfn")
    assert len(leaves) == 1 and leaves[0].shape == (2, 4, 4, 2)
    y = optree.tree_unflatten(spec, leaves)
    assert isinstance(y, ShardedArray) and torch.equal(y.full_tensor(), x.full_tensor())
    u = sf.distribute(torch.randn(7, 5), P("x", "y"), mesh=mesh24)
    assert len(optree.tree_leaves(u, namespace="shardfn")) == 8


@pytest.mark.parametrize(
    "mutate, op, hint",
    [
        (lambda x: x.add_(1), "aten.add_", "torch.add"),
        (lambda x: x.mul_(2), "aten.mul_", "torch.mul"),
        (lambda x: x.zero_(), "aten.zero_", "zeros_like"),
        (lambda x: x.copy_(torch.zeros(4, 4)), "aten.copy_", "reshard"),
        (lambda x: x.__setitem__(0, 1.0), "aten.fill_", "masked_fill"),
    ],
)
def test_in_place_ops_raise(mesh22, mutate, op, hint):
    x = sf.distribute(torch.ones(4, 4), P("x"), mesh=mesh22)
    with pytest.raises(ImmutableError, match=f"{op} would modify a ShardedArray in place.*{hint}"):
        mutate(x)
    assert torch.equal(x.full_tensor(), torch.ones(4, 4))  # nothing half-changed
    assert issubclass(ImmutableError, TypeError)


def test_gradient_accumulation_still_works(mesh22):
    x = sf.distribute(torch.randn(4, 4), P("x", "y"), mesh=mesh22).detach().requires_grad_()
    for _ in range(2):
        (x * 3.0).full_tensor().sum().backward()
    assert isinstance(x.grad, ShardedArray)
    torch.testing.assert_close(x.grad.full_tensor(), torch.full((4, 4), 6.0))


def test_redistribute_method_and_gradient_layout(mesh24):
    t = torch.randn(8, 6, requires_grad=True)
    x = sf.distribute(t, P("x"), mesh=mesh24)
    y = x.redistribute(P(None, "y"))
    assert y.spec == P(None, "y")
    y.full_tensor().pow(2).sum().backward()
    torch.testing.assert_close(t.grad, 2 * t.detach())


def test_comm_counter_counts_kinds_and_bytes(mesh24):
    x = sf.distribute(torch.randn(8, 8), P("x", "y"), mesh=mesh24)
    with CommCounter() as c:
        x.full_tensor()
        sf.reshard(x, P("x", "y"))  # no-op
        sf.reshard(x, P("y", "x"))
    # small values: the latency-aware planner gathers over both axes in one exchange
    assert c.counts == {"all_to_all": 2} and sum(c.counts.values()) == 2
    plan_bytes = (
        sf.plan_redistribute(P("x", "y"), P(), (8, 8), mesh=mesh24).bytes_per_device
        + sf.plan_redistribute(P("x", "y"), P("y", "x"), (8, 8), mesh=mesh24).bytes_per_device
    )
    assert c.bytes == plan_bytes
    with CommCounter() as c:
        sf.distribute(torch.randn(8, 8), P(partial="x"), mesh=mesh24)
    assert c.total == 0 and c.bytes == 0


def test_visualize_sharding(mesh24, capsys):
    x = sf.distribute(torch.randn(7, 5), P("x", "y"), mesh=mesh24)
    text = sf.debug.visualize_sharding(x)
    assert "device 3 (x=0, y=3): [0:4, 5:5]" in text and "device 4 (x=1, y=0): [4:7, 0:2]" in text
    assert text in capsys.readouterr().out


def test_repr_is_compact(mesh24):
    x = sf.distribute(torch.randn(7, 5), P("x", None), mesh=mesh24)
    assert "f32[7,5] P('x', None)" in repr(x)
    assert repr(x).startswith("ShardedArray([[")  # values first, as a tensor prints (tests/test_multiproc.py)


def test_format_spec_of_a_scalar_array_formats_its_value():
    """``f"{loss:.4f}"`` works on a 0-d array as on a 0-d tensor; other arrays reject a
    format spec as torch does."""
    mesh = sf.Mesh((2,), ("x",), backend="local")
    t = torch.arange(16.0).reshape(4, 4) / 7
    x = sf.distribute(t, P("x"), mesh=mesh)
    assert f"{x.sum():.4f}" == f"{t.sum():.4f}"
    assert f"{x.mean(dtype=torch.float64):10.2e}" == f"{t.mean(dtype=torch.float64):10.2e}"
    assert f"{x}" == str(x)
    with pytest.raises(TypeError):
        f"{x:.3f}"
