"""torch's random ops on ShardedArrays (rules/random_ops.py): sharding-invariant draws
from torch's generator, generator semantics, sf.random.set_seed, dropout with autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import meshes, shapes, specs
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn import P
from shardfn.values.layout import device_box

aten = torch.ops.aten

OPS = {
    "dropout": lambda x: F.dropout(x, 0.3),
    "dropout_p0": lambda x: F.dropout(x, 0.0),
    "dropout2d": lambda x: F.dropout1d(x, 0.5) if x.dim() in (2, 3) else F.dropout(x, 0.5),
    "rand_like": torch.rand_like,
    "randn_like": lambda x: torch.randn_like(x, dtype=torch.float64),
    "randint_like": lambda x: torch.randint_like(x, 2, 9),
    "bernoulli": lambda x: torch.bernoulli(torch.sigmoid(x)),
    "bernoulli_p": lambda x: torch.bernoulli(x, 0.4),
    "uniform": lambda x: aten.uniform(x, -1.0, 2.0),
    "exponential": lambda x: aten.exponential(x, 2.0),
    "normal_tensor_float": lambda x: torch.normal(x, 0.5),
    "normal_tensor_tensor": lambda x: torch.normal(x, torch.ones_like(x)),
    "native_dropout": lambda x: aten.native_dropout(x, 0.5, True)[0],
    "native_dropout_mask": lambda x: aten.native_dropout(x, 0.5, True)[1],
    "scratch_uniform_": lambda x: torch.empty_like(x).uniform_(),
    "scratch_random_": lambda x: torch.empty_like(x).random_(0, 5),
}


def run(op: str, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered result of ``op`` after ``torch.manual_seed(seed)``, and the next
    plain torch draw (which shows how far the generator advanced)."""
    torch.manual_seed(seed)
    out = OPS[op](x)
    after = torch.rand(2)
    return (sf.gather(out) if isinstance(out, sf.ShardedArray) else out), after


@given(st.data())
def test_same_draws_for_every_mesh_and_sharding(data):
    shape = data.draw(shapes())
    op = data.draw(st.sampled_from(sorted(OPS)))
    seed = data.draw(st.integers(0, 2**32))
    full = torch.randn(shape)
    mesh = data.draw(meshes())
    spec = data.draw(specs(mesh, len(shape), partial_ops=("sum", "max")))
    x = sf.distribute(full, spec, mesh=mesh)
    ref = sf.distribute(full, P(), mesh=sf.Mesh((1,), ("r",), backend="local"))
    got, after = run(op, x, seed)
    want, after_ref = run(op, ref, seed)
    assert got.dtype == want.dtype and got.shape == want.shape == OPS[op](torch.zeros(shape)).shape
    assert torch.equal(got, want), op
    assert torch.equal(after, after_ref)


@given(st.data())
def test_replicas_draw_identical_numbers_shards_different(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes(min_dims=1))
    spec = data.draw(specs(mesh, len(shape), partial_ops=()))
    x = sf.distribute(torch.randn(shape), spec, mesh=mesh)
    out = torch.rand_like(x)
    by_box: dict = {}
    for dev, shard in enumerate(out.local_shards()):
        by_box.setdefault(device_box(out._layout, shape, dev), []).append(shard)
    for shards in by_box.values():
        assert all(torch.equal(s, shards[0]) for s in shards)
    firsts = [s[0].flatten() for s in by_box.values() if s[0].numel() >= 4]
    for i in range(len(firsts)):
        for j in range(i + 1, len(firsts)):
            assert not torch.equal(firsts[i][:4], firsts[j][:4])


def test_output_layouts(mesh24):
    x = sf.distribute(torch.randn(8, 8), P("x", partial="y"), mesh=mesh24)
    for op in ("rand_like", "bernoulli_p", "native_dropout_mask"):
        out = OPS[op](x)
        assert isinstance(out, sf.ShardedArray) and out._layout == x._layout.without_partial(), op
    # dropout is linear in x for a fixed mask: a pending sum passes through
    assert F.dropout(x, 0.5)._layout.dims == x._layout.dims


def test_different_seeds_differ(mesh24):
    x = sf.distribute(torch.randn(16, 16), P("x", "y"), mesh=mesh24)
    for op in ("dropout", "rand_like", "randn_like", "bernoulli_p"):
        a, _ = run(op, x, 1)
        b, _ = run(op, x, 2)
        assert not torch.equal(a, b), op


def test_differs_from_plain_torch_but_is_documented(mesh24):
    x = torch.randn(16, 16)
    a, _ = run("rand_like", sf.distribute(x, P("x"), mesh=mesh24), 0)
    b, _ = run("rand_like", x, 0)
    assert not torch.equal(a, b)
    assert "differ from plain torch" in sf.random.__doc__


# -- dropout ------------------------------------------------------------------------------------


def test_dropout_keeps_1_minus_p_and_scales(mesh24):
    x = torch.rand(256, 512) + 1.0
    for p in (0.1, 0.5):
        torch.manual_seed(0)
        out = sf.gather(F.dropout(sf.distribute(x, P("x", "y"), mesh=mesh24), p))
        kept = out != 0
        assert abs(kept.double().mean().item() - (1 - p)) < 0.01
        assert torch.equal(out[kept], x[kept] * (torch.ones(()) / (1 - p)))


def test_dropout_eval_and_edge_rates_draw_nothing(mesh24):
    x = sf.distribute(torch.randn(4, 4), P("x"), mesh=mesh24)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert torch.equal(sf.gather(F.dropout(x, 0.5, training=False)), sf.gather(x))
    assert torch.equal(sf.gather(F.dropout(x, 0.0)), sf.gather(x))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(sf.gather(F.dropout(x, 1.0)), torch.zeros(4, 4))


@pytest.mark.parametrize("spec", [P("x", "y"), P(None, ("y", "x")), P()])
def test_dropout_gradient_uses_the_same_mask(mesh24, spec):
    x = torch.randn(6, 10)
    xs = sf.distribute(x, spec, mesh=mesh24).requires_grad_()
    torch.manual_seed(4)
    out = F.dropout(xs, 0.4)
    (out * 3).sum().backward()
    mask = sf.gather(out) != 0
    assert torch.equal(sf.gather(xs.grad), mask.float() * 3 * (torch.ones(()) / 0.6))


def test_native_dropout_gradient_uses_its_mask(mesh24):
    xs = sf.distribute(torch.randn(8, 6), P("y"), mesh=mesh24).requires_grad_()
    torch.manual_seed(4)
    out, mask = aten.native_dropout(xs, 0.25, True)
    out.sum().backward()
    assert torch.allclose(sf.gather(xs.grad), sf.gather(mask).float() / 0.75)
    assert torch.equal(sf.gather(out) != 0, sf.gather(mask))


def test_dropout_module_in_a_model(mesh24):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    params = sf.nn.shard_params(model, [(r"0\.weight", P("y", None)), (r"0\.bias", P("y"))], mesh=mesh24)
    x = torch.randn(4, 8)
    outs = []
    for spec in (P("x"), P()):
        torch.manual_seed(7)
        outs.append(sf.gather(torch.func.functional_call(model, params, (sf.distribute(x, spec, mesh=mesh24),))))
    assert torch.equal(outs[0] == 0, outs[1] == 0)


# -- attention with dropout -------------------------------------------------------------------------
# F.scaled_dot_product_attention with dropout_p > 0 on arrays of 3+ dims runs torch's math formula
# with batch dims kept and F.dropout's sharding-invariant mask (CUDA's fused kernels would draw a
# philox seed per device; torch's math path would gather heads sharded over a second axis).

ATTN_CASES = {  # q heads 8; (kv heads, mask, is_causal, scale)
    "plain": (8, None, False, None),
    "causal": (8, None, True, None),
    "bool_mask": (8, "bool", False, None),
    "float_mask": (8, "float", False, 0.3),
    "gqa": (4, None, True, None),
    "negative_scale": (8, None, False, -0.2),
}
ATTN_LAYOUTS = [P(), P("x"), P("x", "y"), P(None, ("x", "y")), P(None, "y"), P("y", "x")]


def _attn_inputs(hkv: int, mask: str | None):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, 6, 5, generator=g, dtype=torch.float64)
    k, v = (torch.randn(4, hkv, 7, 5, generator=g, dtype=torch.float64) for _ in range(2))
    m = None
    if mask == "bool":
        m = torch.rand(6, 7, generator=g) > 0.3
        m[2] = False  # a fully masked row: 0 there, as torch's math path gives
    elif mask == "float":
        m = torch.randn(4, 1, 6, 7, generator=g, dtype=torch.float64)
    return q, k, v, m


def _sdpa(q, k, v, m, causal, scale, hkv, p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=causal, scale=scale,
                                          enable_gqa=hkv != q.shape[-3])


def _reference(q, k, v, m, causal, scale, hkv, p, keep):
    """torch's math path on plain tensors with a given keep-mask."""
    rep = q.shape[-3] // hkv
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    attn = torch.ops.aten._safe_softmax(s, -1)
    return (attn * keep / (1 - p)) @ v


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_attention_dropout_same_for_every_layout_and_equals_the_formula(mesh24, case):
    hkv, mask, causal, scale = ATTN_CASES[case]
    q, k, v, m = _attn_inputs(hkv, mask)
    p, key = 0.4, sf.random.key(5)
    # the one random op draws fold_in(key, 0): its keep-mask, the same for every layout
    keep = sf.random.bernoulli(sf.random.fold_in(key, 0), 1 - p, (4, 8, 6, 7))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, m, causal, scale, hkv, p, keep)
    want_grads = torch.autograd.grad((want * want).sum(), leaves)
    for spec in ATTN_LAYOUTS:
        qs, ks, vs = (sf.distribute(t, spec, mesh=mesh24).requires_grad_() for t in (q, k, v))
        ms = m if m is None or m.dim() < 4 else sf.distribute(m, P(spec[0] if len(spec) else None), mesh=mesh24)
        with sf.random.seeded(key), sf.debug.CommCounter() as cc:
            out = _sdpa(qs, ks, vs, ms, causal, scale, hkv, p)
        grads = torch.autograd.grad((out * out).sum(), (qs, ks, vs))
        assert out.spec == P(*spec[:2]), (case, spec)
        if hkv == 8 or len(spec) < 2 or spec[1] is None:  # gqa: repeating sharded kv heads moves data
            assert cc.counts == {}, (case, spec, cc.counts)
        torch.testing.assert_close(sf.gather(out), want, msg=f"{case} {spec}")
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(sf.gather(g), w, msg=f"{case} {spec} grad")


def test_attention_dropout_on_a_meta_mesh_reaches_no_fused_kernel():
    """On CUDA torch would pick a fused kernel drawing a philox seed per device; with dropout the
    math formula runs instead (batched products), heads stay sharded (meta stands in for CUDA)."""
    mesh = sf.Mesh((2, 2), ("x", "y"), device_type="meta")
    qs, ks, vs = (sf.distribute(torch.randn(4, 8, 6, 5), P("x", "y"), mesh=mesh).requires_grad_() for _ in range(3))

    def kernels(t):  # the autograd nodes behind t
        seen, todo = set(), [t.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.extend(f for f, _ in fn.next_functions)
        return {type(f).__name__ for f in seen}

    with sf.debug.CommCounter() as cc:
        out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.1, is_causal=True)
        grads = torch.autograd.grad(out.sum(), (qs, ks, vs))
    names = kernels(out)
    assert not any("ScaledDotProduct" in n for n in names) and any("contract" in n for n in names), names
    assert cc.counts == {} and out.spec == P("x", "y") and [g.spec for g in grads] == [P("x", "y")] * 3


# -- generator semantics ------------------------------------------------------------------------------


def step(x: torch.Tensor) -> torch.Tensor:
    h = F.dropout(x * 2, 0.2)
    return h + torch.randn_like(h) * 0.1


def test_two_seeded_steps_reproduce_exactly(mesh24):
    x = sf.distribute(torch.randn(12, 8), P("x", "y"), mesh=mesh24)
    torch.manual_seed(123)
    first = [sf.gather(step(x)) for _ in range(2)]
    torch.manual_seed(123)
    second = [sf.gather(step(x)) for _ in range(2)]
    assert not torch.equal(first[0], first[1])  # the generator advanced between steps
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_generator_advances_by_the_same_amount_for_any_shape(mesh24):
    afters = []
    for shape, spec in [((3,), P("x")), ((64, 64), P("x", "y")), ((0, 5), P()), ((), P())]:
        torch.manual_seed(0)
        torch.rand_like(sf.distribute(torch.zeros(shape), spec, mesh=mesh24))
        afters.append(torch.rand(3))
    assert all(torch.equal(a, afters[0]) for a in afters)


def test_explicit_generator(mesh24):
    x = sf.distribute(torch.zeros(5, 5), P("x"), mesh=mesh24)
    state = torch.get_rng_state()
    a = sf.gather(torch.rand_like(x, generator=torch.Generator().manual_seed(3)))
    b = sf.gather(torch.bernoulli(x + 0.5, generator=torch.Generator().manual_seed(3)))
    c = sf.gather(torch.rand_like(x, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(a, c) and torch.equal(torch.get_rng_state(), state)
    assert torch.equal(b, (a < 0.5).float())  # the same key: bernoulli(p) keeps where uniform < p


# -- sf.random.set_seed -----------------------------------------------------------------------------


def test_set_seed_key_drives_the_ops(mesh24):
    x = sf.distribute(torch.randn(8, 8), P("x", "y"), mesh=mesh24)
    k = sf.random.key(42)
    try:
        state = torch.get_rng_state()
        sf.random.set_seed(k)
        a1, a2 = sf.gather(F.dropout(x, 0.5)), sf.gather(torch.rand_like(x))
        assert torch.equal(torch.get_rng_state(), state)  # torch's generator untouched
        sf.random.set_seed(k)
        b1, b2 = sf.gather(F.dropout(x, 0.5)), sf.gather(torch.rand_like(x))
        assert torch.equal(a1, b1) and torch.equal(a2, b2)
        # the n-th op uses fold_in(key, n)
        assert torch.equal(a2, sf.random.uniform(sf.random.fold_in(k, 1), (8, 8)))
    finally:
        sf.random.set_seed(None)
    torch.manual_seed(0)
    c = sf.gather(torch.rand_like(x))
    torch.manual_seed(0)
    assert torch.equal(c, sf.gather(torch.rand_like(x)))


def test_seeded_per_stage_streams_and_restore(mesh24):
    x = sf.distribute(torch.randn(8, 8), P("x"), mesh=mesh24)
    k = sf.random.key(0)
    masks = []
    for stage in range(2):
        with sf.random.seeded(sf.random.fold_in(k, stage)):
            masks.append(sf.gather(F.dropout(x, 0.5)) == 0)
    assert not torch.equal(masks[0], masks[1])
    with sf.random.seeded(7):
        a = sf.gather(torch.rand_like(x))
        with sf.random.seeded(8):
            pass
        b = sf.gather(torch.rand_like(x))
    assert torch.equal(a, sf.random.uniform(sf.random.fold_in(sf.random.key(7), 0), (8, 8)))
    assert torch.equal(b, sf.random.uniform(sf.random.fold_in(sf.random.key(7), 1), (8, 8)))
    assert sf.random.keys._state.key is None


def test_set_seed_rejects_bad_keys():
    with pytest.raises(TypeError, match="key"):
        sf.random.set_seed("abc")


# -- immutability ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill,hint", [
    (lambda x: x.uniform_(), "rand_like"),
    (lambda x: x.normal_(), "randn_like"),
    (lambda x: x.bernoulli_(0.5), "bernoulli"),
    (lambda x: x.exponential_(), "exponential"),
    (lambda x: x.random_(0, 3), "randint_like"),
    (lambda x: torch.nn.init.normal_(x), "randn_like"),
])
def test_in_place_fills_on_arrays_raise(mesh24, fill, hint):
    x = sf.distribute(torch.zeros(4, 4), P("x"), mesh=mesh24)
    with pytest.raises(sf.ImmutableError, match=rf"in place.*{hint}"):
        fill(x)
    assert torch.equal(sf.gather(x), torch.zeros(4, 4))


def test_empty_arrays_are_immutable_once_read(mesh24):
    # issue 13 / 25: an array from empty_like / new_empty is fresh (``fresh.py``) until its
    # value is first read; from then on in-place fills raise like any array's
    x = sf.distribute(torch.zeros(6, 4), P("x", "y"), mesh=mesh24)
    y = torch.empty_like(x)
    before = sf.gather(y).clone()  # a read
    with pytest.raises(sf.ImmutableError, match="normal_.*randn_like"):
        y.normal_(2.0, 0.5)
    assert torch.equal(sf.gather(y), before)
    w = x.new_empty((3, 5))
    assert w._layout.is_replicated() and tuple(w.shape) == (3, 5)
    w.fill_(4.0)  # fresh: filled
    assert torch.equal((w * 1).full_tensor(), torch.full((3, 5), 4.0))  # read
    with pytest.raises(sf.ImmutableError, match="div_"):
        w.div_(2.0)
    with pytest.raises(sf.ImmutableError):
        x.div_(2.0)
