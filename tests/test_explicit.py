"""sf.explicit: implicit redistribution raises (or warns); explicit moves and local
compute run as usual."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardfn as sf
from shardfn import P


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _arrays(mesh: sf.Mesh, n: int = 8):
    torch.manual_seed(0)
    x = torch.randn(n, 6)
    w = torch.randn(6, 4)
    return x, w, sf.distribute(x, P("dp", None), mesh=mesh), sf.distribute(w, P(None, "tp"), mesh=mesh)


@pytest.mark.parametrize("n", [8, 7])
def test_local_compute_and_partial_results_run(mesh, n):
    x, w, xs, ws = _arrays(mesh, n)
    with sf.explicit(), sf.debug.CommCounter() as c:
        y = xs @ ws
        z = (y * 2).sum(0)  # sum over a sharded dim: left Partial, no data moves
    assert y.spec == P("dp", "tp")
    assert c.total == 0
    assert z.spec == P("tp", partial="dp")
    torch.testing.assert_close(z.full_tensor(), (x @ w * 2).sum(0))


def test_raise_names_op_input_layouts_and_reshard(mesh):
    x, w, xs, ws = _arrays(mesh)
    y = (xs @ ws).sum(0)  # P('tp', partial='dp')
    with sf.explicit(), sf.debug.CommCounter() as c:
        with pytest.raises(sf.ImplicitReshardError, match=r"aten\.relu.*input 0 is f32\[4\] P\('tp', partial='dp'\)"
                           r".*needs P\('tp'\).*all_reduce.*sf\.reshard\(input_0, P\('tp'\)\)"):
            torch.relu(y)
    assert c.total == 0
    assert y.spec == P("tp", partial="dp")  # nothing changed
    assert isinstance(sf.ImplicitReshardError("m"), sf.ShardingError)


def test_error_fixed_by_the_suggested_reshard(mesh):
    x, w, xs, ws = _arrays(mesh)
    y = (xs @ ws).sum(0)
    with sf.explicit():
        r = torch.relu(sf.reshard(y, P("tp")))
    torch.testing.assert_close(r.full_tensor(), torch.relu((x @ w).sum(0)))


def test_fallback_on_sharded_inputs_is_implicit(mesh, monkeypatch):
    from shardfn.arrays import dispatch

    xs = sf.distribute(torch.randn(10, 3), P("dp", None), mesh=mesh)
    monkeypatch.setattr(dispatch, "_cache", {})  # the fallback entries stay private to this test
    monkeypatch.setattr(dispatch._rules, "lookup", lambda func: None)
    with sf.explicit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sf.FallbackWarning)
        with pytest.raises(sf.ImplicitReshardError, match=r"aten\.cumsum.*input 0.*replicate fallback.*all_gather"):
            torch.cumsum(xs, 0)
        r = torch.cumsum(sf.distribute(torch.ones(10, 3), P(), mesh=mesh), 0)  # replicated: no move
    assert r.spec == P()


def test_warn_once_per_op_and_layouts(mesh):
    x, w, xs, ws = _arrays(mesh)
    y = (xs @ ws).sum(0)
    with sf.explicit(mode="warn"):
        with pytest.warns(sf.ImplicitReshardWarning, match=r"aten\.relu.*P\('tp', partial='dp'\)"):
            r = torch.relu(y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.relu(y)  # same op, same layouts: no second warning
    torch.testing.assert_close(r.full_tensor(), torch.relu((x @ w).sum(0)))
    assert issubclass(sf.ImplicitReshardWarning, UserWarning)


def test_explicit_moves_always_allowed(mesh):
    x, w, xs, ws = _arrays(mesh)
    with sf.explicit():
        a = sf.reshard(xs, P(None, "tp"))
        b = sf.with_sharding_constraint(ws, P())
        full = xs.full_tensor()
        f = sf.shard_map(lambda t: sf.lax.psum(t.sum(0), "dp"), mesh=mesh, in_specs=P("dp", None),
                         out_specs=P())
        s = f(xs)
    torch.testing.assert_close(a.full_tensor(), x)
    torch.testing.assert_close(b.full_tensor(), w)
    torch.testing.assert_close(full, x)
    torch.testing.assert_close(s.full_tensor(), x.sum(0))


def test_nesting_innermost_wins_and_decorator(mesh):
    x, w, xs, ws = _arrays(mesh)
    y = (xs @ ws).sum(0)
    with sf.explicit():
        with sf.explicit(mode="off"):
            torch.relu(y)
        with pytest.raises(sf.ImplicitReshardError):
            torch.relu(y)

    @sf.explicit()
    def f(t):
        return torch.relu(t)

    with pytest.raises(sf.ImplicitReshardError, match="relu"):
        f(y)
    torch.relu(y)  # outside: propagation as usual


def test_gradients_under_explicit(mesh):
    x, w, xs, ws = _arrays(mesh)
    xs.requires_grad_(True)
    ws.requires_grad_(True)
    with sf.explicit():
        loss = sf.reshard((xs @ ws).sum(), P())
    loss.backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr).sum().backward()
    torch.testing.assert_close(xs.grad.full_tensor(), xr.grad)
    torch.testing.assert_close(ws.grad.full_tensor(), wr.grad)


def test_bad_mode():
    with pytest.raises(sf.ShardingError, match="mode='loud'"):
        sf.explicit(mode="loud")


def test_explicit_mlp_example(capsys):
    from conftest import load_example

    results = load_example("explicit_mlp").main()
    out = capsys.readouterr().out
    assert "same loss and gradients: True" in out
    assert results["propagation"][2]["forward"] == {"all_reduce": 1}
    assert results["explicit"][2]["forward"] == {"reduce_scatter": 1}
    assert "aten.pow would redistribute" in out and "sf.reshard(input_0, P('dp', None))" in out
