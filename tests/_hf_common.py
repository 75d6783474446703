"""What the Hugging Face model tests share: logits and loss through ``functional_call``
with a given parameter dict, and a value comparison that gathers sharded results."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.func import functional_call

import shardfn as sf
from shardfn import P


def logits(model: torch.nn.Module, params: dict, ids: torch.Tensor) -> torch.Tensor:
    """The LM logits of ``ids``; an encoder-decoder reads ``ids`` as its source and its decoder
    input (teacher forcing: the loss is the decoder's)."""
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs = {"decoder_input_ids": ids, "use_cache": False}
    else:  # (encoders take no cache)
        kwargs = {"use_cache": False} if "ForCausalLM" in type(model).__name__ else {}
    return functional_call(model, params, (ids,), kwargs).logits


def make_loss(model: torch.nn.Module):
    """Next-token cross entropy of ``model`` as a function of its parameters (for torch.func.grad)."""

    def loss(params: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits(model, params, ids).flatten(0, 1).float(), labels.flatten())

    return loss


def sharded_loss_and_grads(loss_fn, params: dict, ids: torch.Tensor, labels: torch.Tensor, mode: str) -> tuple:
    """``(loss, grads)`` by ``loss.backward()`` on detached leaves (``mode="autograd"``) or by
    ``torch.func.grad_and_value``, of the parameters (``requires_grad``), as the unsharded
    reference differentiates them: buffers (RoPE's ``inv_freq``) stay constants."""
    trainable = {n for n, p in params.items() if p.requires_grad}
    if mode == "autograd":
        leaves = {n: p.detach().requires_grad_(n in trainable) for n, p in params.items()}
        loss = loss_fn(leaves, ids, labels)
        loss.backward()
        return loss, {n: p.grad for n, p in leaves.items() if n in trainable}
    grads, loss = parameters_grad_and_value(loss_fn, params, ids, labels)
    return loss, grads


def parameters_grad_and_value(loss_fn, params: dict, *args) -> tuple[dict, torch.Tensor]:
    """``torch.func.grad_and_value(loss_fn)(params, *args)`` w.r.t. the parameters of the sharded
    ``params`` (``requires_grad``: what ``sf.nn.shard_params`` gives a model's parameters); its
    buffers stay constants, as the unsharded reference's ``plain`` holds parameters only."""
    consts = {n: p for n, p in params.items() if not p.requires_grad}
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    return torch.func.grad_and_value(lambda tr: loss_fn({**consts, **tr}, *args))(trainable)


def full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, sf.ShardedArray) else x


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(full(got).float(), full(want).float(), rtol=tol, atol=tol)


def check_family(model: torch.nn.Module, rules: list, vocab: int,
                 mode: str) -> tuple[sf.debug.CommCounter, sf.debug.CommCounter]:
    """Shard ``model`` by ``rules`` on a (dp=2, tp=2) mesh and run its forward and forward +
    backward (``mode``: autograd or func) on a dp-split batch: values and gradients against
    the unsharded model, no fallback warning; returns the two collective counters."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    params = sf.nn.shard_params(model, rules, mesh=mesh, unmatched="ignore")
    plain = {n: t.detach().clone() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)  # ids from 5: no family's pad token
    ids, labels = torch.randint(5, vocab, (4, 8), generator=g), torch.randint(0, vocab, (4, 8), generator=g)
    sids, slabels = sf.distribute(ids, P("dp"), mesh=mesh), sf.distribute(labels, P("dp"), mesh=mesh)
    loss_fn = make_loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sf.debug.CommCounter() as fwd:
            out = logits(model, params, sids)
        with sf.debug.CommCounter() as both:
            loss, grads = sharded_loss_and_grads(loss_fn, params, sids, slabels, mode)
    close(out, logits(model, plain, ids))
    want_grads, want = torch.func.grad_and_value(loss_fn)(plain, ids, labels)
    close(loss, want)
    trainable = {n for n, p in params.items() if p.requires_grad}
    grads = {n: g for n, g in grads.items() if g is not None}
    assert set(grads) == trainable, set(grads) ^ trainable
    for n in trainable:
        close(grads[n], want_grads[n])
    return fwd, both
