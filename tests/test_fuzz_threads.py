"""The fuzzer's thread mode, quick profile (``tools/fuzz.py --threads N`` is the long one):
random programs run in 4 threads at once, each in its own entered mesh, ``sf.random.seeded``
key and (for some) ``sf.explicit()``, give exactly what they give alone."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_threads  # noqa: E402


@pytest.fixture
def quiet():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the long run: kernels split work by thread count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


def test_programs_in_threads_match_their_single_thread_runs(quiet) -> None:
    res = fuzz_threads.run_batch(list(range(9100, 9112)), 4)
    assert len(res) == 12
    bad = {s: r for s, r in res.items() if r}
    assert not bad, bad


def test_a_leaking_seed_context_is_caught(quiet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode can fail: with seeded() state shared by every thread, the random parts differ."""
    import shardfn.random.keys as keys

    class Shared:
        def __init__(self) -> None:
            self.items: list = []

    monkeypatch.setattr(keys, "_scoped", Shared())
    res = fuzz_threads.run_batch(list(range(9100, 9108)), 4)
    assert any(r and "rand" in r for r in res.values()), res


@pytest.mark.parametrize("module", ["fuzz_threads", "fuzz_dist"])
def test_digests_of_an_expanded_size_one_value(module) -> None:
    """A [1, 1] vjp cotangent expanded from a scalar keeps stride 0 through contiguous(), which
    view(uint8) rejects: the dist fuzzer reported its own digest's error as shardfn raising
    (seed 5791219228 --dist). Digests read the values from fresh memory."""
    import importlib

    digest = importlib.import_module(module)._digest
    v = torch.tensor(1 + 2j, dtype=torch.complex128).expand(1, 1)
    wrap = (lambda t: t) if module == "fuzz_threads" else (lambda t: [("value", t)])
    assert digest(wrap(v)) == digest(wrap(v.clone(memory_format=torch.contiguous_format)))
