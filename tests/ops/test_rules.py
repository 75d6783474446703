"""Sharding rules against plain torch: values, gradients, layouts and communication."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P, ShardingError
from shardfn.arrays import dispatch as _dispatch
from shardfn.arrays import entries as _entries
from shardfn.arrays import rule_table as _rules

MESHES = [((2, 2), ("x", "y")), ((4,), ("x",)), ((2, 4), ("x", "y"))]


def mesh_of(shape_names: tuple) -> sf.Mesh:
    return sf.Mesh(*shape_names, backend="local")


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert isinstance(got, sf.ShardedArray)
    torch.testing.assert_close(got.full_tensor(), want, rtol=tol, atol=tol)


def leaf(t: torch.Tensor, spec: P, mesh: sf.Mesh) -> sf.ShardedArray:
    return sf.distribute(t.detach(), spec, mesh=mesh).requires_grad_()


# -- matrix products ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("sa,sb", [(P("x"), P()), (P(None, "x"), P("x")), (P("x"), P(None, "x")),
                                   (P(None, "x"), P(None, "x")), (P(("x",)), P("x", None))])
def test_mm_values_and_grads(mesh_spec: tuple, sa: P, sb: P) -> None:
    mesh = mesh_of(mesh_spec)
    a, b = torch.randn(7, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    x, w = leaf(a, sa, mesh), leaf(b, sb, mesh)
    out = x @ w
    close(out, a @ b)
    out.full_tensor().pow(2).sum().backward()
    (a @ b).pow(2).sum().backward()
    close(x.grad, a.grad, 1e-4)
    close(w.grad, b.grad, 1e-4)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_addmm_baddbmm_matmul_linear_einsum(mesh_spec: tuple) -> None:
    mesh = mesh_of(mesh_spec)
    last = mesh.axis_names[-1]
    bias, m1, m2 = torch.randn(3), torch.randn(6, 5), torch.randn(5, 3)
    close(torch.addmm(sf.distribute(bias, P(), mesh=mesh), sf.distribute(m1, P("x"), mesh=mesh),
                      sf.distribute(m2, P(None, last), mesh=mesh), beta=0.5, alpha=2.0),
          torch.addmm(bias, m1, m2, beta=0.5, alpha=2.0))
    b1, b2, b0 = torch.randn(4, 3, 5), torch.randn(4, 5, 2), torch.randn(4, 3, 2)
    s1 = sf.distribute(b1, P("x", None, last if last != "x" else None), mesh=mesh)
    close(torch.baddbmm(sf.distribute(b0, P("x"), mesh=mesh), s1, sf.distribute(b2, P("x"), mesh=mesh)),
          torch.baddbmm(b0, b1, b2))
    x3 = torch.randn(4, 6, 5)
    w = torch.randn(3, 5)
    xs = sf.distribute(x3, P("x"), mesh=mesh)
    close(torch.matmul(xs, sf.distribute(w.T, P(), mesh=mesh)), x3 @ w.T)
    close(F.linear(xs, sf.distribute(w, P(last), mesh=mesh)), F.linear(x3, w))
    close(torch.einsum("bij,kj->bik", xs, sf.distribute(w, P(None, last), mesh=mesh)),
          torch.einsum("bij,kj->bik", x3, w), 1e-4)


def test_contracted_sharding_gives_partial_without_communication(mesh22: sf.Mesh) -> None:
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    x, w = sf.distribute(a, P(None, "y"), mesh=mesh22), sf.distribute(b, P("y"), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        out = x @ w
    assert cc.total == 0
    assert out.spec == P(partial="y")
    close(out, a @ b)


def test_mlp_column_then_row_parallel_issues_one_reduction(mesh22: sf.Mesh) -> None:
    X, W1, W2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    x = sf.distribute(X, P("x"), mesh=mesh22)
    w1 = sf.distribute(W1, P(None, "y"), mesh=mesh22)
    w2 = sf.distribute(W2, P("y", None), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        h = F.gelu(x @ w1)
        y = (h @ w2) * 0.5  # the pending sum passes through the scaling
        out = sf.reshard(y, P("x"))
    assert cc.counts["all_reduce"] + cc.counts["reduce_scatter"] == 1
    assert cc.total == 1
    close(out, (F.gelu(X @ W1) @ W2) * 0.5, 1e-4)


def test_common_ops_need_no_communication(mesh22: sf.Mesh) -> None:
    a = torch.randn(8, 6, 4)
    x = sf.distribute(a, P("x", "y"), mesh=mesh22)
    with sf.debug.CommCounter() as cc:
        y = (x * 2 + 1).relu().reshape(8, 24).transpose(0, 1)
        z = torch.softmax(x, dim=-1).sum(dim=-1)
        n = F.layer_norm(x, (4,))
        u = x.unsqueeze(0).squeeze(0)[:, :, 1:3]
    assert cc.total == 0
    close(y, (a * 2 + 1).relu().reshape(8, 24).transpose(0, 1))
    close(z, torch.softmax(a, -1).sum(-1))
    close(n, F.layer_norm(a, (4,)), 1e-5)
    close(u, a[:, :, 1:3])


# -- reductions, including uneven layouts ---------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_uneven_reductions_including_empty_devices(n: int, mesh_spec: tuple) -> None:
    mesh = mesh_of(mesh_spec)
    a = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    x = leaf(a, P("x"), mesh)  # (4,) / (2, 4) with n=3: a device holds zero rows
    for fn in (lambda t: t.mean(0), lambda t: t.var(0), lambda t: t.std(0, correction=0),
               lambda t: t.sum(0), lambda t: t.amax(0), lambda t: t.amin(0), lambda t: t.mean(),
               lambda t: torch.softmax(t, 0), lambda t: t.logsumexp(0), lambda t: t.max(0).values):
        close(fn(x), fn(a).detach(), 1e-9)
    x.mean(0).full_tensor().sum().backward()
    a.mean(0).sum().backward()
    close(x.grad, a.grad, 1e-12)


def test_max_with_indices_argmax_cumsum(mesh22: sf.Mesh) -> None:
    a = torch.randn(6, 5)
    x = sf.distribute(a, P("x", "y"), mesh=mesh22)
    v, i = x.max(1)
    close(v, a.max(1).values)
    assert torch.equal(i.full_tensor(), a.max(1).indices)
    assert torch.equal(x.argmax().full_tensor(), a.argmax())
    close(x.cumsum(0), a.cumsum(0))


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("spec", [P("x"), P(None, "x"), P("x", None, "y"), P(("y", "x")), P(partial="x")])
def test_median_and_nanmedian(mesh_spec: tuple, spec: P) -> None:
    """median / nanmedian (all dims, and along a dim with values and indices): the reduced dim
    whole, the others keep their split (even, uneven and empty shards), values, indices and
    gradients equal torch's; no replicated fallback."""
    mesh = mesh_of(mesh_spec)
    if "y" not in mesh.axis_names and any("y" in (e if isinstance(e, tuple) else (e,)) for e in spec):
        pytest.skip("a spec of axis y on a mesh without it")
    a = torch.randn(5, 3, 2, dtype=torch.float64)
    a[1, 2, 0] = a[3, 0, 1] = float("nan")
    if spec.partial:
        a = a.nan_to_num().mul(8).round()  # a pending sum of integers: no rounding between the parts
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FallbackWarning fails the test
        x = leaf(a, spec, mesh)
        for fn in (torch.median, torch.nanmedian):
            same(fn(x), fn(a))
            for d in (0, 1, -1):
                for keep in (False, True):
                    got, want = fn(x, d, keepdim=keep), fn(a, d, keepdim=keep)
                    same(got.values, want.values)
                    assert torch.equal(got.indices.full_tensor(), want.indices), (fn, d, keep)
                    if d == 1 and not spec.partial:  # the split dims other than the reduced one stay split
                        assert (*got.values.spec, None)[0] == (*spec, None)[0], got.values.spec
        (torch.nanmedian(x, 1).values.full_tensor().sum() + x.nanmedian().full_tensor()).backward()
    a.requires_grad_()
    (torch.nanmedian(a, 1).values.sum() + a.nanmedian()).backward()
    same(x.grad, a.grad)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, sf.ShardedArray)
    torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=0, atol=0, equal_nan=True)


def test_sum_leaves_partial_and_mean_is_exact_for_uneven(mesh22: sf.Mesh) -> None:
    a = torch.randn(5, 3)
    x = sf.distribute(a, P(("x", "y")), mesh=mesh22)  # rows 2, 1, 1, 1
    s = x.sum(0)
    assert s.spec == P(partial=("x", "y"))
    close(s, a.sum(0))
    close(x.mean(0), a.mean(0))


# -- views ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("shape", [(5, 3), (8, 6), (3, 4, 2)])
def test_view_reshape_of_uneven_values(mesh_spec: tuple, shape: tuple) -> None:
    mesh = mesh_of(mesh_spec)
    a = torch.randn(shape, requires_grad=True)
    x = leaf(a, P("x"), mesh)
    close(x.view(-1), a.view(-1))
    close(x.reshape(shape[0], -1), a.reshape(shape[0], -1))
    close(x.flatten().reshape(shape), a)
    x.view(-1).full_tensor().pow(2).sum().backward()
    a.view(-1).pow(2).sum().backward()
    close(x.grad, a.grad)


def test_view_merge_and_split_keep_even_sharding(mesh24: sf.Mesh) -> None:
    a = torch.randn(8, 3, 4)
    x = sf.distribute(a, P("y"), mesh=mesh24)
    with sf.debug.CommCounter() as cc:
        m = x.view(24, 4)
        s = m.view(8, 3, 4)
    assert cc.total == 0
    assert m.spec == P("y") and s.spec == P("y")
    close(s, a)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_shape_ops(mesh_spec: tuple) -> None:
    mesh = mesh_of(mesh_spec)
    a = torch.randn(6, 5, 4)
    second = mesh.axis_names[-1] if mesh.ndim > 1 else None
    x = sf.distribute(a, P("x", None, second), mesh=mesh)
    close(x.permute(2, 0, 1), a.permute(2, 0, 1))
    close(x.transpose(0, 2), a.transpose(0, 2))
    close(x[:, :1].expand(3, 6, 5, 4), a[:, :1].expand(3, 6, 5, 4))
    close(x.narrow(0, 1, 3), a.narrow(0, 1, 3))
    close(x.select(1, 2), a.select(1, 2))
    for got, want in zip(x.split(2, 0), a.split(2, 0)):
        close(got, want)
    for got, want in zip(x.chunk(3, 2), a.chunk(3, 2)):
        close(got, want)
    for got, want in zip(x.unbind(1), a.unbind(1)):
        close(got, want)
    close(torch.cat([x, x * 2], 1), torch.cat([a, a * 2], 1))
    close(torch.stack([x, x], 0), torch.stack([a, a], 0))


# -- nn ops ---------------------------------------------------------------------------------------


def test_nn_ops_values_and_grads(mesh22: sf.Mesh) -> None:
    a = torch.randn(4, 6, 8, requires_grad=True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    x, ws, bs = leaf(a, P("x", "y"), mesh22), leaf(w, P(), mesh22), leaf(b, P(), mesh22)
    for f in (lambda x, w, b: F.layer_norm(x, (8,), w, b), lambda x, w, b: F.rms_norm(x, (8,), w),
              lambda x, w, b: F.silu(F.gelu(x) * w) + F.relu(b)):
        for t in (a, w, b, x, ws, bs):
            t.grad = None
        out, ref = f(x, ws, bs), f(a, w, b)
        close(out, ref, 1e-5)
        out.full_tensor().pow(2).sum().backward()
        ref.pow(2).sum().backward()
        close(x.grad, a.grad, 1e-4)
        close(ws.grad, w.grad, 1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(mesh22: sf.Mesh, reduction: str) -> None:
    logits, target = torch.randn(6, 5, requires_grad=True), torch.randint(0, 5, (6,))
    lg = leaf(logits, P("x"), mesh22)
    out = F.cross_entropy(lg, sf.distribute(target, P("x"), mesh=mesh22), reduction=reduction)
    ref = F.cross_entropy(logits, target, reduction=reduction)
    close(out, ref)
    out.full_tensor().sum().backward()
    ref.sum().backward()
    close(lg.grad, logits.grad)


def test_attention_sharded_over_heads_has_no_communication(mesh22: sf.Mesh) -> None:
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    qs = leaf(q, P("x", "y"), mesh22)
    with sf.debug.CommCounter() as cc:
        out = F.scaled_dot_product_attention(qs, qs, qs, is_causal=True)
    assert cc.total == 0 and out.spec == P("x", "y")
    ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    close(out, ref, 1e-5)
    out.full_tensor().sum().backward()
    ref.sum().backward()
    close(qs.grad, q.grad, 1e-4)


@pytest.mark.parametrize("wspec", [P(), P("x"), P(None, "y"), P("x", "y")])
def test_embedding_including_vocab_sharded(mesh22: sf.Mesh, wspec: P) -> None:
    weight, idx = torch.randn(10, 4, requires_grad=True), torch.randint(0, 10, (3, 5))
    w = leaf(weight, wspec, mesh22)
    out = F.embedding(sf.distribute(idx, P("y"), mesh=mesh22), w)
    close(out, F.embedding(idx, weight))
    out.full_tensor().pow(2).sum().backward()
    F.embedding(idx, weight).pow(2).sum().backward()
    close(w.grad, weight.grad)


# -- indexing -------------------------------------------------------------------------------------


def test_indexing_ops(mesh22: sf.Mesh) -> None:
    a = torch.randn(6, 5, 4)
    x = sf.distribute(a, P("x", None, "y"), mesh=mesh22)
    idx = torch.tensor([4, 0, 2])
    g = torch.randint(0, 5, (6, 3, 4))
    close(x.index_select(1, idx), a.index_select(1, idx))
    close(x.gather(1, g), a.gather(1, g))
    close(x.scatter_add(1, g, torch.ones(6, 3, 4)), a.scatter_add(1, g, torch.ones(6, 3, 4)))
    close(x[:, idx], a[:, idx])
    mask = a > 0
    close(x.masked_fill(mask, 0.5), a.masked_fill(mask, 0.5))
    close(torch.where(mask, x, -x), torch.where(mask, a, -a))


# -- hypothesis: random shardings ------------------------------------------------------------------


@given(st.sampled_from(MESHES), st.integers(1, 9), st.integers(1, 7), st.data())
def test_random_shardings_pointwise_matmul_reduce(mesh_spec: tuple, n: int, k: int, data: st.DataObject) -> None:
    mesh = mesh_of(mesh_spec)
    entries = st.sampled_from([None, *mesh.axis_names])
    sa = data.draw(st.tuples(entries, entries).filter(lambda s: len({e for e in s if e}) == len([e for e in s if e])))
    sb = data.draw(st.tuples(entries, entries).filter(lambda s: len({e for e in s if e}) == len([e for e in s if e])))
    a, b = torch.randn(n, k, dtype=torch.float64), torch.randn(k, 3, dtype=torch.float64)
    x, w = sf.distribute(a, P(*sa), mesh=mesh), sf.distribute(b, P(*sb), mesh=mesh)
    close((x @ w).tanh().sum(0), (a @ b).tanh().sum(0), 1e-9)
    close((x * 3 - x.mean(0)).amax(1), (a * 3 - a.mean(0)).amax(1), 1e-9)


# -- cache, equal, is_same_size --------------------------------------------------------------------


def test_new_scalar_each_step_hits_the_cache(mesh22: sf.Mesh) -> None:
    a = torch.randn(8, 4)
    x = sf.distribute(a, P("x", "y"), mesh=mesh22)
    x / 0.5
    size = len(_dispatch._cache)
    for s in (0.37, 1.7, 2.9):
        close(x / s, a / s)
    assert len(_dispatch._cache) == size


def test_equal_and_is_same_size(mesh22: sf.Mesh) -> None:
    a = torch.randn(6, 4)
    x, y = sf.distribute(a, P("x"), mesh=mesh22), sf.distribute(a, P(None, "y"), mesh=mesh22)
    assert torch.equal(x, y) is True
    assert torch.equal(x, sf.distribute(a + 1, P(), mesh=mesh22)) is False
    with sf.debug.CommCounter() as cc:
        assert torch.is_same_size(x, y)
    assert cc.total == 0


# -- errors and fallback --------------------------------------------------------------------------


def test_shape_mismatch_error_names_op_and_layouts(mesh22: sf.Mesh) -> None:
    a = sf.distribute(torch.randn(8, 4), P("x", None), mesh=mesh22)
    b = sf.distribute(torch.randn(5, 3), P(None, "y"), mesh=mesh22)
    with pytest.raises(ShardingError, match=r"aten\.mm: f32\[8,4\] P\('x', None\) x f32\[5,3\] P\(None, 'y'\): shape mismatch"):
        torch.mm(a, b)


def test_op_without_rule_falls_back_with_one_warning(mesh22: sf.Mesh) -> None:
    a = torch.randn(4, 4)
    x = sf.distribute(a, P("x"), mesh=mesh22)
    _entries._warned.discard("aten.trace")
    expected = r"aten\.trace: f32\[4,4\] P\('x', None\) has no sharding rule.*register_sharding"
    with pytest.warns(sf.FallbackWarning, match=expected):
        out = torch.trace(x)
    assert out.spec == P()
    close(out, torch.trace(a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.trace(x)  # warned once only


# -- register_sharding ----------------------------------------------------------------------------


_lib = torch.library.Library("shardfn_test", "FRAGMENT")
_lib.define("mymm(Tensor a, Tensor b) -> Tensor")
_lib.impl("mymm", lambda a, b: a @ b, "CPU")
_lib.impl("mymm", lambda a, b: a.new_empty(a.shape[0], b.shape[1]), "Meta")
_lib.define("scale_split(Tensor x, *, Tensor w) -> Tensor[]")
_lib.impl("scale_split", lambda x, *, w: [x * w, x + w], "CPU")
_lib.impl("scale_split", lambda x, *, w: [torch.empty_like(x), torch.empty_like(x)], "Meta")


def test_register_sharding_einsum_string(mesh22: sf.Mesh) -> None:
    sf.register_sharding(torch.ops.shardfn_test.mymm, "mk,kn->mn")
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    with sf.debug.CommCounter() as cc:
        out = torch.ops.shardfn_test.mymm(sf.distribute(a, P("x", "y"), mesh=mesh22), sf.distribute(b, P("y"), mesh=mesh22))
    assert cc.total == 0 and out.spec == P("x", partial="y")
    close(out, a @ b)


def test_register_sharding_decorator_tensor_kwargs_and_list_outputs(mesh22: sf.Mesh) -> None:
    calls = []

    @sf.register_sharding(torch.ops.shardfn_test.scale_split)
    def _rule(x, *, w):
        calls.append(tuple(x.shape))
        return [([P("x"), P("x")], (P("x"), P("x"))), (P(), (P(), P()))]

    a, w = torch.randn(6, 3), torch.randn(6, 3)
    with sf.debug.CommCounter() as cc:
        outs = torch.ops.shardfn_test.scale_split(sf.distribute(a, P("x"), mesh=mesh22), w=sf.distribute(w, P("x"), mesh=mesh22))
    assert calls == [(6, 3)] and cc.total == 0
    assert [o.spec for o in outs] == [P("x"), P("x")]
    close(outs[0], a * w)
    close(outs[1], a + w)


def test_register_sharding_overrides_builtin_rule(mesh22: sf.Mesh) -> None:
    saved = {op: _rules._TABLE.get(op) for op in (torch.ops.aten.mm, torch.ops.aten.mm.default)}
    try:
        @sf.register_sharding(torch.ops.aten.mm)
        def _replicate_everything(a, b):
            return [(P(), (P(), P()))]

        a, b = torch.randn(8, 4), torch.randn(4, 2)
        out = sf.distribute(a, P("x"), mesh=mesh22) @ sf.distribute(b, P(), mesh=mesh22)
        assert out.spec == P()
        close(out, a @ b)
    finally:
        for op, rule in saved.items():
            if rule is None:
                _rules._TABLE.pop(op, None)
            else:
                _rules._TABLE[op] = rule
        _dispatch._cache.clear()
    out = sf.distribute(a, P("x"), mesh=mesh22) @ sf.distribute(b, P(), mesh=mesh22)
    assert out.spec == P("x")


def test_register_sharding_bad_spec_is_a_sharding_error(mesh22: sf.Mesh) -> None:
    sf.register_sharding(torch.ops.shardfn_test.mymm, "mk,k->m")
    try:
        with pytest.raises(ShardingError, match="ranks"):
            torch.ops.shardfn_test.mymm(sf.distribute(torch.randn(4, 3), P("x"), mesh=mesh22),
                                        sf.distribute(torch.randn(3, 2), P(), mesh=mesh22))
    finally:
        sf.register_sharding(torch.ops.shardfn_test.mymm, "mk,kn->mn")
