"""Hugging Face families that ``tools/fallback_census.py`` listed as new (``NEW_FAMILIES``: no
test built them) under Megatron's tensor parallelism: values and gradients against the
unsharded model (float32), no FallbackWarning, and the collectives against a hand-written
Megatron plan.

Setup as ``tests/test_hf_families_more.py``: tiny random models (2 layers) from each family's
default config with its sizes made tiny (``_tiny``, as the census's ``tiny_config``),
``Mesh((2, 2), ("dp", "tp"))``, token ids ``P("dp")``, ``torch.func.functional_call``;
column-parallel q/k/v/gate/up and fused qkv (and their biases), row-parallel o/down/out,
routed experts replicated. Megatron's counts per layer (forward, forward + backward; the loss
adds one scalar all_reduce):

- sequential residual (2, 4): InternLM3, EXAONE-MoE and AFMoE (sliding-window layers; MoE
  layers' shared experts column/row-parallel), the encoders ESM (rotary) and EuroBERT;
- FlexOlmo (MoE, attention only; OLMo2's qk-norm across the split heads: 1 + 2 small, 2 + 2
  small backward) (3, 6), post-norm: one fewer (the first layer's q/k/v input gradient goes
  straight into the embedding's gradient, pending, ``POST_NORM`` in test_hf_families_more);
- eager attention with learned sinks (GraniteSWA; ``logsumexp`` of the scores per head) and
  MiniMax (a full-attention layer and a lightning linear-attention layer whose output
  RMS-norm spans the split heads: one small all_reduce forward and backward; MoE, attention
  only): Megatron's counts under autograd, (2, 4) per layer, and for MiniMax's two layers
  forward 1 + (1 + 1 small), forward + backward 2 + (2 + 2 small);
  under torch.func the same values and gradients, no fallback (torch's 4-d ``matmul`` composite
  folds batch and heads: gathered, as eager attention in test_hf_families);
- Doge (dynamic mask attention: ``dt_proj`` reads the split value heads, so its output is a
  pending sum, reduced at its ``softplus``: one small all_reduce per layer forward, as a
  row-parallel ``dt_proj`` in Megatron; the mask's gradient arrives split by heads and is
  gathered (small) for the replicated ``dt_proj``, as Megatron's row-parallel backward): under
  autograd forward (2 + 1) per layer, backward Megatron's 2 + 1 small all_gather, and one
  all_reduce beyond it: the value gradient through ``dt_proj`` is computed before that gather,
  as a pending sum (the cost model weighs a pending output at half its reduction), and reduced
  at the value projection. Under torch.func values and gradients only (SDPA with a float mask:
  torch's math composite folds batch and heads). Its softplus backward read the forward's
  pending ``dt_proj`` output split, which reduce-scattered it again (now sliced from the
  forward's reduction, ``arrays/redistribute._from_reduced``);
- RecurrentGemma (recurrent blocks replicated, MLPs split): (1, 2) under autograd against the
  unsharded model under autograd (its own autograd.Function cannot run under torch.func).

Not here (values and gradients equal unsharded under torch.func when checked, but each takes
20-140 s on CPU, their reference recurrences in Python): Qwen3-Next, Jamba, Falcon-H1,
OLMo-hybrid.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P

from _hf_common import check_family, close, logits, make_loss, sharded_loss_and_grads

transformers = pytest.importorskip("transformers")

LAYERS, VOCAB = 2, 128
# the sizes a family's config may name, made tiny (those it does not name are left out)
_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, sliding_window=4, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
_C = r"(q_proj|k_proj|v_proj|(?<!_)gate_proj|(?<!_)up_proj|qkv_proj|query|key|value|intermediate\.dense)"
_R = r"(o_proj|down_proj|out_proj|attention\.output\.dense|layer\.\d+\.output\.dense)"
RULES = [(_C + r"\.weight$", P("tp", None)), (_C + r"\.bias$", P("tp")), (_R + r"\.weight$", P(None, "tp"))]


def _tiny(model_type: str):
    """The default config of ``model_type`` built with the ``_TINY`` sizes it names (through its
    constructor, so that what it derives, such as ``layer_types``, follows)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    default = cls()
    return cls(**{k: v for k, v in _TINY.items() if hasattr(default, k)})


SEQ = (2, 4)
# family -> Megatron's (forward all_reduce per layer, forward + backward all_reduce per layer)
MEGATRON = {"internlm3": SEQ, "exaone_moe": SEQ, "afmoe": SEQ, "esm": SEQ, "eurobert": SEQ, "flex_olmo": (3, 6)}
POST_NORM = {"flex_olmo"}
# Megatron's counts (whole model) under autograd; under torch.func values and gradients only (module doc)
AUTOGRAD = {"granite_swa": (2 * LAYERS, 4 * LAYERS + 1), "minimax": (1 + 2, 2 + 4 + 1),
            "doge": (3 * LAYERS, (3 + 2 + 1) * LAYERS + 1)}
# all_gather under autograd (forward + backward): Doge's mask gradient for dt_proj (module doc)
AUTOGRAD_GATHERS = {"doge": LAYERS}
ENCODERS = ("esm", "eurobert")
EAGER = ("granite_swa",)  # (attention sinks: no SDPA path)


def _check(name: str, mode: str) -> tuple[sf.debug.CommCounter, sf.debug.CommCounter]:
    """``check_family`` (values, gradients, no fallback; the two counters) of ``name``."""
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if name in ENCODERS else transformers.AutoModelForCausalLM
    kwargs = {"attn_implementation": "eager" if name in EAGER else "sdpa"}
    try:
        model = auto.from_config(_tiny(name), experts_implementation="batched_mm", **kwargs)
    except (ValueError, TypeError):  # (no experts)
        model = auto.from_config(_tiny(name), **kwargs)
    return check_family(model.eval(), RULES, VOCAB, mode)


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_megatron_counts_values_and_gradients(name: str) -> None:
    """TP forward and forward + backward under torch.func: Megatron's all_reduce counts
    (module doc) and nothing else; values and gradients equal unsharded. (torch.func: ESM's
    unused contact head gets zero gradients, where autograd gives none.)"""
    fwd, both = _check(name, "func")
    assert dict(fwd.counts) == {"all_reduce": MEGATRON[name][0] * LAYERS}, fwd
    assert dict(both.counts) == {"all_reduce": MEGATRON[name][1] * LAYERS + 1 - (name in POST_NORM)}, both


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_megatron_counts_under_autograd(name: str) -> None:
    """GraniteSWA, MiniMax and Doge: Megatron's counts by ``loss.backward()`` (Doge: one
    all_reduce more per layer); under torch.func the same values and gradients, no fallback
    (module doc)."""
    fwd, both = _check(name, "autograd")
    assert dict(fwd.counts) == {"all_reduce": AUTOGRAD[name][0]}, fwd
    gathers = AUTOGRAD_GATHERS.get(name, 0)
    assert dict(both.counts) == {"all_reduce": AUTOGRAD[name][1], **({"all_gather": gathers} if gathers else {})}, both
    _check(name, "func")


def test_recurrent_gemma_mlp_parallel_under_autograd() -> None:
    """RecurrentGemma (two recurrent RG-LRU blocks, replicated; their MLPs column/row-parallel):
    Megatron's MLP-only counts (1, 2) per layer by ``loss.backward()``, values and gradients
    equal the unsharded model's by ``loss.backward()``, no fallback. (Neither plain torch nor
    shardfn runs it under torch.func: its ``SqrtBoundDerivative`` autograd.Function has no
    setup_context, so ``check_family``'s torch.func reference cannot be used.)"""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny("recurrent_gemma"), attn_implementation="sdpa").eval()
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    params = sf.nn.shard_params(model, RULES, mesh=mesh, unmatched="ignore")
    plain = {n: t.detach().clone().requires_grad_() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(5, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)
    loss_fn = make_loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as fwd:
            out = logits(model, params, sf.distribute(ids, P("dp"), mesh=mesh))
        with sf.debug.CommCounter() as both:
            loss, grads = sharded_loss_and_grads(loss_fn, params, sf.distribute(ids, P("dp"), mesh=mesh),
                                                 sf.distribute(labels, P("dp"), mesh=mesh), "autograd")
    assert dict(fwd.counts) == {"all_reduce": LAYERS}, fwd
    assert dict(both.counts) == {"all_reduce": 2 * LAYERS + 1}, both
    close(out, logits(model, plain, ids))
    want, want_grads = sharded_loss_and_grads(loss_fn, plain, ids, labels, "autograd")
    close(loss, want)
    assert {n for n, v in grads.items() if v is not None} == {n for n, v in want_grads.items() if v is not None}
    for n, v in want_grads.items():
        if v is not None:
            close(grads[n], v)
