"""Files: atomic writes, strict JSON, and output paths checked before a run starts.

Every JSON, trace or profile that minibatch writes goes through :func:`write_json` or
:func:`atomic_write_text`:

* **Atomic.** The text goes to a temp file in the target's folder (``.NAME.tmp-PID-RANDOM``, NAME cut short),
  is flushed to disk (``fsync``) and renamed over the target (``os.replace``, atomic on POSIX and
  Windows). A failed write -- full disk, unwritable folder, Ctrl-C half way -- removes the temp
  file and leaves the old file as it was: readers see the old file or the new one, never half.
* **Strict JSON.** ``NaN`` and ``Infinity`` are not JSON (Python writes them, most parsers
  refuse them). :func:`strict_json` turns every non-finite float into ``null``, and the writer
  uses ``allow_nan=False``. **In minibatch's output files ``null`` means "metric undefined"**
  (e.g. TPOT of requests that produced one token, a throughput over a zero-length window).

:func:`check_output_file` / :func:`check_output_dir` validate an output path up front (the CLI
calls them before any model loads): nothing is created, the message names the option.
:func:`read_json` is the reading side: one ValueError naming the file for every way a JSON
input can be broken (missing, a folder, binary, empty, truncated, NaN/Infinity).
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import secrets
import stat
import tempfile
from pathlib import Path

MAX_NAME_BYTES = 255  # a file name's limit on Linux, macOS and Windows file systems


def strict_json(obj):
    """A copy of ``obj`` with every non-finite float (NaN, +-inf; numpy floats too) replaced by
    None, at any depth of dicts, lists and tuples (tuples become lists, as json writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dumps_json(obj, indent: int | None = 2, separators: tuple[str, str] | None = None) -> str:
    """Strict JSON text of ``obj`` (non-finite floats -> null, see :func:`strict_json`).

    Raises:
        TypeError: an object json cannot write (e.g. a numpy array, a set).
    """
    return json.dumps(strict_json(obj), indent=indent, separators=separators, allow_nan=False)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically: :func:`atomic_write_bytes` of its encoding."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (parent folders made); returns the path.

    Temp file in the same folder + fsync + ``os.replace``: on any failure (OSError, Ctrl-C) the
    temp file is removed and an existing file at ``path`` is unchanged. A new file gets the
    usual permissions (0o666 minus the umask); a replaced file keeps its mode.

    Raises:
        OSError: the folder cannot be made or written, the disk is full, ``path`` is a folder or
            not a regular file (a device, pipe or socket: never replaced); the message names ``path``.
    """
    given = path = Path(path)
    if path.is_symlink():  # write through the link: replace its target, keep the link
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file() and not path.is_dir():  # os.replace would put a file where it was
        raise OSError(errno.EINVAL, f"cannot write {given}: not a regular file (a device, pipe or socket)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # (the name cut to 40 characters: a name near the 255-byte limit would make the temp file's too long)
        tmp = path.parent / f".{path.name[:40]}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {given}: {e.strerror}") from e
    try:
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        except FileNotFoundError:
            pass
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {given}: {e.strerror}") from e
        raise
    _fsync_dir(path.parent)
    return given


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every OS/file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | Path, obj, indent: int | None = 2,
               separators: tuple[str, str] | None = None) -> Path:
    """Write ``obj`` as strict JSON (NaN/inf -> null: "metric undefined") to ``path``,
    atomically (:func:`atomic_write_text`), with a final newline; returns the path.

    Raises:
        TypeError: ``obj`` holds something json cannot write (nothing is written then).
        OSError: see :func:`atomic_write_text` (the old file is kept).
    """
    return atomic_write_text(path, dumps_json(obj, indent, separators) + "\n")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _non_finite_at(data, where: str = "") -> str | None:
    """Where the first NaN / Infinity sits in parsed JSON (e.g. ``requests[0].arrival_time_s``), or None."""
    if isinstance(data, float) and not math.isfinite(data):
        return where or "the top level"
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _non_finite_at(value, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found:
            return found
    return None


def read_json(path: str | Path, what: str = "JSON"):
    """Parse the JSON file ``path`` strictly (no NaN/Infinity); ``what`` names the kind of file
    in messages ("trace", "profile").

    Raises:
        ValueError: no such file, a folder, unreadable, not UTF-8 (binary), empty, not valid
            JSON (truncated: the message gives line and column) or holding NaN/Infinity; the
            message names ``path``.
    """
    path = Path(path)
    try:  # a file read again unchanged (a trace or profile checked, then used) is parsed once
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key in _PARSED:
        return copy.deepcopy(_PARSED[key])  # (it was copied once without RecursionError)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a folder, not a {what} file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a {what} file: not UTF-8 text (byte {e.start}; a binary file?)") from None
    if not text.strip():
        raise ValueError(f"{path}: the {what} file is empty")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON {what} file ({e.msg}: line {e.lineno}, column {e.colno}; "
                         "truncated?)") from None
    except ValueError as e:  # NaN / Infinity: name the field it is in
        try:
            where = _non_finite_at(json.loads(text))
        except (ValueError, RecursionError):
            where = None
        raise ValueError(f"{path}: not a JSON {what} file: {where + ' is ' if where else ''}{str(e).split()[0]}, "
                         "which JSON does not allow (write a finite number, or leave an optional field out for its "
                         "default)") from None
    except RecursionError:
        raise ValueError(f"{path}: not a {what} file (nested too deeply)") from None
    try:
        fresh = copy.deepcopy(data)  # callers may change what they get; the cache keeps its own
    except RecursionError:
        raise ValueError(f"{path}: not a {what} file (nested too deeply)") from None
    if key is not None:
        if len(_PARSED) >= 16:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = data
    return fresh


_PARSED: dict[tuple, object] = {}  # (resolved path, mtime_ns, size) -> parsed JSON, the last 16 files read


# ----------------------------------------------------------------------------- output paths

def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (relative paths from the current folder)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable(path: Path, option: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder we can write in (probed by
    making an anonymous temp file there: ``os.access`` says yes to root on read-only places)."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ValueError(f"{option}: {base} is a file, so {path} cannot be made (a folder is needed there)")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise ValueError(f"{option}: cannot write in {base} ({e.strerror})") from None


def check_output_file(path: str | Path, option: str = "--json") -> Path:
    """Check that a file can be written at ``path`` (its folders may be missing: they are made
    at write time); creates nothing. Returns ``Path(path)``.

    Raises:
        ValueError: (naming ``option``) empty path, ``path`` is a folder or not a regular file (a
            device such as /dev/null, a pipe, a socket), an ancestor is a file, or the folder is not writable.
    """
    if not str(path).strip():
        raise ValueError(f"{option} must be a file path, got {str(path)!r}")
    p = Path(path)
    if len(os.fsencode(p.name)) > MAX_NAME_BYTES:
        raise ValueError(f"{option}: its file name is {len(os.fsencode(p.name))} bytes long, more than the "
                         f"{MAX_NAME_BYTES} a file system allows; give a shorter one")
    if p.is_dir():
        raise ValueError(f"{option}: {p} is a folder; give a file path (e.g. {p / 'result.json'})")
    if p.exists() and not p.is_file():  # a write replaces the file: never /dev/null, a pipe or a socket
        raise ValueError(f"{option}: {p} is not a regular file (a device, pipe or socket); give a file path")
    _check_creatable(p.parent, option)
    return p


def check_output_dir(path: str | Path, option: str = "--figures-dir") -> Path:
    """Check that ``path`` is (or can be made as) a writable folder; creates nothing. Returns
    ``Path(path)``.

    Raises:
        ValueError: (naming ``option``) empty path, ``path`` or an ancestor is an existing file,
            or the folder is not writable.
    """
    if not str(path).strip():
        raise ValueError(f"{option} must be a folder path, got {str(path)!r}")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option}: {p} is a file; a folder is needed")
    _check_creatable(p, option)
    return p
