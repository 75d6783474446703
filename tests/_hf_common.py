"""What the Hugging Face model tests share: logits and loss through ``functional_call``
with a given parameter dict, and a value comparison that gathers sharded results."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

import shardfn as sf


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
