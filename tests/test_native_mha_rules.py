"""Rules for the kernels of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``'s inference
fast path (``rules/native_mha.py``): ``_native_multi_head_attention``,
``_transformer_encoder_layer_fwd``, ``_transform_bias_rescale_qkv``.

The oracle is the plain module in its fast path (eval, batch first, inference mode), whose
kernels the sharded call runs with the module's own parameters and merged mask. A batch split
moves nothing; a Megatron split of the packed in_proj rows cuts q, k and v apart, so heads stay
whole (the weight gathered), values still torch's. No call may run through the replicate fallback.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P

from _no_fallback import NoFallback

aten = torch.ops.aten
E, H, B, S = 16, 4, 4, 6
ATTN = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mha(embed: int = E, heads: int = H, dtype: torch.dtype = torch.float32) -> torch.nn.MultiheadAttention:
    torch.manual_seed(0)
    return torch.nn.MultiheadAttention(embed, heads, batch_first=True, dtype=dtype).eval()


def _masks(kind: str, batch: int = B, seq: int = S) -> dict:
    """The module's keyword masks for ``kind`` (each row keeps at least one key)."""
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[:, -1] = True
    pad[::2, -2] = True
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    per_head = torch.rand(batch * H, seq, seq, generator=_gen(11)) > 0.6
    per_head[..., 0] = False
    return {"none": {}, "pad": {"key_padding_mask": pad}, "attn": {"attn_mask": causal},
            "both": {"key_padding_mask": pad, "attn_mask": causal}, "per_head": {"attn_mask": per_head},
            "per_head_pad": {"attn_mask": per_head, "key_padding_mask": pad}}[kind]


def _merged(mod: torch.nn.MultiheadAttention, x: torch.Tensor, masks: dict) -> tuple:
    """The mask and mask type the fast path hands the kernel: the module's own canonical
    (float) masks, merged by its ``merge_masks``."""
    am, kpm = masks.get("attn_mask"), masks.get("key_padding_mask")
    kpm = F._canonical_mask(mask=kpm, mask_name="key_padding_mask", other_type=F._none_or_dtype(am),
                            other_name="attn_mask", target_type=x.dtype)
    am = F._canonical_mask(mask=am, mask_name="attn_mask", other_type=None, other_name="", target_type=x.dtype,
                           check_other=False)
    return mod.merge_masks(am, kpm, x)


def _mask_spec(mask_type: int | None, batch_spec: P) -> P:
    """A (B, S) padding mask (type 1) or (B, H, L, S) mask (type 2) split like the batch; an
    (L, S) attention mask (type 0) replicated."""
    return P(batch_spec[0] if batch_spec else None) if mask_type in (1, 2) else P()


def _sharded_mha(mod: torch.nn.MultiheadAttention, mesh: sf.Mesh, x: torch.Tensor, x_spec: P, mask: Any,
                 mask_type: Any, w_specs: dict | None = None, **kw) -> tuple:
    w_specs = w_specs or {}
    p = [sf.distribute(t.detach(), w_specs.get(n, P()), mesh=mesh) for n, t in zip(ATTN, _params(mod))]
    xs = sf.distribute(x, x_spec, mesh=mesh)
    ms = None if mask is None else sf.distribute(mask, _mask_spec(mask_type, x_spec), mesh=mesh)
    return aten._native_multi_head_attention(xs, xs, xs, mod.embed_dim, mod.num_heads, *p, ms,
                                             kw.get("need_weights", True), kw.get("average_attn_weights", True),
                                             mask_type)


@pytest.mark.parametrize("kind", ["none", "pad", "attn", "both", "per_head", "per_head_pad"])
@pytest.mark.parametrize("weights", [dict(need_weights=False), dict(need_weights=True),
                                     dict(need_weights=True, average_attn_weights=False)], ids=str)
@pytest.mark.parametrize("x_spec", [P("dp"), P(("dp", "tp")), P("tp")], ids=str)
def test_mha_batch_split_moves_nothing(mesh: sf.Mesh, kind: str, weights: dict, x_spec: P) -> None:
    """Batch split over one or both axes, weights replicated: no collective, outputs (and
    attention weights) split like the batch, values the module's fast path's."""
    mod = _mha()
    x = torch.randn(B, S, E, generator=_gen(1))
    masks = _masks(kind)
    with torch.inference_mode():
        ref_out, ref_w = mod(x, x, x, **masks, **weights)
        mask, mask_type = _merged(mod, x, masks)
        with NoFallback(), sf.debug.CommCounter() as cc:
            out, w = _sharded_mha(mod, mesh, x, x_spec, mask, mask_type, **weights)
    assert cc.total == 0, cc
    assert out.spec == x_spec
    torch.testing.assert_close(out.full_tensor(), ref_out)
    if ref_w is None:
        assert w is None
    else:
        assert w.spec == x_spec and w.shape == ref_w.shape
        torch.testing.assert_close(w.full_tensor(), ref_w)


@pytest.mark.parametrize("kind", ["none", "both"])
def test_mha_megatron_in_proj_keeps_heads_whole(mesh: sf.Mesh, kind: str) -> None:
    """in_proj split by packed rows over tp (Megatron's column split), out_proj by columns:
    not a heads split of this kernel (the rows are [q | k | v] blocks), so the weights are
    gathered -- only all_gathers -- and the values are the module's."""
    mod = _mha()
    x = torch.randn(B, S, E, generator=_gen(2))
    masks = _masks(kind)
    specs = {"in_proj_weight": P("tp", None), "in_proj_bias": P("tp"), "out_proj.weight": P(None, "tp")}
    with torch.inference_mode():
        ref_out, ref_w = mod(x, x, x, **masks)
        mask, mask_type = _merged(mod, x, masks)
        with NoFallback(), sf.debug.CommCounter() as cc:
            out, w = _sharded_mha(mod, mesh, x, P("dp"), mask, mask_type, specs)
    assert set(cc.counts) <= {"all_gather"}, cc
    assert out.spec == P("dp")
    torch.testing.assert_close(out.full_tensor(), ref_out)
    torch.testing.assert_close(w.full_tensor(), ref_w)


def test_mha_split_sequence_or_embedding_is_gathered(mesh: sf.Mesh) -> None:
    """Sequence or embedding split: the kernel needs them whole (gathered), values right."""
    mod = _mha()
    x = torch.randn(B, S, E, generator=_gen(3))
    with torch.inference_mode():
        ref_out, ref_w = mod(x, x, x)
        for spec in (P(None, "tp"), P("dp", None, "tp")):
            with NoFallback():
                out, w = _sharded_mha(mod, mesh, x, spec, None, None)
            torch.testing.assert_close(out.full_tensor(), ref_out)
            torch.testing.assert_close(w.full_tensor(), ref_w)


@settings(max_examples=16, deadline=None)
@given(batch=st.integers(0, 5), heads=st.sampled_from([2, 4]), seq=st.integers(1, 5),
       need=st.booleans(), average=st.booleans(), mask_type=st.sampled_from([None, 0, 1, 2]))
def test_mha_shapes_property(batch: int, heads: int, seq: int, need: bool, average: bool, mask_type: Any) -> None:
    """Any batch (uneven, fewer rows than devices, empty), head count and length, each mask type
    (bool; type 0, an (L, S) mask, as a direct caller gives it): the batch split gives
    torch's values with no collective (a device with no rows returns empty results: torch's
    kernel returns no weights for an empty query)."""
    mesh = sf.Mesh((4,), ("dp",), backend="local")
    mod = _mha(8, heads)
    x = torch.randn(batch, seq, 8, generator=_gen(batch * 31 + seq))
    mask = {None: None, 0: torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1),
            1: torch.arange(seq).expand(batch, seq) == seq - 1,
            2: torch.rand(batch, heads, seq, seq, generator=_gen(seq)) > 0.7}[mask_type]
    if mask is not None:
        mask[..., 0] = False  # every row keeps a key
    with torch.inference_mode():
        ref_out, ref_w = aten._native_multi_head_attention(x, x, x, 8, heads, *(t.detach() for t in _params(mod)),
                                                           mask, need, average, mask_type)
        xs = sf.distribute(x, P("dp"), mesh=mesh)
        ms = None if mask is None else sf.distribute(mask, _mask_spec(mask_type, P("dp")), mesh=mesh)
        ps = [sf.distribute(t.detach(), P(), mesh=mesh) for t in _params(mod)]
        with NoFallback(), sf.debug.CommCounter() as cc:
            out, w = aten._native_multi_head_attention(xs, xs, xs, 8, heads, *ps, ms, need, average, mask_type)
    assert cc.total == 0, cc
    torch.testing.assert_close(out.full_tensor(), ref_out)
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w.full_tensor(), ref_w)


def _params(mod: torch.nn.MultiheadAttention) -> list[torch.Tensor]:
    return [mod.in_proj_weight, mod.in_proj_bias, mod.out_proj.weight, mod.out_proj.bias]


def _encoder(norm_first: bool, activation: str) -> torch.nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, activation=activation, batch_first=True,
                                            norm_first=norm_first).eval()


def _encoder_args(enc: torch.nn.TransformerEncoderLayer, arr: Any) -> list:
    """The arguments after ``src`` the fast path hands ``_transformer_encoder_layer_fwd``."""
    a = enc.self_attn
    return [a.embed_dim, a.num_heads, *(arr(t) for t in _params(a)), enc.activation_relu_or_gelu == 2, enc.norm_first,
            enc.norm1.eps, *(arr(t) for t in (enc.norm1.weight, enc.norm1.bias, enc.norm2.weight, enc.norm2.bias,
                                                 enc.linear1.weight, enc.linear1.bias, enc.linear2.weight,
                                                 enc.linear2.bias))]


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")])
@pytest.mark.parametrize("kind", ["none", "pad", "attn", "both"])
def test_encoder_layer_batch_split_moves_nothing(mesh: sf.Mesh, norm_first: bool, activation: str,
                                                 kind: str) -> None:
    enc = _encoder(norm_first, activation)
    x = torch.randn(B, S, E, generator=_gen(4))
    masks = _masks(kind)
    kw = {"src_key_padding_mask": masks.get("key_padding_mask"), "src_mask": masks.get("attn_mask")}
    with torch.inference_mode():
        ref = enc(x, **kw)
        mask, mask_type = enc.self_attn.merge_masks(kw["src_mask"], kw["src_key_padding_mask"], x)
        spec = P(("dp", "tp"))
        args = _encoder_args(enc, lambda t: sf.distribute(t.detach(), P(), mesh=mesh))
        ms = None if mask is None else sf.distribute(mask, _mask_spec(mask_type, spec), mesh=mesh)
        with NoFallback(), sf.debug.CommCounter() as cc:
            out = aten._transformer_encoder_layer_fwd(sf.distribute(x, spec, mesh=mesh), *args, ms, mask_type)
    assert cc.total == 0, cc
    assert out.spec == spec
    torch.testing.assert_close(out.full_tensor(), ref)


@pytest.mark.parametrize("spec, moves", [(P("dp"), False), (P("dp", "tp"), False), (P(None, ("dp", "tp")), False),
                                         (P(None, None, "tp"), True)], ids=str)
def test_transform_bias_rescale_qkv_splits_batch_and_tokens(mesh: sf.Mesh, spec: P, moves: bool) -> None:
    """q, k, v (B, H, T, D) follow qkv's batch and tokens with no collective; a split of the
    packed [q | k | v] dim is gathered (its blocks are not heads). Values against the
    column order torch's kernel documents: each block heads-major, q scaled by 1/sqrt(D)."""
    qkv = torch.randn(B, S, 3 * E, generator=_gen(5))
    bias = torch.randn(3 * E, generator=_gen(6))
    ref = aten._transform_bias_rescale_qkv(qkv, bias, H)
    split = [(qkv[..., i * E:(i + 1) * E] + bias[i * E:(i + 1) * E]).view(B, S, H, E // H).transpose(1, 2)
             for i in range(3)]
    torch.testing.assert_close(ref[0], split[0] / (E // H) ** 0.5)
    torch.testing.assert_close(ref[1], split[1])
    with NoFallback(), sf.debug.CommCounter() as cc:
        got = aten._transform_bias_rescale_qkv(sf.distribute(qkv, spec, mesh=mesh),
                                               sf.distribute(bias, P(), mesh=mesh), H)
    assert bool(cc.total) == moves, cc
    want = P() if moves else P(spec[0], None, spec[1]) if len(spec) > 1 else spec
    for g, r in zip(got, ref):
        assert g.spec == want
        torch.testing.assert_close(g.full_tensor(), r)


def test_transform_bias_rescale_qkv_empty_shards() -> None:
    """Fewer batch rows than devices: the devices with none return empty results (torch's
    CPU kernel crashes the process on an empty batch, so it is not called there)."""
    mesh = sf.Mesh((4,), ("dp",), backend="local")
    qkv = torch.randn(2, S, 3 * E, generator=_gen(7))
    bias = torch.randn(3 * E, generator=_gen(8))
    with NoFallback():
        got = aten._transform_bias_rescale_qkv(sf.distribute(qkv, P("dp"), mesh=mesh),
                                               sf.distribute(bias, P(), mesh=mesh), H)
    for g, r in zip(got, aten._transform_bias_rescale_qkv(qkv, bias, H)):
        torch.testing.assert_close(g.full_tensor(), r)


def test_on_meta_mesh() -> None:
    """On a meta mesh: the layouts and shapes the CPU mesh gets, nothing moved, no weights
    where none are asked for (the device kernels' None, not the meta kernel's empty tensor)."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    mod, enc = _mha(), _encoder(False, "relu")

    def arr(t: torch.Tensor, spec: P = P()) -> Any:
        return sf.distribute(t.detach().to("meta"), spec, mesh=mesh)

    x = arr(torch.randn(B, S, E), P("dp"))
    pad = arr(_masks("pad")["key_padding_mask"], P("dp"))
    ps = [arr(t) for t in _params(mod)]
    with torch.inference_mode(), NoFallback(), sf.debug.CommCounter() as cc:
        out, w = aten._native_multi_head_attention(x, x, x, E, H, *ps, pad, True, False, 1)
        out2, w2 = aten._native_multi_head_attention(x, x, x, E, H, *ps, None, False)
        enc_out = aten._transformer_encoder_layer_fwd(x, *_encoder_args(enc, arr), pad, 1)
        q, k, v = aten._transform_bias_rescale_qkv(arr(torch.randn(B, S, 3 * E), P("dp", "tp")), ps[1], H)
    assert cc.total == 0, cc
    assert out.spec == w.spec == out2.spec == enc_out.spec == P("dp")
    assert w.shape == (B, H, S, S) and w2 is None and out.shape == enc_out.shape == (B, S, E)
    assert q.spec == k.spec == v.spec == P("dp", None, "tp") and q.shape == (B, H, S, E // H)
    assert all(t.device.type == "meta" for t in (out, w, enc_out, q))


def test_modules_take_composite_path_without_fallback(mesh: sf.Mesh) -> None:
    """The modules themselves on ShardedArrays: torch's fast-path check refuses tensors with a
    torch-function hook (3-d arrays carry one), so they run their composite path -- which
    has rules too: values the fast path's, no fallback."""
    mod, enc = _mha(), _encoder(False, "relu")
    x = torch.randn(B, S, E, generator=_gen(9))
    pad = _masks("pad")["key_padding_mask"]
    with torch.inference_mode():
        ref, ref_w = mod(x, x, x, key_padding_mask=pad)
        ref_enc = enc(x, src_key_padding_mask=pad)
        xs, ps = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(pad, P("dp"), mesh=mesh)
        with NoFallback():
            params = {n: sf.distribute(p.detach(), P(), mesh=mesh) for n, p in mod.named_parameters()}
            out, w = torch.func.functional_call(mod, params, (xs, xs, xs), {"key_padding_mask": ps})
            params = {n: sf.distribute(p.detach(), P(), mesh=mesh) for n, p in enc.named_parameters()}
            out_enc = torch.func.functional_call(enc, params, (xs,), {"src_key_padding_mask": ps})
    torch.testing.assert_close(out.full_tensor(), ref)
    torch.testing.assert_close(w.full_tensor(), ref_w)
    torch.testing.assert_close(out_enc.full_tensor(), ref_enc)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fallback_census_mha_rows_are_empty(device: str) -> None:
    """tools/fallback_census.py's ``mha`` model (the modules and their fast-path kernels with
    every mask type, batch over dp, in_proj rows over tp): no op falls back, nothing raises."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import fallback_census

    rows = fallback_census.run_census(device, [torch.float32], ["auto"], ["mha"], ["dptp"])
    assert rows and all(r[3] == [] for r in rows), fallback_census.report(rows)


def _no_meta_kernel(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("aten::_transformer_encoder_layer_fwd: no Meta kernel (as in torch 2.11)")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_encoder_layer_without_a_meta_kernel_keeps_the_batch_split(device: str) -> None:
    # torch 2.11 (an H100's torch) has no meta kernel for _transformer_encoder_layer_fwd: the call
    # fell back to replication on CUDA; the rule's metadata now stands in (shape, dtype, strides
    # as torch 2.13's meta kernel gives them)
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type=device)
    enc = _encoder(False, "relu")
    x = torch.randn(B, S, E, generator=_gen(5))
    plain = _encoder_args(enc, lambda t: t.detach().to("meta"))
    want = aten._transformer_encoder_layer_fwd(x.to("meta"), *plain, None, None)  # the real meta kernel
    with torch.inference_mode():
        ref = aten._transformer_encoder_layer_fwd(x, *_encoder_args(enc, lambda t: t.detach()), None, None)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_transformer_encoder_layer_fwd", _no_meta_kernel, "Meta")
    try:
        with pytest.raises(NotImplementedError):
            aten._transformer_encoder_layer_fwd(x.to("meta"), *plain, None, None)
        from shardfn.rules.native_mha import encoder_layer_meta
        got = encoder_layer_meta(aten._transformer_encoder_layer_fwd.default, (x.to("meta"), *plain, None, None), {})
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        args = _encoder_args(enc, lambda t: sf.distribute(t.detach().to(device), P(), mesh=mesh))
        with torch.inference_mode(), NoFallback(), sf.debug.CommCounter() as cc:
            out = aten._transformer_encoder_layer_fwd(sf.distribute(x.to(device), P("dp"), mesh=mesh), *args, None, None)
    finally:
        lib._destroy()
    assert cc.total == 0 and out.spec == P("dp") and out.shape == (B, S, E)
    if device == "cpu":
        torch.testing.assert_close(out.full_tensor(), ref)
