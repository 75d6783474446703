"""Bad arguments thrown at the public API (API.md): each raises the documented error, a
``ShardingError`` whose message names the offending argument, axis or dim, and nothing that
was passed in changes (issue 25's adversarial inputs)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

MESH = sf.Mesh((2, 2), ("x", "y"), backend="local")
OTHER = sf.Mesh((3,), ("x",), backend="local")
T = torch.arange(24.0).reshape(4, 6)

# a bad spec and a word its error must name
BAD_SPECS = st.sampled_from([
    (P("q"), "q"),  # an axis the mesh lacks
    (P(None, None, "x"), "3 entries"),  # longer than the rank
    (P(partial="zz"), "zz"),
    ((sf.Shard(0), sf.Shard(0), sf.Replicate()), "placements"),
    ("x", "sharding"),  # not a sharding
    ((sf.Shard(0),), "placements"),  # one placement for a mesh of two axes
    ((sf.Shard(2), sf.Replicate()), "Shard(2)"),
    (sf.NamedSharding(OTHER, P("x")), "Mesh(x=3"),  # another mesh
])


def _entry_points(bad):
    """Every public call that takes a sharding, given ``bad`` in that place."""
    x = sf.distribute(T, P("x"), mesh=MESH)
    body = lambda b: b  # noqa: E731
    return {
        "distribute": lambda: sf.distribute(T, bad, mesh=MESH),
        "device_put": lambda: sf.device_put(T, bad, mesh=MESH),
        "reshard": lambda: sf.reshard(x, bad),
        "redistribute": lambda: x.redistribute(bad),
        "with_sharding_constraint": lambda: sf.with_sharding_constraint(x, bad),
        "zeros": lambda: sf.zeros((4, 6), bad, mesh=MESH),
        "full": lambda: sf.full((4, 6), 2.0, bad, mesh=MESH),
        "random.normal": lambda: sf.random.normal(sf.random.key(0), (4, 6), bad, mesh=MESH),
        "from_local": lambda: sf.ShardedArray.from_local(x.local_shards(), bad, mesh=MESH),
        "shard_map in_specs": lambda: sf.shard_map(body, mesh=MESH, in_specs=(bad,), out_specs=P("x"))(T),
        "shard_map out_specs": lambda: sf.shard_map(body, mesh=MESH, in_specs=(P("x"),), out_specs=bad)(T),
        "local_map out_specs": lambda: sf.local_map(body, bad, mesh=MESH)(x),
        "matmul out_sharding": lambda: sf.matmul(x, x.mT @ x, out_sharding=bad),
        "einsum out_sharding": lambda: sf.einsum("ij,jk->ik", x, x.mT @ x, out_sharding=bad),
        "to_local grad_sharding": lambda: x.to_local(grad_sharding=bad),
    }


@settings(max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(BAD_SPECS, st.data())
def test_bad_shardings_raise_sharding_error_naming_them(bad_and_word, data):
    bad, word = bad_and_word
    calls = _entry_points(bad)
    name = data.draw(st.sampled_from(sorted(calls)))
    before = T.clone()
    with pytest.raises(sf.ShardingError) as info:
        calls[name]()
    assert word in str(info.value), f"{name}: {info.value}"
    assert torch.equal(T, before)


BAD_CALLS = {  # a call and a word its ShardingError must hold
    "P axis twice": (lambda: P("x", "x"), "'x'"),
    "P axis twice nested": (lambda: P(("y", "y")), "'y'"),
    "P axis twice partial": (lambda: P("x", partial="x"), "'x'"),
    "P entry": (lambda: P(0), "entry 0"),
    "P reduction": (lambda: P(partial={"x": "mul"}), "mul"),
    "Partial reduction": (lambda: sf.Partial("mul"), "mul"),
    "Shard dim": (lambda: sf.Shard("a"), "dim"),
    "distribute None": (lambda: sf.distribute(T, None, mesh=MESH), "sharding=None"),
    "reshard None": (lambda: sf.reshard(sf.distribute(T, P("x"), mesh=MESH), None), "sharding=None"),
    "NamedSharding mesh": (lambda: sf.NamedSharding("m", P("x")), "mesh"),
    "NamedSharding spec": (lambda: sf.NamedSharding(MESH, "x"), "spec"),
    "mesh shape -1": (lambda: sf.Mesh((2, -1), ("x", "y")), "-1"),
    "mesh names count": (lambda: sf.Mesh((2, 2), ("x",)), "axis_names"),
    "mesh names repeat": (lambda: sf.Mesh((2, 2), ("x", "x")), "'x'"),
    "mesh backend": (lambda: sf.Mesh((2,), ("x",), backend="bogus"), "bogus"),
    "axis_size": (lambda: MESH.axis_size("q"), "'q'"),
    "flatten order": (lambda: MESH.flatten(("y", "x"), "xy"), "adjacent"),
    "unflatten size": (lambda: MESH.unflatten("x", (3,), ("a",)), "axis 'x'"),
    "from_local count": (lambda: sf.ShardedArray.from_local([T[:2]], P("x"), mesh=MESH), "4 devices"),
    "from_local shape": (lambda: sf.ShardedArray.from_local([T[:2]] * 2 + [T[2:]] * 2, P("x"), mesh=MESH, shape=(5, 6)),
                         "(5, 6)"),
    "from_local stride": (lambda: sf.ShardedArray.from_local([T[:2]] * 2 + [T[2:]] * 2, P("x"), mesh=MESH, stride=(1,)),
                          "stride"),
    "from_local dtypes": (lambda: sf.ShardedArray.from_local([T[:2], T[:2].double(), T[2:], T[2:]], P("x"), mesh=MESH),
                          "shard 1"),
    "distribute a list": (lambda: sf.distribute([1, 2], P("x"), mesh=MESH), "list"),
    "no mesh": (lambda: sf.distribute(T, P("x")), "mesh"),
    "zeros shape": (lambda: sf.zeros((-1, 3), P("x"), mesh=MESH), "shape"),
    "mixed meshes": (lambda: sf.distribute(T, P("x"), mesh=MESH) + sf.distribute(T, P("x"), mesh=sf.Mesh((4,), ("x",))),
                     "different meshes"),
    "not a view": (lambda: sf.reshard(sf.distribute(T, P("x"), mesh=MESH), sf.NamedSharding(OTHER, P("x"))), "not a view"),
    "smap in_specs count": (lambda: sf.shard_map(lambda a: a, mesh=MESH, in_specs=(P("x"), P()), out_specs=P("x"))(T),
                            "in_specs"),
    "smap vma": (lambda: sf.shard_map(lambda a: a, mesh=MESH, in_specs=(P("x"),), out_specs=P())(T), "'x'"),
    "smap body str": (lambda: sf.shard_map(lambda a: "s", mesh=MESH, in_specs=(P("x"),), out_specs=P())(T), "str"),
    "smap axis_names": (lambda: sf.shard_map(lambda a: a, mesh=MESH, in_specs=(P("x"),), out_specs=P("x"),
                                             axis_names={"q"})(T), "'q'"),
    "smap other mesh": (lambda: sf.shard_map(lambda a: a, mesh=MESH, in_specs=(P("x"),), out_specs=P("x"))(
        sf.distribute(T, P("x"), mesh=OTHER)), "args[0]"),
    "psum axis": (lambda: sf.shard_map(lambda a: sf.lax.psum(a, "q"), mesh=MESH, in_specs=(P("x"),), out_specs=P())(T),
                  "'q'"),
    "psum outside": (lambda: sf.lax.psum(T, "x"), "outside"),
    "all_gather axis": (lambda: sf.shard_map(lambda a: sf.lax.all_gather(a, "x", axis=5), mesh=MESH, in_specs=(P("x"),),
                                             out_specs=P())(T), "axis=5"),
    "ppermute pair": (lambda: sf.shard_map(lambda a: sf.lax.ppermute(a, "x", [(0, 5)]), mesh=MESH, in_specs=(P("x"),),
                                           out_specs=P("x"))(T), "(0, 5)"),
    "all_to_all axis": (lambda: sf.shard_map(lambda a: sf.lax.all_to_all(a, "x", 7, 0), mesh=MESH, in_specs=(P("x"),),
                                             out_specs=P("x"))(T), "split_axis=7"),
    "smap in_axes": (lambda: sf.smap(lambda a: a, in_axes=5, out_axes=0, axis_name="x", mesh=MESH)(T), "in_axes=5"),
    "einsum equation": (lambda: sf.einsum("ij,jk->il", sf.distribute(T, P("x"), mesh=MESH), T.mT), "ij,jk->il"),
    "explicit mode": (lambda: sf.explicit(mode="bogus"), "bogus"),
    "plan shape": (lambda: sf.plan_redistribute(sf.NamedSharding(MESH, P("x")), sf.NamedSharding(MESH, P("y")), (4, -6)),
                   "shape"),
    "shard_params": (lambda: sf.nn.shard_params(torch.nn.Linear(4, 3), [(".*weight", P("q"))], mesh=MESH), "weight"),
    "visualize plain": (lambda: sf.debug.visualize_sharding(T), "ShardedArray"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_arguments_raise_sharding_error_naming_them(name):
    call, word = BAD_CALLS[name]
    with pytest.raises(sf.ShardingError) as info:
        call()
    assert word in str(info.value), str(info.value)


def test_shard_map_refuses_tensors_passed_by_keyword_and_non_bool_check_vma():
    """A keyword argument is not split by in_specs: a tensor there would reach every device
    whole (an (8, 6) result for a (4, 6) input), so it is refused naming the keyword;
    non-tensor keywords still pass; check_vma must be a bool ("no" is truthy)."""
    mesh = sf.Mesh((2,), ("x",), backend="local")
    x = torch.randn(4, 6)
    f = sf.shard_map(lambda a, k=2: a * k, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    torch.testing.assert_close(sf.gather(f(x, k=3)), x * 3)
    for kw in (dict(k=x), dict(k=sf.distribute(x, P("x"), mesh=mesh)), dict(k=[1, (x,)])):
        with pytest.raises(sf.ShardingTypeError, match="keyword argument k= holds a tensor"):
            f(x, **kw)
    with pytest.raises(sf.ShardingTypeError, match="check_vma='no'"):
        sf.shard_map(lambda a: a, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma="no")


def test_a_sharded_array_as_a_host_side_argument_names_it():
    """``scalars`` of the foreach ops is read on the host: torch wants a plain CPU tensor. A
    ShardedArray there raised a complaint about the global shapes; it names the argument
    and what to pass, and the plain tensor works."""
    mesh = sf.Mesh((2,), ("x",))
    a = [sf.distribute(torch.randn(4), P("x"), mesh=mesh) for _ in range(2)]
    s = sf.distribute(torch.tensor([0.5, 2.0]), P(), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"'scalars' is read on the host.*scalars\.full_tensor\(\)"):
        torch._foreach_addcmul(a, a, a, s)
    got = torch._foreach_addcmul(a, a, a, s.full_tensor())
    plain = [t.full_tensor() for t in a]
    for g, w in zip(got, torch._foreach_addcmul(plain, plain, plain, torch.tensor([0.5, 2.0])), strict=True):
        torch.testing.assert_close(g.full_tensor(), w)
