"""Notebook 08b (beyond one replica): clusters of simulated replicas on the committed calibrated profile, as small
tables, and the exercise checks. The machinery is ``minibatch.cluster`` (``python -m minibatch simulate
--replicas N --router NAME``); this module only runs it at notebook size and reads the results.
"""

from __future__ import annotations

from pathlib import Path

from minibatch.cluster.cluster import ClusterRun
from minibatch.lessons import exercise

PROFILE = str(Path(__file__).resolve().parents[2] / "data" / "profiles" / "smollm2-135m-cpu.json")  # committed
COLUMNS = ("prefix_cache_hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
           "goodput_req_s")


def run_cluster(conversations=(), requests=(), *, router: str = "round_robin", replicas: int = 4,
                policy: str = "paged_prefix", profile: str = PROFILE, **cluster_options) -> tuple[ClusterRun, dict]:
    """One cluster run on the simulated clock: ``replicas`` engines of ``policy`` behind ``router`` (or
    ``disaggregate="P:D"``), on fresh copies of ``conversations`` (multi-turn) and ``requests``. Returns the run and
    its rows (``minibatch.cluster.simulate.cluster_rows``)."""
    from minibatch.cluster.simulate import ClusterConfig, build_cluster, cluster_rows, conversation_sizing
    from minibatch.compare import CompareConfig
    from minibatch.metrics import SLO
    from minibatch.checks import FieldTypeError, short_repr
    from minibatch.request import Request
    from minibatch.sim.cost_model import Profile

    if not conversations and not requests:
        raise ValueError("run_cluster needs conversations (multi-turn) or requests to run")
    if not all(isinstance(r, Request) for r in requests):  # (before they size the KV cache; Cluster.run checks too)
        raise FieldTypeError(f"requests must be Requests, got {short_repr(list(requests))}")
    cfg = CompareConfig(clock="sim", check_reference=False, figures_dir=None, progress=False, policies=(policy,))
    if "disaggregate" not in cluster_options:  # P:D sets the replicas itself
        cluster_options["replicas"] = replicas
    if conversations:  # the multi-turn options (think_time_s, max_turns, ...) apply
        cluster_options.setdefault("workload", "multiturn")
    ccfg = ClusterConfig(router=router, **cluster_options)
    sizing = list(requests) + (conversation_sizing(conversations) if conversations else [])
    cluster = build_cluster(cfg, ccfg, Profile.load(profile), policy, sizing)
    run = cluster.run(list(requests), [c.fresh() for c in conversations])
    return run, cluster_rows(run, policy, SLO(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s))


def print_rows(rows: dict[str, dict], columns=COLUMNS) -> None:
    """One line per setup: the overall row's ``columns`` (shares as percentages, times in seconds)."""
    shown = [c for c in columns if any(r["overall"].get(c) is not None for r in rows.values())]
    print(f"{'setup':<22}" + "".join(f"{c:>23}" for c in shown))
    for name, r in rows.items():
        cells = []
        for c in shown:
            v = r["overall"].get(c)
            cells.append("-" if v is None else f"{v:.1%}" if c.endswith("rate") else f"{v:.3f}")
        print(f"{name:<22}" + "".join(f"{x:>23}" for x in cells))


@exercise.check(hint="a conversation's next turn starts with all of its earlier turns: which router sends it back "
                     "to the replica that already holds them?")
def check_router_prediction(my_prediction, rows: dict[str, dict], show_answer: bool = False):
    """``my_prediction``: the router with the highest prefix cache hit rate in ``rows`` (router -> rows)."""
    best = max(rows, key=lambda name: rows[name]["overall"]["prefix_cache_hit_rate"])
    exercise.expect(my_prediction, best, "my_prediction", show_answer=show_answer)
    return f"{best} hits {rows[best]['overall']['prefix_cache_hit_rate']:.1%} of prompt tokens in the cache"


@exercise.check(hint="route() gets the eligible replicas (each with .index, .outstanding, .kv_usage, .engine) and "
                     "must return one of them")
def check_my_router(router_cls, conversations):
    """Register ``router_cls`` (a Router subclass with a name), run it on ``conversations``, check that every turn
    finished and every request went to an eligible replica; returns its hit rate and load imbalance."""
    from minibatch.cluster.routers import ROUTERS, Router, register_router

    exercise.require(router_cls, "MyRouter")
    assert isinstance(router_cls, type) and issubclass(router_cls, Router), "MyRouter must subclass Router"
    assert router_cls.name and router_cls.name not in ("round_robin", "least_outstanding", "least_kv",
                                                       "prefix_affinity"), "give MyRouter a name of its own"
    class Checked(router_cls):
        def route(self, request, replicas, now_s):
            chosen = exercise.require(super().route(request, replicas, now_s), "MyRouter.route")
            assert any(chosen is r for r in replicas), "route must return one of the replicas it was given"
            return chosen

    Checked.__qualname__ = router_cls.__qualname__
    ROUTERS.pop(router_cls.name, None)  # a cell run again registers the new version
    register_router(Checked)
    try:
        run, rows = run_cluster(conversations, router=router_cls.name)
    finally:
        ROUTERS.pop(router_cls.name, None)
    assert all(r.is_finished for r in run.requests), "some turns never finished"
    o = rows["overall"]
    return (f"{len(run.requests)} turns finished; prefix cache hit rate {o['prefix_cache_hit_rate']:.1%}, "
            f"load imbalance {o['load_imbalance']}, TTFT p99 {o['ttft_p99_s']:.3f} s")
