"""Argument checks shared by every boundary (Request, SamplingParams, the run configuration).

Each check raises one error whose message names the field and the allowed range, e.g.
``ValueError: max_new_tokens must be an int in [1, 1048576], got 2.5``: a library caller gets
a ``ValueError``/``TypeError`` naming what to fix, and the CLI turns it into one usage line.
Bools are refused where a number is wanted (``True`` is an ``int`` to Python, not to a user).
"""

from __future__ import annotations

import argparse
import math
import operator
import reprlib
from numbers import Real

# Limits shared by the engine's and the run's configuration: beyond them a value is a typo, not an
# experiment (and would exhaust memory or time before saying so).
MAX_TOKENS = 1 << 20  # longest prompt / output / context / token budget (1,048,576 tokens)
MAX_NUM_REQUESTS = 1_000_000  # requests in one trace or benchmark
MAX_NUM_SEQS = 65_536  # batch_size, max_num_seqs (vLLM's max_num_seqs)
MAX_KV_SLOTS = 1 << 26  # n_slots: 67M token slots, far beyond any GPU's KV memory for these models
MAX_BLOCK_SIZE = 4096
MAX_SPEC_TOKENS = 64  # num_speculative_tokens, k
MIN_RATE, MAX_RATE = 1e-6, 1e6  # requests/s (below MIN_RATE arrivals pass any sane trace length)
MAX_SECONDS = 7 * 24 * 3600.0  # any waiting time or latency objective: a week
MAX_ECHO_CHARS = 200  # an error quotes at most this much of the value it refuses


class FieldTypeError(TypeError, ValueError):
    """A field of the wrong type. Both a TypeError and a ValueError, so a caller that catches
    ValueError for any bad input (the CLI, the trace reader) catches this one too."""


def _range_text(low, high, low_open: bool = False, high_open: bool = False) -> str:
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_int(value, name: str, low: int | None = 0, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (None: unbounded on that side). Accepts any integer
    type (numpy, 0-d tensors: ``operator.index``), never a bool or a float such as 2.0.

    Raises:
        FieldTypeError (a TypeError and ValueError): not an integer. ValueError: out of range. Both name ``name``.
    """
    allowed = f"an int {_range_text(low, high)}" if low is not None else "an int"
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise FieldTypeError(f"{name} must be {allowed}, got {short_repr(value)}") from None
    if (low is not None and out < low) or (high is not None and out > high):
        raise ValueError(f"{name} must be {allowed}, got {out}")
    return out


def check_real(value, name: str, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float in the range (bounds inclusive unless ``*_open``). NaN and
    infinities are refused, and so are bools and strings.

    Raises:
        TypeError: not a real number. ValueError: NaN, infinite or out of range. Both name ``name``.
    """
    allowed = "a finite number" + ("" if low is None else f" {_range_text(low, high, low_open, high_open)}")
    if isinstance(value, bool) or not isinstance(value, Real):
        raise FieldTypeError(f"{name} must be {allowed}, got {short_repr(value)}")
    out = float(value)
    if not math.isfinite(out) or (low is not None and (out <= low if low_open else out < low)) \
            or (high is not None and (out >= high if high_open else out > high)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return out


def check_choice(value, name: str, choices) -> str:
    """``value`` if it is one of ``choices``; else ValueError naming ``name`` and the choices."""
    if value not in tuple(choices):
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {short_repr(value)}")
    return value


def check_str(value, name: str, allow_none: bool = False) -> str | None:
    """``value`` if it is a non-empty str (or None when ``allow_none``); else FieldTypeError (not a str) or
    ValueError (empty), naming ``name``."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise FieldTypeError(f"{name} must be a non-empty string{' or None' if allow_none else ''}, "
                             f"got {short_repr(value)}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string, got ''")
    return value


def comma_list(text: str, name: str) -> tuple[str, ...]:
    """The items of a comma-separated option (``"a, b"`` -> ("a", "b"); ``""`` -> ()).

    Raises:
        ValueError: an empty item ("a,,b", "a,", ",") or an item given twice; the message names ``name``."""
    items = tuple(x.strip() for x in text.split(",")) if text.strip() else ()
    if any(not x for x in items):
        raise ValueError(f"{name} must be a comma-separated list without empty items, got {short_repr(text)}")
    if len(set(items)) < len(items):
        raise ValueError(f"{name} lists an item twice: {short_repr(text)}")
    return items


def check_token_ids(value, name: str, vocab_size: int | None = None) -> list[int]:
    """A non-empty flat sequence of token ids as a list of ints, each in [0, vocab_size).

    Raises:
        TypeError: not a sequence (a str, a dict, a nested list) or an id that is not an int.
        ValueError: empty, or an id out of range (the message gives its index).
    """
    if isinstance(value, (str, bytes, dict, set)) or not hasattr(value, "__iter__"):
        raise FieldTypeError(f"{name} must be a list of token ids (ints), got {type(value).__name__}")
    ids = list(value)
    if not ids:
        raise ValueError(f"{name} must hold >= 1 token id, got an empty list")
    high = None if vocab_size is None else vocab_size - 1
    return [check_int(t, f"{name}[{i}]", 0, high) for i, t in enumerate(ids)]


def check_in_vocab(ids: list[int], vocab_size: int, name: str = "prompt_token_ids") -> None:
    """Raise ValueError unless every id is below ``vocab_size`` (the model's embedding rows);
    ``ids`` are ints >= 0 already (:func:`check_token_ids`)."""
    bad = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}] must be in [0, {vocab_size}) (the model's vocab_size), got {ids[bad]}")


def check_device(value, name: str = "device") -> str:
    """``value`` if it names a torch device this machine has: "cpu", "cuda" or "cuda:N"; else ValueError (another
    string, or CUDA asked for where torch sees no GPU, or not that many)."""
    import re

    import torch

    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ValueError(f"{name} must be cpu, cuda or cuda:N, got {short_repr(value)}")
    if value.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= count:
            raise ValueError(f"{name} {value!r}: this machine has {count} CUDA device(s) visible to torch")
    return value


def one_line(message) -> str:
    """``message`` on one line (an error for stderr): its lines joined by a space; spaces inside a line are kept."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``minibatch compare: error: --n-slots must be ...`` on stderr and exit code 2,
    no usage block and never a traceback (the CLI's parser, and the benchmarks')."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def int_arg(low: int, high: int):
    """An argparse ``type``: the text as an int in [low, high] (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            return check_int(int(text) if text.strip().lstrip("-").isdigit() else text, "it", low, high)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("it ")) from None
    return parse


def real_arg(low: float, high: float, *, low_open: bool = False):
    """An argparse ``type``: the text as a finite float in [low, high] ((low, high] with ``low_open``; NaN and
    infinities refused, :func:`check_real`; argparse names the option in its error)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = text  # check_real refuses it, naming the range
        try:
            return check_real(value, "it", low, high, low_open=low_open)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("it ")) from None
    return parse


def _list_arg(item):
    """An argparse ``type``: a comma-separated list (:func:`comma_list`, at least one item), each item parsed by
    the argparse ``type`` ``item``, as a tuple."""
    def parse(text: str) -> tuple:
        try:
            items = comma_list(text, "it")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("it ")) from None
        if not items:
            raise argparse.ArgumentTypeError("must list at least one value")
        return tuple(item(x) for x in items)
    return parse


def ints_arg(low: int, high: int):
    """An argparse ``type``: a comma-separated list of ints in [low, high] (:func:`comma_list`), as a tuple."""
    return _list_arg(int_arg(low, high))


def reals_arg(low: float, high: float, *, low_open: bool = False):
    """An argparse ``type``: a comma-separated list of finite floats in the range of :func:`real_arg`, as a tuple."""
    return _list_arg(real_arg(low, high, low_open=low_open))


def device_arg(text: str) -> str:
    """An argparse ``type``: a torch device this machine has (:func:`check_device`: cpu, cuda or cuda:N)."""
    try:
        return check_device(text, "it")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("it ")) from None


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace, names, command: tuple = ()) -> list:
    """The options among ``names`` (dest names) whose value in ``args`` is not their default, i.e. were given (one
    given at its default value cannot be told apart). The defaults are the parser's own values for the arguments
    ``command`` alone (a subcommand's name, or none), so those must parse with no required option."""
    defaults = vars(parser.parse_args(list(command)))
    return [name for name in names if getattr(args, name) != defaults[name]]


def check_not_given(parser: argparse.ArgumentParser, args: argparse.Namespace, names, why: str) -> None:
    """``parser.error`` naming the first option of ``names`` (dest names) that was given (:func:`given_options`):
    for options a mode (``why``, e.g. "with --quick, which sets it") replaces or ignores."""
    if given := given_options(parser, args, names):
        parser.error(f"--{given[0].replace('_', '-')} does not apply {why}")


def output_file_arg(text: str) -> str:
    """An argparse ``type``: a path a file can be written at (``files.check_output_file``), checked before any work."""
    from minibatch.files import check_output_file

    try:
        check_output_file(text, "it")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("it ").removeprefix("it: ")) from None
    return text


def run_script(main) -> None:
    """Run a script's ``main()`` (a benchmark's): a ValueError or OSError it raises (a bad file, an option found bad
    after parsing) ends it with one line on stderr and exit code 2 instead of a traceback."""
    import sys
    from pathlib import Path

    try:
        code = main()
    except (ValueError, OSError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)  # a main's int is its exit code; a result dict is 0


def short_repr(value) -> str:
    """``repr(value)`` in at most ``MAX_ECHO_CHARS`` characters (and "...", with the value's length when it was
    cut): an error never sends a huge value back, nor spends long writing its whole repr (``reprlib``)."""
    text = _ECHO.repr(value)
    limit = {str: None, list: _ECHO.maxlist, tuple: _ECHO.maxtuple, dict: _ECHO.maxdict, set: _ECHO.maxset}
    cut = len(text) > MAX_ECHO_CHARS or (len(repr(value[:MAX_ECHO_CHARS])) > MAX_ECHO_CHARS if isinstance(value, str)
                                         else type(value) in limit and len(value) > limit[type(value)])
    if len(text) > MAX_ECHO_CHARS:
        text = text[:MAX_ECHO_CHARS] + "..."
    if cut and isinstance(value, (str, list, tuple, dict, set)):
        text += f" ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
    return text


_ECHO = reprlib.Repr()  # bounded work for a value of any size (Python 3.11's Repr takes no arguments)
_ECHO.maxlevel, _ECHO.maxlist, _ECHO.maxtuple, _ECHO.maxdict, _ECHO.maxset = 3, 32, 32, 16, 16
_ECHO.maxstring = _ECHO.maxlong = _ECHO.maxother = MAX_ECHO_CHARS
