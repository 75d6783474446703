"""Fewer ops on the stacked shards per simulated op (host work on a GPU: each is a dispatch
from Python): a local all-reduce's parts taken by one split per level, a view op on a
replicated value run as one view, a stacked product's folds replayed as one ``as_strided``
each. Values bit for bit as before."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from _shard_ops import TorchCalls
from shardfn import P
from shardfn.backends import local_values, stacked_matmul

aten = torch.ops.aten


def _added_by_narrows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The adds of ``local_values._added`` as it took its parts before (a narrow each)."""
    g = x.shape[dim]
    if g <= 4:
        total = torch.add(x.narrow(dim, 0, 1), x.narrow(dim, 1, 1))
        for i in range(2, g):
            total.add_(x.narrow(dim, i, 1))
        return total
    h = g // 2
    total = torch.add(x.narrow(dim, 0, h), x.narrow(dim, g - h, h))
    if g % 2:
        total = torch.cat([total, x.narrow(dim, h, 1)], dim)
    return _added_by_narrows(total, dim) if total.shape[dim] > 1 else total


@settings(max_examples=60, deadline=None)
@given(g=st.integers(2, 8), dim=st.integers(0, 2), dtype=st.sampled_from([torch.float32, torch.float64, torch.complex64]),
       seed=st.integers(0, 2**16), zeros=st.booleans())
def test_added_parts_bits_unchanged(g, dim, dtype, seed, zeros):
    shape = [3, 5, 4]
    shape[dim] = g
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 1e3
    if zeros:  # signed zeros: all -0 parts total -0
        x = torch.where(torch.rand(*shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.5, x, -0.0 * x.abs())
    got, want = local_values._added(x, dim), _added_by_narrows(x, dim)
    assert got.shape == want.shape
    if dtype.is_complex:
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[got.dtype]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


@pytest.mark.parametrize("g", [2, 3, 4, 5, 8])
def test_added_takes_one_split_per_level(g):
    x = torch.randn(g, 4, 3)
    with TorchCalls() as mode:
        local_values._added(x, 0)
    splits = mode.calls.count(aten.split_with_sizes.default)
    assert aten.slice.Tensor not in mode.calls and aten.narrow.default not in mode.calls, mode.calls
    assert splits == {2: 1, 3: 1, 4: 1, 5: 2, 8: 2}[g], mode.calls


def test_view_of_a_replicated_value_is_one_view():
    """``w.t()`` of a replicated weight (as a linear's backward takes it) runs one ``transpose`` on
    the stacked shards, not device 0's ``t`` between a select and an unsqueeze."""
    mesh = sf.Mesh((8,), ("dp",), backend="local")
    w = torch.randn(6, 4)
    ws = sf.distribute(w, P(), mesh=mesh)
    ws = ws * 2.0  # an op's output: no squeezed form kept
    for _ in range(2):
        ws.t()
    with TorchCalls() as mode:
        wt = ws.t()
    assert mode.calls == [aten.transpose.int], mode.calls
    assert torch.equal(wt.full_tensor(), (w * 2.0).t())
    assert wt.stride() == (w * 2.0).t().stride()


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from(["both", "a", "b"])), min_size=1,
                     max_size=3), m=st.integers(1, 4), k=st.integers(1, 3), n=st.integers(1, 3),
       perm=st.booleans())
def test_stacked_matmul_replayed_folds_equal_the_chain(lead, m, k, n, perm):
    """A warm stacked product (its folds replayed as ``as_strided`` views) equals the first call's
    (the permutes and reshapes) bit for bit, on fresh operands of the same sizes and strides, at
    another storage offset too."""
    a_shape = [s if who != "b" else 1 for s, who in lead] + [m, k]
    b_shape = [s if who != "a" else 1 for s, who in lead] + [k, n]

    def operands(seed):
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(*a_shape, generator=gen)
        b = torch.randn(*b_shape, generator=gen)
        if perm and len(lead) >= 2:  # leading dims laid out the other way round
            a = a.transpose(0, 1).contiguous().transpose(0, 1)
        pad = torch.randn(b.numel() + 3, generator=gen)
        pad[3:] = b.reshape(-1)
        return a, pad[3:].view(b.shape)  # b at storage offset 3

    stacked_matmul._PLANS.clear()
    stacked_matmul._FOLDS.clear()
    a, b = operands(0)
    first = stacked_matmul.matmul(a, b)  # the chain, its geometry recorded
    a2, b2 = operands(1)
    warm = stacked_matmul.matmul(a2, b2)  # replayed
    stacked_matmul._FOLDS.clear()
    want = stacked_matmul.matmul(a2, b2)  # the chain
    assert torch.equal(warm, want) and warm.shape == want.shape and warm.stride() == want.stride()
    assert torch.equal(first, stacked_matmul.matmul(a, b))
    torch.testing.assert_close(warm, torch.matmul(a2, b2))


def test_warm_dp_x_tp_product_is_a_gemm_and_three_views():
    """An activation split over 'dp' times a weight split over 'tp': warm, one view per operand and
    one for the output around the GEMM (not a permute and two reshapes, then a view and a permute)."""
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    x, w = torch.randn(16, 8), torch.randn(8, 12)
    xs, ws = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(w, P(None, "tp"), mesh=mesh)
    for _ in range(2):
        xs @ ws
    with TorchCalls() as mode:
        y = xs @ ws
    assert sorted(map(str, mode.calls)) == ["aten.as_strided.default"] * 3 + ["aten.mm.default"], mode.calls
    torch.testing.assert_close(y.full_tensor(), x @ w)


def test_stacked_matmul_under_vmap_runs_the_chain():
    """Functorch-wrapped operands (vmap over a simulated product) take the permutes and reshapes,
    not a replayed ``as_strided`` (whose geometry is that of the plain tensors)."""
    a, b = torch.randn(3, 2, 1, 4, 5), torch.randn(3, 1, 4, 5, 2)
    stacked_matmul._FOLDS.clear()
    for x, y in zip(a, b):
        stacked_matmul.matmul(x, y)  # the geometry of plain operands remembered
    got = torch.vmap(stacked_matmul.matmul)(a, b)
    torch.testing.assert_close(got, torch.matmul(a, b))


@pytest.mark.parametrize("src,dst", [(P(), P("dp")), (P(), P("tp", "dp")), (P("dp"), P("dp", "tp")), (P("tp"), P("dp")),
                                     (P(None, "tp"), P("dp", "tp"))])
def test_warm_regrid_is_one_view_where_it_views(src, dst):
    """A reshard between even layouts that only slices or reorders (no gather) is, warm, one
    ``as_strided`` of the stacked value per step (the regrid's reshapes, selects and permute replayed);
    the shards equal the first run's and the global value is unchanged."""
    from shardfn.arrays.redistribute import raw_reshard
    from shardfn.values.spec import to_layout

    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    t = torch.randn(8, 16)
    layout = to_layout(dst, 2, mesh)
    first = raw_reshard(sf.distribute(t, src, mesh=mesh), layout)
    x = sf.distribute(t, src, mesh=mesh)
    with TorchCalls() as mode:
        warm = raw_reshard(x, layout)
    assert torch.equal(warm, first) and warm.stride() == first.stride()
    got = sf.ShardedArray(warm, layout, (8, 16), t.dtype).full_tensor()
    assert torch.equal(got, t)
    if first._base is not None:  # each regrid viewed the stacked value: one view per step of the plan
        assert mode.calls and set(mode.calls) == {aten.as_strided.default}, mode.calls


def test_meta_products_run_the_chain():
    """On meta tensors (a meta mesh), whose storages all read address 0, a fold that copies is not
    taken for a view: a warm product has the sizes and strides of the first."""
    a, b = torch.empty(2, 1, 8, 8, device="meta"), torch.empty(1, 4, 8, 3, device="meta")
    stacked_matmul._FOLDS.clear()
    first = stacked_matmul.matmul(a, b)
    warm = stacked_matmul.matmul(a, b)
    assert not stacked_matmul._FOLDS or all(g is None for g in stacked_matmul._FOLDS[next(iter(stacked_matmul._FOLDS))][:2])
    assert warm.shape == first.shape == (2, 4, 8, 3) and warm.stride() == first.stride()


def _sdpa_step(q, k, v, go):
    """Attention's output and the gradients of q, k, v for the output gradient ``go``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


@pytest.mark.parametrize("shape,names,spec", [((8,), ("dp",), P("dp")), ((2, 4), ("dp", "tp"), P("dp", "tp"))])
def test_warm_flash_attention_folds_are_one_view_each(shape, names, spec):
    """CPU flash attention forward and backward on a simulated mesh: warm, each tensor argument's
    fold of the mesh dims into (batch, heads) and each output's unfold is one ``as_strided`` (the
    chain's reshapes and permutes replayed; the logsumexp's dense copy stays), with torch's values."""
    mesh = sf.Mesh(shape, names, backend="local")
    gen = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(8, 4, 6, 8, generator=gen) for _ in range(4))
    want = _sdpa_step(q, k, v, go)
    arrays = [sf.distribute(t, spec, mesh=mesh) for t in (q, k, v, go)]
    for _ in range(2):
        _sdpa_step(*arrays)
    with TorchCalls() as mode:
        got = _sdpa_step(*arrays)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.full_tensor(), b)
    calls = [str(c) for c in mode.calls]
    assert not {"aten.reshape.default", "aten.permute.default", "aten.view.default"} & set(calls), calls
    # forward: q, k, v in, output and logsumexp out; backward: six in, three out
    assert calls.count("aten.as_strided.default") == 14, calls


@pytest.mark.parametrize("transposed", [False, True])
def test_replayed_attention_folds_follow_the_operands_strides(transposed):
    """The replayed folds are keyed by the operands' strides: the same shapes laid out another way
    (a transposed-contiguous query) after a warm call still give torch's values and gradients."""
    mesh = sf.Mesh((2, 4), ("dp", "tp"), backend="local")
    gen = torch.Generator().manual_seed(1)
    q, k, v, go = (torch.randn(8, 4, 6, 8, generator=gen) for _ in range(4))
    spec = P("dp", "tp")
    arrays = [sf.distribute(t, spec, mesh=mesh) for t in (q, k, v, go)]
    for _ in range(2):
        _sdpa_step(*arrays)
    if transposed:  # (batch, seq, heads, dim) in memory, viewed as (batch, heads, seq, dim)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        arrays[0] = sf.distribute(q.transpose(1, 2).contiguous(), P("dp", None, "tp"), mesh=mesh).transpose(1, 2)
    else:
        arrays[0] = sf.distribute(q, spec, mesh=mesh)
    for _ in range(2):
        got = _sdpa_step(*arrays)
        for a, b in zip(got, _sdpa_step(q, k, v, go)):
            torch.testing.assert_close(a.full_tensor(), b)
