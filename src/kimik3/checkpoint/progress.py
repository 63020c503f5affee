"""A bytes + tensors progress bar on stderr (rich), shown only when stderr is a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def wanted(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


@contextmanager
def progress_bar(description: str, total_bytes: int, total_tensors: int, enabled: bool
                 ) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`, to call once per tensor; a no-op when not `enabled`."""
    if not enabled:
        yield lambda nbytes: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TextColumn("{task.fields[tensors]:,}/{task.fields[total_tensors]:,} tensors"),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total_bytes, tensors=0, total_tensors=total_tensors)
        done = 0

        def advance(nbytes: int) -> None:
            nonlocal done
            done += 1
            bar.update(task, advance=nbytes, tensors=done)

        yield advance
