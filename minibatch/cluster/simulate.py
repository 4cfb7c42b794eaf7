"""``python -m minibatch simulate --replicas N --router NAME [--workload multiturn] [--disaggregate P:D]``.

Each selected policy runs as a cluster (``minibatch.cluster.cluster``): N replicas of the policy's engine on the
calibrated clock, behind the router; the table shows the cluster overall and each replica. Without any cluster
option, ``simulate`` runs one engine as before (``minibatch.sim.simulator``); ``--replicas 1`` with no other
cluster option gives exactly the same numbers (``tests/test_cluster.py``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

from minibatch.cluster.cluster import Cluster, ClusterRun, KVLink
from minibatch.cluster.routers import get_router, router_names
from minibatch.config import option

WORKLOADS = ("trace", "multiturn")
# a model's KV elements per token (2 x layers x KV heads x head_dim), for the KV transfer of disaggregation
KV_ELEMENTS_PER_TOKEN = {"smollm2-135m": 2 * 30 * 3 * 64}
MAX_REPLICAS = 4096  # replicas, and each side of --disaggregate P:D
PAGED_POLICIES_ONLY = "--disaggregate needs a paged policy (its decode replicas take transferred KV blocks)"


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster options of ``simulate`` (checked on creation, each error naming its option)."""

    replicas: int = option(1, "replicas (engines), each with its own scheduler, KV cache and clock", "int", low=1,
                           high=MAX_REPLICAS, cli="sim")
    router: str = option("round_robin", "how each request picks a replica", "choice", choices=router_names,
                         cli="sim")
    max_outstanding: int | None = option(None, "router admission limit: unfinished requests per replica (more wait "
                                         "at the router)", "int", low=1, high=1 << 20, optional=True, cli="sim")
    workload: str = option("trace", "trace: independent requests (the --num-requests trace); multiturn: ShareGPT "
                           "conversations, each turn's prompt holding the earlier turns", "choice",
                           choices=WORKLOADS, cli="sim")
    conversations: int = option(32, "multiturn: conversations (they start at --rate per second)", "int", low=1,
                                high=1_000_000, cli="sim")
    think_time_s: float = option(5.0, "multiturn: mean pause between an answer and the next turn, s", "real",
                                 low=0.0, high=1e6, cli="sim")
    max_turns: int = option(8, "multiturn: turns kept per conversation", "int", low=1, high=1000, cli="sim")
    system_prompt_len: int = option(0, "multiturn: tokens of a system prompt every conversation shares", "int",
                                    low=0, high=1 << 20, cli="sim")
    max_model_len: int = option(8192, "multiturn: a conversation ends before a turn longer than this", "int",
                                low=2, high=1 << 24, cli="sim")
    disaggregate: str | None = option(None, "P:D prefill and decode replicas instead of --replicas colocated ones",
                                      "str", optional=True, cli="sim")
    kv_link_gbps: float = option(25.0, "disaggregation: KV transfer bandwidth, GB/s", "real", low=0.0, high=1e6,
                                 low_open=True, cli="sim")
    kv_link_latency_us: float = option(10.0, "disaggregation: KV transfer latency, us", "real", low=0.0, high=1e9,
                                       cli="sim")
    kv_bytes_per_token: int | None = option(None, "disaggregation: KV bytes per token (default: the model's, for "
                                            "known models)", "int", low=1, high=1 << 30, optional=True, cli="sim")
    roles: tuple = field(default=(), metadata={"cli": None})

    def __post_init__(self):
        from minibatch.config import check_fields, opt

        check_fields(self, opt)
        needs = {"multiturn:": ("--workload multiturn", self.workload == "multiturn"),
                 "disaggregation:": ("--disaggregate P:D", self.disaggregate is not None)}
        for f in fields(self):  # an option of one mode, given without that mode, would be silently ignored
            mode = next((m for m in needs if f.metadata.get("help", "").startswith(m)), None)
            if mode and not needs[mode][1] and getattr(self, f.name) != f.default:
                raise ValueError(f"{opt(f.name)} applies only with {needs[mode][0]}")
        if self.disaggregate is not None and self.replicas != 1:
            raise ValueError("--replicas and --disaggregate both set the replicas: give one")
        roles = ("both",) * self.replicas
        if self.disaggregate is not None:
            p, _, d = self.disaggregate.partition(":")
            if not (f"{p}{d}".isascii() and p.isdecimal() and d.isdecimal() and 1 <= int(p) <= MAX_REPLICAS
                    and 1 <= int(d) <= MAX_REPLICAS):
                raise ValueError(f"--disaggregate must be P:D with P, D in [1, {MAX_REPLICAS}] (prefill and decode "
                                 f"replicas), got {self.disaggregate!r}")
            roles = ("prefill",) * int(p) + ("decode",) * int(d)
        object.__setattr__(self, "roles", roles)

    @property
    def is_cluster(self) -> bool:
        """Whether any cluster option differs from one plain engine."""
        return self != ClusterConfig()


def conversation_tokens(c) -> int:
    """The most tokens a conversation's last turn can hold (system prompt, every message and answer)."""
    return len(c.system_prompt) + sum(map(len, c.user_turns)) + sum(c.output_lens)


def conversation_sizing(conversations: list) -> list:
    """A stand-in request as long as the longest conversation's last turn can be, to size the default KV cache by
    compare's rule (conversations' turns are made only as the run goes)."""
    from minibatch.request import Request

    longest = max(conversations, key=conversation_tokens)
    return [Request("size", [3] * (conversation_tokens(longest) - longest.output_lens[-1]), longest.output_lens[-1])]


def build_cluster(cfg, ccfg: ClusterConfig, profile, policy: str, sizing: list, acceptance_rate=None) -> Cluster:
    """The policy's engines (one per role in ``ccfg.roles``) on SimClocks of ``profile``, behind a new router.
    ``sizing``: requests whose lengths size the default KV cache (compare's rule)."""
    from minibatch.clock import SimClock
    from minibatch.policies import get_policy, make_engine
    from minibatch.sim.simulator import sim_executor

    from minibatch.scheduler.paged import PagedScheduler

    spec = get_policy(policy)
    if ccfg.disaggregate and (not issubclass(spec.scheduler, PagedScheduler) or spec.proposer):
        raise ValueError(f"{PAGED_POLICIES_ONLY}, without speculative decoding; {policy!r} is not")
    config = cfg.policy_config(policy, sizing)
    engines = [make_engine(policy, sim_executor(policy, acceptance_rate, cfg.seed, max_model_len=profile.max_model_len),
                           SimClock(profile, profile), config=config) for _ in ccfg.roles]
    per_token = ccfg.kv_bytes_per_token
    if per_token is None:
        elements = KV_ELEMENTS_PER_TOKEN.get(profile.model)
        if ccfg.disaggregate and elements is None:
            raise ValueError(f"--kv-bytes-per-token is needed for model {profile.model!r} (KV transfer size)")
        per_token = (elements or 0) * (2 if profile.dtype in ("bfloat16", "float16") else 4)
    link = KVLink(ccfg.kv_link_gbps * 1e9, ccfg.kv_link_latency_us * 1e-6)
    return Cluster(engines, get_router(ccfg.router), roles=list(ccfg.roles), max_outstanding=ccfg.max_outstanding,
                   kv_link=link, kv_bytes_per_token=per_token, max_model_len=ccfg.max_model_len)


def load_imbalance(replicas) -> float | None:
    """Requests routed, max / mean over the replicas of a role; disaggregated, the larger of the prefill and the
    decode replicas' (None: nothing routed)."""
    ratios = []
    for role in dict.fromkeys(rep.role for rep in replicas):
        routed = [rep.routed for rep in replicas if rep.role == role]
        if sum(routed):
            ratios.append(max(routed) / (sum(routed) / len(routed)))
    return round(max(ratios), 3) if ratios else None


# A decode replica's requests arrive with their KV and their first token, made on a prefill replica: timed from
# that arrival, their "TTFT" would be the time to the user's second token and their E2E and goodput not the users';
# their prompt tokens were transferred, not computed there. Its row leaves these out ("overall" has the users').
NOT_THE_USERS = ("ttft_", "e2e_", "num_good_requests", "goodput_req_s", "total_throughput_tok_s")


def cluster_rows(run: ClusterRun, policy: str, slo=None, run_time_s: float = 0.0) -> dict:
    """The run's JSON: "overall" (the users' requests; trace fields over every replica's steps), "replicas" (one
    row per replica: its role, requests routed, summary, prefix cache; a decode replica's without the fields of
    :data:`NOT_THE_USERS`, None there), and the router's own counts."""
    from minibatch.experiment import Run
    from minibatch.metrics import summarize

    replicas = []
    for rep in run.replicas:
        row = {"replica": rep.index, "role": rep.role, "routed": rep.routed}
        mine = [r for r in rep.engine.requests.values()]
        if mine:
            row |= Run(policy, mine, rep.engine, run_time_s, slo).row()
        if rep.role == "decode" and mine:  # its requests came with their first token: see NOT_THE_USERS
            row |= {k: None for k in row if k.startswith(NOT_THE_USERS)}
        replicas.append(row)
    trace = [rec for rep in run.replicas for rec in rep.engine.trace]
    overall = {"policy": policy, **summarize(run.requests, trace, slo).to_dict()}
    # the prompts' lookups: a decode replica's are of KV transferred to it (counted on its prefill replica)
    counts = [rep.engine.scheduler.prefix_cache_counts() for rep in run.replicas if rep.role != "decode"]
    if all(c is not None for c in counts):  # prefix caching on every replica
        queried = sum(q for _, q in counts)
        overall["prefix_cache_hit_rate"] = sum(h for h, _ in counts) / queried if queried else 0.0
    overall |= {"clock": "sim", "run_time_s": round(run_time_s, 3), "num_replicas": len(run.replicas),
                "load_imbalance": load_imbalance(run.replicas)}
    extra = {"num_kv_transfers": run.num_transfers, "kv_transfer_time_s": run.transfer_time_s} if \
        run.num_transfers else {}
    if run.conversations:
        extra |= {"num_conversations": len(run.conversations),
                  "num_truncated_conversations": sum(c.truncated for c in run.conversations)}
    spilled = getattr(run.router, "num_spilled", None)
    return {"overall": overall | extra, "replicas": replicas, "router": run.router.name} | (
        {"router_spilled": spilled} if spilled is not None else {})


def run_cluster_simulation(cfg, ccfg: ClusterConfig, profile_path: str, acceptance_rate=None) -> dict:
    """Each of cfg.policies as a cluster on the workload; prints the overall and per-replica tables; returns (and
    with cfg.json_path writes) the results."""
    from minibatch.cluster.multiturn import make_conversations
    from minibatch.metrics import SLO
    from minibatch.report import environment, print_table, write_json
    from minibatch.sim.cost_model import Profile
    from minibatch.sim.simulator import profile_trace
    from minibatch.trace_io import describe_trace

    profile = Profile.load(profile_path)
    requests, conversations, limit = [], [], profile.max_model_len  # None: a profile that does not record it
    if ccfg.workload == "multiturn" and limit is not None and ccfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {ccfg.max_model_len} exceeds {profile.model}'s max_model_len {limit} "
                         f"(recorded in {profile_path}): give --max-model-len <= {limit}")
    if ccfg.workload == "multiturn":
        conversations = make_conversations(ccfg.conversations, rate_per_s=cfg.rate, think_time_s=ccfg.think_time_s,
                                           max_turns=ccfg.max_turns, max_user_len=cfg.max_prompt_len,
                                           max_output_len=cfg.max_output_len, output_scale=cfg.output_scale,
                                           system_prompt_len=ccfg.system_prompt_len, seed=cfg.seed,
                                           vocab_size=profile.vocab_size or 49152)
        if all(c.fresh().next_request(c.start_time_s, ccfg.max_model_len) is None for c in conversations):
            raise ValueError("every conversation ends before its first turn: its system prompt (--system-prompt-len), "
                             f"message and answer are longer than --max-model-len ({ccfg.max_model_len})")
        sizing = conversation_sizing(conversations)
        print(f"workload: {len(conversations)} conversations, {sum(c.num_turns for c in conversations)} turns")
    else:
        requests = sizing = profile_trace(cfg, profile)
        print(f"trace: {describe_trace(requests)}")
    kinds = ' + '.join(f"{ccfg.roles.count(r)}{'' if r == 'both' else ' ' + r}" for r in dict.fromkeys(ccfg.roles))
    print(f"cluster: {kinds} replicas, "
          f"router {ccfg.router}" + (f", at most {ccfg.max_outstanding} outstanding per replica"
                                      if ccfg.max_outstanding else ""))
    slo = SLO(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s)
    results = {}
    clusters = {p: build_cluster(cfg, ccfg, profile, p, sizing, acceptance_rate) for p in cfg.policies}  # all
    for policy, cluster in clusters.items():  # checked (policy, router, roles) before any runs
        t0 = time.perf_counter()
        run = cluster.run(requests, [c.fresh() for c in conversations])
        results[policy] = cluster_rows(run, policy, slo, time.perf_counter() - t0)
    table = {"policies": {}}
    for policy, res in results.items():
        table["policies"][policy] = res["overall"]
        for row in res["replicas"]:
            if row.get("policy"):
                table["policies"][f"  {row['role'][0]}{row['replica']} ({row['routed']} req)"] = row
    print_table(table)
    for policy, res in results.items():
        hit = res["overall"].get("prefix_cache_hit_rate")
        print(f"{policy}: load imbalance (max / mean requests routed) {res['overall']['load_imbalance']}"
              + ("" if hit is None else f", prefix cache hit rate {hit:.1%}")
              + (f", {res['overall']['num_kv_transfers']} KV transfers" if "num_kv_transfers" in res["overall"]
                 else ""))
    result = {"command": cfg.command, "environment": environment(), "profile": str(profile_path),
              "model": profile.model, "cluster": asdict(ccfg) | {"replicas": len(ccfg.roles)},  # (--disaggregate's too)
              "config": asdict(cfg) | {"policies": list(cfg.policies)}, "policies": results}
    write_json(result, cfg.json_path)
    return result


def simulate_command(args, cfg) -> dict:
    """``python -m minibatch simulate``: :func:`simulate` with the cluster options of ``args``."""
    from dataclasses import fields

    from minibatch.config import changed_fields

    cluster = ClusterConfig(**{f.name: getattr(args, f.name) for f in fields(ClusterConfig) if f.metadata.get("cli")})
    # options that a command line gives for nothing (a sweep's grid may still pair them, e.g. replicas [1, 2, 4])
    if changed_fields(cluster, ("router",)) and len(set(cluster.roles)) == len(cluster.roles):  # one of each role
        raise ValueError(f"--router {cluster.router} picks among replicas: it needs --replicas 2 or more (or "
                         "--disaggregate P:D with P or D above 1)")
    if changed_fields(cluster, ("think_time_s",)) and cluster.max_turns == 1:
        raise ValueError("--think-time-s is the pause before a conversation's next turn: it needs --max-turns 2 or "
                         "more")
    return simulate(cfg, cluster, args.acceptance_rate)


def simulate(cfg, cluster: ClusterConfig, acceptance_rate: str | None = None) -> dict:
    """One engine per policy (``sim.simulator.run_simulation``), or a cluster when a cluster option is given.
    acceptance_rate: the spec policies' rate(s) as the command line writes them ("0.7" or "0.6,0.3").

    Raises:
        ValueError: no profile, a bad profile or acceptance rate, a bad cluster option (each named)."""
    from minibatch.config import changed_fields, opt
    from minibatch.policies import POLICIES, get_policy
    from minibatch.sim.cost_model import Profile
    from minibatch.sim.simulator import parse_acceptance_rate, run_simulation
    from minibatch.spec.speculator import SpecConfig

    acceptance = parse_acceptance_rate(acceptance_rate)
    speculative = any(p in POLICIES and get_policy(p).proposer for p in cfg.policies)  # (others refused later)
    if acceptance is not None and not speculative:
        raise ValueError("--acceptance-rate applies only to the speculative policies (spec, spec_ngram)")
    k = cfg.settings.get("num_speculative_tokens", SpecConfig.num_speculative_tokens)
    if isinstance(acceptance, list) and len(acceptance) > k:  # positions past k are never drafted
        raise ValueError(f"--acceptance-rate gives {len(acceptance)} per-position rates, more than the {k} draft "
                         "positions (--num-speculative-tokens)")
    if cluster.workload == "multiturn" and (given := changed_fields(cfg, ("trace", "num_requests", "arrival",
                                                                            "long_prompts", "long_prompt_len"))):
        raise ValueError(f"{opt(given[0])} does not apply with --workload multiturn (--conversations, --rate, "
                         "--max-prompt-len, --max-output-len and --output-scale shape it)")
    if cfg.trace is not None and not speculative and changed_fields(cfg, ("seed",)):
        raise ValueError("--seed with --trace seeds only the speculative policies' simulated acceptance draws (spec, "
                         "spec_ngram), and none is selected")
    if cfg.profile is None:
        raise ValueError("--profile is required: a calibrated cost model (python -m minibatch calibrate)")
    Profile.load(cfg.profile)  # a bad profile is reported before the run
    if cluster.is_cluster:
        if cfg.trace_out:  # schedules are drawn per engine, not per cluster
            raise ValueError("--trace-out applies to a single engine, not to a cluster (--replicas, --disaggregate, "
                             "--workload multiturn)")
        return run_cluster_simulation(cfg, cluster, cfg.profile, acceptance)
    return run_simulation(cfg, cfg.profile, acceptance)
