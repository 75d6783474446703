"""The local backend stores each distinct shard once: a stacked value has size 1 on every
mesh dim its layout does not vary over, and ops broadcast over the mesh dims."""

from __future__ import annotations

import torch
from conftest import meshes, specs
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P
from shardfn.backends.local_values import varying

OPS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "matmul_t": lambda a, b: a @ b.transpose(0, 1),
    "sub_relu_sum": lambda a, b: (a - b).relu().sum(0),
}


def _canonical(x: sf.ShardedArray) -> None:
    """Every mesh dim of the stacked value is 1 where the layout does not vary."""
    if isinstance(x._local, torch.Tensor):
        for k, v in enumerate(varying(x._layout)):
            if not v:
                assert x._local.shape[k] == 1, (x._layout, x._local.shape)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_ops_on_mixed_layouts_match_torch_and_stay_compact(data) -> None:
    mesh = data.draw(meshes())
    shape = data.draw(st.sampled_from([(4, 8), (6, 4), (8, 8)]))
    name = data.draw(st.sampled_from(sorted(OPS)))
    a, b = torch.randn(shape), torch.randn(shape)
    xa = sf.distribute(a, data.draw(specs(mesh, 2, partial_ops=())), mesh=mesh)
    xb = sf.distribute(b, data.draw(specs(mesh, 2, partial_ops=())), mesh=mesh)
    _canonical(xa)
    _canonical(xb)
    a.requires_grad_(True)
    b.requires_grad_(True)
    xa, xb = xa.requires_grad_(True), xb.requires_grad_(True)
    out, want = OPS[name](xa, xb), OPS[name](a, b)
    _canonical(out)
    torch.testing.assert_close(out.full_tensor(), want)
    ga, gb = torch.autograd.grad(out.full_tensor().sum(), (xa, xb))
    wa, wb = torch.autograd.grad(want.sum(), (a, b))
    torch.testing.assert_close(ga.full_tensor(), wa)
    torch.testing.assert_close(gb.full_tensor(), wb)


def test_a_replicated_computation_runs_once(mesh24) -> None:
    """A value split over 'x' only is computed at its 2 distinct shards, not 8."""
    x = sf.distribute(torch.randn(8, 16), P("x"), mesh=mesh24)
    w = sf.distribute(torch.randn(16, 16), P(), mesh=mesh24)
    y = (x @ w).relu()
    assert y._local.shape == (2, 1, 4, 16)
    assert [s.shape for s in y.local_shards()] == [(4, 16)] * 8


def test_an_op_that_does_not_broadcast_over_the_mesh_dims_is_still_right(mesh24) -> None:
    """gather's output follows its index: on a compact input it would drop devices."""
    t = torch.randn(8, 6)
    idx = torch.randint(0, 6, (8, 6))
    x = sf.distribute(t, P(), mesh=mesh24)
    i = sf.distribute(idx, P("x"), mesh=mesh24)
    torch.testing.assert_close(torch.gather(x, 1, i).full_tensor(), torch.gather(t, 1, idx))
    torch.testing.assert_close(torch.cat([x, x * 2], 1).full_tensor(), torch.cat([t, t * 2], 1))


def test_attention_runs_once_for_the_mesh_and_matches_torch(mesh24) -> None:
    """CPU flash attention folds the mesh dims into the batch (values and gradients)."""
    q, k, v = (torch.randn(4, 8, 6, 4, requires_grad=True) for _ in range(3))
    specs = [P("x", "y"), P("x"), P()]
    for spec in specs:
        sq, sk, sv = (sf.distribute(t.detach(), spec, mesh=mesh24).requires_grad_(True) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, is_causal=True)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out.full_tensor(), want)
        grads = torch.autograd.grad(out.full_tensor().square().sum(), (sq, sk, sv))
        wants = torch.autograd.grad(want.square().sum(), (q, k, v))
        for g, w in zip(grads, wants):
            torch.testing.assert_close(g.full_tensor(), w)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stacked_matmul_folds_broadcast_mesh_dims_and_matches_torch_matmul(data) -> None:
    """stacked_matmul.matmul (the stacked kernel of mm/bmm/addmm) equals torch.matmul whatever the
    leading dims broadcast, the strides or the dtype."""
    from shardfn.backends.stacked_matmul import matmul

    lead = data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3))
    la = [n if data.draw(st.booleans()) else 1 for n in lead]
    lb = [n if data.draw(st.booleans()) else 1 for n in lead]
    m, k, n = (data.draw(st.sampled_from(s)) for s in ([0, 1, 3], [0, 1, 4], [1, 2, 5]))
    dtype = data.draw(st.sampled_from([torch.float64, torch.complex128, torch.int64]))
    a = (torch.randn(*la, k, m) * 4).to(dtype).transpose(-1, -2)  # a transposed view, as in mm backward
    b = (torch.randn(*lb, k, n) * 4).to(dtype)
    if dtype.is_complex and data.draw(st.booleans()):
        a = a.conj()
    if len(lead) > 1 and data.draw(st.booleans()):
        b = b.transpose(0, 1).contiguous().transpose(0, 1)
    got, want = matmul(a, b), torch.matmul(a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_megatron_products_match_torch(data) -> None:
    """Row-split activations times column-/row-split weights (the Megatron products,
    whose stacked operands broadcast over different mesh dims): values and gradients."""
    mesh = sf.Mesh((2, 4), ("x", "y"), backend="local")
    x_spec, w_spec = data.draw(st.sampled_from([
        (P("x", None), P(None, "y")), (P("x", "y"), P("y", None)), (P(None, "y"), P("y", None)),
        (P("x", None), P(None, "x")), (P(None, ("y", "x")), P(("y", "x"), None)), (P("y", None), P(None, "x")),
    ]))
    t, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    xs = sf.distribute(t.detach(), x_spec, mesh=mesh).requires_grad_(True)
    ws = sf.distribute(w.detach(), w_spec, mesh=mesh).requires_grad_(True)
    out, want = xs @ ws, t @ w
    _canonical(out)
    torch.testing.assert_close(out.full_tensor(), want)
    g = torch.randn(8, 8)
    gx, gw = torch.autograd.grad(out.full_tensor(), (xs, ws), g)
    wx, ww = torch.autograd.grad(want, (t, w), g)
    torch.testing.assert_close(gx.full_tensor(), wx)
    torch.testing.assert_close(gw.full_tensor(), ww)


def test_a_product_pending_a_sum_keeps_each_devices_part() -> None:
    """x.T @ g with both split over 'dp' along the contraction (a weight gradient under
    data parallelism) is pending a sum over 'dp': each device's part is its own rows'
    product, as on a real device (and on the dist backend), and the parts sum to it."""
    for n in (8, 3):
        mesh = sf.Mesh((n,), ("dp",), backend="local")
        x, g = torch.randn(24, 16, dtype=torch.float64), torch.randn(24, 8, dtype=torch.float64)
        xs, gs = sf.distribute(x, P("dp"), mesh=mesh), sf.distribute(g, P("dp"), mesh=mesh)
        dw = xs.t() @ gs
        assert dw.spec == P(partial="dp")
        rows = 24 // n
        for d, part in enumerate(dw.local_shards()):
            torch.testing.assert_close(part, x[d * rows:(d + 1) * rows].t() @ g[d * rows:(d + 1) * rows])
        torch.testing.assert_close(sf.reshard(dw, P()).full_tensor(), x.t() @ g)
        b = sf.distribute(torch.randn(16, 8, dtype=torch.float64), P(), mesh=mesh)
        torch.testing.assert_close(torch.addmm(b, xs.t(), gs).full_tensor(), torch.addmm(b.full_tensor(), x.t(), g))
        torch.testing.assert_close((dw * 2 + dw).full_tensor(), 3 * (x.t() @ g))
