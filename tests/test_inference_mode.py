"""``torch.inference_mode`` on ShardedArrays: values, communication and tensor kinds as under
``torch.no_grad``.

In inference mode autograd's dispatch keys are skipped, so ops torch implements as
compositions of others (``flatten``, ``matmul``, ``linear``, ``layer_norm``, ``softmax`` ...)
reach ``__torch_dispatch__`` whole; without a rule of their own they took the replicate
fallback (every input gathered). They now run as torch's own decomposition, each part by its
rule. Views of normal arrays raised "Cannot set version_counter for inference tensor"
(pytorch#112024): torch gives a view its base's version counter, which a wrapper made in
inference mode cannot hold; they are now normal tensors, as torch's views of normal tensors are.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

MESH = sf.Mesh((2, 2), ("x", "y"))

# name -> f(x, w) on x (4, 6, 8) and w (8, 8)
OPS = {
    "flatten": lambda x, w: x.flatten(1),
    "reshape": lambda x, w: x.reshape(4, 48),
    "unflatten": lambda x, w: x.unflatten(2, (2, 4)),
    "matmul": lambda x, w: x @ w,
    "linear": lambda x, w: F.linear(x, w),
    "einsum": lambda x, w: torch.einsum("bij,jk->bik", x, w),
    "layer_norm": lambda x, w: F.layer_norm(x, (8,)),
    "rms_norm": lambda x, w: F.rms_norm(x, (8,)),
    "softmax": lambda x, w: x.softmax(-1),
    "sdpa": lambda x, w: F.scaled_dot_product_attention(x, x, x),
    "cross_entropy": lambda x, w: F.cross_entropy(x.flatten(0, 1), torch.arange(24) % 8),
    "var": lambda x, w: x.var(-1),
    "norm": lambda x, w: x.norm(dim=-1),
    "where": lambda x, w: torch.where(x > 0, x, 0.0),
    "embedding": lambda x, w: F.embedding(torch.tensor([3, 0, 7]), w),
    "transpose": lambda x, w: x.transpose(1, 2),
    "t": lambda x, w: w.t(),
    "split": lambda x, w: x.split(3, 1)[1],
    "chunk": lambda x, w: x.chunk(2, -1)[0],
    "unbind": lambda x, w: x.unbind(1)[2],
    "getitem": lambda x, w: x[:, 1:3],
    "view_add": lambda x, w: x.view(4, 48) + 1,
    "contiguous": lambda x, w: x.transpose(1, 2).contiguous(),
}
# composite ops with a rule of their own, which inference mode runs whole (autograd decomposes
# them first otherwise): rms_norm's rule keeps the normalised dims whole (the fused kernel's)
OWN_RULES = {"rms_norm"}
SPECS = {"batch": (P("x"), P(None, "y")), "features": (P(None, None, "y"), P("y", None)),
         "two_axes": (P(("x", "y")), P()), "uneven": (P(None, ("x", "y")), P(None, "x"))}


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_values_communication_and_kinds_as_under_no_grad(name, spec):
    """Values as torch's; the collectives as under no_grad (no gather a rule would not make);
    no fallback (a FallbackWarning is an error in the tests); ``is_inference()`` as torch's:
    views of normal tensors are normal, new values are inference tensors."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    xs, ws = (sf.distribute(t, s, mesh=MESH) for t, s in zip((x, w), SPECS[spec]))
    f = OPS[name]
    with torch.no_grad(), sf.debug.CommCounter() as plain:
        f(xs, ws)
    with torch.inference_mode(), sf.debug.CommCounter() as inference:
        got = f(xs, ws)
        want = f(x, w)
    torch.testing.assert_close(got.full_tensor(), want)
    if name not in OWN_RULES:
        assert dict(inference.counts) == dict(plain.counts)
    assert got.is_inference() == want.is_inference(), (got.is_inference(), want.is_inference())


def test_arrays_made_in_inference_mode():
    """Arrays made inside inference mode are inference tensors, their views too, as torch's."""
    x = torch.randn(4, 6)
    with torch.inference_mode():
        xs = sf.distribute(x, P("x", "y"), mesh=MESH)
        assert xs.is_inference()
        v = xs.t()
        assert v.is_inference() and x.t().is_inference() is False
        torch.testing.assert_close((v @ xs).full_tensor(), x.t() @ x)


def test_tensor_parallel_model_forward():
    """A Megatron-style tensor-parallel MLP block under inference mode: one all_reduce, the
    value of the unsharded block."""
    torch.manual_seed(1)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    w1, w2 = torch.randn(16, 8, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    xs = sf.distribute(x, P(), mesh=MESH)
    w1s, w2s = sf.distribute(w1, P("y", None), mesh=MESH), sf.distribute(w2, P(None, "y"), mesh=MESH)

    def block(v, a, b):
        return F.linear(F.gelu(F.linear(F.layer_norm(v, (8,)), a)), b).flatten(0, 1)

    with torch.inference_mode(), sf.debug.CommCounter() as comm:
        got = block(xs, w1s, w2s)
        assert got.sharding.spec == P(partial="y")  # (the row-parallel product's pending sum)
        got = got.full_tensor()
    torch.testing.assert_close(got, block(x, w1, w2))
    assert comm.counts.get("all_gather", 0) == 0, comm


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hugging_face_tensor_parallel_logits(family):
    """A Hugging Face decoder, tensor-parallel (Megatron's column / row split), under inference
    mode: the logits of the unsharded model and the all_reduces of no_grad, no fallback."""
    transformers = pytest.importorskip("transformers")
    from _hf_common import close, logits

    col, row = P("tp", None), P(None, "tp")
    rules = [(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", col), (r"(q_proj|k_proj|v_proj)\.bias$", P("tp")),
             (r"(o_proj|down_proj)\.weight$", row)]
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    params = sf.nn.shard_params(model, rules, mesh=mesh, unmatched="ignore")
    plain = {n: t.detach().clone() for n, t in model.named_parameters()}
    ids = torch.randint(5, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    sids = sf.distribute(ids, P("dp"), mesh=mesh)
    with torch.no_grad(), sf.debug.CommCounter() as no_grad:
        logits(model, params, sids)
    with torch.inference_mode(), sf.debug.CommCounter() as inference:
        got = logits(model, params, sids)
        want = logits(model, plain, ids)
    close(got, want)
    assert dict(inference.counts) == dict(no_grad.counts) == {"all_reduce": 4}
