"""sf.nn: shard_params (rules, unmatched reporting, errors, meta materialisation), sf.nn.init,
distribute_module."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _alloc import Allocations, assert_shard_sized
from conftest import meshes, specs
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import shardfn as sf
from shardfn import P
from shardfn.values.layout import max_local_numel


class Block(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.emb = nn.Embedding(64, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.fc2(torch.relu(self.fc1(h)))


TP_RULES = [
    (r"qkv\.weight$", P("y", None), sf.nn.init.normal(std=0.02)),
    (r"qkv\.bias$", P("y"), sf.nn.init.zeros()),
    (r"proj\.weight$", P(None, "y"), sf.nn.init.normal(std=0.02)),
    (r"fc1\.weight$", P("y", None)),
    (r"fc1\.bias$", P("y")),
    (r"fc2\.weight$", P(None, "y")),
    (r"emb\.weight$", P("y", None)),
    (r"^ln\.", P()),
    (r"fc2\.bias$", P()),
]


def meta_block() -> Block:
    with torch.device("meta"):
        return Block()


# -- rule matching ---------------------------------------------------------------------------------


def test_first_matching_rule_wins(mesh24):
    model = Block()
    params = sf.nn.shard_params(model, [
        (r"fc1\.weight", P("x", "y")),
        (r"fc\d\.weight", P("y")),
        (r"(qkv|proj)\.weight", P(None, "x")),
        (r"weight", P("x")),
        (r".*", P()),
    ], mesh=mesh24)
    assert params["fc1.weight"].spec == P("x", "y")
    assert params["fc2.weight"].spec == P("y")
    assert params["qkv.weight"].spec == P(None, "x")
    assert params["ln.weight"].spec == P("x") and params["ln.bias"].spec == P()
    assert set(params) == {n for n, _ in model.named_parameters()}


def test_real_values_are_kept_and_gradients_enabled(mesh24):
    model = Block()
    params = sf.nn.shard_params(model, TP_RULES, mesh=mesh24)
    for name, p in model.named_parameters():
        assert torch.equal(sf.gather(params[name]), p.detach()), name
        assert params[name].requires_grad


def test_state_dict_input(mesh24):
    sd = {"a.weight": torch.randn(8, 4), "b": torch.arange(6)}
    params = sf.nn.shard_params(sd, [(r"^a\.", P("x"))], mesh=mesh24, unmatched="ignore")
    assert params["a.weight"].spec == P("x") and params["b"].spec == P()
    assert torch.equal(sf.gather(params["b"]), sd["b"])


def test_unmatched_parameters_are_replicated_and_reported(mesh24):
    with pytest.warns(sf.nn.UnmatchedParamsWarning, match=r"2 parameter\(s\).*ln\.weight, fc2\.bias"):
        params = sf.nn.shard_params(Block(), TP_RULES[:7] + [(r"ln\.bias", P())], mesh=mesh24)
    assert params["fc2.bias"]._layout.is_replicated() and params["ln.weight"]._layout.is_replicated()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.nn.shard_params(Block(), TP_RULES[:7], mesh=mesh24, unmatched="ignore")
    with pytest.raises(sf.ShardingError, match="ln.weight"):
        sf.nn.shard_params(Block(), TP_RULES[:7], mesh=mesh24, unmatched="error")


def test_spec_that_does_not_fit_names_parameter_shape_and_spec(mesh24):
    with pytest.raises(sf.ShardingError, match=r"'fc1\.bias' of shape \(128,\).*rule 0.*P\('x', 'y'\).*rank 1"):
        sf.nn.shard_params(Block(), [(r"fc1\.bias", P("x", "y"))], mesh=mesh24)
    with pytest.raises(sf.ShardingError, match=r"'fc1\.weight' of shape \(128, 32\).*P\('tp'\).*'tp'"):
        sf.nn.shard_params(Block(), [(r"fc1\.weight", P("tp"))], mesh=mesh24)


@pytest.mark.parametrize("rules,match", [
    ([("fc1", P(), "not callable")], "not callable"),
    ([("fc1",)], r"rules\[0\]"),
    ([("(", P())], "not a valid regex"),
    ("fc1", "list of"),
])
def test_bad_rules(mesh24, rules, match):
    with pytest.raises(sf.ShardingError, match=match):
        sf.nn.shard_params(Block(), rules, mesh=mesh24)


def test_unmatched_mode_is_checked(mesh24):
    with pytest.raises(sf.ShardingError, match="unmatched"):
        sf.nn.shard_params(Block(), [], mesh=mesh24, unmatched="loud")


def test_rules_as_a_dict_are_its_items_in_order(mesh24):
    model = Block()
    as_dict = sf.nn.shard_params(model, {r"fc1\.weight": P("y"), r"fc1": P("x"), r".*": P()}, mesh=mesh24)
    as_list = sf.nn.shard_params(model, [(r"fc1\.weight", P("y")), (r"fc1", P("x")), (r".*", P())], mesh=mesh24)
    assert as_dict["fc1.weight"].spec == P("y") and as_dict["fc1.bias"].spec == P("x")
    assert {k: v.spec for k, v in as_dict.items()} == {k: v.spec for k, v in as_list.items()}
    for name, p in model.named_parameters():
        assert torch.equal(sf.gather(as_dict[name]), p.detach()), name


# -- meta materialisation ------------------------------------------------------------------------------


def test_meta_model_is_materialised_shard_by_shard(mesh24):
    with Allocations() as rec:
        params = sf.nn.shard_params(meta_block(), TP_RULES, mesh=mesh24, key=sf.random.key(0))
    # the largest shard is 32 x 32 (fc1/fc2 weights over y=4); no temporary exceeds it,
    # while those weights are 4096 elements in full
    largest_shard = max(max_local_numel(p._layout, tuple(p.shape)) for p in params.values())
    assert largest_shard == 32 * 32
    assert rec.largest_temp() <= largest_shard < params["fc1.weight"].numel()
    for op, n in rec.storage:
        assert n <= largest_shard * mesh24.size, (op, n)
    for name, p in params.items():
        assert p.device.type == "cpu" and not p._layout.partial, name


@given(st.data())
def test_meta_init_never_allocates_a_full_parameter(data):
    mesh = data.draw(meshes())
    shape = tuple(data.draw(st.lists(st.sampled_from([4, 6, 8, 16]), min_size=2, max_size=3)))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    init = data.draw(st.sampled_from([sf.nn.init.normal(std=0.02), sf.nn.init.kaiming_uniform(a=math.sqrt(5)),
                                      sf.nn.init.ones(), sf.nn.init.xavier_normal()]))
    sd = {"w": torch.empty(shape, device="meta")}
    with Allocations() as rec:
        params = sf.nn.shard_params(sd, [("w", spec, init)], mesh=mesh, key=sf.random.key(1))
    assert_shard_sized(rec, params["w"])


def test_meta_values_do_not_depend_on_sharding_or_rule_order(mesh24):
    k = sf.random.key(5)
    a = sf.nn.shard_params(meta_block(), TP_RULES, mesh=mesh24, key=k)
    rules_b = [(r, P(), *rest) for r, _, *rest in reversed(TP_RULES)]
    b = sf.nn.shard_params(meta_block(), rules_b, mesh=sf.Mesh((1,), ("y",), backend="local"), key=k)
    for name in a:
        assert torch.equal(sf.gather(a[name]), sf.gather(b[name])), name


def test_meta_defaults_follow_torch_init(mesh24):
    params = sf.nn.shard_params(meta_block(), [(r"fc1\.weight", P("y"))], mesh=mesh24,
                                key=sf.random.key(0), unmatched="ignore")
    w = sf.gather(params["fc1.weight"])
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) on fan_in 32
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    b = sf.gather(params["fc1.bias"])
    assert b.abs().max() <= 1 / math.sqrt(32) and b.std() > 0
    assert torch.equal(sf.gather(params["ln.weight"]), torch.ones(32))
    assert torch.equal(sf.gather(params["ln.bias"]), torch.zeros(32))
    assert abs(sf.gather(params["emb.weight"]).std().item() - 1.0) < 0.1


def test_meta_without_init_is_an_error(mesh24):
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4, device="meta"))

    with pytest.raises(sf.ShardingError, match=r"'scale'.*meta device.*sf\.nn\.init"):
        sf.nn.shard_params(Custom(), [("scale", P("x"))], mesh=mesh24)


def test_key_none_follows_torch_seed(mesh24):
    torch.manual_seed(0)
    a = sf.nn.shard_params(meta_block(), TP_RULES, mesh=mesh24)
    torch.manual_seed(0)
    b = sf.nn.shard_params(meta_block(), TP_RULES, mesh=mesh24)
    assert all(torch.equal(sf.gather(a[n]), sf.gather(b[n])) for n in a)


def test_forward_with_sharded_params_matches_unsharded(mesh24):
    model = meta_block()
    params = sf.nn.shard_params(model, TP_RULES, mesh=mesh24, key=sf.random.key(0))
    dense = {n: sf.gather(p) for n, p in params.items()}
    x = torch.randn(4, 32)
    want = torch.func.functional_call(model, dense, (x,))
    got = torch.func.functional_call(model, params, (sf.distribute(x, P("x"), mesh=mesh24),))
    assert torch.allclose(sf.gather(got), want, atol=1e-5)


# -- sf.nn.init ---------------------------------------------------------------------------------------------


def test_init_statistics(mesh24):
    k = sf.random.key(3)
    shape, spec = (512, 256), P("x", "y")
    w = sf.gather(sf.nn.init.normal(std=0.02)(k, shape, spec, dtype=torch.float32, mesh=mesh24))
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    u = sf.gather(sf.nn.init.xavier_uniform()(k, shape, spec, dtype=torch.float32, mesh=mesh24))
    assert u.abs().max() <= math.sqrt(6 / (512 + 256))
    n = sf.gather(sf.nn.init.kaiming_normal(nonlinearity="relu")(k, shape, spec, dtype=torch.float32, mesh=mesh24))
    assert abs(n.std().item() - math.sqrt(2 / 256)) < 0.003
    c = sf.gather(sf.nn.init.constant(0.5)(k, shape, spec, dtype=torch.float16, mesh=mesh24))
    assert c.dtype == torch.float16 and torch.equal(c, torch.full(shape, 0.5, dtype=torch.float16))
    assert torch.equal(sf.nn.init.uniform(1.0, 1.0)(k, (3,), None, dtype=torch.float32), torch.ones(3))


def test_init_argument_errors():
    with pytest.raises(ValueError, match="a <= b"):
        sf.nn.init.uniform(2.0, 1.0)
    with pytest.raises(ValueError, match="mode"):
        sf.nn.init.kaiming_uniform(mode="fan_sideways")


# -- distribute_module ------------------------------------------------------------------------------------


def test_distribute_module(mesh24):
    model = Block()
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def partition(name: str, mod: nn.Module, mesh: sf.Mesh) -> None:
        if isinstance(mod, nn.Linear) and name == "fc1":
            mod.weight = nn.Parameter(sf.distribute(mod.weight.detach(), P("y"), mesh=mesh))

    def input_fn(mod: nn.Module, inputs: tuple, mesh: sf.Mesh) -> tuple:
        seen.append(mod)
        return tuple(sf.distribute(t, P(getattr(mod, "batch_axis", None)), mesh=mesh) for t in inputs)

    def output_fn(mod: nn.Module, outputs: torch.Tensor, mesh: sf.Mesh) -> torch.Tensor:
        return sf.gather(outputs)

    model.batch_axis = "x"
    out_mod = sf.nn.distribute_module(model, mesh24, partition, input_fn, output_fn)
    assert out_mod is model and model.fc1.weight.spec == P("y")
    assert isinstance(model.fc1.weight, nn.Parameter) and isinstance(model.fc2.weight, sf.ShardedArray)
    assert model.fc2.weight._layout.is_replicated()
    x = torch.randn(4, 32)
    out = model(x)
    assert seen == [model] and type(out) is torch.Tensor
    assert torch.allclose(out, torch.func.functional_call(Block(), dense, (x,)), atol=1e-5)
    out.sum().backward()
    assert isinstance(model.fc1.weight.grad, sf.ShardedArray)


def test_distribute_module_checks_hook_signatures(mesh24):
    with pytest.raises(TypeError, match=r"input_fn takes \(module, inputs, mesh\)"):
        sf.nn.distribute_module(nn.Linear(2, 2), mesh24, input_fn=lambda inputs, mesh: inputs)
