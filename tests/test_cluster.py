"""A simulated cluster (minibatch/cluster): one replica is exactly ``simulate``; routers balance and keep prefixes
together (cache_aware from the replicas' caches themselves); the admission limit holds requests at the router;
disaggregated replicas prefill on one side and decode on the other with the KV transferred; multi-turn
conversations carry each answer into the next prompt; bad options get one line naming them; a router from a
--policy-module file runs by name."""

import json
from types import SimpleNamespace

import pytest

from minibatch.__main__ import main
from minibatch.cluster.cluster import Cluster, KVLink
from minibatch.cluster.multiturn import make_conversations
from minibatch.cluster.routers import ROUTERS, Replica, get_router
from minibatch.cluster.simulate import (ClusterConfig, build_cluster, cluster_rows, conversation_sizing,
                                        load_imbalance, run_cluster_simulation)
from minibatch.compare import CompareConfig, build_trace
from minibatch.request import Request
from minibatch.sim.cost_model import Profile
from minibatch.sim.simulator import run_simulation

PROFILE = "data/profiles/smollm2-135m-cpu.json"
COMMON = dict(clock="sim", check_reference=False, figures_dir=None, progress=False, profile=PROFILE)


def sim_config(**kw) -> CompareConfig:
    return CompareConfig(**(COMMON | dict(num_requests=30, rate=6.0) | kw))


@pytest.mark.parametrize("policies", [("static", "orca", "paged"), ("paged_prefix", "chunked", "prefill_first")])
def test_one_replica_is_exactly_simulate(policies, capsys):
    cfg = sim_config(policies=policies)
    single = run_simulation(cfg, PROFILE)
    cluster = run_cluster_simulation(cfg, ClusterConfig(), PROFILE)
    for policy in policies:
        expected = {k: v for k, v in single["policies"][policy].items() if k not in ("run_time_s", "settings")}
        replica = cluster["policies"][policy]["replicas"][0]
        assert {k: replica[k] for k in expected} == expected
        overall = cluster["policies"][policy]["overall"]
        assert {k: overall[k] for k in expected if k in overall} == {k: expected[k] for k in overall if k in expected}


def multiturn_run(router: str, replicas: int = 4, **kw):
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged_prefix",))
    conversations = make_conversations(24, rate_per_s=2.0, think_time_s=2.0, max_output_len=64, seed=3)
    ccfg = ClusterConfig(replicas=replicas, router=router, workload="multiturn", **kw)
    cluster = build_cluster(cfg, ccfg, profile, "paged_prefix", conversation_sizing(conversations))
    run = cluster.run((), conversations)
    return run, cluster_rows(run, "paged_prefix")


def test_multiturn_turns_carry_the_answers_and_wait_for_them():
    run, _ = multiturn_run("round_robin")
    assert run.conversations and all(r.is_finished for r in run.requests)
    for c in run.conversations:
        for prev, turn in zip(c.turns, c.turns[1:]):
            assert turn.prompt_token_ids[: prev.num_tokens] == prev.all_token_ids  # the answer is in the prompt
            assert turn.arrival_time_s >= prev.finish_time_s  # the user waits for the answer (closed loop)
    assert len(run.requests) == sum(len(c.turns) for c in run.conversations) > len(run.conversations)


def test_prefix_affinity_hits_the_cache_more_than_round_robin():
    _, rr = multiturn_run("round_robin")
    _, pa = multiturn_run("prefix_affinity")
    assert pa["overall"]["prefix_cache_hit_rate"] > rr["overall"]["prefix_cache_hit_rate"] + 0.05
    assert pa["overall"]["load_imbalance"] <= 2.0  # the load bound keeps hot prefixes from piling up


def test_cache_aware_finds_more_of_the_conversations_than_prefix_affinity():
    _, pa = multiturn_run("prefix_affinity")
    _, ca = multiturn_run("cache_aware")
    assert ca["overall"]["prefix_cache_hit_rate"] > pa["overall"]["prefix_cache_hit_rate"]
    assert ca["overall"]["load_imbalance"] <= 2.0


def test_cache_aware_picks_the_longest_cached_prefix_within_the_load_bound():
    def replica(index, cached, outstanding):
        scheduler = SimpleNamespace(num_cached_prefix_tokens=lambda request: 16 * cached)
        return Replica(index, SimpleNamespace(scheduler=scheduler), outstanding=outstanding)

    router, request = get_router("cache_aware"), Request("r", [1] * 64, 4)
    # one outstanding each: the bound is ceil(1.25 x (3 + 1) / 3) = 2, all may take it; the longest cached prefix
    assert router.route(request, [replica(0, 0, 1), replica(1, 3, 1), replica(2, 2, 1)], 0.0).index == 1
    # the bound is ceil(1.25 x (6 + 1) / 3) = 3: replica 1 (3 outstanding) would pass it, so the next longest prefix
    assert router.route(request, [replica(0, 0, 1), replica(1, 3, 3), replica(2, 2, 2)], 0.0).index == 2
    # cached nowhere: the fewest outstanding, then the lowest index
    assert router.route(request, [replica(0, 0, 2), replica(1, 0, 1), replica(2, 0, 1)], 0.0).index == 1


def test_every_router_finishes_every_request_and_least_outstanding_balances():
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged",), num_requests=40, rate=8.0)
    requests = build_trace(cfg, None, profile.vocab_size)
    for name in ROUTERS:
        policy = "paged_prefix" if ROUTERS[name].needs == "prefix_cache" else "paged"
        run = build_cluster(cfg, ClusterConfig(replicas=3, router=name), profile, policy, requests).run(requests)
        assert len(run.requests) == 40 and all(r.is_finished for r in run.requests)
        assert sum(rep.routed for rep in run.replicas) == 40
        if name in ("round_robin", "least_outstanding"):
            assert max(rep.routed for rep in run.replicas) - min(rep.routed for rep in run.replicas) <= 4


def test_admission_limit_holds_requests_at_the_router():
    profile = Profile.load(PROFILE)
    cfg = CompareConfig(**(COMMON | dict(policies=("paged",), num_requests=20, arrival="zero")))  # no rate
    requests = build_trace(cfg, None, profile.vocab_size)
    ccfg = ClusterConfig(replicas=2, router="least_outstanding", max_outstanding=3)
    run = build_cluster(cfg, ccfg, profile, "paged", requests).run(requests)
    assert all(r.is_finished for r in run.requests) and len(run.requests) == 20
    for rep in run.replicas:
        assert max(rec.num_running + rec.num_waiting for rec in rep.engine.trace) <= 3
    ttft = sorted(r.first_token_time_s - r.arrival_time_s for r in run.requests)
    assert ttft[-1] > 3 * ttft[0]  # the held ones waited


def test_disaggregated_prefill_then_transfer_then_decode():
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged",), num_requests=24, rate=4.0)
    requests = build_trace(cfg, None, profile.vocab_size)
    ccfg = ClusterConfig(disaggregate="1:2", router="least_outstanding", kv_link_gbps=0.001)  # 1 MB/s: visible
    cluster = build_cluster(cfg, ccfg, profile, "paged", requests)
    run = cluster.run(requests)
    assert [rep.role for rep in run.replicas] == ["prefill", "decode", "decode"]
    by_id = {r.request_id: r for r in requests}
    for r in run.requests:
        assert r.is_finished and r.num_output_tokens == by_id[r.request_id].max_new_tokens
        assert len(r.token_times_s) == r.num_output_tokens and r.token_times_s == sorted(r.token_times_s)
        if r.max_new_tokens > 1:  # the KV's trip: its prompt's bytes at 1 MB/s, between token 1 and token 2
            transfer = cluster.kv_link.transfer_s(r.num_prompt_tokens, cluster.kv_bytes_per_token)
            assert r.token_times_s[1] - r.token_times_s[0] >= transfer
    decode_tokens = sum(e.num_new_tokens for rep in run.replicas[1:] for rec in rep.engine.trace for e in rec.entries)
    assert decode_tokens == sum(r.max_new_tokens - 1 for r in requests)  # the prompts were not computed again
    prefill_outputs = sum(len(e.token_ids) for rec in run.replicas[0].engine.trace for e in rec.entries)
    assert prefill_outputs == len(requests)  # one token each
    assert run.num_transfers == sum(r.max_new_tokens > 1 for r in requests)
    # per replica: the prefill replica's TTFT is the users'; a decode replica's requests came with their first token,
    # so its row has no TTFT, E2E or goodput (they were the time to the second token), only TPOT and ITL
    rows = cluster_rows(run, "paged")
    prefill, *decode = rows["replicas"]
    assert prefill["ttft_p50_s"] == rows["overall"]["ttft_p50_s"] and prefill["tpot_p50_s"] is None
    for row in decode:
        assert row["tpot_p50_s"] > 0 and row["itl_p99_s"] > 0 and row["output_throughput_tok_s"] > 0
        assert row["ttft_p50_s"] is row["e2e_p99_s"] is row["goodput_req_s"] is row["total_throughput_tok_s"] is None
    # the prefill replica ran batches though each of its requests left with its prefill's step
    assert 1 <= prefill["max_num_running"] <= 24 and all(row["max_num_running"] >= 1 for row in decode)


def test_kv_link_cost():
    assert KVLink(25e9, 10e-6).transfer_s(1000, 23040) == pytest.approx(10e-6 + 1000 * 23040 / 25e9)


@pytest.mark.parametrize("argv,message", [
    (["--disaggregate", "0:2"], "--disaggregate must be P:D"),
    (["--disaggregate", "two"], "--disaggregate must be P:D"),
    (["--disaggregate", "\uff11:\uff12"], "--disaggregate must be P:D"),  # full-width digits
    (["--router", "nearest"], "--router must be one of"),
    (["--replicas", "0"], "--replicas"),
    (["--disaggregate", "1:1", "--policies", "static"], "--disaggregate needs a paged policy"),
    (["--workload", "chat"], "--workload"),
])
def test_bad_cluster_options_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", PROFILE, "--num-requests", "4", "--no-progress", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


ROUTER_PLUGIN = '''
from minibatch.cluster.routers import Router, register_router


@register_router
class LastReplica(Router):
    name = "last_replica"
    description = "always the highest index"

    def route(self, request, replicas, now_s):
        return max(replicas, key=lambda r: r.index)
'''


def test_a_router_from_a_policy_module_runs_by_name(tmp_path, capsys):
    plugin = tmp_path / "my_router.py"
    plugin.write_text(ROUTER_PLUGIN)
    out = tmp_path / "r.json"
    try:
        main(["simulate", "--profile", PROFILE, "--policy-module", str(plugin), "--policies", "paged",
              "--num-requests", "6", "--replicas", "3", "--router", "last_replica", "--json", str(out),
              "--no-progress"])
    finally:
        ROUTERS.pop("last_replica", None)
    result = json.loads(out.read_text())
    assert [r["routed"] for r in result["policies"]["paged"]["replicas"]] == [0, 0, 6]
    assert "load imbalance" in capsys.readouterr().out


def test_routers_are_fresh_per_run():
    assert get_router("round_robin") is not get_router("round_robin")
    with pytest.raises(ValueError, match="one or more engines"):
        Cluster([], get_router("round_robin"))


def routed_order(run, role: str) -> list[str]:
    """The user requests' ids in the order the replicas of ``role`` first scheduled them."""
    firsts = [(rec.start_s, i, e.request_id) for rep in run.replicas if rep.role == role
              for i, rec in enumerate(rep.engine.trace) for e in rec.entries]
    seen = {}
    for _, _, rid in sorted(firsts):
        seen.setdefault(rid, None)
    return list(seen)


@pytest.mark.parametrize("options", [dict(replicas=2), dict(disaggregate="1:1")])
def test_requests_held_at_the_router_are_served_first_come_first_served(options):
    """A finished request frees its slot at its finish time, and the oldest request held for that role takes it: a
    later arrival never overtakes a held one (it did: the slot was given to an arrival from before the finish)."""
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged",), num_requests=30, rate=20.0)
    requests = build_trace(cfg, None, profile.vocab_size)
    ccfg = ClusterConfig(router="least_outstanding", max_outstanding=1, **options)
    run = build_cluster(cfg, ccfg, profile, "paged", requests).run(requests)
    role = "prefill" if "disaggregate" in options else "both"
    arrival_order = [r.request_id for r in sorted(requests, key=lambda r: (r.arrival_time_s, r.request_id))]
    assert routed_order(run, role) == arrival_order and all(r.is_finished for r in run.requests)


def test_round_robin_takes_each_role_in_turn_and_load_imbalance_counts_both_roles():
    """Disaggregated, round_robin keeps a turn per role (one counter for both sent most decodes to the first decode
    replica), and load_imbalance is the larger of the prefill and the decode replicas' (it read the prefill's)."""
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged",), num_requests=40, rate=1.0)
    requests = build_trace(cfg, None, profile.vocab_size)
    run = build_cluster(cfg, ClusterConfig(disaggregate="1:4", router="round_robin"), profile, "paged",
                        requests).run(requests)
    decoding = [rep.routed for rep in run.replicas if rep.role == "decode"]
    assert max(decoding) - min(decoding) <= 1 and sum(decoding) == run.num_transfers
    lopsided = [SimpleNamespace(role="prefill", routed=40), SimpleNamespace(role="decode", routed=30),
                SimpleNamespace(role="decode", routed=10)]
    assert load_imbalance(lopsided) == 1.5 and load_imbalance(lopsided[:1]) == 1.0


@pytest.mark.parametrize("policies, router", [("paged", "cache_aware"), ("static", "least_kv"),
                                              ("paged_prefix,static", "least_kv")])
def test_a_router_that_reads_what_the_policy_lacks_is_refused_before_any_runs(policies, router, capsys):
    """cache_aware without prefix caching, least_kv without a block manager routed by their tie-breaks alone (the
    same as least_outstanding); every policy's cluster is checked before the first runs."""
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", PROFILE, "--num-requests", "4", "--no-progress", "--replicas", "2",
              "--router", router, "--policies", policies])
    captured = capsys.readouterr()
    assert f"router {router} reads the replicas'" in captured.err and "load imbalance" not in captured.out


@pytest.mark.parametrize("argv, header, replicas", [(["--disaggregate", "1:2"], "1 prefill + 2 decode replicas", 3),
                                                     (["--replicas", "2"], "cluster: 2 replicas", 2)])
def test_the_header_and_the_json_count_every_replica(tmp_path, capsys, argv, header, replicas):
    out = tmp_path / "c.json"
    main(["simulate", "--profile", PROFILE, "--num-requests", "4", "--no-progress", "--policies", "paged", *argv,
          "--json", str(out)])
    assert header in capsys.readouterr().out and json.loads(out.read_text())["cluster"]["replicas"] == replicas


def test_a_slot_freed_at_an_arrivals_time_is_free_for_it():
    """At one timestamp a finished request's slot is freed before an arrival is routed: a request arriving exactly
    when replica 0's only request finishes sees it free (arrivals were pushed first, so they saw the finishing
    request and least_outstanding sent them to replica 1)."""
    profile = Profile.load(PROFILE)
    cfg = sim_config(policies=("paged",), num_requests=2, rate=1.0)
    first = Request("first", [5] * 8, 2, arrival_time_s=0.0)
    probe = build_cluster(cfg, ClusterConfig(replicas=1), profile, "paged", [first]).run([first])
    second = Request("second", [6] * 8, 2, arrival_time_s=probe.requests[0].finish_time_s)
    ccfg = ClusterConfig(replicas=2, router="least_outstanding")
    run = build_cluster(cfg, ccfg, profile, "paged", [first, second]).run([first, second])
    assert set(run.replicas[0].engine.requests) == {"first", "second"} and not run.replicas[1].engine.requests


def test_a_turn_that_outgrows_the_kv_cache_names_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", PROFILE, "--no-progress", "--replicas", "2", "--n-slots", "600",
              "--workload", "multiturn", "--conversations", "6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a conversation's turn grew past what a replica holds" in err[0] and "--n-slots" in err[0]
