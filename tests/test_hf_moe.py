"""Mixture-of-experts ops and Hugging Face MoE families on their default experts code paths.

``aten._grouped_mm`` (transformers 5.x's default ``grouped_mm`` experts): its rule keeps the
grouped rows and the experts whole (``offs`` holds global row offsets) and shards the matrix
dims like ``mm``; torch's meta kernel accepts only bfloat16 (CUDA's kernel) where CPU's
accepts float32, so the rule computes the output metadata itself. ``histc`` over fixed bins
(the tokens per expert) leaves a pending sum; ``nonzero`` (the eager experts' hit list) on a
replicated input runs on each device's replica without a warning.

Both default experts implementations write into a buffer they just made (``grouped_mm``:
``inv_perm[perm] = arange`` into an ``empty_like``; ``eager``: ``final.index_add_`` into a
``zeros_like``), which the in-place policy runs as a functional update (a fresh array:
``shardfn/arrays/fresh.py``). The same grouped-mm computation written out of place
(``_grouped_experts`` below, registered as an experts implementation) runs sharded too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P

from _hf_common import close, logits, make_loss, sharded_loss_and_grads
from test_hf_families import LAYERS, _backward, _cfg, _forward
import test_hf_families as fam

transformers = pytest.importorskip("transformers")

OFFS = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # 4 experts, one with no rows


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


@pytest.mark.parametrize("x_spec, w_spec, out_spec", [
    (P(), P(), P()),
    (P(None, "tp"), P(None, "tp", None), P(partial="tp")),  # contraction split: a pending sum
    (P(), P(None, None, "tp"), P(None, "tp")),  # output features split
])
def test_grouped_mm_forward_backward(mesh: sf.Mesh, x_spec: P, w_spec: P, out_spec: P) -> None:
    """2-D tokens x 3-D experts with ``offs``, float32: values and both gradients equal torch's
    (the backward is ``_grouped_mm`` again, 2-D x 2-D for the expert weights); no gather."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(10, 8, generator=g), torch.randn(4, 8, 8, generator=g), torch.randn(10, 8, generator=g)
    xs = sf.distribute(x, x_spec, mesh=mesh).requires_grad_()
    ws = sf.distribute(w, w_spec, mesh=mesh).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as cc:
            y = torch._grouped_mm(xs, ws, offs=sf.distribute(OFFS, P(), mesh=mesh))
        assert y.spec == out_spec and not cc.counts, (y.spec, cc)
        (y * sf.distribute(dy, P(), mesh=mesh)).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = torch._grouped_mm(xr, wr, offs=OFFS)
    (yr * dy).sum().backward()
    close(y, yr)
    close(xs.grad, xr.grad)
    close(ws.grad, wr.grad)


def test_grouped_mm_rejects_bad_shapes_as_torch(mesh: sf.Mesh) -> None:
    """The rule's own output metadata still rejects what torch rejects (experts vs offs)."""
    xs, ws = sf.distribute(torch.randn(10, 8), P(), mesh=mesh), sf.distribute(torch.randn(3, 8, 8), P(), mesh=mesh)
    with pytest.raises(RuntimeError, match="group count"):
        torch._grouped_mm(xs, ws, offs=sf.distribute(OFFS, P(), mesh=mesh))


def test_histc_split_input_pending_sum(mesh: sf.Mesh) -> None:
    """Tokens per expert from split expert ids: the shards' counts add up (a pending sum)."""
    ids = torch.tensor([0.0, 3, 1, 1, 3, 3, 0, 2])
    h = torch.histc(sf.distribute(ids, P(("dp", "tp")), mesh=mesh), bins=4, min=0, max=3)
    assert h.spec == P(partial=("dp", "tp"))
    close(h, torch.histc(ids, bins=4, min=0, max=3))


def test_nonzero_replicated_is_local_sharded_warns(mesh: sf.Mesh) -> None:
    x = torch.tensor([0.0, 1.0, 0.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as cc:
            y = torch.nonzero(sf.distribute(x, P(), mesh=mesh))
    assert y.spec == P() and not cc.counts
    close(y, torch.nonzero(x))
    # sharded: a global index list, through the replicate fallback (which warns once per
    # decision, so whether it warns here depends on the tests run before); values as torch's
    odd = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 0.0, 4.0, 0.0, 5.0, 0.0, 0.0, 6.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sf.FallbackWarning)
        close(torch.nonzero(sf.distribute(odd, P("tp"), mesh=mesh)), torch.nonzero(odd))


def _grouped_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm experts computation, out of place (the inverse permutation
    by argsort)."""
    k = top_k_index.size(-1)
    ids, order = torch.sort(top_k_index.reshape(-1))
    counts = torch.histc(ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(hidden[order // k], self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
    y = (y * top_k_weights.reshape(-1)[order].unsqueeze(-1))[torch.argsort(order)]
    return y.view(-1, k, y.size(-1)).sum(1).to(hidden.dtype)


MOE = ["mixtral", "qwen2moe", "qwen3moe"]


@pytest.fixture
def experts(monkeypatch: pytest.MonkeyPatch):
    """Build the families of test_hf_families with a given experts implementation."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("grouped_mm_out_of_place", _grouped_experts)
    cfg = _cfg
    c = dict(vocab_size=fam.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def with_qwen3(name: str) -> tuple:
        if name == "qwen3moe":
            return (lambda: transformers.Qwen3MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=32), "sdpa", fam.STD)
        return cfg(name)

    monkeypatch.setattr(fam, "_cfg", with_qwen3)

    def use(impl: str | None) -> None:
        monkeypatch.setattr(fam, "EXPERTS", impl, raising=False)
    return use


@pytest.mark.parametrize("name", MOE)
def test_default_grouped_mm_experts_fill_a_fresh_buffer(experts, name: str) -> None:
    """The default experts (grouped_mm) write ``inv_perm[perm] = arange`` into an
    ``empty_like`` they just made, which the in-place policy runs as a functional update
    (``shardfn/arrays/fresh.py``): values and gradients equal unsharded, under autograd and
    torch.func, no fallback."""
    experts(None)
    _forward(name)
    for mode in ("autograd", "func"):
        _backward(name, mode)


@pytest.mark.parametrize("name", MOE)
def test_eager_experts_index_add_into_a_fresh_buffer(experts, name: str) -> None:
    """The eager experts ``index_add_`` each expert's rows into a ``zeros_like`` they just
    made (a fresh array): values and gradients equal unsharded, under autograd and
    torch.func, no fallback. Tokens replicated over dp: the eager loop's ``torch.where``
    of a dp-split routing mask is a global index list (a gather, which warns)."""
    experts("eager")
    model, params, plain, ids, labels, mesh = fam._setup(name)
    sids, slabels = sf.distribute(ids, P(), mesh=mesh), sf.distribute(labels, P(), mesh=mesh)
    loss_fn = make_loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(logits(model, params, sids), logits(model, plain, ids))
        got = {mode: sharded_loss_and_grads(loss_fn, params, sids, slabels, mode) for mode in ("autograd", "func")}
    ref = {n: p.detach().requires_grad_() for n, p in plain.items()}
    want = loss_fn(ref, ids, labels)
    want.backward()
    for loss, grads in got.values():
        close(loss, want)
        for n, p in ref.items():
            if p.grad is not None:
                close(grads[n], p.grad)


@pytest.mark.parametrize("name", MOE)
def test_grouped_mm_experts_sharded(experts, name: str) -> None:
    """The grouped_mm experts (out of place), experts replicated over tp, attention TP:
    values and gradients equal unsharded, no fallback; forward all_reduce as Megatron (1 per
    layer, +1 for Qwen2-MoE's shared expert) and the gathers the global sort of the
    dp-split expert ids needs."""
    experts("grouped_mm_out_of_place")
    cc = _forward(name)
    fwd = {"mixtral": 1, "qwen2moe": 2, "qwen3moe": 1}[name]
    assert cc.counts["all_reduce"] == fwd * LAYERS, cc
    for mode in ("autograd", "func"):
        _backward(name, mode)
