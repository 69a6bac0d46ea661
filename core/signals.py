"""Signals, in one place: how rlcore turns SIGINT and SIGTERM into a clean stop, and puts handlers back.

- A run's loop (`StopOnSignal`, around `Trainer.fit`): the first SIGINT/SIGTERM/SIGHUP (a closed terminal or
  ssh session, treated as SIGTERM) is noted, the step finishes, a
  checkpoint is saved and the run leaves (KeyboardInterrupt, or SystemExit 143); a second one stops at once.
  The previous handlers are restored when the loop's `with` block ends.
- Ray (`ray_sigterm`, around `ray.init`, and `restore_sigterm` at its shutdown): `ray.init` sets a SIGTERM
  handler of its own; the program's own comes back, or where it had none, SIGTERM becomes SystemExit(143), so
  `finally` blocks and atexit (the local Ray's shutdown) run.
- The process's exit after a signal (`leaving`, from the CLI): the local Ray's shutdown gets 15 s and another
  SIGINT/SIGTERM meanwhile ends the process at once with the same status (`exit_deadline`).

Handlers are only ever set from the main thread; elsewhere signals are left as they are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import watchdog
from .log import STOP, logger

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: a closed terminal or ssh session


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_deadline(code: int, why: str, grace_s: float = 15.0, done: threading.Event | None = None) -> threading.Event:
    """End the process with `code` if it is still here `grace_s` seconds from now, saying `why`, unless
    `done` (returned) is set first; the local Ray it started ends first. For a process that is leaving
    anyway: a signal was honoured."""
    done = done or threading.Event()

    def deadline() -> None:
        if not done.wait(grace_s):
            logger.warning(f"{why}; exiting", extra=STOP)
            if "rlcore.runtime.cluster" in sys.modules:  # its processes would outlive an os._exit
                sys.modules["rlcore.runtime.cluster"].end_local(after_exit=True)
            os._exit(code)

    threading.Thread(target=deadline, daemon=True, name="rlcore-exit-deadline").start()
    return done


class StopOnSignal:
    """SIGINT and SIGTERM while the loop runs: the first is noted (the loop stops after its step; Ray's own
    work gets `watchdog.STOP_GRACE_S`), a second one interrupts at once, and the process ends within the exit
    deadline whatever the teardown waits on. Outside the main thread, signals are left as they are."""

    EXIT = {signal.SIGINT: None, signal.SIGTERM: 143, signal.SIGHUP: 129}  # None: KeyboardInterrupt (the CLI exits 130)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()  # set when the `with` block is left: the exit deadline is off
        self._held: Callable[[], str] | None = None  # what the output_dir holds, once the loop runs (`failing`)

    def __enter__(self) -> StopOnSignal:
        if _main_thread():
            for sig in self.EXIT:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def arm(self) -> None:
        """Take the signals back from whoever set handlers since (the previous ones are restored on exit)."""
        for sig in self._previous:
            signal.signal(sig, self._note)

    def _note(self, sig: int, frame: Any) -> None:
        if self.signal is not None:  # the second one: stop now
            name = signal.Signals(sig).name
            held = f"; {self._held()}" if self._held is not None else ""
            logger.warning(f"stopped by a second {name}, at once{held}", extra=STOP)
            code = 130 if self.EXIT[sig] is None else self.EXIT[sig]
            exit_deadline(code, f"shutting the roles down took over 15 s after a second {name}", done=self._done)
            self._raise(sig)
        self.signal = sig
        watchdog.stopping()
        logger.warning(f"{signal.Signals(sig).name}: finishing this step, then saving a checkpoint "
                       f"(again to stop at once)", extra=STOP)

    def _raise(self, sig: int) -> None:
        if self.EXIT[sig] is None:
            raise KeyboardInterrupt
        raise SystemExit(self.EXIT[sig])

    @contextlib.contextmanager
    def failing(self, held: Callable[[], str], grace_s: float = 15.0) -> Iterator[None]:
        """A step (or save) that fails after the signal failed because of it, most likely: a scheduler
        signals every process of a job, the roles' workers and Ray's own too. The run then stops as the
        signal asked (SystemExit 143 / KeyboardInterrupt), saying so, why, and what `held()` says the
        output_dir holds; the teardown of roles whose processes are gone gets `grace_s` seconds."""
        self._held = held
        try:
            yield
        except Exception as exc:
            if self.signal is None:
                raise
            why = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            if len(why) > 1000:  # whole words, and said to be cut
                why = why[:1000].rsplit(" ", 1)[0] + " [...]"
            try:
                self.exit(f"during a step that then failed ({why}); {held()}", grace_s)
            except BaseException as stop:
                raise stop from exc

    def exit(self, message: str, grace_s: float = 15.0) -> None:
        """Say where the run stopped, then leave; the checkpoint is on disk, so a teardown of the roles that
        hangs (a scheduler's SIGTERM reached Ray's own processes too) ends the process after `grace_s`.
        The deadline ends with the teardown (`__exit__`): a caller that catches the exception lives on."""
        name = signal.Signals(self.signal).name
        logger.warning(f"stopped by {name} {message}", extra=STOP)
        code = 130 if self.EXIT[self.signal] is None else self.EXIT[self.signal]
        exit_deadline(code, f"shutting the roles down took over {grace_s:.0f} s after {name}", grace_s, self._done)
        self._raise(self.signal)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        watchdog.stopping(False)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# -------------------------------------------------------------------------
# Ray's SIGTERM handler
# -------------------------------------------------------------------------

_previous_sigterm: Any = None  # SIG_DFL when `_exit_on_sigterm` was put in its place after ray.init


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def ray_sigterm() -> Iterator[None]:
    """Around `ray.init` (which sets a SIGTERM handler of its own, in Python and in C++): afterwards the
    program's own handler is back, or, where it had none, SIGTERM is SystemExit(143) until `restore_sigterm`."""
    global _previous_sigterm
    if not _main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is signal.SIG_DFL:
            _previous_sigterm = previous
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        elif previous is not None:
            signal.signal(signal.SIGTERM, previous)


def restore_sigterm() -> None:
    """Once Ray is shut down: SIGTERM's default back where `ray_sigterm` replaced it (and nobody since)."""
    global _previous_sigterm
    if _previous_sigterm is not None and _main_thread():
        if signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


# -------------------------------------------------------------------------
# the process's exit after a signal
# -------------------------------------------------------------------------


_leaving: int | None = None  # the status `leaving` was given: the process is on its way out with it


def leaving_with() -> int | None:
    """The exit status of a process that a signal stopped and that is now leaving (`leaving`), else None."""
    return _leaving


def leaving(code: int) -> None:
    """Stopped by a signal: what is left is the exit (the local Ray's shutdown at exit); it gets 15 s, and
    another Ctrl-C or SIGTERM meanwhile ends it at once, with the same status (instead of a
    KeyboardInterrupt in the interpreter's shutdown, which dies of SIGINT)."""
    global _leaving
    _leaving = code
    if watchdog.stuck() is not None and "rlcore.runtime.cluster" in sys.modules:  # Ray's own processes do not answer
        sys.modules["rlcore.runtime.cluster"].exit_now(code)
    exit_deadline(code, "stopping the local Ray took over 15 s after the signal")
    if _main_thread():
        for sig in STOPS:
            signal.signal(sig, lambda *_: os._exit(code))
