"""Notebook 08 (serving lab): the exercise check on the committed rate sweep.

``benchmarks/serving.py`` ran the load generator (``minibatch.serving.bench``) against servers
under several policies at a few Poisson request rates and wrote ``data/cpu/serving.json``: one
run per (server, rate), each with its client-side ``summary`` (TTFT, ITL, throughput...).
Here: :func:`sweep_by_server` (that file as tables) and :func:`check_max_rate_meeting`.
"""

from __future__ import annotations

from typing import Callable

from minibatch.lessons import exercise

# TTFT p99 bounds (seconds) the check asks about: under every measured value, between them, above all of them
CHECKED_SLOS_S = (0.1, 0.45, 0.5, 0.52, 2.0, 6.0, 8.0, 60.0)


def sweep_by_server(sweep: dict) -> dict[str, dict[float, dict]]:
    """``{server: {rate: summary}}`` from a rate sweep's JSON (``{"runs": [{"server", "rate", "summary"}]}``)."""
    rows: dict[str, dict[float, dict]] = {}
    for run in sweep["runs"]:
        rows.setdefault(run["server"], {})[run["rate"]] = run["summary"]
    return rows


@exercise.check(hint="a rate meets the SLO when its summary's ttft_p99_s is at most slo_s; when none does, return None")
def check_max_rate_meeting(fn: Callable, sweep: dict, slos_s=CHECKED_SLOS_S) -> str:
    """The exercise check: ``fn(by_rate, slo_s)`` must return the highest rate of ``by_rate`` (rate ->
    summary) whose measured TTFT p99 is at most ``slo_s`` seconds, or None when no rate meets it, for
    every server of ``sweep`` and every bound in ``slos_s``. Prints one line (``exercise.check``);
    returns whether every answer was right.

    Raises (reported as "not yet"):
        AssertionError: the first (server, SLO) where fn's rate differs from the measurements'.
    """
    cases = []
    for server, by_rate in sweep_by_server(sweep).items():
        for slo_s in slos_s:
            ok = [rate for rate, s in by_rate.items() if s["ttft_p99_s"] is not None and s["ttft_p99_s"] <= slo_s]
            cases.append((max(ok) if ok else None, server, by_rate, slo_s))
    cases.sort(key=lambda case: case[0] is None)  # a stub's None is caught before a None answer is asked for
    for i, (want, server, by_rate, slo_s) in enumerate(cases):
        got = fn({rate: dict(s) for rate, s in by_rate.items()}, slo_s)
        if i == 0:
            got = exercise.require(got, "max_rate_meeting")
        measured = {rate: round(s["ttft_p99_s"], 2) for rate, s in sorted(by_rate.items())}
        assert got == want, (f"{server} at a {slo_s:g} s SLO (TTFT p99 by rate: {measured}): "
                             f"expected {want}, you returned {got}")
    return f"max_rate_meeting agrees with the measurements for all {len(cases)} (server, SLO) pairs"


def server_ttft(base_url: str) -> tuple[float, float]:
    """(count, sum in seconds) of the server's own TTFT histogram, read from its ``/metrics`` (Prometheus text,
    parsed with prometheus_client). ``base_url``: the server's OpenAI base URL (ending in /v1). The server starts
    a request's TTFT when the request reaches the engine and stops it when the step that made its first token
    ends; the difference of two readings covers the requests finished in between."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics").read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text)
              if family.name == "minibatch:time_to_first_token_seconds" for s in family.samples}
    return values["minibatch:time_to_first_token_seconds_count"], values["minibatch:time_to_first_token_seconds_sum"]
