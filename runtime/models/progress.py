"""Start-up steps that take a while say so: a tqdm bar where stderr is a terminal, plain log
lines elsewhere (a line when the step starts, one every LOG_EVERY_S while it runs, one when
it ends with its time), so a 7B model's minute of loading and tuning is never silent."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from tqdm import tqdm

log = logging.getLogger("radixflow.startup")
LOG_EVERY_S = 10.0


class Progress:
    """`with Progress("reading weights", total=n, unit="B") as p: ... p.update(k)`."""

    def __init__(self, what: str, total: int = 0, unit: str = "it") -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.start = self.last_log = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty() and log.isEnabledFor(logging.INFO):
            self.bar = tqdm(
                total=total or None, desc=what, unit=unit, unit_scale=unit == "B", leave=False
            )
        else:
            log.info("%s ...", what)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            share = f" ({self.done / self.total:.0%})" if self.total else ""
            log.info("%s: %.0f s so far%s", self.what, now - self.start, share)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.close()
        seconds = time.perf_counter() - self.start
        if kind is None:  # a step over in a moment needs no second line
            log.log(
                logging.INFO if seconds >= 1 else logging.DEBUG,
                "%s: done in %.1f s",
                self.what,
                seconds,
            )
