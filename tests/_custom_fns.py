"""JAX's ``foo`` of its custom-derivative tests as torch autograd Functions: forward 2x,
with the tangent (and cotangent) scaled by a chosen factor, so a test can tell the custom
rule from autodiff of the forward."""

from __future__ import annotations

import torch


def scaled_foo(tangent_scale: float, bwd=None, vmappable: bool = True) -> type[torch.autograd.Function]:
    """``bwd`` replaces the cotangent rule; ``vmappable=False`` makes the classic style
    (ctx in forward, no setup_context, no vmap rule: JAX's custom_vjp)."""

    def cotangent(g: torch.Tensor) -> torch.Tensor:
        return bwd(g) if bwd else tangent_scale * g

    if not vmappable:
        return type("FooVjp", (torch.autograd.Function,), {
            "forward": staticmethod(lambda ctx, x: 2.0 * x),
            "backward": staticmethod(lambda ctx, g: cotangent(g)),
        })

    class Foo(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return 2.0 * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def jvp(ctx, t):
            return tangent_scale * t

        @staticmethod
        def backward(ctx, g):
            return cotangent(g)

    return Foo
