"""Exercise checks that a student's notebook can run top to bottom.

Every check prints one line and never raises: ``correct: ...`` when the answer is right, or
``not yet: ...`` with what is missing or wrong and a hint. A stub (the student edition's ``...``,
or a function whose body is still ``...`` and so returns None) reads as "not implemented yet".
A check compares the answer with what the engine does (its schedule, its KV writes, its
outputs) or with properties the answer must have, never with a reference solution, so nothing of a
solution enters the student's namespace.

A prediction check (:func:`expect`) answers a miss with a direction first, not the answer: a number is
"too low" or "too high" (or the caller's words, e.g. "too early" / "too late" for steps), a dict names
its first wrong key and that key's direction, a list or set says how many entries are wrong or
missing. The measured answer is printed only when the student asks for it: every prediction check takes
``show_answer=False``; ``check_x(my_prediction, ..., show_answer=True)`` reveals it.

Writing a check::

    @exercise.check(hint="each batch runs as long as its longest member")
    def check_padding_rows(answer, trace, show_answer=False):
        measured = ...                                # what the engine did
        exercise.expect(answer, measured, "my_answer", show_answer=show_answer)
        return f"{measured} padding rows"             # printed after "correct: "
"""

from __future__ import annotations

import functools
import numbers
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


def expect(answer, measured, name: str = "my_prediction", *, show_answer: bool = False,
           words: tuple[str, str] = ("too low", "too high")):
    """For a predict-then-verify check: ``answer`` must equal what the engine ``measured``. Raises
    :class:`NotYet` for a stub, AssertionError when they differ: its message gives a direction (see the module
    docstring; ``words`` = what to say for a number below / above the answer) and, only with ``show_answer``, the
    measured answer. Returns ``measured``."""
    if _same(require(answer, name), measured):
        return measured
    how = miss(answer, measured, words)
    why = name + ("" if how.startswith("[") else " ") + how
    if show_answer:
        raise AssertionError(f"{why}; the engine: {measured!r}")
    raise AssertionError(f"{why} (to see the answer, run the check with show_answer=True)")


def _same(answer, measured) -> bool:
    """answer == measured, for an answer of any type: a list and a tuple of the same entries are the same; what
    compares elementwise (a numpy array) or fails to compare is not."""
    try:
        if isinstance(answer, (list, tuple)) and isinstance(measured, (list, tuple)):
            return len(answer) == len(measured) and all(_same(a, m) for a, m in zip(answer, measured))
        same = answer == measured
        return type(same).__name__ in ("bool", "bool_") and bool(same)
    except Exception:
        return False


def _is_number(x) -> bool:  # numpy's numbers too (a student's np.float64), never a bool (numpy's neither)
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def miss(answer, measured, words: tuple[str, str] = ("too low", "too high")) -> str:
    """How ``answer`` misses ``measured``, without saying ``measured``: "is too low", "['orca'] is too early",
    "has 2 of 3 entries wrong", ... (a student's answer of any type gets a sentence, never an exception)."""
    try:
        return _miss(answer, measured, words)
    except Exception:  # an answer of a type the comparison cannot take (an array for a list, ...)
        return f"is not what the engine did (a {type(measured).__name__} is expected, got a {type(answer).__name__})"


def _miss(answer, measured, words: tuple[str, str]) -> str:
    if _is_number(answer) and _is_number(measured):
        return f"is {words[int(answer > measured)]}"
    if isinstance(measured, dict):
        if not isinstance(answer, dict) or set(answer) != set(measured):
            return f"must be a dict with the keys {sorted(map(str, measured))}"
        key = next(k for k in measured if answer[k] != measured[k])
        how = miss(answer[key], measured[key], words)
        return f"[{key!r}]" + ("" if how.startswith("[") else " ") + how
    if isinstance(measured, (set, frozenset)) or isinstance(answer, (set, frozenset)):
        if not isinstance(answer, (set, frozenset, list, tuple)):
            return f"must be a set of {len(measured)}"
        answer, measured = set(answer), set(measured)
        wrong, missing = len(answer - measured), len(measured - answer)
        return f"has {wrong} wrong {'entry' if wrong == 1 else 'entries'} and misses {missing}"
    if isinstance(measured, (list, tuple)):
        if not isinstance(answer, (list, tuple)):
            return f"must be a list of {len(measured)}"
        if len(answer) != len(measured):
            return f"has {len(answer)} entries, the answer {len(measured)}"
        wrong = [i for i, (a, m) in enumerate(zip(answer, measured)) if a != m]
        if not wrong:  # the same values in another kind of sequence
            return f"has the right entries but must be a {type(measured).__name__}"
        return f"has {len(wrong)} of {len(measured)} entries wrong, the first at index {wrong[0]}"
    return "is not what the engine did"


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
