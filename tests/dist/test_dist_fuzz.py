"""The dist fuzzer's quick profile (``tools/fuzz.py --dist`` is the long one) and what its runs
found, each on 4 gloo processes and on the simulated mesh."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_harness import collect, is_dist, scenario, shards_for

import shardfn as sf
from shardfn import P

ROOT = Path(__file__).resolve().parents[2]


def test_dist_fuzzer_quick_profile() -> None:
    """A few random programs in one 4-process world: each agrees with torch and the local
    backend on every rank, and the run reports its count (a failure prints its seed)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--dist", "--cases", "10", "--seed", "7000"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert "cases run: 10, failures: 0" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0


# -- found by the dist fuzzer ----------------------------------------------------------------------


@scenario
def shard_map_collectives_of_dtypes_off_the_wire(mesh: sf.Mesh) -> None:
    """shard_map's collectives on dist took gloo's dtypes only: complex (and bool) bodies raised
    "Invalid scalar type" on every rank (seeds 1002, 1017: all_to_all of complex128)."""
    a = mesh.axis_names[-1]
    n = mesh.axis_size(a)
    for dtype in (torch.complex128, torch.complex64, torch.bool, torch.int16):
        full = torch.arange(4 * n * n).reshape(2 * n, 2 * n)
        full = (full + 1j * full).to(dtype) if dtype.is_complex else (full % 3 == 0).to(dtype)
        x = sf.ShardedArray.from_local(shards_for(full, P(a), mesh), P(a), mesh=mesh, shape=tuple(full.shape))

        def body(b: torch.Tensor) -> tuple:
            flip = [(i, (i + 1) % n) for i in range(n)]
            return (sf.lax.all_to_all(b, a, split_axis=1, concat_axis=0, tiled=True),
                    sf.lax.all_gather(b, a, axis=0, tiled=True),
                    sf.lax.ppermute(b.conj() if b.is_complex() else b, a, flip),
                    sf.lax.pshuffle(b, a, list(reversed(range(n)))))

        outs = sf.shard_map(body, mesh=mesh, in_specs=(P(a),), out_specs=(P(None, a), P(), P(a), P(a)))(x)
        blocks = list(full.chunk(n))
        want = (full, full, torch.cat(blocks[-1:] + blocks[:-1]).conj() if dtype.is_complex else
                torch.cat(blocks[-1:] + blocks[:-1]), torch.cat(blocks[::-1]))
        for i, (got, w) in enumerate(zip(outs, want)):
            g = got.full_tensor()
            assert g.dtype == dtype and torch.equal(g.resolve_conj(), w.resolve_conj()), (dtype, i, g, w)
        if dtype.is_complex:
            s = sf.shard_map(lambda b: sf.lax.psum(b.sum(0, keepdim=True), a), mesh=mesh, in_specs=(P(a),),
                             out_specs=P())(x)
            assert torch.equal(s.full_tensor(), full.sum(0, keepdim=True)), is_dist(mesh)



@scenario
def errors_of_values_on_one_shard_raise_on_every_rank(mesh: sf.Mesh) -> None:
    """A kernel that raises on values (an index out of range, an integer division by zero)
    raised only on the ranks whose shard held the bad value; the others ran on into the next
    collective and waited there until the timeout (seeds 200006, 200142, 200446, 200578), or
    raised another error type from an empty shard (seed 200363). Now every rank raises the
    type torch raises, and the world goes on."""
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    src = torch.arange(2.0 * n).reshape(2, n)

    def arr(full: torch.Tensor, spec: P) -> sf.ShardedArray:
        return sf.ShardedArray.from_local(shards_for(full, spec, mesh), spec, mesh=mesh, shape=tuple(full.shape))

    x = arr(src, P(None, a))
    bad = torch.zeros(2, n, dtype=torch.int64)
    bad[0, n - 1] = 5  # only the last rank's shard holds it
    with pytest.raises(RuntimeError, match=r"out of bounds|rank \d raised RuntimeError"):
        torch.gather(x, 0, arr(bad, P(None, a)))
    idx = torch.zeros(n + 1, dtype=torch.int64)
    idx[-1] = 7  # uneven: the last rank holds two entries, the bad one among them
    with pytest.raises(IndexError):
        torch.index_select(arr(src.t().contiguous(), P()), 0, arr(idx, P(a)))
    w = arr(torch.arange(6.0).reshape(3, 2), P(None, a))  # embedding dim 2: empty shards where n > 2
    with pytest.raises(IndexError):
        torch.nn.functional.embedding(arr(torch.tensor([0, 3] * n), P(a)), w)
    num = arr(torch.arange(1, n + 1), P(a))
    den = torch.ones(n, dtype=torch.int64)
    den[-1] = 0
    with pytest.raises(RuntimeError, match=r"ZeroDivisionError|rank \d raised RuntimeError"):
        torch.floor_divide(num, arr(den, P(a)))
    assert torch.equal((num // arr(den + 1, P(a))).full_tensor(), torch.arange(1, n + 1) // (den + 1))
    assert torch.equal(x.full_tensor(), src)  # the world goes on: the next collective pairs up

@scenario
def one_element_strided_complex_shard_through_a_collective(mesh: sf.Mesh) -> None:
    """A one-element complex shard with a stride (``x[::2]``) went to the wire as bytes through
    ``view(uint8)``, which rejects its stride: the rank holding it raised, the others waited
    in the all_gather (seed 401243)."""
    a = mesh.axis_names[0]
    full = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    x = sf.ShardedArray.from_local(shards_for(full, P(), mesh), P(), mesh=mesh)
    y = sf.reshard(x[::2], P(a))  # shape (1,), stride (2,): one rank holds it, the others are empty
    assert torch.equal(y.full_tensor(), full[::2])
    assert torch.equal(sf.reshard(y, P()).full_tensor(), full[::2])


@scenario
def kernel_errors_with_empty_shards_on_some_ranks(mesh: sf.Mesh) -> None:
    """Kernels check dtypes only on non-empty inputs: amax of a complex [1, 1] split over 4
    devices raised on the rank holding the element, the empty ranks ran on into the next
    collective (seed 400065). Every rank raises torch's error type now."""
    a = mesh.axis_names[0]
    full = torch.ones(1, 1, dtype=torch.complex128)
    with pytest.raises(Exception) as want:
        full.amax(0)
    x = sf.ShardedArray.from_local(shards_for(full, P(None, a), mesh), P(None, a), mesh=mesh, shape=(1, 1))
    with pytest.raises(want.type):
        x.amax(0)
    assert torch.equal(x.full_tensor(), full)  # the world goes on

@scenario
def kernels_are_not_given_an_empty_shard_of_a_valid_call(mesh: sf.Mesh) -> None:
    """Pooling an unbatched (C, L) input with C=3 split over 4 devices: the empty shard's
    kernel call raised, and since the agreement on errors every rank raised where torch does
    not (seeds 501650, 502660). As on the local backend, a rank whose outputs are all empty
    where the global ones are not returns empty outputs instead."""
    full = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    spec = P(tuple(mesh.axis_names))
    x = sf.ShardedArray.from_local(shards_for(full, spec, mesh), spec, mesh=mesh, shape=(3, 4))
    for f in (torch.nn.functional.avg_pool1d, torch.nn.functional.max_pool1d):
        assert torch.equal(f(x, 2).full_tensor(), f(full, 2)), f

@scenario
def a_kernel_is_not_called_where_its_outputs_are_all_empty(mesh: sf.Mesh) -> None:
    """batch_norm's backward over 9 channels split 3, 3, 3, 0: the CPU kernel of no channel
    divides by zero and killed the process (SIGFPE; dist seed 5858079005, and the local backend
    alike). Its unasked gradients are undefined outputs, which made the call not count as empty
    there; a device whose defined outputs are all empty now skips any functional op's kernel."""
    spec = P(None, tuple(mesh.axis_names))
    x, w = torch.randn(7, 9, dtype=torch.float64), torch.rand(9, dtype=torch.float64) + 0.5
    X = sf.distribute(x, spec, mesh=mesh)
    for weight in (None, w):
        def loss(v, weight=weight):
            return torch.nn.functional.batch_norm(v, None, None, weight=weight, training=True).pow(3).sum()

        want = torch.func.grad(loss)(x)
        W = None if weight is None else sf.distribute(weight, P(tuple(mesh.axis_names)), mesh=mesh)
        got = torch.func.grad(lambda v: loss(v, W))(X)
        torch.testing.assert_close(got.full_tensor(), want)
    g = torch.randn(7, 9, dtype=torch.float64)
    mean, invstd = x.mean(0), x.var(0, unbiased=False).add(1e-5).rsqrt()
    vec = P(tuple(mesh.axis_names))
    for mask in ([True, False, False], [True, True, True]):
        out = torch.ops.aten.native_batch_norm_backward(
            sf.distribute(g, spec, mesh=mesh), X, None, None, None, sf.distribute(mean, vec, mesh=mesh),
            sf.distribute(invstd, vec, mesh=mesh), True, 1e-5, mask)
        ref = torch.ops.aten.native_batch_norm_backward(g, x, None, None, None, mean, invstd, True, 1e-5, mask)
        for o, r in zip(out, ref):
            assert (o is None) == (r is None), mask
            if r is not None:
                torch.testing.assert_close(o.full_tensor(), r)


@scenario
def outputs_empty_on_some_ranks_decide_the_same_everywhere(mesh: sf.Mesh) -> None:
    """max over an empty dim of a [0, 2, 6] array whose last dim splits 2, 2, 2, 0: torch
    raises; the rank with an empty output ran the error agreement and the others did not, so
    it waited alone (seed 700481). Whether a call agrees is now the same decision on every rank."""
    full = torch.zeros(0, 2, 6)
    spec = P(None, None, tuple(mesh.axis_names))
    x = sf.ShardedArray.from_local(shards_for(full, spec, mesh), spec, mesh=mesh, shape=(0, 2, 6))
    with pytest.raises(Exception) as want:
        full.max(0)
    with pytest.raises(want.type):
        x.max(0)
    assert torch.equal(x.full_tensor(), full)  # the world goes on


@scenario
def complex_sums_of_copies_add_component_by_component(mesh: sf.Mesh) -> None:
    """psum / psum_scatter / a pending sum of a complex value the same on every device: the local
    backend multiplied the value by the axis size, ``(inf+0j) * 4 = inf+nanj``, where dist (and
    torch.sum of the copies, and the local backend's own sum of distinct parts) adds component by
    component, ``inf+0j`` (seed 501189). Both backends give torch.sum's answer now."""
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    inf = float("inf")
    full = torch.tensor([complex(inf, 0), complex(-inf, 1), complex(1, inf), 1 + 2j] * n, dtype=torch.complex128)
    want = full.unsqueeze(0).expand(n, *full.shape).sum(0)
    x = sf.ShardedArray.from_local(shards_for(full, P(), mesh), P(), mesh=mesh)
    scattered = sf.shard_map(lambda b: sf.lax.psum_scatter(b, a, scatter_dimension=0, tiled=True), mesh=mesh,
                             in_specs=(P(),), out_specs=P(a))(x)
    summed = sf.shard_map(lambda b: sf.lax.psum(b, a), mesh=mesh, in_specs=(P(),), out_specs=P())(x)
    number = sf.shard_map(lambda: sf.lax.psum(complex(inf, 1), a), mesh=mesh, in_specs=(), out_specs=P())()
    for got in (scattered.full_tensor(), summed.full_tensor()):
        assert torch.equal(got.isnan(), want.isnan()), (is_dist(mesh), got, want)
        torch.testing.assert_close(got, want, equal_nan=True)
    assert number == complex(inf, n), number
    # the pending sum of a replicated value made pending and resolved again is the value
    assert torch.equal(sf.reshard(sf.reshard(x, P(partial=a)), P()).full_tensor(), full)


@scenario
def max_and_min_over_devices_keep_a_nan(mesh: sf.Mesh) -> None:
    """pmax / pmin / a pending max or min resolved, with a nan on one device: gloo's max/min
    compare with ``<``, so whether a nan survived depended on the ring's order (dist seed
    33000356: sqrt of a negative, then pmin, gave a number where torch's amin gives nan).
    torch's amax/amin give nan, and so do both backends, wherever the nan sits; infinities and
    zeros order as floats."""
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    nan, inf = float("nan"), float("inf")
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        parts = torch.zeros(n, 5, dtype=dtype)
        for j in range(n):  # column j: the nan on device j; column 4: +-inf and numbers
            parts[:, j % 4] = torch.arange(n, dtype=dtype) - 1.5
            parts[j, j % 4] = nan
        parts[:, 4] = torch.tensor([-inf, 2.0, inf, -3.0] * n, dtype=dtype)[:n]
        want_max, want_min = parts.amax(0, keepdim=True), parts.amin(0, keepdim=True)
        x = sf.ShardedArray.from_local(shards_for(parts, P(a), mesh), P(a), mesh=mesh, shape=tuple(parts.shape))
        for lax_op, want in ((sf.lax.pmax, want_max), (sf.lax.pmin, want_min)):
            got = sf.shard_map(lambda b, op=lax_op: op(b, a), mesh=mesh, in_specs=(P(a),), out_specs=P())(x).full_tensor()
            assert torch.equal(got.isnan(), want.isnan()), (is_dist(mesh), dtype, lax_op, got, want)
            torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
        for op, want in (("max", want_max), ("min", want_min)):
            spec = P(None, partial={a: op})
            rows = [parts[mesh.coords(d)[0]:][:1] for d in range(mesh.size)]
            pend = sf.ShardedArray.from_local(shards_for(rows, spec, mesh), spec, mesh=mesh, shape=(1, 5))
            for dst in (P(), P(None, a)):
                got = sf.reshard(pend, dst).full_tensor()
                assert torch.equal(got.isnan(), want.isnan()), (is_dist(mesh), dtype, op, dst, got, want)
                torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


@scenario
def complex_parts_of_a_pending_sum_add_component_by_component(mesh: sf.Mesh) -> None:
    """Distinct complex parts of a pending sum, resolved and psum'd: the local backend added 2 to
    8 parts with torch's complex ``add``, which computes ``a + 1 * b`` and turns ``(1.5-inf j) +
    (1.5-inf j)`` into ``nan-inf j`` (fuzzer seed 35004348, a pcast's transpose); torch.sum of the
    parts, and the dist backend's collectives, add component by component (``3-inf j``)."""
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    inf = float("inf")
    row = [complex(1.5, -inf), complex(-inf, -inf), complex(inf, 2), complex(-0.0, -0.0), 1 - 2j]
    parts = torch.tensor([row] * n, dtype=torch.complex128)
    parts[-1, -1] = 3 + 0.5j
    want = parts.sum(0, keepdim=True)
    spec = P(None, partial={a: "sum"})
    pend = sf.ShardedArray.from_local(shards_for([parts[mesh.coords(d)[0]:][:1] for d in range(mesh.size)], spec, mesh),
                                      spec, mesh=mesh, shape=(1, len(row)))
    x = sf.ShardedArray.from_local(shards_for(parts, P(a), mesh), P(a), mesh=mesh, shape=tuple(parts.shape))
    summed = sf.shard_map(lambda b: sf.lax.psum(b, a), mesh=mesh, in_specs=(P(a),), out_specs=P())(x)
    for got in (sf.reshard(pend, P()).full_tensor(), sf.reshard(pend, P(None, a)).full_tensor(), summed.full_tensor()):
        assert torch.equal(torch.view_as_real(got).isnan(), torch.view_as_real(want).isnan()), (is_dist(mesh), got, want)
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def _same_components(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """Complex results equal component by component, nan where torch has nan (``|a - b|`` is
    nan at an infinite component, so assert_close alone cannot tell inf from nan)."""
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    a, b = torch.view_as_real(got.resolve_conj()), torch.view_as_real(want.resolve_conj())
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (what, got, want)


@scenario
def complex_division_by_zero(mesh: sf.Mesh) -> None:
    """Complex shards divided by zeros (bool, float, -0.0, complex, integer, 0-d and Python
    zeros; plain, sharded or replicated divisors), by themselves and after a pbroadcast in a
    shard_map, values and gradients (autograd and torch.func), and a pending sum divided by zero
    (reduced first: sum(parts / 0) is inf + -inf): every entry as torch gives it, inf or nan, on
    every rank (dist seed 5768711957: complex inf through a division by 0, not reproduced)."""
    import itertools

    from torch.func import grad

    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.4951 - 0.0291j, complex(inf, 1), complex(1, -inf), complex(nan, 0), 0j,
                      complex(-0.0, 0), 2 - 3j, complex(-inf, -inf)], dtype=torch.complex128)
    divisors = {"bool": torch.tensor([False, True] * 4), "float": torch.tensor([0.0, -0.0, 1.0, 0.0, 2.0, -0.0, 0.0, 3.0]),
                "complex": torch.tensor([0j, complex(-0.0, 0), 1j, complex(0, -0.0), 0j, 2 + 0j, 0j, 1 + 1j]),
                "int": torch.tensor([0, 1, 0, 2, 0, 0, 3, 0]), "0-d": torch.tensor(0.0), "0-d complex": torch.tensor(0j)}

    def loss(v, o):
        return torch.view_as_real(v / o).pow(2).sum()

    blk = 8 // n
    bcast = sf.shard_map(lambda b: sf.lax.pbroadcast(b, a, 0), mesh=mesh, in_specs=(P(a),), out_specs=P(a))

    def bcast_ref(v):  # expand's gradient sums the copies as torch.sum does (component by component)
        return v[:blk].unsqueeze(0).expand(n, blk).reshape(8)

    for (name, o), spec, ospec in itertools.product(divisors.items(), (P(a), P()), ("plain", P(a), P())):
        if ospec != "plain" and o.dim() == 0:
            continue
        what = (name, spec, ospec, is_dist(mesh))
        X = sf.distribute(x, spec, mesh=mesh)
        O = o if ospec == "plain" else sf.distribute(o, ospec, mesh=mesh)
        _same_components((X / O).full_tensor(), x / o, ("div",) + what)
        _same_components((O / X).full_tensor(), o / x, ("rdiv",) + what)
        _same_components((X / 0).full_tensor(), x / 0, ("python 0",) + what)
        want = grad(loss)(x, o)
        _same_components(grad(loss)(X, O).full_tensor(), want, ("func.grad",) + what)
        xs = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(sf.distribute(xs, spec, mesh=mesh), O), xs)
        _same_components(g, want, ("autograd",) + what)
        if spec == P(a):
            _same_components(bcast(X / O).full_tensor(), bcast_ref(x / o), ("pbroadcast",) + what)
            got = grad(lambda v: torch.view_as_real(bcast(v / O)).pow(2).sum())(X).full_tensor()
            _same_components(got, grad(lambda v: torch.view_as_real(bcast_ref(v / o)).pow(2).sum())(x),
                             ("pbroadcast grad",) + what)
    dyadic = torch.tensor([0.5 - 0.25j, 3 + 1j, 1 - 2j, 0j, 4 + 0j, -2 + 0j, 2 - 3j, -1 - 1j], dtype=torch.complex128)
    parts = torch.stack([dyadic] * n) * torch.arange(1, n + 1).reshape(n, 1)  # sums exact in any order
    pend = sf.ShardedArray.from_local(shards_for([parts[mesh.coords(d)[0]] for d in range(mesh.size)],
                                                 P(partial=a), mesh), P(partial=a), mesh=mesh, shape=(8,))
    for o in (divisors["complex"], divisors["bool"], torch.tensor(0j)):
        _same_components((pend / o).full_tensor(), parts.sum(0) / o, ("pending", is_dist(mesh)))


test_local, test_dist = collect(globals())
