"""Collectives shardfn issues on real Hugging Face model code, per transformer layer, beside
Megatron-LM's hand counts.

Tiny random Llama, Qwen2, Mistral and Gemma models built from configs (``transformers``, sdpa
attention), 2 layers, on the local backend with ``Mesh((2, 2), ("dp", "tp"))``: weights by
regex rules (``sf.nn.shard_params``: q/k/v, gate/up column-parallel, o/down row-parallel),
token ids ``P("dp")``, the model run through ``torch.func.functional_call``. Modes:

- ``tp fwd``: tensor parallel forward (Megatron: 2 all_reduce per layer);
- ``tp fwd+bwd`` (autograd) and ``tp fwd+bwd func`` (``torch.func.grad``) of the cross-entropy
  loss (Megatron: 4 per layer, +1 scalar for the loss);
- ``vocab fwd``: embedding and LM head split over the vocabulary, logits kept
  ``P("dp", None, "tp")`` by ``sf.nn.shard_activations`` (Megatron: 1 + 2 per layer, no gathers);
- ``seq fwd``: sequence parallel through ``sf.nn.shard_activations`` (Megatron: 2 all_gather +
  2 reduce_scatter per layer, one all_gather before the head);
- ``bf16 fwd+bwd``: the model in bfloat16 (as ``tp fwd+bwd``).

Counts come from ``sf.debug.CommCounter().records``: a record inside ``model.layers.<i>`` counts
for layer i, the rest (embedding, final norm, head, loss) as "other". A pending sum is reduced
where it is first read (a row-parallel layer's output by the next norm, the last one by the final
norm), so a layer's reduction may count for the next layer or for "other": the totals compare
like for like. Every case checks its
values (and gradients) against the unsharded model. The records tree of one case is printed
at the end, then a second table: totals for the 18 families of ``tests/test_hf_families.py``
(Megatron's counts by block structure there). ``SHARDFN_BENCH_QUICK=1`` runs Llama in two
modes (the smoke test).
Run ``python benchmarks/bench_comm_models.py``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

LAYERS, BATCH, SEQ, VOCAB = 2, 4, 8, 64
QUICK = os.environ.get("SHARDFN_BENCH_QUICK") == "1" or "--quick" in sys.argv

TP_RULES = [(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", P("tp", None)),
            (r"(q_proj|k_proj|v_proj)\.bias$", P("tp")),
            (r"(o_proj|down_proj)\.weight$", P(None, "tp"))]
VOCAB_RULES = [(r"(embed_tokens|lm_head)\.weight$", P("tp", None))]
SP = P("dp", "tp")
SEQ_ACTS = [(r"embed_tokens$", None, SP),
            (r"(self_attn|mlp)$", None, {0: SP}),
            (r"(input_layernorm|post_attention_layernorm|model\.norm)$", SP, P("dp"))]
VOCAB_ACTS = [(r"lm_head$", None, P("dp", None, "tp"))]

# mode -> (Megatron's collectives per layer, and outside the layers)
MEGATRON = {
    "tp fwd": ({"all_reduce": 2}, {}),
    "tp fwd+bwd": ({"all_reduce": 4}, {"all_reduce": 1}),
    "tp fwd+bwd func": ({"all_reduce": 4}, {"all_reduce": 1}),
    "vocab fwd": ({"all_reduce": 2}, {"all_reduce": 1}),
    "seq fwd": ({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 1}),
    "bf16 fwd+bwd": ({"all_reduce": 4}, {"all_reduce": 1}),
}


def build(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random model of ``family`` built from its config (no download)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation="sdpa")
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "mistral": lambda: transformers.MistralConfig(**common, head_dim=8, sliding_window=None),
        "gemma": lambda: transformers.GemmaConfig(**common, head_dim=8),
    }[family]()
    model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM"}[family])
    torch.manual_seed(0)
    return model(cfg).to(dtype)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def run_case(family: str, mode: str, mesh: sf.Mesh) -> tuple[sf.debug.CommCounter, float]:
    """Run one (model, mode), check values/gradients against the unsharded model, and return
    the counter and the largest relative error."""
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    model = build(family, dtype)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    backward = "bwd" in mode
    rules = ([*VOCAB_RULES] if mode.startswith("vocab") else []) + TP_RULES + [(r".*", P())]
    params = sf.nn.shard_params(model, rules, mesh=mesh)
    acts = SEQ_ACTS if mode.startswith("seq") else VOCAB_ACTS if mode.startswith("vocab") else []
    x, y = sf.distribute(ids, P("dp"), mesh=mesh), sf.distribute(labels, P("dp"), mesh=mesh)

    model.zero_grad()
    ref_logits = model(ids).logits
    if backward:
        _loss(ref_logits, labels).backward()

    with sf.nn.shard_activations(model, acts, mesh=mesh), sf.debug.CommCounter() as cc:
        # the parameters are differentiated (``requires_grad``), buffers (RoPE's ``inv_freq``) are constants
        if mode.endswith("func"):
            consts = {k: v for k, v in params.items() if not v.requires_grad}

            def loss_of(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
                logits = torch.func.functional_call(model, {**consts, **p}, (x,)).logits
                return _loss(logits, y), logits

            grads, logits = torch.func.grad(loss_of, has_aux=True)({k: v for k, v in params.items() if v.requires_grad})
        else:
            params = {k: v.detach().requires_grad_(backward and v.requires_grad) for k, v in params.items()}
            logits = torch.func.functional_call(model, params, (x,)).logits
            if backward:
                _loss(logits, y).backward()
                grads = {k: v.grad for k, v in params.items()}
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    err = _rel(logits.full_tensor(), ref_logits)
    if backward:
        err = max([err] + [_rel(grads[n].full_tensor(), p.grad) for n, p in model.named_parameters() if n in grads])
    if err > tol:
        raise AssertionError(f"{family} {mode}: shardfn differs from the unsharded model by {err:.2e} (> {tol})")
    return cc, err


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def per_layer(cc: sf.debug.CommCounter) -> tuple[list[Counter], Counter]:
    """Counts by kind in each layer (records inside ``model.layers.<i>``) and outside them."""
    layers = [Counter() for _ in range(LAYERS)]
    other: Counter = Counter()
    for r in cc.records:
        m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", r.module or "")
        (layers[int(m.group(1))] if m else other)[r.kind] += 1
    return layers, other


def _fmt(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"


def _layers_fmt(layers: list[Counter]) -> str:
    return _fmt(layers[0]) if all(c == layers[0] for c in layers) else " | ".join(_fmt(c) for c in layers)


def more_families() -> None:
    """Totals over 2 layers for the families of ``tests/test_hf_families.py`` (its configs,
    rules and Megatron counts by block structure), each case checked against the unsharded
    model there: TP forward, TP forward + backward (autograd, torch.func), vocabulary-parallel
    forward."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import test_hf_families as fam

    print(f"\nMore families (totals over {fam.LAYERS} layers, shardfn | Megatron; AR all_reduce, AG all_gather, "
          f"RS reduce_scatter)")
    print(f"{'model':11} {'tp fwd':16} {'tp fwd+bwd':22} {'tp fwd+bwd func':22} {'vocab fwd':16} {'seq fwd':20}")
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}

    def fmt(cc: sf.debug.CommCounter | None) -> str:
        return "n/a" if cc is None else " + ".join(f"{v} {short.get(k, k)}" for k, v in sorted(cc.counts.items())) or "0"

    megatron = {**fam.MEGATRON, "mixtral": (1, 2), "qwen2moe": (2, 4), "bloom": (2, 4), "phi3": (2, 4), "gpt2": (2, 4)}
    for name in [*sorted(fam.MEGATRON), "mixtral", "qwen2moe", "bloom", "phi3", "gpt2"]:
        f, b = megatron[name]
        cells = [fmt(fam._forward(name)), fmt(fam._backward(name, "autograd")),
                 fmt(None if name in fam.NO_FUNC else fam._backward(name, "func")),
                 fmt(fam._forward(name, vocab=True) if name in fam.MEGATRON else None)]
        want = [f"{f * fam.LAYERS} AR", f"{b * fam.LAYERS + 1} AR", f"{b * fam.LAYERS + 1} AR", f"{f * fam.LAYERS + 1} AR"]
        if name in fam.SEQUENCE_PARALLEL:
            recipe, ag, rs = fam.SEQUENCE_PARALLEL[name]
            cells.append(fmt(_sequence_parallel(fam, name, recipe)))
            want.append(f"{ag * fam.LAYERS + 1} AG + {rs * fam.LAYERS} RS")
        print(f"{name:11} " + " ".join(f"{c + ' | ' + w:{n}}" for c, w, n in zip(cells, want, (16, 22, 22, 16, 20))),
              flush=True)
    print("values and gradients equal unsharded (1e-4)")


def _sequence_parallel(fam: object, name: str, recipe: list) -> sf.debug.CommCounter:
    """The forward under ``fam``'s sequence-parallel recipe, its logits checked."""
    model, params, plain, ids, _, mesh = fam._setup(name)
    with sf.nn.shard_activations(model, recipe, mesh=mesh), sf.debug.CommCounter() as cc:
        out = fam.logits(model, params, sf.distribute(ids, P("dp"), mesh=mesh))
    fam.close(out, fam.logits(model, plain, ids))
    return cc


def main() -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    families = ["llama"] if QUICK else ["llama", "qwen2", "mistral", "gemma"]
    modes = ["tp fwd", "seq fwd"] if QUICK else list(MEGATRON)
    print(f"HF models on Mesh(dp=2, tp=2), {LAYERS} layers, batch {BATCH} x seq {SEQ}; "
          f"collectives per layer (shardfn | Megatron) and outside the layers")
    print(f"{'model':8} {'mode':16} {'shardfn per layer':46} {'Megatron per layer':32} "
          f"{'shardfn other':28} {'Megatron other':18} {'shardfn total':30} {'Megatron total':30} "
          f"{'max rel err':>11} {'s':>5}")
    tree = None
    for family in families:
        for mode in modes:
            t0 = time.perf_counter()
            cc, err = run_case(family, mode, mesh)
            layers, other = per_layer(cc)
            want_layer, want_other = MEGATRON[mode]
            total = sum(layers, Counter()) + other
            want_total = Counter({k: v * LAYERS for k, v in want_layer.items()}) + Counter(want_other)
            print(f"{family:8} {mode:16} {_layers_fmt(layers):46} {_fmt(want_layer):32} {_fmt(other):28} "
                  f"{_fmt(want_other):18} {_fmt(total):30} {_fmt(want_total):30} "
                  f"{err:11.1e} {time.perf_counter() - t0:5.1f}", flush=True)
            if tree is None and (mode == "tp fwd+bwd" or QUICK):
                tree = (family, mode, str(cc))
    print("values and gradients equal unsharded")
    if tree is not None:
        print(f"\nrecords of {tree[0]} {tree[1]} (sf.debug.CommCounter, by module):\n{tree[2]}")
    if not QUICK:
        more_families()


if __name__ == "__main__":
    main()
