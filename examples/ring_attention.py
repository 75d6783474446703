"""Ring attention: attention over a sequence sharded across devices.

Each device holds a block of queries, keys and values (sequence dim sharded over
``'sp'``). Key/value blocks travel around the ring with ``sf.lax.ppermute``; each device
folds every block into an online (streaming) softmax, so no device ever holds the full
sequence, yet the result equals full attention, causal or not, and so do its gradients.
Run: ``python examples/ring_attention.py``.
"""

from __future__ import annotations

import functools
import math

import torch

import shardfn as sf
from shardfn import P, lax

# single-process example: every device simulated in this process (not meant for torchrun)
mesh = sf.Mesh((4,), ("sp",), backend="local")
SPEC = P(None, "sp", None)  # (batch, sequence, features), sequence sharded


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain full attention, the reference."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Full attention of sequence-sharded ``q``, ``k``, ``v`` (each ``P(None, 'sp', None)``)."""
    body = functools.partial(_ring_body, causal=causal)
    return sf.shard_map(body, mesh=mesh, in_specs=(SPEC, SPEC, SPEC), out_specs=SPEC)(q, k, v)


def _ring_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    n, me = lax.axis_size("sp"), lax.axis_index("sp")
    ring = [(j, (j + 1) % n) for j in range(n)]
    t = q.shape[-2]
    q_pos = me * t + torch.arange(t)
    lowest = torch.finfo(q.dtype).min
    m = torch.full((*q.shape[:-1], 1), lowest)  # running max of the scores
    denom = torch.zeros(*q.shape[:-1], 1)  # running softmax denominator
    acc = torch.zeros_like(q)  # running numerator @ v
    for step in range(n):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:  # this k block came from device (me - step) % n
            k_pos = ((me - step) % n) * t + torch.arange(t)
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], lowest)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - m_new)
        scale = torch.exp(m - m_new)
        denom = denom * scale + p.sum(-1, keepdim=True)
        acc = acc * scale + p @ v
        m = m_new
        if step < n - 1:
            k, v = lax.ppermute(k, "sp", ring), lax.ppermute(v, "sp", ring)
    return acc / denom


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 32, 16, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        out = ring_attention(q, k, v, causal)
        ref = attention(q, k, v, causal)
        err = (out.full_tensor() - ref).abs().max().item()
        ct = torch.randn_like(ref)
        got = torch.autograd.grad((out.full_tensor() * ct).sum(), (q, k, v))
        want = torch.autograd.grad((ref * ct).sum(), (q, k, v))
        grad_err = max((a - b).abs().max().item() for a, b in zip(got, want))
        print(f"causal={causal!s:<5} {out!r}\n             max |ring - full| = {err:.2e}, max grad error = {grad_err:.2e}")
        assert err < 1e-5 and grad_err < 1e-4


if __name__ == "__main__":
    main()
