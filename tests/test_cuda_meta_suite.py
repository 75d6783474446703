"""CUDA kernels' rules on meta meshes and their values through test-only CPU kernels: the
cases a meta-mesh suite asks beyond ``test_cuda_rules`` / ``test_attention_kernels`` --
biases of every broadcast shape, every output's metadata against torch's meta result,
layouts the kernels cannot keep (gathered, never wrong), meshes bigger than the dims.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import shardfn as sf
from shardfn import P

import test_attention_kernels as bshd
import test_cuda_rules as bhsd

aten = torch.ops.aten
B, H, S, D = 4, 4, 8, 16


@pytest.fixture(scope="module")
def cpu_kernels() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_scaled_dot_product_flash_attention", bhsd._flash),
                     ("_scaled_dot_product_flash_attention_backward", bhsd._flash_bwd),
                     ("_scaled_dot_product_efficient_attention", bhsd._efficient),
                     ("_scaled_dot_product_efficient_attention_backward", bhsd._efficient_bwd),
                     ("_scaled_dot_product_cudnn_attention", bhsd._cudnn),
                     ("_scaled_dot_product_cudnn_attention_backward", bhsd._cudnn_bwd),
                     ("_efficient_attention_forward", bshd._eff_fwd),
                     ("_efficient_attention_backward", bshd._eff_bwd)]:
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


def _sdpa_efficient(q, k, v, b):  # noqa: ANN001, ANN202
    return aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, False)


def _sdpa_cudnn(q, k, v, b):  # noqa: ANN001, ANN202
    return aten._scaled_dot_product_cudnn_attention(q, k, v, b, True, 0.0, True, False, scale=0.3)


def _bshd_efficient(q, k, v, b):  # noqa: ANN001, ANN202
    return aten._efficient_attention_forward(q, k, v, b, None, None, q.shape[1], k.shape[1], 0.0, 0, True)


KERNELS = {"sdpa_efficient": (_sdpa_efficient, False), "sdpa_cudnn": (_sdpa_cudnn, False),
           "bshd_efficient": (_bshd_efficient, True)}
# a bias broadcasts against the scores (batch, heads, seq_q, seq_k), right-aligned; B == H so that
# a (heads, ...) bias aligned from the left would be read as a batch one
BIASES = [(H, S, S), (S, S), (1, S, S), (B, 1, S, S), (1, H, S, S), (B, H, 1, S)]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("bias_shape", BIASES, ids=str)
@pytest.mark.parametrize("layout", ["heads", "batch", "heads_over_8", "batch_over_8"])
def test_broadcast_bias_values_and_grads_equal_unsharded(kernel: str, bias_shape: tuple, layout: str,
                                                         cpu_kernels: None) -> None:
    fn, seq_first = KERNELS[kernel]
    heads_dim = 2 if seq_first else 1
    mesh = sf.Mesh((8,) if "8" in layout else (2, 2), ("x",) if "8" in layout else ("dp", "tp"), backend="local")
    spec = {"heads": P("dp", "tp") if not seq_first else P("dp", None, "tp"), "batch": P("dp"),
            "heads_over_8": P(*[None] * heads_dim, "x"), "batch_over_8": P("x")}[layout]
    g = torch.Generator().manual_seed(0)
    shape = (B, S, H, D) if seq_first else (B, H, S, D)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    b = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    plain = [t.clone().requires_grad_(i < 3 or kernel != "sdpa_cudnn") for i, t in enumerate((q, k, v, b))]
    want = fn(*plain)[0]
    wgrads = torch.autograd.grad((want ** 2).sum(), [t for t in plain if t.requires_grad])
    sharded = [sf.distribute(t, spec, mesh=mesh).requires_grad_() for t in (q, k, v)]
    sharded.append(sf.distribute(b, P(), mesh=mesh).requires_grad_(kernel != "sdpa_cudnn"))
    with sf.debug.CommCounter() as cc:
        got = fn(*sharded)[0]
    assert cc.records == [] and got.spec == spec  # a broadcast bias splits like the scores
    torch.testing.assert_close(got.full_tensor(), want)
    need = sharded if kernel != "sdpa_cudnn" else sharded[:3]  # cuDNN's backward gives no bias gradient
    grads = torch.autograd.grad((got ** 2).sum(), need)
    for i, (gr, w) in enumerate(zip(grads, wgrads)):
        assert gr.shape == w.shape
        torch.testing.assert_close(gr.full_tensor(), w, msg=f"grad {i}")


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("bias_shape", BIASES, ids=str)
def test_broadcast_bias_heads_sharded_on_meta_mesh_moves_nothing(kernel: str, bias_shape: tuple) -> None:
    fn, seq_first = KERNELS[kernel]
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    spec = P("dp", None, "tp") if seq_first else P("dp", "tp")
    shape = (B, S, H, D) if seq_first else (B, H, S, D)
    q, k, v = (torch.randn(shape, device="meta") for _ in range(3))
    b = torch.randn(bias_shape, device="meta")
    want = fn(q, k, v, b)
    qs, ks, vs = (sf.distribute(t, spec, mesh=mesh).requires_grad_() for t in (q, k, v))
    bs = sf.distribute(b, P(), mesh=mesh).requires_grad_(kernel != "sdpa_cudnn")
    with sf.debug.CommCounter() as cc:
        outs = fn(qs, ks, vs, bs)
        grads = torch.autograd.grad(outs[0].sum(), (qs, ks, vs, bs) if kernel != "sdpa_cudnn" else (qs, ks, vs))
    assert [r.kind for r in cc.records if r.op != "aten.sum.default"] == []
    for w, o in zip(want, outs):
        if isinstance(w, torch.Tensor):
            assert (o.shape, o.dtype, o.device) == (w.shape, w.dtype, w.device)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v, b)][:len(grads)]


# -- the mesh owns the device: moves between meshes, accelerator moves refused on every rank ------


@pytest.mark.parametrize("sharding", ["bare_spec", "named"])
def test_distribute_of_an_array_onto_a_meta_mesh_moves_its_shards(sharding: str) -> None:
    cpu_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    meta_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    x = sf.distribute(torch.randn(4, 6), P("dp", "tp"), mesh=cpu_mesh)
    y = (sf.distribute(x, P("dp"), mesh=meta_mesh) if sharding == "bare_spec"
         else sf.distribute(x, sf.NamedSharding(meta_mesh, P("dp"))))
    assert y.mesh == meta_mesh and y.spec == P("dp") and y.shape == (4, 6)
    assert {s.device.type for s in y.local_shards()} == {"meta"} and y.device.type == "meta"
    z = sf.reshard(x, sf.NamedSharding(meta_mesh, P(None, "tp")))
    assert z.mesh == meta_mesh and {s.device.type for s in z.local_shards()} == {"meta"}


def test_distribute_of_an_array_takes_the_mesh_argument() -> None:
    """A bare spec with ``mesh=`` lays the array out on that mesh (a view of its devices), not its own."""
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    flat = mesh.flatten(("dp", "tp"), "x")
    t = torch.randn(8, 6, requires_grad=True)
    x = sf.distribute(t, P("dp", "tp"), mesh=mesh)
    y = sf.distribute(x, P("x"), mesh=flat)
    assert y.mesh == flat and y.spec == P("x")
    torch.testing.assert_close(y.full_tensor(), t)
    (g,) = torch.autograd.grad((y * y).sum().full_tensor(), (t,))
    torch.testing.assert_close(g, 2 * t)
    with pytest.raises(sf.ShardingError, match="not a view"):
        sf.distribute(x, P("x"), mesh=sf.Mesh((3,), ("x",), backend="local"))  # not the same devices


def test_an_array_on_a_meta_mesh_cannot_move_onto_a_data_mesh() -> None:
    meta_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    cpu_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    x = sf.distribute(torch.randn(4, 6), P("dp"), mesh=meta_mesh)
    with pytest.raises(sf.ShardingError, match=r"meta mesh holds no values.*'cpu'"):
        sf.distribute(x, P("tp"), mesh=cpu_mesh)


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("call", [
    lambda x: x.cuda(), lambda x: x.cuda(0), lambda x: x.cuda(non_blocking=True), lambda x: x.to("cuda"),
    lambda x: x.to("cuda:0", torch.float16), lambda x: x.to(device="cuda", dtype=torch.float16),
    lambda x: x.to(torch.device("cuda", 0), non_blocking=True), lambda x: x.type("torch.cuda.FloatTensor"),
    lambda x: x.xpu(), lambda x: torch.zeros_like(x, device="cuda") if x.dim() >= 3 else x.to("cuda"),
], ids=["cuda", "cuda0", "cuda_nb", "to", "to_dtype", "to_kw", "to_device", "type_str", "xpu", "zeros_like"])
def test_an_accelerator_move_off_the_mesh_device_is_a_sharding_error_on_any_machine(ndim: int, call) -> None:  # noqa: ANN001
    """Refused before torch starts the accelerator's runtime (on a CPU-only machine that failed
    with torch's 'not compiled with CUDA' rather than the mesh's error)."""
    meta_mesh = sf.Mesh((2,), ("x",), backend="local", device_type="meta")
    x = sf.distribute(torch.randn((4, 3, 2)[:ndim]), P("x"), mesh=meta_mesh)
    with pytest.raises(sf.ShardingError, match=r"device='(cuda|xpu)(:0)?'\).*mesh's device type 'meta'"):
        call(x)


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_moves_onto_the_mesh_device_and_casts_still_work(ndim: int) -> None:
    meta_mesh = sf.Mesh((2,), ("x",), backend="local", device_type="meta")
    x = sf.distribute(torch.randn((4, 3, 2)[:ndim]), P("x"), mesh=meta_mesh)
    other = torch.zeros(1, dtype=torch.float16, device="meta")
    for y in (x.to("meta"), x.to(torch.float64), x.to("meta", torch.float64, True, True), x.to(other, copy=True),
              x.to(other, non_blocking=True), x.to(device="meta", dtype=torch.bfloat16, copy=True),
              x.type(torch.float64), x.to(x)):
        assert isinstance(y, sf.ShardedArray) and y.spec == P("x") and y.device.type == "meta"
        assert {s.device.type for s in y.local_shards()} == {"meta"}
    assert x.to(other, copy=True).dtype == torch.float16 and x.type() == "torch.meta.FloatTensor"


# -- factories on the mesh's device ----------------------------------------------------------------


@pytest.mark.parametrize("args, kwargs", [
    ((10,), {}), ((2, 11, 3), {}), ((0.5, 3.0, 0.1), {}), ((1, 2.5, 0.25), {"dtype": torch.bfloat16}),
    ((10,), {"dtype": torch.float16}), ((-3, 7), {"dtype": torch.int32}), ((5, 0, -1), {}), ((0,), {}),
    ((2 ** 40, 2 ** 40 + 7, 2), {}),
], ids=str)
def test_arange_equals_torch_and_lands_on_the_mesh_device(args: tuple, kwargs: dict) -> None:
    want = torch.arange(*args, **kwargs)
    mesh = sf.Mesh((3,), ("x",), backend="local")  # uneven pieces, some empty
    for spec in (P("x"), P()):
        got = sf.arange(*args, sharding=spec, mesh=mesh, **kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape and got.spec == spec
        assert torch.equal(got.full_tensor(), want)
    meta_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    m = sf.arange(*args, sharding=P(("dp", "tp")), mesh=meta_mesh, **kwargs)
    assert m.shape == want.shape and m.dtype == want.dtype and {s.device.type for s in m.local_shards()} == {"meta"}
    assert torch.equal(sf.arange(*args, **kwargs), want)  # no sharding: a plain tensor


def test_make_array_from_callback_moves_shards_onto_the_mesh_device() -> None:
    meta_mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local", device_type="meta")
    full = torch.randn(4, 6)
    x = sf.make_array_from_callback((4, 6), P("dp", "tp"), lambda idx: full[idx], mesh=meta_mesh)
    assert x.device.type == "meta" and {s.device.type for s in x.local_shards()} == {"meta"}
    cpu_mesh = sf.Mesh((2,), ("x",), backend="local")
    with pytest.raises(sf.ShardingError, match="meta tensor"):
        sf.make_array_from_callback((4,), P("x"), lambda idx: torch.empty(2, device="meta"), mesh=cpu_mesh)


@pytest.mark.parametrize("bias_shape, bias_spec, spec", [
    ((1, H, S, S), P(None, "tp"), P("dp", "tp")),  # the bias's heads split like the query's: nothing moves
    ((1, H, S, S), P(None, "dp"), P("dp", "tp")),  # split over another axis: moved to the query's
    ((B, H, S, S), P(None, None, None, "tp"), P("dp", "tp")),  # keys split: moved, never read in pieces
    ((H, S, S), P("tp"), P("dp", "tp")),  # a 3-d bias's heads (right-aligned) split like the query's
    ((H, S, S), P(None, "dp"), P(None, "tp")),
    ((S, S), P("tp"), P("dp")),
    ((B, 1, S, S), P("tp"), P("dp", "tp")),
], ids=str)
def test_sharded_bias_values_and_grads_equal_unsharded(bias_shape: tuple, bias_spec: P, spec: P,
                                                        cpu_kernels: None) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"), backend="local")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
    b = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    plain = [t.clone().requires_grad_() for t in (q, k, v, b)]
    want = _sdpa_efficient(*plain)[0]
    wgrads = torch.autograd.grad((want ** 2).sum(), plain)
    sharded = [sf.distribute(t, spec, mesh=mesh).requires_grad_() for t in (q, k, v)]
    sharded.append(sf.distribute(b, bias_spec, mesh=mesh).requires_grad_())
    got = _sdpa_efficient(*sharded)[0]
    assert got.spec == spec
    torch.testing.assert_close(got.full_tensor(), want)
    for gr, w in zip(torch.autograd.grad((got ** 2).sum(), sharded), wgrads):
        torch.testing.assert_close(gr.full_tensor(), w)
