"""Fallback census: which aten ops reach shardfn's replicate-everything fallback in model code.

Runs tensor-parallel model code forward + backward on a simulated mesh and lists every op that
warned ``FallbackWarning`` (no sharding rule), with whether DTensor has a strategy for it:

- HF Llama, Qwen2, Mistral and Gemma from tiny configs (when ``transformers`` is installed),
  Megatron-sharded over ``tp`` (q/k/v/gate/up by output row, o/down by input column);
- the project's transformer block (``benchmarks/bench_sim.py``), dp x tp.

On ``--device meta`` (any CPU machine) torch's meta kernels stand in for the CUDA ones; as
``F.scaled_dot_product_attention`` picks the math path off CUDA, ``--sdpa`` routes it to the
kernel CUDA would use (``flash``, ``efficient``, ``cudnn``, ``math``; ``cuda`` = efficient
for float32, flash for half types, as torch picks on an H100; ``all`` = each in turn; ``auto``
= torch's own choice, the right one on ``--device cuda``). ``F.rms_norm`` runs the fused kernel
on CUDA and meta alike.

    python tools/fallback_census.py [--device meta] [--dtypes float32,bfloat16] [--sdpa cuda]

Target on CUDA / meta: no op for the four HF families.
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


def _hf_step(build: Callable[[], Any], mesh: sf.Mesh, device: str, dtype: torch.dtype) -> tuple[Any, dict]:
    """One TP forward + backward of an HF model; (loss, grads by name)."""
    torch.manual_seed(0)
    model = build().to(dtype=dtype)
    model = model.to(device) if device != "meta" else model.to("meta")
    params = {n: sf.distribute(p.detach(), _tp_spec(n), mesh=mesh).requires_grad_()
              for n, p in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.func.functional_call(model, params, (ids,))
    loss = out.logits.float().pow(2).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss, dict(zip(params, grads))


def _block_step(mesh: sf.Mesh, device: str, dtype: torch.dtype) -> None:
    import bench_sim

    cfg = bench_sim.QUICK
    params = {k: sf.distribute(v.to(device, dtype), bench_sim.MEGATRON.get(k, P()), mesh=mesh)
              for k, v in bench_sim.init_params(cfg).items()}
    x, y = (sf.distribute(t.to(device, dtype), P("dp"), mesh=mesh) for t in bench_sim.make_batch(cfg, 0))
    bench_sim.train_step(params, x, y, cfg["heads"])


def models() -> dict[str, Callable[[str, torch.dtype], Any]]:
    """name -> run(device, dtype): one TP training step on a simulated mesh of that device."""
    out: dict[str, Callable[[str, torch.dtype], Any]] = {}
    for name, build in hf_families().items():
        out[name] = lambda device, dtype, build=build: _hf_step(
            build, sf.Mesh((2,), ("tp",), backend="local", device_type=device), device, dtype)
    out["block"] = lambda device, dtype: _block_step(
        sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=device), device, dtype)
    return out


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


def run_census(device: str, dtypes: list[torch.dtype], kernels: list[str],
               only: list[str] | None = None) -> list[tuple[str, str, str, list[str] | str]]:
    """(model, dtype, sdpa kernel, fallen-back ops or an error message) per run."""
    rows = []
    for name, run in models().items():
        if only and name not in only:
            continue
        for dtype in dtypes:
            for kernel in kernels:
                mode = SdpaRoute(kernel) if kernel != "auto" else contextlib.nullcontext()
                try:
                    with recording_fallbacks() as ops, mode:
                        run(device, dtype)
                    rows.append((name, str(dtype).replace("torch.", ""), kernel, sorted(ops)))
                except Exception as e:  # noqa: BLE001 - one model's failure must not hide the rest
                    rows.append((name, str(dtype).replace("torch.", ""), kernel, f"error: {type(e).__name__}: {e}"[:300]))
    return rows


def report(rows: list[tuple[str, str, str, list[str] | str]]) -> str:
    lines = [f"{'model':10s}{'dtype':10s}{'sdpa':11s}ops that fell back (DTensor has a strategy?)"]
    for name, dtype, kernel, ops in rows:
        if isinstance(ops, str):
            desc = ops
        else:
            desc = ", ".join(f"{op} ({dtensor_strategy(op)})" for op in ops) or "none"
        lines.append(f"{name:10s}{dtype:10s}{kernel:11s}{desc}")
    fell = sorted({op for *_, ops in rows if not isinstance(ops, str) for op in ops})
    errors = sum(isinstance(ops, str) for *_, ops in rows)
    lines.append(f"distinct ops that fell back: {len(fell)}{': ' + ', '.join(fell) if fell else ''}; "
                 f"runs that raised: {errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="meta", help="mesh device type: meta (any machine), cuda, cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sdpa", default="cuda", help="auto, cuda, all, or one of " + ", ".join(SDPA_KERNELS))
    ap.add_argument("--models", default="", help="comma-separated subset (default: all)")
    ns = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in ns.dtypes.split(",") if d]
    kernels = list(SDPA_KERNELS) if ns.sdpa == "all" else [ns.sdpa]
    rows = run_census(ns.device, dtypes, kernels, [m for m in ns.models.split(",") if m] or None)
    print(report(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
