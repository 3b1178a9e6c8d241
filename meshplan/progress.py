"""Progress bars for long searches, benchmarks and training loops: tqdm on stderr, shown only
when asked for and when stderr is a terminal (a log file or a pipe gets no bar)."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], *, total: int, desc: str, enabled: bool = True,
             unit: str = "solve") -> Iterator[T]:
    """``items`` unchanged, with a bar of ``total`` ``unit``s titled ``desc`` when ``enabled``
    and stderr is a terminal; the bar is removed when done."""
    show = enabled and sys.stderr.isatty()
    yield from tqdm(items, total=total, desc=desc, disable=not show, file=sys.stderr,
                    leave=False, dynamic_ncols=True, unit=unit)
