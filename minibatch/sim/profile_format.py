"""What a profile file (``python -m minibatch calibrate``) holds, and the checks ``Profile.load`` runs
on it: every key the simulator uses, with a message that names the file and the key."""

from __future__ import annotations

import numpy as np

PROFILE_FORMAT = "minibatch-profile-v1"
FEATURES = ("logits", "prefill_rows", "prefill_attention", "decode_attention")  # the fit's linear terms
LAYOUTS = ("packed", "padded")


def check_profile_data(data, path) -> None:
    """Raise ValueError naming ``path`` and the key unless ``data`` (a parsed profile) is one this
    version reads (see ``Profile.load``)."""
    recalibrate = "re-run python -m minibatch calibrate to make a new profile"
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a profile (a JSON object with format, model, layouts), "
                         f"got a {type(data).__name__}")
    fmt = data.get("format")
    if fmt != PROFILE_FORMAT:
        why = ("no 'format' key" if fmt is None else
               f"format {fmt!r} is another version's (this version reads {PROFILE_FORMAT!r})"
               if isinstance(fmt, str) and fmt.startswith("minibatch-profile") else
               f"format must be {PROFILE_FORMAT!r}, got {fmt!r}")
        raise ValueError(f"{path}: {why}: not a profile of this version of minibatch; {recalibrate}")
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise ValueError(f"{path}: key 'model' must be a non-empty string (the model's name), "
                         f"got {brief(data, 'model')}; {recalibrate}")
    layouts = data.get("layouts")
    if not isinstance(layouts, dict) or "packed" not in layouts or not set(layouts) <= set(LAYOUTS):
        raise ValueError(f"{path}: key 'layouts' must be an object with 'packed' (and optionally 'padded'), "
                         f"got {brief(data, 'layouts')}; {recalibrate}")
    for name, value in [*((f"layouts.{k}", v) for k, v in layouts.items()), ("draft", data.get("draft"))]:
        problem = None if name == "draft" and value is None else layout_problem(value)
        if problem:
            raise ValueError(f"{path}: key {name!r}: {problem}; {recalibrate}")
    for key, what in (("vocab_size", "config.vocab_size"), ("max_model_len", "context limit")):
        if key in data and not (is_int(data[key]) and data[key] >= 1):
            raise ValueError(f"{path}: key {key!r} must be an int >= 1, got {data[key]!r}; "
                             f"set it to the model's {what}")
    for key, needed in (("samples", SAMPLE_KEYS), ("draft_samples", DRAFT_SAMPLE_KEYS)):
        problem = samples_problem(data.get(key), needed) if key in data else None
        if problem:
            raise ValueError(f"{path}: key {key!r}: {problem}; {recalibrate}")


# What a stored calibration sample holds (calibrate.measure / measure_draft).
SAMPLE_KEYS = ("scenario", "layout", "time_s", "num_tokens", *FEATURES, "padded")
DRAFT_SAMPLE_KEYS = ("scenario", "forwards", "time_s")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


MAX_STEP_S = 3600.0  # a stored step time or per-unit cost beyond an hour is a damaged profile


def is_cost(x, positive: bool = False) -> bool:
    """A stored time: a finite number in [0, MAX_STEP_S] (> 0 when ``positive``)."""
    return is_number(x) and (x > 0 if positive else x >= 0) and x <= MAX_STEP_S


def brief(x, key: str | None = None) -> str:
    """A short description of ``x`` (of ``x[key]`` if key is given: "nothing" if absent) for
    messages; an object is described by its keys."""
    import reprlib

    if key is not None:
        if key not in x:
            return "nothing (the key is missing)"
        x = x[key]
    return f"an object with keys {sorted(x)}" if isinstance(x, dict) else reprlib.repr(x)


def layout_problem(value) -> str | None:
    """What is wrong with a stored LayoutModel (None: nothing): {knots: ints >= 1, increasing,
    >= 2 of them; curve_s: one time in (0, MAX_STEP_S] per knot; coef_s: a time in [0, MAX_STEP_S]
    per FEATURES name}: the NNLS fit makes them non-negative, so anything else is a damaged file."""
    keys = ("knots", "curve_s", "coef_s")
    if not isinstance(value, dict) or set(value) != set(keys):
        return f"must be an object with keys {', '.join(keys)}, got {brief(value)}"
    knots, curve, coef = value["knots"], value["curve_s"], value["coef_s"]
    if not (isinstance(knots, list) and len(knots) >= 2 and all(is_int(k) and k >= 1 for k in knots)
            and all(a < b for a, b in zip(knots, knots[1:]))):
        return f"knots must be >= 2 increasing ints >= 1 (tokens), got {brief(knots)}"
    if not (isinstance(curve, list) and len(curve) == len(knots) and all(is_cost(v, positive=True) for v in curve)):
        return (f"curve_s must be {len(knots)} numbers in (0, {MAX_STEP_S:g}] (seconds, one per knot), "
                f"got {brief(curve)}")
    if not (isinstance(coef, dict) and set(coef) == set(FEATURES)):
        return f"coef_s must be an object with keys {', '.join(FEATURES)}, got {brief(coef)}"
    bad = [k for k in FEATURES if not is_cost(coef[k])]
    if bad:
        return (f"coef_s[{bad[0]!r}] must be a number in [0, {MAX_STEP_S:g}] (seconds per unit), "
                f"got {brief(coef[bad[0]])}")
    return None


def samples_problem(samples, needed: tuple[str, ...]) -> str | None:
    """What is wrong with stored calibration samples (None: nothing): a list of objects holding
    ``needed`` keys, time_s > 0."""
    if not isinstance(samples, list):
        return f"must be a list of calibration samples, got {brief(samples)}"
    for i, x in enumerate(samples):
        missing = [k for k in needed if k not in x] if isinstance(x, dict) else list(needed)
        if missing:
            return f"sample {i} must be an object with keys {', '.join(needed)} (missing {', '.join(missing)})"
        if not (is_number(x["time_s"]) and x["time_s"] > 0):
            return f"sample {i}: time_s must be a finite number > 0, got {x['time_s']!r}"
    return None
