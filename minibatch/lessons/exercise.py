"""Exercise checks that a student's notebook can run top to bottom.

Every check prints one line and never raises: ``correct: ...`` when the answer is right, or
``not yet: ...`` with what is missing or wrong and a hint. A stub (the student edition's ``...``,
or a function whose body is still ``...`` and so returns None) reads as "not implemented yet".
A check compares the answer with what the engine does (its schedule, its KV writes, its
outputs), never with a reference solution, so nothing of a solution enters the student's
namespace.

Writing a check::

    @exercise.check(hint="each batch runs as long as its longest member")
    def check_padding_rows(answer):
        answer = exercise.require(answer, "my_answer")
        measured = ...                                # what the engine did
        assert answer == measured, f"you said {answer}, the engine computed {measured}"
        return f"{measured} padding rows"             # printed after "correct: "
"""

from __future__ import annotations

import functools
from typing import Callable

CORRECT, NOT_YET = "correct:", "not yet:"


class NotYet(Exception):
    """The answer is still a stub (raised by :func:`require`, reported by :func:`check`)."""


def is_stub(value) -> bool:
    """Whether ``value`` is the student edition's placeholder: ``...`` or None (a ``...`` body's result)."""
    return value is ... or value is None


def require(value, name: str):
    """``value``, or raise :class:`NotYet` naming ``name`` when it is a stub."""
    if is_stub(value):
        raise NotYet(f"{name} is not implemented yet")
    return value


def expect(answer, measured, name: str = "my_prediction"):
    """For a predict-then-verify check: ``answer`` must equal what the engine ``measured``; raises
    :class:`NotYet` for a stub, AssertionError (saying both) when they differ. Returns ``measured``."""
    if require(answer, name) != measured:
        raise AssertionError(f"you said {answer}, the engine: {measured}")
    return measured


def check(hint: str = "") -> Callable:
    """Decorator for a check function: it returns a message (correct) or raises AssertionError
    (wrong: its message says what differs) or NotYet (a stub). The wrapped check prints one line,
    ``correct: <message>`` or ``not yet: <why>`` plus ``hint``, and returns whether it was correct.
    An exception raised by the student's own code is reported the same way, never re-raised."""

    def wrap(fn: Callable[..., str]) -> Callable[..., bool]:
        @functools.wraps(fn)
        def run(*args, **kwargs) -> bool:
            try:
                message = fn(*args, **kwargs)
            except NotYet as e:
                print(f"{NOT_YET} {e}" + (f". Hint: {hint}" if hint else ""))
                return False
            except AssertionError as e:
                why = str(e).split("\n")[0] or "the answer differs from what the engine does"
                print(f"{NOT_YET} {why}" + (f". Hint: {hint}" if hint else ""))
                return False
            except NotImplementedError as e:
                print(f"{NOT_YET} {e or 'not implemented yet'}")
                return False
            except Exception as e:  # the student's code failed: say how, keep the notebook running
                print(f"{NOT_YET} your code raised {type(e).__name__}: {e}")
                return False
            print(f"{CORRECT} {message}")
            return True

        return run

    return wrap
