"""Hugging Face model code (tiny random models built from configs) under the Megatron
recipe: values and gradients against the unsharded model, and the collectives shardfn
issues against the hand-written recipe's (issue 20).

Mesh (dp=2, tp=2); q/k/v/gate/up column-parallel ``P("tp", None)`` on the (out, in)
weight, o/down row-parallel ``P(None, "tp")``; vocabulary-parallel cases also split the
embedding and LM head rows; token ids ``P("dp")``; ``torch.func.functional_call``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P

from _hf_common import close, logits, make_loss, parameters_grad_and_value, sharded_loss_and_grads

transformers = pytest.importorskip("transformers")

LAYERS = 2
VOCAB = 128
TP = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("tp", None)),
    (r"(q_proj|k_proj|v_proj)\.bias$", P("tp")),
    (r"(o_proj|down_proj)\.weight$", P(None, "tp")),
]
VOCAB_PARALLEL = [(r"embed_tokens\.weight$", P("tp", None)), (r"lm_head\.weight$", P("tp", None))]
MODELS = ["llama", "qwen2", "mistral", "gemma"]


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig, "gemma": transformers.GemmaConfig}
    cfg = configs[name](hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    return model.eval()


def _setup(name: str, vocab: bool, dtype: torch.dtype = torch.float32) -> tuple:
    model = _model(name, dtype)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    params = sf.nn.shard_params(model, TP + (VOCAB_PARALLEL if vocab else []), mesh=mesh, unmatched="ignore")
    plain = {n: t.detach().clone() for n, t in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (4, 8))
    labels = torch.randint(0, VOCAB, (4, 8))
    return model, params, plain, ids, labels, mesh


def _checked_loss(name: str, vocab: bool, mode: str) -> sf.debug.CommCounter:
    """The loss and its gradients against the unsharded model's; returns the collectives."""
    model, params, plain, ids, labels, mesh = _setup(name, vocab=vocab)
    sids, slabels = sf.distribute(ids, P("dp"), mesh=mesh), sf.distribute(labels, P("dp"), mesh=mesh)
    loss_fn = make_loss(model)
    with sf.debug.CommCounter() as cc:
        loss, grads = sharded_loss_and_grads(loss_fn, params, sids, slabels, mode)
    want_grads, want = torch.func.grad_and_value(loss_fn)(plain, ids, labels)
    close(loss, want, 1e-4)
    for n, g in want_grads.items():
        close(grads[n], g, 1e-4)
    return cc


@pytest.mark.parametrize("vocab", [False, True], ids=["tp", "vocab"])
@pytest.mark.parametrize("name", MODELS)
def test_forward_values_and_collectives(name: str, vocab: bool) -> None:
    """TP forward: 2 all_reduce per layer; vocabulary-parallel: one more (the embedding),
    the logits staying split over the vocabulary. Nothing gathered."""
    model, params, plain, ids, _, mesh = _setup(name, vocab)
    sids = sf.distribute(ids, P("dp"), mesh=mesh)
    with sf.debug.CommCounter() as cc:
        out = logits(model, params, sids)
    assert dict(cc.counts) == {"all_reduce": 2 * LAYERS + vocab}, cc
    if vocab:
        assert out.spec == P("dp", None, "tp")
    close(out, logits(model, plain, ids), 1e-4)


@pytest.mark.parametrize("mode", ["autograd", "func"])
@pytest.mark.parametrize("name", MODELS)
def test_loss_gradients_and_collectives(name: str, mode: str) -> None:
    """Forward + backward of the cross-entropy loss: at most 4 all_reduce per layer plus
    one for the (dp-split) loss, the same under autograd and torch.func.grad; values and
    gradients equal the unsharded model's."""
    cc = _checked_loss(name, vocab=False, mode=mode)
    assert set(cc.counts) == {"all_reduce"} and cc.total <= 4 * LAYERS + 1, cc


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_vocab_parallel_loss(name: str) -> None:
    """The vocabulary-parallel loss and its gradients (embedding and LM head rows split)
    without gathering the logits; values equal the unsharded model's."""
    cc = _checked_loss(name, vocab=True, mode="func")
    assert set(cc.counts) == {"all_reduce"}, cc


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_bfloat16_counts(name: str) -> None:
    """bfloat16: the casts keep the pending sums (no replication, no warning), so the
    counts are float32's; values within bfloat16 rounding of the unsharded model's."""
    model, params, plain, ids, labels, mesh = _setup(name, vocab=False, dtype=torch.bfloat16)
    sids, slabels = sf.distribute(ids, P("dp"), mesh=mesh), sf.distribute(labels, P("dp"), mesh=mesh)
    loss_fn = make_loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as fwd:
            out = logits(model, params, sids)
        with sf.debug.CommCounter() as both:
            grads = parameters_grad_and_value(loss_fn, params, sids, slabels)[0]
    assert dict(fwd.counts) == {"all_reduce": 2 * LAYERS}, fwd
    assert set(both.counts) == {"all_reduce"} and both.total <= 4 * LAYERS + 1, both
    close(out, logits(model, plain, ids), 5e-2)
    want = torch.func.grad(loss_fn)(plain, ids, labels)
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        close(grads[n], want[n], 5e-2)
