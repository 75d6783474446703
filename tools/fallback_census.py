"""Fallback census: which aten ops reach shardfn's replicate-everything fallback in model code.

Runs model code forward + backward on a simulated mesh, tensor-parallel (``tp``), data-parallel
(``dp``) and both (``dptp``), and lists every op that warned ``FallbackWarning`` (no sharding
rule), with whether DTensor has a strategy for it:

- HF Llama, Qwen2, Mistral and Gemma from tiny configs (when ``transformers`` is installed),
  Megatron-sharded over ``tp`` (q/k/v/gate/up by output row, o/down by input column), batch
  over ``dp``; with ``--families all`` also every family ``tests/test_hf_families.py`` and
  ``tests/test_hf_families_more.py`` build (their tensor-parallel rules; when the tests are
  importable);
- the project's transformer block (``benchmarks/bench_sim.py``);
- ``sdpa``: ``F.scaled_dot_product_attention`` itself with grouped-query heads (``enable_gqa``),
  bool / float / causal masks, dropout and a custom scale, heads over ``tp``, batch over ``dp``;
- ``kernels``: the CUDA kernels called directly (every SDPA backend's forward and backward,
  ``_flash_attention_*``, ``_efficient_attention_*``, the fused-overrideable SDPA, the fused
  RMS norm, ``native_layer_norm``, ``_addmm_activation``, the ``_foreach`` ops, ``_scaled_mm``,
  ``_int_mm``, ``_weight_int8pack_mm``, ``_grouped_mm`` of 2-D operands and its backward);
- ``optim``: ``sf.optim`` AdamW / Adam / SGD with ``foreach=True`` and ``fused=True``;
- ``mha``: ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` in inference and the
  kernels of their fast path (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``,
  ``_transform_bias_rescale_qkv``) with every mask type, forward only.

On ``--device meta`` (any CPU machine) torch's meta kernels stand in for the CUDA ones; as
``F.scaled_dot_product_attention`` picks the math path off CUDA, ``--sdpa`` routes it to the
kernel CUDA would use (``flash``, ``efficient``, ``cudnn``, ``math``; ``cuda`` = efficient
for float32, flash for half types, as torch picks on an H100; ``all`` = each in turn; ``auto``
= torch's own choice, the right one on ``--device cuda``). ``F.rms_norm`` runs the fused kernel
on CUDA and meta alike.

``--grad autograd,func`` differentiates the HF families by ``torch.autograd.grad`` and also by
``torch.func.grad`` (rows ``name+func``); ``--families new`` runs the model types transformers ships
that no test builds yet (``NEW_FAMILIES``, tiny configs by ``tiny_config``). On meta, a model that
reads its data on the host (``.tolist()``, ``.cpu()``) cannot run: such a row names the error.

    python tools/fallback_census.py [--device meta] [--dtypes float32,bfloat16] [--sdpa cuda]
                                    [--configs tp,dp,dptp] [--families core|all|new] [--models llama,sdpa,mha]
                                    [--grad autograd,func]

Target on CUDA / meta: no op for any model.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's shardfn
sys.path.insert(0, str(ROOT / "benchmarks"))

import shardfn as sf  # noqa: E402
from shardfn import P  # noqa: E402
from shardfn.arrays import dispatch as _dispatch  # noqa: E402
from shardfn.arrays import entries as _entries  # noqa: E402

aten = torch.ops.aten
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")

TP_RULES = [
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("tp", None)),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.bias$", P("tp")),
    (r"(o_proj|down_proj)\.weight$", P(None, "tp")),
]


def _tp_spec(name: str) -> P:
    for pattern, spec in TP_RULES:
        if re.search(pattern, name):
            return spec
    return P()


# -- routing F.scaled_dot_product_attention to one kernel -----------------------------------------


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA for kernels without it: each k/v head serves q.shape[-3] // k.shape[-3] query heads."""
    rep = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)


def sdpa_via(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` computed by the aten kernel ``kernel`` (as CUDA's
    dispatcher would call it; GQA by repeating k/v where the kernel lacks it)."""
    if kernel == "math":
        return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k, v = _repeat_kv(q, k, v)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kernel in ("flash", "cudnn") and q.shape[-1] != v.shape[-1]:
        kernel = "efficient"  # as CUDA's dispatcher: only the efficient kernel takes a value head dim of its own (MLA)
    if kernel == "flash" and attn_mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, grad, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    # efficient (and flash with a mask, which CUDA sends to the efficient kernel)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                        scale=scale)[0]


class SdpaRoute(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` to one aten kernel (``cuda``: by dtype, as
    torch does on an H100: efficient for float32, flash for float16/bfloat16)."""

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            kernel = self.kernel
            if kernel == "cuda":
                kernel = "efficient" if args[0].dtype == torch.float32 else "flash"
            return sdpa_via(kernel, *args, **kwargs)
        return func(*args, **kwargs)


# -- models ----------------------------------------------------------------------------------------


def hf_families() -> dict[str, Callable[[], Any]]:
    """Tiny configs of the HF families ({} when transformers is not installed)."""
    try:
        import transformers as tf
    except ImportError:
        return {}
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    out = {}
    for name, cfg_cls, model_cls in [("llama", "LlamaConfig", "LlamaForCausalLM"),
                                     ("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
                                     ("mistral", "MistralConfig", "MistralForCausalLM"),
                                     ("gemma", "GemmaConfig", "GemmaForCausalLM")]:
        if hasattr(tf, cfg_cls) and hasattr(tf, model_cls):
            extra = {"head_dim": 16} if name == "gemma" else {}
            config_type, model_type = getattr(tf, cfg_cls), getattr(tf, model_cls)

            def build(c: Any = config_type, m: Any = model_type, extra: dict = extra) -> Any:
                cfg = c(**common, **extra)
                cfg._attn_implementation = "sdpa"
                return m(cfg)

            out[name] = build
    return out


CONFIGS = {"tp": ((2,), ("tp",)), "dp": ((2,), ("dp",)), "dptp": ((2, 2), ("dp", "tp"))}


def more_families(families: str = "all") -> dict[str, tuple[Callable[[], Any], list]]:
    """The families ``tests/test_hf_families.py`` and ``tests/test_hf_families_more.py`` build
    (``families="all"``), or those ``NEW_FAMILIES`` lists that no test builds yet (``"new"``):
    name -> (build, TP rules) ({} when the tests or transformers are not importable)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_hf_families as fam
        import transformers as tf
    except Exception:  # noqa: BLE001 - pytest or transformers missing: the core families only
        return {}
    if families == "new":
        return new_families()
    out = {}
    for name in sorted(set(fam.MEGATRON) | {"mixtral", "qwen2moe", "bloom", "phi3", "gpt2"}):
        make, attn, rules = fam._cfg(name)
        moe = name in ("mixtral", "qwen2moe")

        def build(make: Any = make, attn: str = attn, moe: bool = moe) -> Any:
            extra = {"experts_implementation": fam.EXPERTS} if moe and fam.EXPERTS else {}
            return tf.AutoModelForCausalLM.from_config(make(), attn_implementation=attn, **extra)

        out[name] = (build, [(pat, spec) for pat, spec in rules])
    try:
        import test_hf_families_more as more
    except Exception:  # noqa: BLE001 - as above
        return out
    for name in sorted(set(more.MEGATRON) | set(more.MLA) | {"gptoss"} | set(getattr(more, "EXTRA", ()))):
        make, attn, rules, auto = more._cfg(name)

        def build_more(make: Any = make, attn: str = attn, auto: Any = auto, moe: bool = name in more.MOE) -> Any:
            extra = {"experts_implementation": "batched_mm"} if moe else {}
            return auto.from_config(make(), attn_implementation=attn, **extra)

        out[name] = (build_more, list(rules))
    return out


# model types transformers ships that no test builds yet (``--families new``), each from its default
# config made tiny by ``tiny_config``; the TP rules name the usual projection names (``_GENERIC_TP``)
NEW_FAMILIES = ("qwen3_next", "exaone_moe", "afmoe", "internlm3", "minimax", "jamba", "doge",
                "dbrx", "flex_olmo", "lfm2", "nanochat", "cwm", "ministral3", "solar_open", "youtu", "granite_swa",
                "glm4_moe_lite", "openai-gpt", "ctrl", "camembert", "data2vec-text", "roformer", "megatron-bert", "albert",
                "roberta-prelayernorm", "xlm-roberta-xl", "esm", "eurobert", "ernie", "falcon_h1", "lfm2_moe",
                "granitemoehybrid", "zamba2", "recurrent_gemma", "olmo_hybrid")
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16, n_embd=64, n_layer=2, n_head=4,
             n_positions=64, d_model=64, n_heads=4, n_layers=2, num_layers=2, num_heads=4, ffn_dim=128, n_inner=128,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4,
             moe_num_experts=4, dim=64, hidden_dim=128, max_seq_len=64, sliding_window=4, embedding_size=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
_C = (r"(q_proj|k_proj|v_proj|(?<!_)gate_proj|(?<!_)up_proj|q_b_proj|kv_b_proj|fc1|fc_in|c_fc|w1|w3|query|key|value|"
      r"intermediate\.dense|dense_h_to_4h|c_attn|qkv_proj|Wqkv|query_key_value|gate_up_proj|Wi)")
_R = (r"(o_proj|down_proj|out_proj|fc2|fc_out|w2|attention\.output\.dense|layer\.\d+\.output\.dense|dense_4h_to_h|"
      r"c_proj|Wo)")
_GENERIC_TP = [(_C + r"\.weight$", P("tp", None)), (_C + r"\.bias$", P("tp")), (_R + r"\.weight$", P(None, "tp"))]


def tiny_config(model_type: str) -> Any:
    """transformers' default config of ``model_type`` with every size it names made tiny (``_TINY``)."""
    import transformers as tf

    cfg = tf.AutoConfig.for_model(model_type)
    for k, v in _TINY.items():
        if hasattr(cfg, k):
            with contextlib.suppress(Exception):
                setattr(cfg, k, v)
    return cfg


def new_families() -> dict[str, tuple[Callable[[], Any], list]]:
    """The families ``NEW_FAMILIES`` lists (no test builds them yet), from ``tiny_config``."""
    import transformers as tf
    from transformers.models.auto import modeling_auto as ma

    out = {}
    for name in NEW_FAMILIES:
        causal = name in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if not causal and name not in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            continue
        auto = tf.AutoModelForCausalLM if causal else tf.AutoModelForMaskedLM

        def build(name: str = name, auto: Any = auto) -> Any:
            # MoE experts as batched matmuls, as the tests run them (torch's grouped_mm takes bfloat16 only
            # on CUDA and meta); no SDPA path: eager attention
            for kwargs in ({"attn_implementation": "sdpa", "experts_implementation": "batched_mm"},
                           {"attn_implementation": "sdpa"}, {"attn_implementation": "eager"}):
                try:
                    return auto.from_config(tiny_config(name), **kwargs)
                except (ValueError, TypeError):
                    continue
            return auto.from_config(tiny_config(name))

        out[name] = (build, _GENERIC_TP)
    return out


def no_func() -> set[str]:
    """Families plain torch cannot run under torch.func (an autograd.Function without setup_context)."""
    try:
        import test_hf_families as fam
    except Exception:  # noqa: BLE001 - as in more_families
        return set()
    # (PhiMoE in training mode, as the census runs it: its router's autograd.Function has no setup_context;
    # JetMoE's router calls ``.tolist()``, which functorch runs on the wrapped array's storage)
    return set(fam.NO_FUNC) | {"phimoe", "jetmoe"}


def _spec(name: str, rules: list | None, mesh: sf.Mesh) -> P:
    if "tp" not in mesh.axis_names:
        return P()
    for pattern, spec in rules if rules is not None else TP_RULES:
        if re.search(pattern, name):
            return spec
    return P()


def _hf_step(build: Callable[[], Any], mesh: sf.Mesh, device: str, dtype: torch.dtype,
             rules: list | None = None, grad_mode: str = "autograd") -> tuple[Any, dict]:
    """One forward + backward of an HF model, weights by ``rules`` over ``tp`` (when the mesh
    has it), token ids split over ``dp`` (when it has that), differentiated by ``grad_mode``
    (``autograd``: ``torch.autograd.grad``; ``func``: ``torch.func.grad``, as functorch users
    train); (loss, grads by name)."""
    torch.manual_seed(0)
    model = build().to(dtype=dtype)
    model = model.to(device) if device != "meta" else model.to("meta")
    params = {n: sf.distribute(p.detach(), _spec(n, rules, mesh), mesh=mesh).requires_grad_()
              for n, p in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    if "dp" in mesh.axis_names:
        ids = sf.distribute(ids, P("dp"), mesh=mesh)

    # no cache, as training and the tests (torch.func cannot run transformers' cache: it builds tensors
    # inside the transform, as plain torch shows); without one transformers reads the ids' positions,
    # which a meta tensor cannot answer: ``_unpacked_on_meta``
    kwargs = {"use_cache": False} if hasattr(model.config, "use_cache") else {}

    def loss_of(p: dict) -> Any:
        return torch.func.functional_call(model, p, (ids,), kwargs).logits.float().pow(2).mean()

    with _unpacked_on_meta(device):
        if grad_mode == "func":
            grads, loss = torch.func.grad_and_value(loss_of)(params)
            return loss, grads
        loss = loss_of(params)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)  # (a masked LM's unused pooler)
    return loss, dict(zip(params, grads))


@contextlib.contextmanager
def _unpacked_on_meta(device: str) -> Iterator[None]:
    """On meta, transformers' data-dependent mask checks (reads of the ids' positions and padding,
    which a meta tensor cannot answer) answer as for the census's ids: not packed, not padded."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    saved = {n: getattr(mu, n, None) for n in ("find_packed_sequence_indices", "fast_all")}
    if device != "meta" or None in saved.values():
        yield
        return
    packed, all_ = saved["find_packed_sequence_indices"], saved["fast_all"]
    mu.find_packed_sequence_indices = lambda position_ids: None if position_ids.is_meta else packed(position_ids)
    mu.fast_all = lambda t: True if t.is_meta else all_(t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(mu, n, f)


def _block_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    import bench_sim

    cfg = bench_sim.QUICK
    specs = bench_sim.MEGATRON if "tp" in mesh.axis_names else {}
    batch = P("dp") if "dp" in mesh.axis_names else P()
    params = {k: sf.distribute(v.to(device, dtype), specs.get(k, P()), mesh=mesh)
              for k, v in bench_sim.init_params(cfg).items()}
    x, y = (sf.distribute(t.to(device, dtype), batch, mesh=mesh) for t in bench_sim.make_batch(cfg, 0))
    bench_sim.train_step(params, x, y, cfg["heads"])


def _qkv_spec(mesh: sf.Mesh) -> P:
    """(batch, heads, seq, head_dim): batch over dp, heads over tp, where the mesh has them."""
    return P("dp" if "dp" in mesh.axis_names else None, "tp" if "tp" in mesh.axis_names else None)


def _sdpa_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    """F.scaled_dot_product_attention in its variants, forward and backward."""
    B, H, S, D = 4, 4, 8, 16
    spec = _qkv_spec(mesh)
    mask_spec = P(spec[0])
    bool_mask = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(0)) > 0.3
    bool_mask[..., 0] = True
    float_mask = torch.zeros(B, 1, S, S).masked_fill(~bool_mask, float("-inf"))
    variants = [
        dict(), dict(is_causal=True), dict(scale=0.3), dict(dropout_p=0.1), dict(kv_heads=2, enable_gqa=True),
        dict(kv_heads=2, enable_gqa=True, is_causal=True), dict(attn_mask=bool_mask), dict(attn_mask=float_mask),
        dict(attn_mask=bool_mask[:1, :, :, :].clone()), dict(attn_mask=float_mask, dropout_p=0.1, scale=0.5),
    ]
    for v in variants:
        v = dict(v)
        hkv = v.pop("kv_heads", H)
        q = sf.distribute(torch.randn(B, H, S, D, dtype=dtype).to(device), spec, mesh=mesh).requires_grad_()
        k, val = (sf.distribute(torch.randn(B, hkv, S, D, dtype=dtype).to(device), spec, mesh=mesh).requires_grad_()
                  for _ in range(2))
        if "attn_mask" in v:
            m = v["attn_mask"].to(device)
            m = m.to(dtype) if m.is_floating_point() else m
            v["attn_mask"] = sf.distribute(m, mask_spec if m.shape[0] == B else P(), mesh=mesh)
        out = F.scaled_dot_product_attention(q, k, val, **v)
        torch.autograd.grad(out.float().pow(2).sum(), (q, k, val))


def _kernels_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    """The CUDA kernels called directly, forward and backward through autograd. On a real
    device a kernel that rejects the call unsharded (flash and cuDNN take only half types,
    alignment rules) is skipped: the census is about rules, not about kernel support."""
    B, H, S, D = 4, 4, 8, 16
    spec = _qkv_spec(mesh)
    bshd = P(spec[0], None, spec[1])
    tp = "tp" if "tp" in mesh.axis_names else None

    def arr(shape: tuple, sp: P, grad: bool = True) -> Any:
        x = sf.distribute(torch.randn(*shape, dtype=dtype).to(device), sp, mesh=mesh)
        return x.requires_grad_() if grad else x

    def back(out: Any, *ins: Any) -> None:
        torch.autograd.grad(out.float().pow(2).sum(), [t for t in ins if t.requires_grad])

    def run(fn: Callable[..., Any], *ins: Any) -> None:
        # on meta only a kernel this torch lacks is skipped (2.11 has no meta kernel for the
        # fused-overrideable backward): a meta kernel's other errors are the rules' business
        skip = NotImplementedError if device == "meta" else Exception
        plain = [t.full_tensor().detach().requires_grad_(t.requires_grad) for t in ins]
        try:
            fn(*plain)
        except skip:  # the kernel's own limits: not the census's business
            return
        fn(*ins)

    q, k, v = (arr((B, H, S, D), spec) for _ in range(3))
    bias = arr((B, H, S, S), spec)
    kg, vg = (arr((B, H // 2, S, D), spec) for _ in range(2))
    for causal in (False, True):
        run(lambda q, k, v, c=causal: back(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c, False, scale=0.3)[0],
                                 q, k, v), q, k, v)
        run(lambda q, k, v, b, c=causal: back(aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, c)[0],
                                    q, k, v, b), q, k, v, bias)
        run(lambda q, k, v, c=causal: back(aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, c, False)[0],
                                 q, k, v), q, k, v)
    run(lambda q, k, v, b: back(aten._scaled_dot_product_attention_math(q, k, v, b, 0.0, False, None)[0], q, k, v, b),
        q, k, v, bias)
    run(lambda q, k, v: back(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0], q, k, v), q, kg, vg)

    def overrideable(q: Any, k: Any, v: Any, b: Any) -> None:
        o = aten._scaled_dot_product_fused_attention_overrideable(q, k, v, b, 0.0, False, False)
        aten._scaled_dot_product_fused_attention_overrideable_backward(
            o[0], q, k, v, b, [True, True, True, True], o[0], o[1], o[2], o[3], o[4], o[5], 0.0, False, o[6], o[7])

    run(overrideable, q, k, v, bias)
    qb, kb, vb = (arr((B, S, H, D), bshd) for _ in range(3))
    run(lambda q, k, v: back(aten._flash_attention_forward(q, k, v, None, None, S, S, 0.0, True, False)[0], q, k, v),
        qb, kb, vb)
    run(lambda q, k, v: back(aten._efficient_attention_forward(q, k, v, None, None, None, S, S, 0.0, 1, True)[0],
                             q, k, v), qb, kb, vb)
    x = arr((B, S, 64), P(spec[0]))
    w, b = arr((64,), P()), arr((64,), P())

    def rms(x: Any, w: Any) -> None:
        out, rstd = aten._fused_rms_norm(x, [64], w, 1e-6)
        back(out, x, w)
        aten._fused_rms_norm_backward(out, x, [64], rstd, w, [True, True])

    def layer_norm(x: Any, w: Any, b: Any) -> None:
        ln = aten.native_layer_norm(x, [64], w, b, 1e-5)
        back(ln[0], x, w, b)
        aten.native_layer_norm_backward(ln[0], x, [64], ln[1], ln[2], w, b, [True, True, True])

    run(rms, x, w)
    run(layer_norm, x, w, b)
    for gelu in (False, True):
        run(lambda b, x, m, g=gelu: aten._addmm_activation(b, x, m, use_gelu=g),
            arr((32,), P(tp), False), arr((B * S, 64), P(spec[0]), False), arr((64, 32), P(None, tp), False))

    def foreach(a: Any, c: Any) -> None:
        ts = [a, c]
        torch._foreach_addcdiv(torch._foreach_lerp(torch._foreach_add(ts, ts, alpha=0.1), ts, 0.5), ts,
                               torch._foreach_add(torch._foreach_sqrt(torch._foreach_abs(ts)), 1e-8), 0.01)
        torch._foreach_norm(torch._foreach_mul(ts, 0.5))
        torch._foreach_max(ts)

    run(foreach, arr((8, 16), P(spec[0], tp), False), arr((16,), P(tp), False))

    def typed(shape: tuple, sp: P, dt: torch.dtype, t: Any = None) -> Any:
        t = torch.randn(shape) if t is None else t
        return sf.distribute(t.to(dt).to(device), sp, mesh=mesh)

    def low_precision(a: Any, bt: Any, s: Any, xi: Any, wi: Any, x: Any, w8: Any, sc: Any) -> None:
        aten._scaled_mm(a, bt.t(), s, s, out_dtype=torch.bfloat16)  # mat2 column-major, as cuBLASLt takes it
        aten._int_mm(xi, wi)
        aten._weight_int8pack_mm(x, w8, sc)

    f8 = torch.float8_e4m3fn
    ints = torch.randint(-4, 4, (64, 64))
    run(low_precision, typed((64, 64), P(spec[0]), f8), typed((64, 64), P(tp), f8),
        typed((), P(), torch.float32), typed((64, 64), P(spec[0]), torch.int8, ints),
        typed((64, 64), P(None, tp), torch.int8, ints), typed((B * S, 64), P(spec[0]), torch.bfloat16),
        typed((32, 64), P(tp), torch.int8, ints[:32]), typed((32,), P(tp), torch.bfloat16))
    offs = sf.distribute(torch.tensor([16, 40, 64], dtype=torch.int32).to(device), P(), mesh=mesh)
    run(lambda a, b: back(torch._grouped_mm(a, b, offs), a, b), typed((32, 64), P(spec[0]), torch.bfloat16).requires_grad_(),
        typed((64, 32), P(None, tp), torch.bfloat16).requires_grad_())


def _mha_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    """``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in inference (eval, batch
    first, inference mode), and the kernels of their fast path called as it calls them
    (``_native_multi_head_attention`` with each mask type and weights variant,
    ``_transformer_encoder_layer_fwd``, ``_transform_bias_rescale_qkv``): batch over ``dp``,
    in_proj's packed rows over ``tp`` (a Megatron split by rows, which cuts q, k and v
    apart: gathered). The modules themselves take their composite path on ShardedArrays (3-d
    arrays carry a torch-function hook, which torch's fast-path check refuses)."""
    E, H, B, S = 16, 4, 4, 8
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    enc = torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=dtype).eval()
    dp = "dp" if "dp" in mesh.axis_names else None
    tp = "tp" if "tp" in mesh.axis_names else None

    def arr(t: torch.Tensor, sp: P = P()) -> Any:
        return sf.distribute(t.to(device), sp, mesh=mesh)

    def params(mod: torch.nn.Module) -> dict:
        return {n: arr(p.detach(), P(tp, None) if n.endswith("in_proj_weight") else P(tp) if n.endswith("in_proj_bias")
                       else P()) for n, p in mod.named_parameters()}

    pm, pe = params(mha), params(enc)
    x = arr(torch.randn(B, S, E, dtype=dtype), P(dp))
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[:, -1] = True
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    full = (causal | pad[:, None, None, :]).expand(B, H, S, S).contiguous()
    masks = [(None, None), (arr(causal), 0), (arr(pad, P(dp)), 1), (arr(full, P(dp)), 2)]
    attn = [pm[n] for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")]
    with torch.inference_mode():
        torch.func.functional_call(mha, pm, (x, x, x), {"key_padding_mask": masks[2][0]})
        torch.func.functional_call(enc, pe, (x,), {"src_key_padding_mask": masks[2][0]})
        for mask, mask_type in masks:
            for need, avg in ((False, True), (True, True), (True, False)):
                aten._native_multi_head_attention(x, x, x, E, H, *attn, mask, need, avg, mask_type)
            ln = [pe[f"norm{i}.{w}"] for i in (1, 2) for w in ("weight", "bias")]
            ff = [pe[f"linear{i}.{w}"] for i in (1, 2) for w in ("weight", "bias")]
            enc_attn = [pe["self_attn." + n] for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                       "out_proj.bias")]
            aten._transformer_encoder_layer_fwd(x, E, H, *enc_attn, False, False, 1e-5, *ln, *ff, mask, mask_type)
        aten._transform_bias_rescale_qkv(arr(torch.randn(B, S, 3 * E, dtype=dtype), P(dp)), attn[1], H)


def _optim_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    """sf.optim with torch's foreach and fused kernels, two steps."""
    tp = "tp" if "tp" in mesh.axis_names else None
    dp = "dp" if "dp" in mesh.axis_names else None
    params = {"w": sf.distribute(torch.randn(8, 16, dtype=dtype).to(device), P(dp, tp), mesh=mesh),
              "b": sf.distribute(torch.randn(16, dtype=dtype).to(device), P(tp), mesh=mesh)}
    grads = {k: v * 0.1 for k, v in params.items()}
    for opt in (sf.optim.AdamW(1e-3, foreach=True), sf.optim.Adam(1e-3, fused=True),
                sf.optim.SGD(1e-2, momentum=0.9, foreach=True)):
        state = opt.init(params)
        p, state = opt.step(params, grads, state)
        opt.step(p, grads, state)


def models(families: str = "core", grad_mode: str = "autograd") -> dict[str, Callable[[str, torch.dtype, sf.Mesh], Any]]:
    """name -> run(device, dtype, mesh): one training step on a simulated mesh of that device
    (the HF families differentiated by ``grad_mode``: ``autograd`` or ``func``)."""
    out: dict[str, Callable[[str, torch.dtype, sf.Mesh], Any]] = {}
    for name, build in hf_families().items():
        out[name] = lambda device, dtype, mesh, build=build: _hf_step(build, mesh, device, dtype, grad_mode=grad_mode)
    if families in ("all", "new"):
        skip = no_func() if grad_mode == "func" else set()
        for name, (build, rules) in more_families(families).items():
            if name in skip:
                continue
            out[name] = lambda device, dtype, mesh, build=build, rules=rules: _hf_step(build, mesh, device, dtype, rules,
                                                                                       grad_mode)
    if families == "new":
        return out
    out["block"] = lambda device, dtype, mesh: _block_step(mesh, device, dtype)
    out["sdpa"] = lambda device, dtype, mesh: _sdpa_step(mesh, device, dtype)
    out["kernels"] = lambda device, dtype, mesh: _kernels_step(mesh, device, dtype)
    out["optim"] = lambda device, dtype, mesh: _optim_step(mesh, device, dtype)
    out["mha"] = lambda device, dtype, mesh: _mha_step(mesh, device, dtype)
    return out


def builders(families: str = "core") -> dict[str, Callable[[], Any]]:
    """name -> the HF model builder ``models`` runs under that name."""
    out = dict(hf_families())
    if families in ("all", "new"):
        out.update({name: build for name, (build, _) in more_families(families).items()})
    return out


def plain_error(build: Callable[[], Any]) -> str | None:
    """What one unsharded CPU forward + backward of the model raises (a tiny config the model
    itself rejects: transformers' defaults made tiny can break its own shape arithmetic), or None."""
    try:
        torch.manual_seed(0)
        model = build()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        kwargs = {"use_cache": False} if hasattr(model.config, "use_cache") else {}
        model(ids, **kwargs).logits.float().pow(2).mean().backward()
    except Exception as e:  # noqa: BLE001 - any error is the answer
        return f"{type(e).__name__}: {e}"
    return None


# -- the census ------------------------------------------------------------------------------------

_OP_IN_MESSAGE = re.compile(r"register_sharding\(torch\.ops\.([\w.]+)")


@contextlib.contextmanager
def recording_fallbacks() -> Iterator[set[str]]:
    """Collects the names of the ops that fall back inside (fresh dispatch caches, so an op
    cached by an earlier run still reports)."""
    ops: set[str] = set()
    _dispatch._cache.clear()
    _entries._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sf.FallbackWarning)
        try:
            yield ops
        finally:
            for w in caught:
                if issubclass(w.category, sf.FallbackWarning):
                    m = _OP_IN_MESSAGE.search(str(w.message))
                    ops.add(m.group(1) if m else str(w.message)[:80])
            _dispatch._cache.clear()
            _entries._warned.clear()


def dtensor_strategy(op_name: str) -> str:
    """Whether DTensor's sharding propagator has a strategy (or rule) for ``aten.<op>``."""
    try:
        from torch.distributed.tensor import DTensor

        packet, _, overload = op_name.partition(".")[2].partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        prop = DTensor._op_dispatcher.sharding_propagator
        tables = [prop.op_strategy_funcs, prop.op_to_rules, getattr(prop, "op_single_dim_strategy_funcs", {})]
        return "yes" if any(op in t for t in tables) else "no"
    except Exception as e:  # noqa: BLE001 - a report, not a check
        return f"? ({type(e).__name__})"


def run_census(device: str, dtypes: list[torch.dtype], kernels: list[str], only: list[str] | None = None,
               configs: list[str] | None = None, families: str = "core",
               grad_modes: tuple[str, ...] = ("autograd",)) -> list[tuple[str, str, str, list[str] | str]]:
    """(model/config, dtype, sdpa kernel, fallen-back ops or an error message) per run
    (``configs``: default ``["dptp"]``, the block on dp x tp and the rest on ``tp``, as before;
    ``grad_modes``: the HF families also under ``torch.func.grad`` with ``"func"``, labelled ``+func``)."""
    rows = []
    runs = []
    builds = builders(families)
    plain_errors: dict[str, str | None] = {}
    for mode in grad_modes:
        for name, run in models(families, mode).items():
            if mode != "autograd" and name in ("block", "sdpa", "kernels", "optim", "mha"):
                continue  # (no torch.func form: autograd only)
            runs.append((name + ("" if mode == "autograd" else "+" + mode), name, run))
    for name, base, run in runs:
        if only and base not in only:
            continue
        for config in configs or [None]:
            if config is None:
                config = "dptp" if base == "block" else "tp"
                label = name
            else:
                label = f"{name}/{config}"
            shape, axes = CONFIGS[config]
            for dtype in dtypes:
                for kernel in kernels:
                    mode = SdpaRoute(kernel) if kernel != "auto" else contextlib.nullcontext()
                    mesh = sf.Mesh(shape, axes, backend="local", device_type=device)
                    try:
                        with recording_fallbacks() as ops, mode:
                            run(device, dtype, mesh)
                        rows.append((label, str(dtype).replace("torch.", ""), kernel, sorted(ops)))
                    except Exception as e:  # noqa: BLE001 - one model's failure must not hide the rest
                        if base in builds and base not in plain_errors:
                            plain_errors[base] = plain_error(builds[base])
                        plain = plain_errors.get(base)
                        what = f"plain torch raises too: {plain}" if plain else f"error: {type(e).__name__}: {e}"
                        rows.append((label, str(dtype).replace("torch.", ""), kernel, what[:300]))
    return rows


def report(rows: list[tuple[str, str, str, list[str] | str]]) -> str:
    lines = [f"{'model':24s}{'dtype':10s}{'sdpa':11s}ops that fell back (DTensor has a strategy?)"]
    for name, dtype, kernel, ops in rows:
        if isinstance(ops, str):
            desc = ops
        else:
            desc = ", ".join(f"{op} ({dtensor_strategy(op)})" for op in ops) or "none"
        lines.append(f"{name:24s}{dtype:10s}{kernel:11s}{desc}")
    fell = sorted({op for *_, ops in rows if not isinstance(ops, str) for op in ops})
    errors = sum(isinstance(ops, str) and ops.startswith("error") for *_, ops in rows)
    theirs = sum(isinstance(ops, str) and ops.startswith("plain torch") for *_, ops in rows)
    lines.append(f"distinct ops that fell back: {len(fell)}{': ' + ', '.join(fell) if fell else ''}; "
                 f"runs that raised: {errors}; runs whose model raises unsharded on CPU too: {theirs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="meta", help="mesh device type: meta (any machine), cuda, cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sdpa", default="cuda", help="auto, cuda, all, or one of " + ", ".join(SDPA_KERNELS))
    ap.add_argument("--models", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--configs", default="", help="comma-separated of tp, dp, dptp (default: the block on dptp, "
                                                  "the rest on tp)")
    ap.add_argument("--families", default="core", help="core (Llama, Qwen2, Mistral, Gemma), all (also the "
                                                       "families tests/test_hf_families*.py build) or new (the "
                                                       "families no test builds yet: NEW_FAMILIES)")
    ap.add_argument("--grad", default="autograd", help="comma-separated of autograd, func (torch.func.grad)")
    ns = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in ns.dtypes.split(",") if d]
    kernels = list(SDPA_KERNELS) if ns.sdpa == "all" else [ns.sdpa]
    configs = [c for c in ns.configs.split(",") if c] or None
    rows = run_census(ns.device, dtypes, kernels, [m for m in ns.models.split(",") if m] or None, configs, ns.families,
                      tuple(g for g in ns.grad.split(",") if g))
    print(report(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
