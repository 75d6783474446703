"""torch.compile(fullgraph=True, backend="aot_eager") on both backends: values and
gradients equal the unsharded computation, and on dist every redistribution is in the
captured graph as a functional collective (torch.ops._c10d_functional.*): as many, of each
kind, as the eager run issues."""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch._dynamo
from dist_harness import collect, is_dist, scenario
from torch._dynamo.backends.debugging import aot_eager

import shardfn as sf
import shardfn.backends.dist_collectives as dist_collectives
from shardfn import P

W = torch.linspace(-1, 1, 48).reshape(8, 6)
X = torch.linspace(-2, 2, 32).reshape(4, 8).cos()
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _is_collective(target) -> bool:
    """A functional collective op (``_c10d_functional`` or, for tensors requiring grad in
    eager mode, its ``_c10d_functional_autograd`` twin); waits are not counted."""
    return (getattr(target, "namespace", None) in ("_c10d_functional", "_c10d_functional_autograd")
            and target._opname not in _NOT_COLLECTIVES)


# the op each funcol function of the dist backend issues (torch 2.13 names / torch 2.11 names)
_FUNCOL_OP = {"all_gather_single": "all_gather_into_tensor", "all_gather_tensor": "all_gather_into_tensor",
              "all_to_all_single": "all_to_all_single", "all_reduce": "all_reduce",
              "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor"}


@contextlib.contextmanager
def eager_collectives():
    """Counts, by op name, the functional collectives the dist backend issues in the block
    (every plan step's collective goes through ``backends.dist_collectives.run_collective``)."""
    counts: collections.Counter = collections.Counter()
    orig = dist_collectives.run_collective

    def counting(what, group, fn, *args):
        counts[_FUNCOL_OP[fn.__name__]] += 1
        return orig(what, group, fn, *args)

    dist_collectives.run_collective = counting
    try:
        yield counts
    finally:
        dist_collectives.run_collective = orig


def _graph_counts(gm, live_only: bool) -> collections.Counter:
    """Collectives in an AOT graph; with ``live_only``, only those the outputs depend on
    (AOTAutograd's default partitioner copies forward collectives whose inputs are saved
    into the backward graph, where nothing uses them)."""
    nodes = list(gm.graph.nodes)
    live = set(nodes)
    if live_only:
        live, todo = set(), [n for n in nodes if n.op == "output"]
        while todo:
            n = todo.pop()
            if n not in live:
                live.add(n)
                todo.extend(n.all_input_nodes)
    return collections.Counter(n.target._opname for n in nodes
                               if n in live and n.op == "call_function" and _is_collective(n.target))


class Recorder:
    """The "aot_eager" backend (min-cut partitioner, no compiler), recording the forward
    and backward AOT graphs."""

    def __init__(self):
        self.graphs: dict[str, list] = {"fw": [], "bw": []}

    def backend(self):
        def compiler(kind):
            def compile_(gm, example_inputs):
                self.graphs[kind].append(gm)
                return torch._functorch.aot_autograd.make_boxed_func(gm.forward)

            return compile_

        return functools.partial(aot_eager, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))

    def counts(self, kind: str, live_only: bool = False) -> collections.Counter:
        total = collections.Counter()
        for gm in self.graphs[kind]:
            total += _graph_counts(gm, live_only)
        return total


def _axes(mesh):
    return mesh.axis_names[0], mesh.axis_names[-1]


def _model(mesh):
    a, b = _axes(mesh)

    def model(x, w):
        h = (x @ w).tanh()                                  # propagation (resharding on 1-D meshes)
        h = sf.reshard(h, P(None, a))
        h = sf.with_sharding_constraint(h * 2.0, P(b) if b != a else P())
        return h.sum(0)

    return model


def _model_ref(x, w):
    return ((x @ w).tanh() * 2.0).sum(0)


def _inputs(mesh, requires_grad=False):
    a, b = _axes(mesh)
    w = sf.distribute(W, P(None, b), mesh=mesh)
    if requires_grad:
        w = w.detach().requires_grad_()
    return sf.distribute(X, P(a), mesh=mesh), w


@scenario
def compiled_forward_and_backward_collectives(mesh: sf.Mesh) -> None:
    """ops, reshard and with_sharding_constraint with requires_grad inputs: one forward and
    one backward graph; the forward holds exactly the eager forward's collectives (one per
    communicating plan step: reductions are not "ordered" here), the backward's outputs
    depend on exactly the eager backward's."""
    torch._dynamo.reset()
    model = _model(mesh)
    x, w = _inputs(mesh, requires_grad=True)
    with eager_collectives() as eager_fw, sf.debug.CommCounter() as steps:
        ref = model(x, w)
    # a cotangent in the layout the compiled backward expects (the output's, reductions done)
    ct = sf.distribute(torch.linspace(-1, 1, 6), P(*ref.spec), mesh=mesh)
    with eager_collectives() as eager_bw:
        ref.backward(ct)

    rec = Recorder()
    f = torch.compile(model, backend=rec.backend(), fullgraph=True)
    x2, w2 = _inputs(mesh, requires_grad=True)
    out = f(x2, w2)
    out.backward(ct)
    torch.testing.assert_close(sf.gather(out), _model_ref(X, W))
    wr = W.clone().requires_grad_()
    _model_ref(X, wr).backward(torch.linspace(-1, 1, 6))
    torch.testing.assert_close(sf.gather(w2.grad), wr.grad)
    torch.testing.assert_close(sf.gather(w2.grad), sf.gather(w.grad))
    assert len(rec.graphs["fw"]) == 1 and len(rec.graphs["bw"]) == 1
    if is_dist(mesh):
        fw = rec.counts("fw")
        bw = rec.counts("bw", live_only=True)
        # a backward collective of forward values only (a saved input gathered for a weight
        # gradient) may be moved into the forward graph by the partitioner
        assert sum(steps.counts.values()) <= sum(fw.values()) and sum(fw.values()) > 0, (steps.counts, fw)
        # (here that may be all of them: the totals match eager's, which has backward ones)
        assert fw + bw == eager_fw + eager_bw and sum(eager_bw.values()) > 0, (fw, bw, eager_fw, eager_bw)
        assert rec.counts("bw") == bw, (rec.counts("bw"), bw)  # no dead copies of forward collectives
    else:
        assert not rec.counts("fw") and not rec.counts("bw")


@scenario
def compiled_func_grad_step_collectives(mesh: sf.Mesh) -> None:
    """torch.func.grad inside the compiled function: forward and backward redistributions
    are all in the one (inference) graph, exactly those of the eager step."""
    torch._dynamo.reset()
    model = _model(mesh)

    def step(w, x):
        g, loss = torch.func.grad_and_value(lambda w: sf.gather(model(x, w)).pow(2).sum())(w)
        return sf.reshard(w - 0.1 * g, P(None, _axes(mesh)[1])), loss

    x, w = _inputs(mesh)
    with eager_collectives() as eager:
        ref_w, ref_loss = step(w, x)
    rec = Recorder()
    new_w, loss = torch.compile(step, backend=rec.backend(), fullgraph=True)(w, x)
    ref_g = torch.func.grad(lambda w: _model_ref(X, w).pow(2).sum())(W)
    torch.testing.assert_close(sf.gather(new_w), W - 0.1 * ref_g)
    torch.testing.assert_close(sf.gather(new_w), sf.gather(ref_w))
    torch.testing.assert_close(loss, ref_loss)
    assert new_w.spec == P(None, _axes(mesh)[1])
    assert len(rec.graphs["fw"]) == 1 and not rec.graphs["bw"]
    got = rec.counts("fw")
    if is_dist(mesh):
        assert got == eager and sum(got.values()) > 0, (got, eager)
    else:
        assert not got


@scenario(meshes=("2x2",))
def compiled_shard_map_backward(mesh: sf.Mesh) -> None:
    """shard_map with a psum under compile: forward and backward graphs issue the same
    collectives on every rank (the zero cotangent of later replicas stays on the backward
    side), values and gradients equal plain torch."""
    torch._dynamo.reset()
    mm = sf.shard_map(lambda a, b: sf.lax.psum(a @ b, "y"), mesh=mesh,
                      in_specs=(P("x", "y"), P("y")), out_specs=P("x"))
    rec = Recorder()
    f = torch.compile(lambda x, w: mm(x, w).relu(), backend=rec.backend(), fullgraph=True)
    x = sf.distribute(X, P("x", "y"), mesh=mesh)
    w = sf.distribute(W, P("y"), mesh=mesh).detach().requires_grad_()
    out = f(x, w)
    out.sum().backward()
    wr = W.clone().requires_grad_()
    (X @ wr).relu().sum().backward()
    torch.testing.assert_close(sf.gather(out), (X @ W).relu())
    torch.testing.assert_close(sf.gather(w.grad), wr.grad)
    if is_dist(mesh):
        assert rec.counts("fw") == {"all_reduce": 1}, rec.counts("fw")
        assert rec.counts("bw")["all_reduce"] >= 1, rec.counts("bw")


@scenario(meshes=("2x2",), backends=("dist",))  # local inductor: tests/test_compile.py
def inductor_forward_and_backward(mesh: sf.Mesh) -> None:
    torch._dynamo.reset()
    x, w = _inputs(mesh, requires_grad=True)
    out = torch.compile(_model(mesh), backend="inductor", fullgraph=True)(x, w)
    out.backward(sf.distribute(torch.linspace(-1, 1, 6), P(*out.spec), mesh=mesh))
    wr = W.clone().requires_grad_()
    ref = _model_ref(X, wr)
    ref.backward(torch.linspace(-1, 1, 6))
    torch.testing.assert_close(sf.gather(out), ref.detach())
    torch.testing.assert_close(sf.gather(w.grad), wr.grad)


@scenario
def new_shapes_recompile(mesh: sf.Mesh) -> None:
    """New global shapes recompile and stay correct. After Dynamo's automatic-dynamic
    shapes make the sizes symbolic, the local backend keeps them symbolic for even
    layouts (one dynamic graph serves 12 and, when it splits evenly, 10); uneven layouts
    and the dist backend specialise them (a new graph per shape)."""
    torch._dynamo.reset()
    a, b = _axes(mesh)
    rec = Recorder()
    f = torch.compile(lambda x: sf.reshard(x * 2.0, P(None, b)).sum(0), backend=rec.backend(), fullgraph=True)
    for n in (8, 12, 10):  # the dim the reshard splits changes size
        t = torch.arange(n * 8.0).reshape(8, n)
        torch.testing.assert_close(sf.gather(f(sf.distribute(t, P(a), mesh=mesh))), (t * 2).sum(0))
    assert len(rec.graphs["fw"]) == (3 if is_dist(mesh) or 10 % mesh.axis_size(b) else 2)
    if is_dist(mesh):
        assert all(_graph_counts(g, False) for g in rec.graphs["fw"])


test_local, test_dist = collect(globals())
