"""Hugging Face families beyond ``tests/test_hf_families_more.py`` under Megatron's tensor
parallelism (issue 21): encoder-decoders, more decoders and encoders. Values and gradients
against the unsharded model (float32), no FallbackWarning, and the collectives against a
hand-written Megatron plan.

Setup as there: tiny random models from configs (2 layers per stack), ``Mesh((2, 2), ("dp",
"tp"))``, token ids ``P("dp")``, ``torch.func.functional_call`` (an encoder-decoder reads the
ids as source and decoder input); column-parallel q/k/v and MLP inputs (and their biases),
row-parallel attention and MLP outputs, routed experts replicated. Counts are totals for the
model (the loss adds one scalar all_reduce):

- decoders and encoders, sequential residual (2, 4) per layer: Ministral 3, CWM, Jais 2
  (biases, up/down MLP), NanoChat (relu^2, fc1/fc2), Gemma 4 text (per-layer inputs, sliding
  window), LFM2 (attention layers; qk-norm per head), CTRL, Solar Open (MoE: shared experts
  column/row-parallel, dense first layer); the encoders CamemBERT, Data2Vec-text,
  RoBERTa-PreLayerNorm, XLM-R XL, ERNIE, ALBERT (one layer's weights shared by both);
  Mellum (MoE, attention only) (1, 2);
- encoder-decoders: each encoder layer (2, 4); each decoder layer forward 3 (self-attention,
  cross-attention, MLP) and backward 4 in Megatron, whose cross-attention k/v input gradient
  is all-reduced per decoder layer; shardfn sums the decoder layers' pending gradients of
  the encoder output and reduces once (one fewer per decoder layer after the first): T5
  (relative position bias split by heads), Flan-T5's gated-GELU, BART, mBART, Pegasus 10 / 22;
  Marian 10 / 20: post-norm with no embedding LayerNorm, the first encoder and decoder
  layers' q/k/v input gradients go straight into the embedding's gradient, which stays
  pending (over tp as over dp: ``POST_NORM`` in test_hf_families_more);
- T5 under SDPA: its mask is ``where(causal, position_bias, min)`` (``rules/pointwise._SELECT``
  keeps the bias gradient pending through it) and the bias table's gradient keeps its head
  split (``rules/nn.EmbeddingBackward``): Megatron's counts under autograd; under torch.func
  SDPA with a float mask runs torch's math composite, whose 4-d matmul folds batch and heads
  (gathered, as eager attention in test_hf_families): values and gradients only;
- MiniCPM3 (multi-head latent attention, as DeepSeek V2): forward 2, backward 2 + the
  up-projections' latent input gradients and the shared RoPE key: (2, 6) under autograd;
- eager attention (MPNet, Megatron-BERT, RoFormer): Megatron's counts under autograd, torch.func
  folds as above; Megatron-BERT and RoFormer run Hugging Face's padding check
  (``pad_token_id in input_ids[:, [-1, 0]]``, no attention mask given): one small all_gather
  over dp for the host's answer;
- LFM2 with a short-convolution layer (``in_proj`` column-parallel, the depthwise convolution's
  channels split over tp, ``rules/nn.GroupedConv``, ``out_proj`` row-parallel): Megatron's
  (2, 4) per layer, and the fused [B | C | x] ``in_proj`` split by ``chunk(3)`` gathered as
  test_hf_families_more's fused projections: 1 forward, 3 backward (one per part);
- values only, with what they gather: OpenAI GPT (fused [Q | K | V] Conv1D, as GPT-2), DeBERTa-v2
  (disentangled attention gathers its relative-position scores by index along the split heads).
"""

from __future__ import annotations


import pytest
import torch

import shardfn as sf
from shardfn import P

from _hf_common import check_family

transformers = pytest.importorskip("transformers")

LAYERS, VOCAB = 2, 128
COL, ROW = P("tp", None), P(None, "tp")


def _rules(col: str, row: str) -> list:
    """Column-parallel ``col`` (weights and biases), row-parallel ``row`` (module names)."""
    return [(rf"\.({col})\.weight$", COL), (rf"\.({col})\.bias$", P("tp")), (rf"\.({row})\.weight$", ROW)]


STD = _rules("q_proj|k_proj|v_proj|gate_proj|up_proj", "o_proj|down_proj")
BART = _rules("q_proj|k_proj|v_proj|fc1", "out_proj|fc2")
T5 = _rules("q|k|v|wi|wi_0|wi_1", "o|wo") + [(r"relative_attention_bias\.weight$", ROW)]
ENCODER = _rules(r"query|key|value|intermediate\.dense", r"attention\.output\.dense|layer\.\d+\.output\.dense")


def _cfg(name: str) -> tuple:
    """(config factory, TP rules, auto class) of a tiny ``name``."""
    T = transformers
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    enc = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=70)
    s2s = dict(vocab_size=VOCAB, d_model=64, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)
    t5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=LAYERS, num_heads=4, decoder_start_token_id=0)
    mla = _rules("q_b_proj|kv_b_proj|gate_proj|up_proj", "o_proj|down_proj")
    causal, masked, s2s_lm = T.AutoModelForCausalLM, T.AutoModelForMaskedLM, T.AutoModelForSeq2SeqLM
    return {
        "t5": (lambda: T.T5Config(**t5), T5, s2s_lm),
        "flant5": (lambda: T.T5Config(**t5, feed_forward_proj="gated-gelu"), T5, s2s_lm),
        "bart": (lambda: T.BartConfig(**s2s), BART, s2s_lm),
        "mbart": (lambda: T.MBartConfig(**s2s), BART, s2s_lm),
        "pegasus": (lambda: T.PegasusConfig(**s2s), BART, s2s_lm),
        "marian": (lambda: T.MarianConfig(**s2s), BART, s2s_lm),
        "ministral3": (lambda: T.Ministral3Config(**c, head_dim=16), STD, causal),
        "cwm": (lambda: T.CwmConfig(**c, head_dim=16), STD, causal),
        "jais2": (lambda: T.Jais2Config(**c), STD, causal),
        "nanochat": (lambda: T.NanoChatConfig(**c), _rules("q_proj|k_proj|v_proj|fc1", "o_proj|fc2"), causal),
        "gemma4": (lambda: T.Gemma4TextConfig(**c, head_dim=16, vocab_size_per_layer_input=VOCAB, sliding_window=4),
                   STD, causal),
        "lfm2": (lambda: T.Lfm2Config(**c), _rules("q_proj|k_proj|v_proj|w1|w3", "out_proj|w2"), causal),
        "lfm2conv": (lambda: T.Lfm2Config(**c, layer_types=["conv", "full_attention"]),
                     _rules("q_proj|k_proj|v_proj|w1|w3|in_proj", "out_proj|w2") + [(r"conv\.conv\.weight$", P("tp"))],
                     causal),
        "ctrl": (lambda: T.CTRLConfig(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, dff=128),
                 _rules(r"Wq|Wk|Wv|ffn\.0", r"multi_head_attention\.dense|ffn\.2"), causal),
        "solaropen": (lambda: T.SolarOpenConfig(**c, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, n_shared_experts=1), STD, causal),
        "mellum": (lambda: T.MellumConfig(**c, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                   STD, causal),
        "minicpm3": (lambda: T.MiniCPM3Config(**{**c, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16,
                                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16), mla, causal),
        "openaigpt": (lambda: T.OpenAIGPTConfig(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64),
                      [(r"(c_attn|c_fc)\.weight$", ROW), (r"(c_attn|c_fc)\.bias$", P("tp")), (r"c_proj\.weight$", COL)],
                      causal),
        "camembert": (lambda: T.CamembertConfig(**enc), ENCODER, masked),
        "data2vectext": (lambda: T.Data2VecTextConfig(**enc), ENCODER, masked),
        "robertaprelayernorm": (lambda: T.RobertaPreLayerNormConfig(**enc), ENCODER, masked),
        "xlmrobertaxl": (lambda: T.XLMRobertaXLConfig(**enc), ENCODER, masked),
        "ernie": (lambda: T.ErnieConfig(**enc), ENCODER, masked),
        "albert": (lambda: T.AlbertConfig(**enc, embedding_size=32),
                   _rules(r"query|key|value|ffn", r"attention\.dense|ffn_output"), masked),
        "mpnet": (lambda: T.MPNetConfig(**enc), _rules(r"q|k|v|intermediate\.dense", r"attn\.o|layer\.\d+\.output\.dense"),
                  masked),
        "megatronbert": (lambda: T.MegatronBertConfig(**enc), ENCODER, masked),
        "roformer": (lambda: T.RoFormerConfig(**enc), ENCODER, masked),
        "debertav2": (lambda: T.DebertaV2Config(**enc),
                      _rules(r"query_proj|key_proj|value_proj|intermediate\.dense",
                             r"attention\.output\.dense|layer\.\d+\.output\.dense"), masked),
    }[name]


MOE = ("solaropen", "mellum")
SEQ = (2 * LAYERS, 4 * LAYERS + 1)  # a decoder-only or encoder-only stack of sequential blocks
# encoder-decoder: forward 2 + 3 per layer pair; backward Megatron's 2 + 4, less the merged cross k/v (module doc)
ENC_DEC = (5 * LAYERS, 5 * LAYERS + 6 * LAYERS - (LAYERS - 1) + 1)
# family -> (forward all_reduce, forward + backward all_reduce) for the whole model (module doc)
MEGATRON = {
    **{f: ENC_DEC for f in ("bart", "mbart", "pegasus")},
    "marian": (ENC_DEC[0], ENC_DEC[1] - 2),
    **{f: SEQ for f in ("ministral3", "cwm", "jais2", "nanochat", "gemma4", "lfm2", "lfm2conv", "ctrl", "solaropen",
                        "camembert", "data2vectext", "robertaprelayernorm", "xlmrobertaxl", "ernie", "albert")},
    "mellum": (LAYERS, 2 * LAYERS + 1),
}
# Megatron's counts under autograd; under torch.func values and gradients only (module doc)
AUTOGRAD = {"t5": ENC_DEC, "flant5": ENC_DEC, "minicpm3": (2 * LAYERS, 6 * LAYERS + 1), "mpnet": SEQ,
            "megatronbert": SEQ, "roformer": SEQ}
# all_gather over tp (forward, forward + backward) where the model splits a fused projection by parts
TP_GATHERS = {"lfm2conv": (1, 4)}
PAD_CHECK = {"megatronbert", "roformer"}  # Hugging Face's padding check: 1 all_gather over dp (module doc)
VALUES_ONLY = ("openaigpt", "debertav2")


def _check(name: str, mode: str) -> tuple[sf.debug.CommCounter, sf.debug.CommCounter]:
    """``check_family`` (values, gradients, no fallback; the two counters) of ``name``."""
    make, rules, auto = _cfg(name)
    torch.manual_seed(0)
    extra = {"experts_implementation": "batched_mm"} if name in MOE else {}
    model = auto.from_config(make(), **extra).eval()
    return check_family(model, rules, VOCAB, mode)


def _counts(reduces: int, gathers: int = 0) -> dict:
    return {"all_reduce": reduces, **({"all_gather": gathers} if gathers else {})}


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_megatron_counts_values_and_gradients(name: str) -> None:
    """TP forward and forward + backward under torch.func: Megatron's all_reduce counts
    (module doc) and nothing else; values and gradients equal unsharded."""
    fwd, both = _check(name, "func")
    gathers = TP_GATHERS.get(name, (0, 0))
    assert dict(fwd.counts) == _counts(MEGATRON[name][0], gathers[0]), fwd
    assert dict(both.counts) == _counts(MEGATRON[name][1], gathers[1]), both


@pytest.mark.parametrize("name", sorted(AUTOGRAD))
def test_megatron_counts_under_autograd(name: str) -> None:
    """T5 / Flan-T5 (position bias through SDPA's float mask), MiniCPM3 (latent attention) and
    the eager-attention encoders: Megatron's counts by ``loss.backward()``; under torch.func the
    same values and gradients, no fallback (torch's 4-d matmul folds batch and heads: gathered)."""
    fwd, both = _check(name, "autograd")
    pad = int(name in PAD_CHECK)
    assert dict(fwd.counts) == _counts(AUTOGRAD[name][0], pad), fwd
    assert dict(both.counts) == _counts(AUTOGRAD[name][1], pad), both
    _check(name, "func")


@pytest.mark.parametrize("name", VALUES_ONLY)
def test_gathering_families_values(name: str) -> None:
    """OpenAI GPT and DeBERTa-v2 (what they gather: module doc): values and
    gradients equal unsharded, no fallback, under autograd and torch.func."""
    for mode in ("autograd", "func"):
        _check(name, mode)
