"""sf.optim on both backends: optimizer steps (ZeRO-1 included) and clipping on the dist
backend equal the local twin bit for bit (ordered reductions) and torch.optim."""

from __future__ import annotations

import torch
from dist_harness import assert_equal, collect, local_twin, scenario

import shardfn as sf
from shardfn import P
from shardfn.backends.dist import reductions


def _train(mesh: sf.Mesh, full: dict, specs: dict, grads: list[dict], opt) -> tuple[dict, torch.Tensor]:
    params = {k: sf.distribute(t, specs[k], mesh=mesh) for k, t in full.items()}
    state = opt.init(params)
    norms = []
    for g in grads:
        # gradients pending a sum over the first axis, as data parallelism leaves them
        a = mesh.axis_names[0]
        n = mesh.axis_size(a)
        pending = {k: sf.distribute(torch.stack([t / n] * n), P(a, *specs[k]), mesh=mesh).sum(0) if a not in specs[k]
                   else sf.distribute(t, specs[k], mesh=mesh) for k, t in g.items()}
        clipped, norm = sf.optim.clip_grad_norm(pending, 1.0)
        params, state = opt.step(params, clipped, state)
        norms.append(norm)
    return {k: v.full_tensor() for k, v in params.items()}, torch.stack(norms)


@scenario
def optimizers_match_twin_and_torch(mesh: sf.Mesh) -> None:
    a, b = mesh.axis_names[0], mesh.axis_names[-1]
    torch.manual_seed(0)
    full = {"w": torch.randn(8, 6), "u": torch.randn(7, 5), "v": torch.randn(9), "s": torch.randn(())}
    specs = {"w": P(None, b), "u": P(b), "v": P(), "s": P()}
    grads = [{k: torch.randn_like(t) for k, t in full.items()} for _ in range(3)]
    for make, tcls, kw in [(sf.optim.AdamW, torch.optim.AdamW, dict(lr=0.1)),
                           (sf.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True))]:
        for zero in (None, a):
            with reductions("ordered"):
                got, norms = _train(mesh, full, specs, grads, make(**kw, shard_state_over=zero))
                twin, twin_norms = _train(local_twin(mesh), full, specs, grads, make(**kw, shard_state_over=zero))
            what = f"{make.__name__} zero={zero}"
            assert_equal(norms, twin_norms, what + " norms")
            for k in full:
                assert_equal(got[k], twin[k], f"{what} {k}")
            ref = {k: t.clone().requires_grad_() for k, t in full.items()}
            topt = tcls(list(ref.values()), **kw)
            for g in grads:
                for k in ref:
                    ref[k].grad = g[k].clone()
                torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
                topt.step()
            for k in full:
                torch.testing.assert_close(got[k], ref[k].detach(), rtol=1e-5, atol=1e-6)


test_local, test_dist = collect(globals())
