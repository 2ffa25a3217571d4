"""The progress bar over `plan`'s compiles (tqdm, if installed). Its total is the
candidates compiled so far and those the search still plans to compile: a stage
(the presets, the single moves, ...) counts the most it may compile when it is
planned, and what it did not use is taken off when it ends, so the total grows
when the search plans another stage and shrinks when one stops early."""

import contextlib
from collections.abc import Iterator
from typing import Any


class Progress:
    """The bar of one search (`show=False`, or without tqdm: no bar, the same
    counts)."""

    def __init__(self, show: bool):
        self.bar = _bar() if show else None
        self.done = 0  # candidates compiled
        self.left = 0  # the most the stage under way may still compile
        self.ahead = 0  # the most the stages planned after it compile

    def expect(self, n: int) -> None:
        """Plans stages still to come that compile at most `n` candidates."""
        self.ahead += n
        self._show()

    @contextlib.contextmanager
    def stage(self, most: int, planned: int | None = None) -> Iterator[None]:
        """A stage that compiles at most `most` candidates, of the `planned` that
        `expect` counted for it (`most` by default; none if it counted none)."""
        self.ahead = max(self.ahead - (most if planned is None else planned), 0)
        self.left = most
        self._show()
        try:
            yield
        finally:
            self.left = 0
            self._show()

    def compiled(self) -> None:
        """One more candidate compiled."""
        self.done += 1
        self.left = max(self.left - 1, 0)
        if self.bar is not None:
            self._show()
            self.bar.update(1)

    def close(self) -> None:
        """The search is over: the total is what it compiled."""
        self.left = self.ahead = 0
        if self.bar is not None:
            self._show()
            self.bar.close()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.total = self.done + self.left + self.ahead
            self.bar.refresh()


def _bar() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(desc="plan: compiled", unit=" step", total=0)
