"""Factories and a training step of the example MLP on both backends; the dist results
equal the local backend's bit for bit (random numbers: test_dist_random.py)."""

from __future__ import annotations

import importlib.util
import os

import torch
from dist_harness import assert_equal, collect, local_twin, scenario

import shardfn as sf
from shardfn import P


def _example(name: str):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@scenario
def factories_fill_only_the_local_shards(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    for shape in ((8, 6), (7, 5)):
        assert_equal(sf.gather(sf.zeros(shape, P(a), mesh=mesh)), torch.zeros(shape))
        assert_equal(sf.gather(sf.ones(shape, P(None, a), mesh=mesh)), torch.ones(shape))
        assert_equal(sf.gather(sf.full(shape, 2.5, P(a), mesh=mesh)), torch.full(shape, 2.5))
        k = sf.random.key(7)
        assert_equal(sf.gather(sf.randn(shape, P(a), key=k, mesh=mesh)), sf.random.normal(k, shape))


@scenario
def shard_params_and_functional_call(mesh: sf.Mesh) -> None:
    """A module's parameters sharded by rules (real and meta-initialised) run under
    torch.func.functional_call and give the unsharded outputs."""
    tp = mesh.axis_names[-1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    rules = [(r"0\.weight", P(tp)), (r"0\.bias", P(tp)), (r"2\.weight", P(None, tp))]
    params = sf.nn.shard_params(model, rules, mesh=mesh)
    for name, p in model.named_parameters():
        assert_equal(params[name].full_tensor(), p.detach(), name)
    x = torch.randn(5, 6)
    out = torch.func.functional_call(model, params, (sf.distribute(x, P(), mesh=mesh),))
    torch.testing.assert_close(out.full_tensor(), model(x).detach())
    with torch.device("meta"):
        meta = torch.nn.Linear(8, 4)
    k = sf.random.key(3)
    init = sf.nn.shard_params(meta, [("weight", P(tp), sf.nn.init.normal(std=0.5))], mesh=mesh, key=k, unmatched="ignore")
    twin = sf.nn.shard_params(meta, [("weight", P(), sf.nn.init.normal(std=0.5))], mesh=local_twin(mesh), key=k,
                              unmatched="ignore")
    assert_equal(init["weight"].full_tensor(), twin["weight"].full_tensor(), "meta init: dist vs local")


@scenario
def mlp_training_step_is_bit_identical_across_backends(mesh: sf.Mesh) -> None:
    """examples/mlp.py: one SGD step on this mesh equals the local backend's bit for bit
    with the dist backend's ordered reductions (and plain torch's up to rounding)."""
    from shardfn.backends.dist import reductions

    mlp = _example("mlp")
    results = []
    for m in (mesh, local_twin(mesh)):
        params = mlp.init_params(m)
        x, y = mlp.batch(m)
        with reductions("ordered"):
            new, loss = mlp.train_step(params, x, y)
            for k, v in new.items():
                assert v.sharding == params[k].sharding, k
            results.append({"loss": loss.full_tensor(), **{k: v.full_tensor() for k, v in new.items()}})
    got, twin = results
    for k in got:
        assert_equal(got[k], twin[k], f"{k}: dist vs local")
    plain = {k: v.full_tensor() for k, v in mlp.init_params(local_twin(mesh)).items()}
    x, y = (t.full_tensor() for t in mlp.batch(local_twin(mesh)))
    new, loss = _plain_step(mlp, plain, x, y)
    torch.testing.assert_close(got["loss"], loss)
    for k in new:
        torch.testing.assert_close(got[k], new[k])


def _plain_step(mlp, params: dict, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> tuple[dict, torch.Tensor]:
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss = mlp.loss_fn(leaves, x, y)
    loss.backward()
    return {k: (v - lr * v.grad).detach() for k, v in leaves.items()}, loss.detach()


test_local, test_dist = collect(globals())
