"""Configuration fields that carry their own limits and help: one source for the Python API, the
checks and the command line (``python -m minibatch``'s options are derived from them). The
configs made of them: each scheduler's (``scheduler/config.py``), speculative decoding's
(``spec/speculator.SpecConfig``), a run's (``compare.CompareConfig``).

A field made with :func:`option` states its kind ("int", "real", "choice", "bool", "str"), range
and help; :func:`check_fields` validates every such field of an instance, naming the field as
``name_of(field)`` (its CLI option at the command line, its own name in Python).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Callable

from minibatch.checks import (FieldTypeError, check_choice, check_int, check_real, check_str)

PREEMPTION_MODES = ("recompute", "swap")


def opt(name: str) -> str:
    """A field's command-line option: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return {"json_path": "--json"}.get(name, "--" + name.replace("_", "-"))


def option(default, help: str, kind: str, *, low=None, high=None, choices=(), optional: bool = False,
           low_open: bool = False, high_open: bool = False, cli: str | None = "all", flag: str | None = None):
    """A dataclass field with its check and its help. kind: "int" | "real" | "choice" | "bool" |
    "str" | "path" | "list" (checked by the dataclass itself); choices: a tuple, or a callable returning the
    allowed values when the option is checked (a registry); optional: None is allowed; cli: which
    commands offer it ("all", "model": compare only, "sim": simulate only, None: none); flag: its
    command-line spelling if not ``--field-name`` (a bool that defaults to True gets ``--no-...``)."""
    meta = dict(help=help, kind=kind, low=low, high=high, choices=choices if callable(choices) else tuple(choices),
                optional=optional,
                low_open=low_open, high_open=high_open, cli=cli, flag=flag)
    return field(default=default, metadata=meta)


def choices_of(meta) -> tuple:
    """A "choice" option's allowed values: its ``choices``, or what they return when they are a callable (a
    registry read when the option is checked, e.g. the attention backends, which plug-ins may add to)."""
    choices = meta["choices"]
    return tuple(choices()) if callable(choices) else choices


def check_field(meta, value, name: str):
    """``value`` checked against an :func:`option` field's metadata ``meta``; returns it normalised
    (numpy ints become ints).

    Raises:
        ValueError / FieldTypeError: a value out of range or of the wrong kind, naming ``name``.
    """
    if value is None and meta["optional"]:
        return value
    if meta["kind"] == "int":
        value = check_int(value, name, meta["low"], meta["high"])
    elif meta["kind"] == "real":
        value = check_real(value, name, meta["low"], meta["high"], low_open=meta["low_open"],
                           high_open=meta["high_open"])
    elif meta["kind"] == "choice":
        check_choice(value, name, choices_of(meta))
    elif meta["kind"] == "bool" and not isinstance(value, bool):
        raise FieldTypeError(f"{name} must be a bool, got {value!r}")
    elif meta["kind"] == "str":
        check_str(value, name)
    elif meta["kind"] == "path" and not isinstance(value, (str, os.PathLike)):
        raise FieldTypeError(f"{name} must be a path (str) or None, got {value!r}")
    return value


def check_fields(obj, name_of: Callable[[str], str] = str) -> None:
    """Check (and normalise) every :func:`option` field of ``obj`` (see :func:`check_field`).

    Raises:
        ValueError / FieldTypeError: the first bad field, named by ``name_of(field_name)``.
    """
    for f in dataclasses.fields(obj):
        if "kind" in f.metadata:
            object.__setattr__(obj, f.name, check_field(f.metadata, getattr(obj, f.name), name_of(f.name)))


def changed_fields(obj, names) -> list[str]:
    """The fields among ``names`` whose value in ``obj`` is not their default (given by the user; one given at its
    default value cannot be told apart): for refusing options that a mode would silently ignore."""
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    return [name for name in names if getattr(obj, name) != defaults[name]]


def setting_fields(config_cls) -> dict:
    """The user-facing fields of a config class (those with a command line): name -> the field's metadata."""
    return {f.name: f.metadata for f in dataclasses.fields(config_cls) if f.metadata.get("cli")}


def settings_of(config_cls, settings: dict) -> dict:
    """The entries of ``settings`` that are user-facing fields of ``config_cls``. None means "not set"
    (the field's default), except for a field that allows None, where it is that value (aging_s=None: no aging)."""
    fields = setting_fields(config_cls)
    return {k: v for k, v in settings.items() if k in fields and (v is not None or fields[k]["optional"])}
