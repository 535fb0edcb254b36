"""Critical sections that a Ctrl-C must not cut short (a restore, a rollback)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """While active, SIGINT (Ctrl-C) is held back: the body runs to its end, then the interrupt is
    delivered as it would have been (the previous handler is called: Python's default raises
    KeyboardInterrupt). Used around restoring a model and rolling a save back, which must not be left
    half done by a second Ctrl-C. Outside the main thread (where Python never delivers signals) it
    changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler installed outside Python, which could not be put back
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])  # default_int_handler raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
            # SIG_IGN: the interrupt was to be ignored anyway
