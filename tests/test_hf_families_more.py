"""Still more Hugging Face model families under Megatron's tensor parallelism (issue 21's
census): values and gradients against the unsharded model (float32), no FallbackWarning,
and the collectives of a TP forward and of forward + backward against a hand-written
Megatron plan for each architecture. ``tests/test_hf_families.py`` holds the first twenty.

Setup as there: tiny random models from configs (2 layers), ``Mesh((2, 2), ("dp", "tp"))``,
token ids ``P("dp")``, ``torch.func.functional_call``; column-parallel q/k/v/gate/up (and
their biases), row-parallel o/down, experts replicated. Megatron's counts per layer
(forward, forward + backward; the loss adds one scalar all_reduce):

Llama 4's MoE (``out.add_`` into its shared expert's result), GPT-OSS's experts (``out.add_(bias)``)
and PhiMoE's router backward (``scatter_add_`` into a product) write into results they just made,
which the in-place policy runs as functional updates (unread results are fresh: ``arrays/fresh.py``).

- sequential residual (2, 4): Helium, Arcee and Nemotron (up/down MLP), OLMo, SmolLM3
  (no-RoPE layers), ERNIE 4.5, EXAONE 4 (sliding window, qk-norm per head, post-norms),
  Seed-OSS (biases), Ministral, HunYuan, Llama 4 text (chunked attention, no-RoPE layers,
  L2 qk-norm), Persimmon (fused per-head query_key_value, qk LayerNorm per head), BioGPT
  and the encoders BERT, RoBERTa, XLM-R, DistilBERT, ELECTRA (post-norm, learned
  positions; BERT's position embeddings broadcast over the batch keep their gradient
  pending over dp, as DDP does), GLM-4-MoE and ERNIE-4.5-MoE (dense first layer, shared
  experts column/row-parallel), dots.llm1 (the same), HunYuan-MoE (shared expert
  column/row-parallel), Apertus (xIELU: its learned scalars' gradients stay
  pending, as other parameters'), GPT-BigCode with multi-head attention (c_attn fused per head,
  viewed (heads, 3 * head_dim), as GPT-NeoX: the row split is per head);
- the same, with a fused projection split by concatenated parts (below; gathers counted in
  ``TP_GATHERS``): GLM, GLM-4 (post-norms), ModernBERT-decoder ([gate | up]), GPT-BigCode
  (multi-query [Q | K | V]), MPT ([Q | K | V], alibi), ModernBERT (both);
- eager attention, (2, 4) under autograd, the heads gathered at torch's matmul fold under
  torch.func: VaultGemma, GPT-Neo; attention that folds batch and heads in the model's own code
  (XGLM), heads paired across devices (DiffLlama), routers sorting the whole batch (JetMoE): their
  tests say what each gathers and why.

Fused projections split by concatenated parts ([gate | up] viewed by ``chunk(2)``, [Q | K | V] by
``split``): a row split gives one device all of gate (or of Q) and the other all of up; the
consumer needs both halves of each on each device, so the projection's output is gathered in the
forward, and its gradient assembled from the parts' gradients in the backward (``cat``: one gather
per part split across the devices). Megatron stores each rank's parts side by side instead, a
layout a block split of HF's weight cannot give (DTensor's ``_StridedShard``; see
test_hf_families' module doc).
- parallel residual, one norm (1, 2): CodeGen (fused qkv_proj in per-head groups), Cohere2, Cohere2-MoE
  (routed experts replicated);
- attention only (routed experts replicated) (1, 2): Qwen3-MoE, GraniteMoE,
  GraniteMoE-shared, PhiMoE (also in training mode: its router's backward), GPT-OSS;
- Llama 4 with MoE layers (the shared expert column/row-parallel, routed experts replicated): (2, 4),
  and the all_gathers over dp its router's expert-major repeat of the tokens needs (``DP_GATHERS``);
- post-norm blocks (EXAONE 4, OLMo3: no norm before attention): one all_reduce fewer than
  Megatron's ``f`` operator issues, the first layer's q/k/v input gradient going straight into
  the embedding's gradient, which stays pending over tp as it does over dp;
- a norm across the split heads (OLMo2's qk-norm): forward 2 + 2 small, backward 2 + 2
  small (4, 8): OLMo3, BitNet (sub-norms of the attention and MLP inner activations);
  (3, 6): OLMoE, MiniMax-M2 (attention only);
- DeepSeek V2 / V3 multi-head latent attention (down-projections replicated, q_b/kv_b
  up-projections column-parallel, o row-parallel): forward 2; backward under autograd the
  up-projections' latent input gradients (q latent in V3), the shared RoPE key's gradient
  summed over the split heads, and the MLP input: (2, 6) V2, (2, 8) V3.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P

from _hf_common import check_family, close, make_loss, sharded_loss_and_grads

transformers = pytest.importorskip("transformers")

LAYERS, VOCAB = 2, 128
COL, ROW = P("tp", None), P(None, "tp")
_C = r"(q_proj|k_proj|v_proj|(?<!_)gate_proj|(?<!_)up_proj|q_b_proj|kv_b_proj|fc1|fc_in|qkv_proj|dense_h_to_4h)"
_R = r"(o_proj|down_proj|out_proj|fc2|fc_out|dense_4h_to_h|self_attn\.dense)"
STD = [(_C + r"\.weight$", COL), (_C + r"\.bias$", P("tp")), (_R + r"\.weight$", ROW)]
_EC = r"(query|key|value|q_lin|k_lin|v_lin|intermediate\.dense|lin1)"
_ER = r"(attention\.output\.dense|layer\.\d+\.output\.dense|out_lin|lin2)"
ENCODER = [(_EC + r"\.weight$", COL), (_EC + r"\.bias$", P("tp")), (_ER + r"\.weight$", ROW)]
# multi-query attention as Megatron runs it: the query heads split, the one kv head's projections replicated
MQA_RULES = [(r"(q_proj|gate_proj|up_proj)\.weight$", COL), (r"(o_proj|down_proj)\.weight$", ROW)]
# fused projections (GLM's gate_up_proj, GPT-BigCode's c_attn, MPT's and ModernBERT's Wqkv and Wi)
# column-parallel, their outputs (c_proj, Wo) row-parallel
_FC = r"(gate_up_proj|c_attn|c_fc|Wqkv|Wi)"
FUSED = STD + [(_FC + r"\.weight$", COL), (_FC + r"\.bias$", P("tp")), (r"(c_proj|Wo)\.weight$", ROW)]


def _cfg(name: str) -> tuple:
    """(config factory, attention implementation, TP rules, model class) of a tiny ``name``."""
    T = transformers
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    mla = dict(c, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    enc = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
               intermediate_size=128)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    bigcode = dict(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, n_inner=128, **ids)
    modernbert = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, max_position_embeddings=64, cls_token_id=1, sep_token_id=2, **ids)
    causal, masked = T.AutoModelForCausalLM, T.AutoModelForMaskedLM
    table = {
        "helium": (lambda: T.HeliumConfig(**c, head_dim=16), STD),
        "arcee": (lambda: T.ArceeConfig(**c), STD),
        "nemotron": (lambda: T.NemotronConfig(**c, partial_rotary_factor=0.5), STD),
        "olmo": (lambda: T.OlmoConfig(**c), STD),
        "smollm3": (lambda: T.SmolLM3Config(**c, no_rope_layer_interval=2, pad_token_id=0), STD),
        "ernie4_5": (lambda: T.Ernie4_5Config(**c, head_dim=16), STD),
        "exaone4": (lambda: T.Exaone4Config(**c, sliding_window=4), STD),
        "seedoss": (lambda: T.SeedOssConfig(**c, head_dim=16), STD),
        "ministral": (lambda: T.MinistralConfig(**c, head_dim=16, sliding_window=4), STD),
        "hunyuan": (lambda: T.HunYuanDenseV1Config(**c, head_dim=16), STD),
        "llama4": (lambda: T.Llama4TextConfig(**c, head_dim=16, intermediate_size_mlp=128, moe_layers=[],
                                              no_rope_layers=[1, 0], attention_chunk_size=4), STD),
        "llama4moe": (lambda: T.Llama4TextConfig(**c, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
                                                 num_experts_per_tok=1, no_rope_layers=[1, 0],
                                                 attention_chunk_size=4), STD),
        "hunyuanmoe": (lambda: T.HunYuanMoEV1Config(**c, head_dim=16, num_experts=4, moe_topk=2), STD),
        "minimaxm2": (lambda: T.MiniMaxM2Config(**c, head_dim=16, num_local_experts=4, num_experts_per_tok=2), STD),
        "cohere2moe": (lambda: T.Cohere2MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                  sliding_window=4), STD),
        "gptoss": (lambda: T.GptOssConfig(**c, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=4), STD, "eager"),
        "persimmon": (lambda: T.PersimmonConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"}), STD),
        "biogpt": (lambda: T.BioGptConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"}), STD),
        "glm4moe": (lambda: T.Glm4MoeConfig(**c, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                            topk_group=1), STD),
        "ernie4_5_moe": (lambda: T.Ernie4_5_MoeConfig(**c, moe_num_experts=4, moe_k=2, moe_intermediate_size=32), STD),
        "codegen": (lambda: T.CodeGenConfig(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, rotary_dim=8,
                                            n_positions=64, n_ctx=64), STD),
        "cohere2": (lambda: T.Cohere2Config(**c, sliding_window=4), STD),
        "qwen3moe": (lambda: T.Qwen3MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32), STD),
        "granitemoe": (lambda: T.GraniteMoeConfig(**c, num_local_experts=4, num_experts_per_tok=2), STD),
        "granitemoeshared": (lambda: T.GraniteMoeSharedConfig(**c, num_local_experts=4, num_experts_per_tok=2,
                                                              shared_intermediate_size=64), STD),
        "phimoe": (lambda: T.PhimoeConfig(**c, num_local_experts=4, num_experts_per_tok=2), STD),
        "olmo3": (lambda: T.Olmo3Config(**c, sliding_window=4), STD),
        "olmoe": (lambda: T.OlmoeConfig(**c, num_experts=4, num_experts_per_tok=2), STD),
        "bitnet": (lambda: T.BitNetConfig(**c), STD),
        "dots1": (lambda: T.Dots1Config(**c, head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1), STD),
        "deepseekv2": (lambda: T.DeepseekV2Config(**mla, q_lora_rank=None), STD),
        "deepseekv3": (lambda: T.DeepseekV3Config(**mla, q_lora_rank=32, n_group=1, topk_group=1), STD),
        "bert": (lambda: T.BertConfig(**enc, max_position_embeddings=64), ENCODER),
        "roberta": (lambda: T.RobertaConfig(**enc, max_position_embeddings=70), ENCODER),
        "xlmroberta": (lambda: T.XLMRobertaConfig(**enc, max_position_embeddings=70), ENCODER),
        "electra": (lambda: T.ElectraConfig(**enc, embedding_size=64, max_position_embeddings=64), ENCODER),
        "apertus": (lambda: T.ApertusConfig(**c, pad_token_id=0), STD),
        "glm": (lambda: T.GlmConfig(**c, head_dim=16, pad_token_id=0), FUSED),
        "glm4": (lambda: T.Glm4Config(**c, head_dim=16, pad_token_id=0), FUSED),
        "gptbigcode": (lambda: T.GPTBigCodeConfig(**bigcode), FUSED),
        "gptbigcode_mha": (lambda: T.GPTBigCodeConfig(**bigcode, multi_query=False), FUSED),
        "modernbert": (lambda: T.ModernBertConfig(**modernbert), FUSED, "sdpa", masked),
        "modernbertdecoder": (lambda: T.ModernBertDecoderConfig(**modernbert, local_attention=4,
                                                                layer_types=["full_attention", "sliding_attention"]),
                              FUSED),
        "mpt": (lambda: T.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=LAYERS, expansion_ratio=2,
                                    max_seq_len=64), FUSED, "eager"),
        "vaultgemma": (lambda: T.VaultGemmaConfig(**c, head_dim=16, sliding_window=4, query_pre_attn_scalar=16),
                       STD, "eager"),
        "gptneo": (lambda: T.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=LAYERS, num_heads=4,
                                          intermediate_size=128, max_position_embeddings=64, window_size=4,
                                          attention_types=[[["global", "local"], 1]], bos_token_id=1, eos_token_id=2),
                   FUSED, "eager"),
        "xglm": (lambda: T.XGLMConfig(vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=LAYERS, attention_heads=4,
                                      max_position_embeddings=64, dropout=0.0, attention_dropout=0.0), STD, "eager"),
        "diffllama": (lambda: T.DiffLlamaConfig(**c, head_dim=16), STD),
        "jetmoe": (lambda: T.JetMoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_key_value_heads=2,
                                          kv_channels=16, intermediate_size=64, max_position_embeddings=64,
                                          num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4), []),
        "llamamqa": (lambda: T.LlamaConfig(**{**c, "num_key_value_heads": 1}), MQA_RULES),
        "distilbert": (lambda: T.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=LAYERS, n_heads=4, hidden_dim=128,
                                                  max_position_embeddings=64), ENCODER),
    }
    make, rules, *rest = table[name]  # (GPT-OSS has no SDPA path: its attention sinks; nor have MPT, VaultGemma,
    # GPT-Neo, XGLM)
    attn, auto = (rest + ["sdpa", masked if rules is ENCODER else causal][len(rest):])[:2]
    return make, attn, rules, auto


SEQUENTIAL = ("helium", "arcee", "nemotron", "olmo", "smollm3", "ernie4_5", "exaone4", "seedoss", "ministral", "hunyuan",
              "llama4", "llama4moe", "hunyuanmoe", "persimmon", "biogpt", "glm4moe", "ernie4_5_moe", "dots1", "bert", "roberta", "xlmroberta", "electra",
              "distilbert", "apertus", "gptbigcode_mha", "glm", "glm4", "gptbigcode", "modernbert", "modernbertdecoder", "mpt")
# family -> Megatron's (forward all_reduce per layer, forward + backward all_reduce per layer)
MEGATRON = {**{f: (2, 4) for f in SEQUENTIAL},
            **{f: (1, 2) for f in ("codegen", "cohere2", "cohere2moe", "qwen3moe", "granitemoe", "granitemoeshared",
                                   "phimoe")},
            "olmo3": (4, 8), "bitnet": (4, 8), "olmoe": (3, 6), "minimaxm2": (3, 6)}
# post-norm blocks (no norm before attention): the first layer's q/k/v input gradient goes
# straight into the embedding's gradient, which stays pending (over tp as over dp): one fewer
POST_NORM = {"exaone4", "olmo3"}
# all_gathers over dp (forward, forward + backward per layer) that the block layouts cannot avoid:
# Llama 4's router repeats the (dp-split) tokens once per expert, expert-major, and flattens the
# transposed (experts, tokens) scores the same way, so a device's rows are no longer its tokens
DP_GATHERS = {"llama4moe": (2, 3)}
# all_gathers over tp (forward, forward + backward per layer) where the model's code splits a fused
# projection by concatenated parts (module doc): GLM / GLM-4 / ModernBERT-decoder's [gate | up] (the
# forward's chunk, the backward's cat of the two gradients: 1, 3), GPT-BigCode's multi-query
# [Q | K | V] (K and V one head each: 1, 2), MPT's [Q | K | V] (1, 2), ModernBERT's both (2, 5)
TP_GATHERS = {"glm": (1, 3), "glm4": (1, 3), "modernbertdecoder": (1, 3), "gptbigcode": (1, 2), "mpt": (1, 2),
              "modernbert": (2, 5)}
# eager attention (no SDPA path): under torch.func torch's 4-d matmul composite folds batch and heads,
# gathered as in test_hf_families' test_eager_attention_under_func (MPT's heads are gathered already)
EAGER = ("vaultgemma", "gptneo")
EXTRA = (*EAGER, "xglm", "diffllama", "jetmoe")  # (tested below; for tools/fallback_census.py)
MLA = {"deepseekv2": (2, 6), "deepseekv3": (2, 8)}
MOE = ("qwen3moe", "granitemoe", "granitemoeshared", "phimoe", "olmoe", "glm4moe", "ernie4_5_moe", "dots1", "deepseekv2",
       "deepseekv3", "llama4moe", "gptoss", "hunyuanmoe", "minimaxm2", "cohere2moe")


def _check(name: str, mode: str) -> tuple[sf.debug.CommCounter, sf.debug.CommCounter]:
    """``check_family`` (values, gradients, no fallback; the two counters) of ``name``."""
    make, attn, rules, auto = _cfg(name)
    torch.manual_seed(0)
    extra = {"experts_implementation": "batched_mm"} if name in MOE else {}
    model = auto.from_config(make(), attn_implementation=attn, **extra).eval()
    return check_family(model, rules, VOCAB, mode)


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_megatron_counts_values_and_gradients(name: str) -> None:
    """TP forward and forward + backward under torch.func: Megatron's all_reduce counts
    (module doc) and nothing else; values and gradients equal unsharded."""
    fwd, both = _check(name, "func")
    gathers = DP_GATHERS.get(name, TP_GATHERS.get(name, (0, 0)))
    assert dict(fwd.counts) == _counts(MEGATRON[name][0] * LAYERS, gathers[0] * LAYERS), fwd
    assert dict(both.counts) == _counts(MEGATRON[name][1] * LAYERS + 1 - (name in POST_NORM), gathers[1] * LAYERS), both


def _counts(reduces: int, gathers: int = 0) -> dict:
    return {"all_reduce": reduces, **({"all_gather": gathers} if gathers else {})}


@pytest.mark.parametrize("name", ["llama4", "bert", "olmoe", "codegen", "persimmon"])
def test_megatron_counts_under_autograd(name: str) -> None:
    """The same counts by ``loss.backward()`` (a sample of the block structures)."""
    fwd, both = _check(name, "autograd")
    assert dict(fwd.counts) == {"all_reduce": MEGATRON[name][0] * LAYERS}, fwd
    assert dict(both.counts) == {"all_reduce": MEGATRON[name][1] * LAYERS + 1}, both


@pytest.mark.parametrize("name", sorted(MLA))
def test_deepseek_latent_attention(name: str) -> None:
    """DeepSeek V2 / V3 (MLA; the key states written head-split into a fresh ``new_empty``:
    no gather): Megatron's counts under autograd (module doc); under torch.func the same
    values and gradients, no fallback (torch's math attention composite for unequal q/v
    head dims folds batch and heads: gathered, as test_hf_families' eager attention)."""
    fwd, both = _check(name, "autograd")
    assert dict(fwd.counts) == {"all_reduce": MLA[name][0] * LAYERS}, fwd
    assert dict(both.counts) == {"all_reduce": MLA[name][1] * LAYERS + 1}, both
    _check(name, "func")


def test_gpt_oss():
    """GPT-OSS (attention sinks, eager attention; experts with biases: transformers' batched
    experts add the bias into their own ``bmm(..).squeeze(1)`` result in place, which the in-place
    policy runs on that unread result, ``arrays/fresh.py``): Megatron's counts under autograd
    (attention only, experts replicated); under torch.func the same values and gradients, no
    fallback (torch's 4-d ``matmul`` composite folds batch and heads: gathered, as eager attention
    in test_hf_families)."""
    fwd, both = _check("gptoss", "autograd")
    assert dict(fwd.counts) == {"all_reduce": LAYERS}, fwd
    assert dict(both.counts) == {"all_reduce": 2 * LAYERS + 1}, both
    _check("gptoss", "func")


def test_phimoe_training_router_backward():
    """PhiMoE in training mode: its router's autograd Function (Heun's estimator) ``scatter_add_``s
    into a product it just made in its backward (an unread result: ``arrays/fresh.py``). Its Gumbel
    sampling draws from shardfn's sharding-invariant generator, so the reference is the same model on
    a one-device mesh (plain torch draws other numbers): loss and gradients equal, no fallback, and
    Megatron's attention-only counts. (torch.func cannot run the Function: it has no setup_context.)"""
    make, attn, rules, auto = _cfg("phimoe")
    torch.manual_seed(0)
    model = auto.from_config(make(), attn_implementation=attn, experts_implementation="batched_mm").train()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(5, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)
    loss_fn = make_loss(model)
    got = []
    for mesh, rules, spec in ((sf.Mesh((1,), ("dp",), backend="local"), [], P()),
                              (sf.Mesh((2, 2), ("dp", "tp"), backend="local"), rules, P("dp"))):
        params = sf.nn.shard_params(model, rules, mesh=mesh, unmatched="ignore")
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with sf.debug.CommCounter() as cc:
                got.append(sharded_loss_and_grads(loss_fn, params, sf.distribute(ids, spec, mesh=mesh),
                                                  sf.distribute(labels, spec, mesh=mesh), "autograd"))
    assert dict(cc.counts) == {"all_reduce": 2 * LAYERS + 1}, cc
    (want, want_grads), (loss, grads) = got
    close(loss, want)
    assert set(grads) == set(want_grads)
    for n in want_grads:
        close(grads[n], want_grads[n])


@pytest.mark.parametrize("name", EAGER)
def test_eager_attention_families(name: str) -> None:
    """VaultGemma (soft-capping) and GPT-Neo (local attention layers), eager attention: Megatron's
    sequential counts (2, 4) under autograd; under torch.func the same values and gradients and,
    as test_hf_families' Gemma2, 4 all_gather per layer (q, k, the probabilities folded with the
    heads; the output's gradient)."""
    fwd, both = _check(name, "autograd")
    assert dict(fwd.counts) == _counts(2 * LAYERS), fwd
    assert dict(both.counts) == _counts(4 * LAYERS + 1), both
    fwd, both = _check(name, "func")
    assert dict(both.counts) == _counts(4 * LAYERS + 1, 4 * LAYERS), both


@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_xglm_attention_folds_batch_and_heads(mode: str) -> None:
    """XGLM's attention reshapes (batch, heads) into one dim itself (``bsz * num_heads``, then
    ``bmm``). With the batch over dp and the heads over tp a device holds, of that dim, a run of
    heads for each of its batch rows: no block of it, so a block layout cannot hold it (that needs
    a strided layout, DTensor's ``_StridedShard``) and q, k, v are gathered over tp (3 per layer),
    the attention runs on every tp device, and the output's gradient is gathered at the same fold
    in the backward (1). Megatron's local code folds each device's own heads: no gather. The
    all_reduces are Megatron's (2, 4); values and gradients equal unsharded."""
    fwd, both = _check("xglm", mode)
    assert dict(fwd.counts) == _counts(2 * LAYERS, 3 * LAYERS), fwd
    assert dict(both.counts) == _counts(4 * LAYERS + 1, 4 * LAYERS), both


def test_diffllama_pairs_heads_across_devices() -> None:
    """DiffLlama's differential attention pairs head ``h`` with head ``h + H/2`` (``chunk(2)`` of
    the heads) and attends with each half of the value heads (``chunk(value, 2, dim=1)``
    repeated): with the heads split over tp in blocks, every pair spans the two devices, so each
    layer gathers the value halves and the second half of the heads' outputs (2 all_gather forward,
    2 more backward), and reduces the value projection's gradient (both devices' heads read each
    value head). Its learned ``lambda_*`` vectors enter through ``exp`` (a factor not known finite),
    so their pending gradients are all-reduced over dp and tp there (4 scalar all_reduce per
    layer), as ``tests/test_pending_factors.py`` requires. Megatron's (2, 4) on top: forward
    2 + 2, forward + backward 9 + 4 per layer; values and gradients equal unsharded."""
    fwd, both = _check("diffllama", "func")
    assert dict(fwd.counts) == _counts(2 * LAYERS, 2 * LAYERS), fwd
    assert dict(both.counts) == _counts(9 * LAYERS + 1, 4 * LAYERS), both


def test_jetmoe_data_parallel() -> None:
    """JetMoE (mixture of attention heads and MoE MLP; experts replicated, no tp rules): its routers
    sort all the tokens by expert (``sort`` of the flattened top-k ids) and gather their rows, so a
    batch split over dp is gathered at each router (7 all_gather per layer forward: the sort and
    its index for the attention's and the MLP's router, and the token rows the experts read, 3 more
    backward) and the expert outputs scattered back into the tokens arrive pending over dp
    (all_reduce). Data-parallel Megatron routes each device's tokens locally: no collective but
    the loss's. Values and gradients equal unsharded under autograd. (torch.func cannot run it:
    its router's ``expert_size.tolist()`` reads a wrapped ShardedArray's storage, which functorch
    takes directly, beneath the array's ``tolist``.)"""
    fwd, both = _check("jetmoe", "autograd")
    assert dict(fwd.counts) == _counts(2 * LAYERS, 7 * LAYERS), fwd
    assert dict(both.counts) == _counts(2 * LAYERS + 1, 10 * LAYERS), both


@pytest.mark.parametrize("mode", ["autograd", "func"])
def test_multi_query_attention_keeps_query_heads_split(mode: str) -> None:
    """Llama with one kv head (multi-query, as Gemma-2B, Falcon-7B, StarCoder), Megatron's plan:
    q column-parallel, k/v projections replicated. The attention keeps the query heads split and
    the kv head whole: Megatron's forward (2 all_reduce per layer, no gather; before, the query
    heads were gathered, 1 all_gather forward and 2 backward per layer). Backward: the key and
    value gradients are sums over the query heads' devices, reduced before the replicated
    projections read them (the key's at RoPE's product by ``cos * attention_scaling``, the
    value's at its weight gradient: factors not known finite, ``tests/test_pending_factors.py``):
    2 small all_reduce per layer beyond Megatron's 4, where a hand-written plan all-reduces the
    replicated kv weights' gradients instead. Values and gradients equal unsharded."""
    fwd, both = _check("llamamqa", mode)
    assert dict(fwd.counts) == _counts(2 * LAYERS), fwd
    assert dict(both.counts) == _counts(6 * LAYERS + 1), both
