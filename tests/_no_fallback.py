"""A context that fails any call running through the replicate-everything fallback (tests
that an op has a rule: its FallbackWarning is given once per op per process, so catching the
warning would miss all but the first)."""

from __future__ import annotations

from shardfn.arrays import entries as _entries


class NoFallback:
    """Fails a call that runs through the replicate-everything fallback."""

    def __enter__(self) -> None:
        self._orig = _entries._Fallback.run

        def run(entry, *a, **k):
            raise AssertionError(f"{entry.func} ran through the replicate fallback")

        _entries._Fallback.run = run

    def __exit__(self, *exc) -> None:
        _entries._Fallback.run = self._orig
