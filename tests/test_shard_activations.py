"""sf.nn.shard_activations: activation layouts by regex over submodule names; sequence- and
vocabulary-parallel recipes on Hugging Face Llama (tiny config) against the unsharded model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf
from shardfn import P

transformers = pytest.importorskip("transformers")

LAYERS = 2
SP = P("dp", "tp")
TP_RULES = [(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("tp", None)),
            (r"(o_proj|down_proj)\.weight$", P(None, "tp"))]
# Megatron's sequence parallelism: the residual stream split over the sequence, each norm's
# output gathered once for the column-parallel projections, each block's output reduce-scattered.
SP_RECIPE = [(r"embed_tokens$", None, SP),
             (r"(self_attn|mlp)$", None, {0: SP}),
             (r"(input_layernorm|post_attention_layernorm|model\.norm)$", SP, P("dp"))]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _params(model: nn.Module, mesh: sf.Mesh, extra: list = ()) -> dict[str, sf.ShardedArray]:
    params = sf.nn.shard_params(model, [*extra, *TP_RULES, (r".*", P())], mesh=mesh)
    return {k: v.detach().requires_grad_() for k, v in params.items()}


def _reference(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.full_tensor() if isinstance(got, sf.ShardedArray) else got, want,
                               rtol=1e-4, atol=1e-4)


def test_sequence_parallel_llama_values_grads_and_counts(llama, mesh) -> None:
    ids = torch.randint(0, 64, (4, 8))
    ref, ref_grads = _reference(llama, ids)
    params = _params(llama, mesh)
    with sf.nn.shard_activations(llama, SP_RECIPE, mesh=mesh) as handle:
        with sf.debug.CommCounter() as fwd:
            logits = torch.func.functional_call(llama, params, (sf.distribute(ids, P("dp"), mesh=mesh),)).logits
        with sf.debug.CommCounter():
            logits.pow(2).mean().backward()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in llama.modules())  # removed on exit
    assert handle.matched["model.layers.0.self_attn"] == 1 and handle.matched["model.norm"] == 2
    _close(logits, ref)
    for name, g in ref_grads.items():
        _close(params[name].grad, g)
    # Megatron's counts: per layer 2 all_gather + 2 reduce_scatter, one gather before the head
    assert dict(fwd.counts) == {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS}, fwd
    for i in range(LAYERS):
        mine = [r.kind for r in fwd.records if r.module and r.module.startswith(f"model.layers.{i}")]
        assert sorted(mine) == ["all_gather"] * 2 + ["reduce_scatter"] * 2, str(fwd)
    assert all(r.op == "sf.with_sharding_constraint" and r.phase == "forward" for r in fwd.records)


def test_sequence_parallel_llama_under_torch_func_grad(llama, mesh) -> None:
    ids = torch.randint(0, 64, (4, 8))
    _, ref_grads = _reference(llama, ids)
    params = {k: v.detach() for k, v in _params(llama, mesh).items()}
    x = sf.distribute(ids, P("dp"), mesh=mesh)
    handle = sf.nn.shard_activations(llama, SP_RECIPE, mesh=mesh)
    try:
        grads = torch.func.grad(lambda p: torch.func.functional_call(llama, p, (x,)).logits.pow(2).mean())(params)
    finally:
        handle.remove()
    for name, g in ref_grads.items():
        _close(grads[name], g)


def test_vocabulary_parallel_llama_logits_stay_split(llama, mesh) -> None:
    ids = torch.randint(0, 64, (4, 8))
    ref, ref_grads = _reference(llama, ids)
    params = _params(llama, mesh, [(r"(embed_tokens|lm_head)\.weight$", P("tp", None))])
    with sf.nn.shard_activations(llama, [(r"lm_head$", None, P("dp", None, "tp"))], mesh=mesh):
        logits = torch.func.functional_call(llama, params, (sf.distribute(ids, P("dp"), mesh=mesh),)).logits
    assert logits.spec == P("dp", None, "tp")
    logits.pow(2).mean().backward()
    _close(logits, ref)
    for name, g in ref_grads.items():
        _close(params[name].grad, g)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(a) * scale, b + 1


def test_dict_specs_pick_arguments_and_outputs(mesh) -> None:
    model = nn.Sequential()
    model.add_module("two", _Two())
    a, b, s = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    with sf.nn.shard_activations(model, [(r"two$", {"a": P("dp"), 1: P(None, "tp"), "scale": P("tp")}, {1: P("dp")})],
                                 mesh=mesh):
        seen = {}
        hook = model.two.register_forward_pre_hook(
            lambda m, args, kwargs: seen.update(a=args[0].spec, b=args[1].spec, scale=kwargs["scale"].spec),
            with_kwargs=True)
        out1, out2 = model.two(a, b, scale=s)
        hook.remove()
    assert seen == {"a": P("dp"), "b": P(None, "tp"), "scale": P("tp")}
    assert out2.spec == P("dp")
    torch.testing.assert_close(out2.full_tensor(), b + 1)
    torch.testing.assert_close(out1.full_tensor(), model.two.lin(a) * s)
    assert not model.two._forward_pre_hooks and not model.two._forward_hooks
    with sf.nn.shard_activations(model, [(r"two$", (P("dp"), None), (None, P("tp")))], mesh=mesh):
        out1, out2 = model.two(a, b, scale=s)
    assert out2.spec == P("tp") and out1.spec == P("dp")  # a over dp; the first output left alone


def test_errors_name_the_rule(mesh, llama) -> None:
    with pytest.raises(sf.ShardingError, match=r"rules\[0\].*triple"):
        sf.nn.shard_activations(llama, [(r"mlp$", P())], mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"rules\[1\].*not a valid regex"):
        sf.nn.shard_activations(llama, [(r"mlp$", None, None), (r"(", None, None)], mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"rules\[0\].*in_spec.*not a sharding"):
        sf.nn.shard_activations(llama, [(r"mlp$", "dp", None)], mesh=mesh)
    with pytest.raises(sf.ShardingError, match="nn.Module"):
        sf.nn.shard_activations({"w": torch.ones(2)}, [], mesh=mesh)
    with pytest.warns(sf.nn.UnmatchedRulesWarning, match=r"rules\[0\].*'no_such_module'"):
        sf.nn.shard_activations(llama, [(r"no_such_module", None, P())], mesh=mesh).remove()
    model = nn.Sequential(nn.Linear(4, 4))
    handle = sf.nn.shard_activations(model, [(r"^0$", P("dp", "tp", None), None)], mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"rules\[0\] \('\^0\$'\) on module '0', inputs"):
        model(torch.randn(4, 4))
    handle.remove()
    assert isinstance(model(torch.randn(4, 4)), torch.Tensor) and not isinstance(model(torch.randn(4, 4)), sf.ShardedArray)
