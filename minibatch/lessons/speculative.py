"""Measurements and pictures for notebook 06 (speculative decoding) and ``benchmarks/spec_decode.py``.

Leviathan et al. 2023 / Chen et al. 2023: a cheap draft proposes k tokens, the target checks all
of them in ONE forward (k+1 positions), and the rejection sampler keeps a prefix so the output
follows the target's distribution exactly. It pays when a target forward over k+1 tokens costs
little more than over one (decode is memory-bound) and the draft is cheap and often right. The
machinery is ``minibatch/spec``; this module runs it and returns plain dicts (JSON-ready):

* :func:`spec_sequences` / :func:`chi_square_pvalue` / :func:`plot_distribution`: the
  distribution test on a random bigram "model" (any sampler function);
* :func:`plot_spec_timeline`: draft and verify phases of every step, accepted vs rejected tokens;
* :func:`run_spec` / :func:`k_sweep`: one policy or a sweep of k on real models, with stats;
* :func:`batch_sweep_sim`: speedup vs batch size on the simulated clock (where it crosses 1);
* :func:`check_rejection_sampler`: the notebook's exercise check.

Times are seconds (``_s``) on the engine clock (SimClock or WallClock).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import numpy as np
import torch

from minibatch.engine import Engine, StepRecord
from minibatch.metrics import summarize
from minibatch.request import Request, SamplingParams
from minibatch.spec import AdaptiveK, DraftModelProposer, FixedK, NgramProposer, SpeculativeRunner
from minibatch.scheduler import PagedScheduler

# Published claims, at their scale: Leviathan et al. 2-3x on T5-XXL (11B) with a T5-small draft;
# Chen et al. 2-2.5x on Chinchilla 70B with a 4B draft -- both at batch size 1 on accelerators.
SEED_CLAIMS = {"leviathan_t5xxl_speedup": (2.0, 3.0), "chen_chinchilla_speedup": (2.0, 2.5)}


# Input-grounded prompts (our own words): the answer copies spans of the prompt, where n-gram
# prompt lookup shines.
GROUNDED_PROMPTS = (
    "Rewrite the following paragraph, replacing every 'car' with 'bicycle' and changing nothing else:\n\n"
    "The car was parked outside the bakery. Every morning the owner of the car bought two loaves of bread, "
    "put them on the back seat of the car, and drove to the station. People in the town said the car was "
    "older than the station itself.",
    "Fix the bug in this function and return the whole corrected function:\n\n"
    "def average(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
    "    return total / len(numbers) if numbers else total / 0\n",
    "Extract every name and age from this text as a list of 'name: age' lines:\n\n"
    "Anna is 34 and lives with Ben, who is 36. Their neighbours are Carla, 71, and her grandson David, 12. "
    "Ben's sister Emma is 29.",
)


# ---------------------------------------------------------------------- 1. exactness
def bigram_models(V: int = 6, seed: int = 0, concentration: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q): a random bigram target and draft over V tokens; row P[prev] is the next-token distribution."""
    with torch.random.fork_rng(devices=[]):  # seeded locally: the caller's RNG stream is untouched
        torch.manual_seed(seed)
        dirichlet = torch.distributions.Dirichlet(torch.full((V,), concentration))
        return dirichlet.sample((V,)), dirichlet.sample((V,))


def spec_sequences(sampler: Callable, n: int = 20_000, V: int = 6, length: int = 3, k: int = 3,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sample n sequences of ``length`` tokens after token 0 from the bigram target P by speculative
    decoding with the bigram draft Q (k drafts per round, ``sampler`` accepts them). Returns
    (observed counts, expected counts under P) over the V**length sequences, in
    ``itertools.product`` order."""
    P, Q = bigram_models(V, seed)
    g = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros(V ** length)
    for _ in range(n):
        seq = [0]
        while len(seq) < length + 1:
            drafts, prev = [], seq[-1]
            for _ in range(k):
                prev = int(torch.multinomial(Q[prev], 1, generator=g))
                drafts.append(prev)
            rows = [seq[-1]] + drafts
            seq += sampler(P[rows], drafts, Q[rows[:-1]], g)
        counts[np.ravel_multi_index(seq[1:length + 1], (V,) * length)] += 1
    expected = [math.prod(float(P[a, b]) for a, b in zip((0,) + s, s)) for s in itertools.product(range(V), repeat=length)]
    return counts, np.array(expected) * n


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit, pooling cells with expected count < min_expected."""
    from scipy.stats import chi2

    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return float(chi2.sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1))


def first_token_histograms(samplers: dict[str, Callable], n: int = 20_000, V: int = 6, seed: int = 0) -> dict:
    """For each sampler: the first token's empirical distribution and the 3-token chi-square
    p-value; plus the target's P[0] and the draft's Q[0]."""
    P, Q = bigram_models(V, seed)
    out = {"target": P[0].tolist(), "draft": Q[0].tolist(), "samplers": {}}
    for name, fn in samplers.items():
        counts, expected = spec_sequences(fn, n, V, seed=seed)
        first = counts.reshape(V, -1).sum(1) / n
        out["samplers"][name] = {"first_token": first.tolist(), "p_value": chi_square_pvalue(counts, expected)}
    return out


def plot_distribution(hist: dict, ax=None, title: str | None = None):
    """Bars: the target's next-token distribution, the draft's, and what each sampler produced."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
    V = len(hist["target"])
    series = [("target p", hist["target"], "#000000"), ("draft q", hist["draft"], "#BBBBBB")] + [
        (f"{name} (chi-square p = {v['p_value']:.2g})", v["first_token"], c)
        for (name, v), c in zip(hist["samplers"].items(), ("#009E73", "#D55E00", "#0072B2"))]
    w = 0.8 / len(series)
    for i, (label, ys, color) in enumerate(series):
        ax.bar(np.arange(V) + (i - (len(series) - 1) / 2) * w, ys, w, label=label, color=color)
    ax.set_xlabel("first token")
    ax.set_ylabel("probability")
    ax.set_xticks(range(V))
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def check_rejection_sampler(fn: Callable, n: int = 20_000, seed: int = 3) -> float:
    """The exercise check: ``fn(target_probs, draft_tokens, draft_probs, generator)`` must emit
    tokens distributed exactly as the target (chi-square p > 1e-3 over n sequences). Returns p.

    Raises:
        AssertionError: the distribution is off, or fn returns something other than 1..k+1 ints.
    """
    counts, expected = spec_sequences(_checked(fn), n, seed=seed)
    p = chi_square_pvalue(counts, expected)
    assert p > 1e-3, f"the emitted tokens do not follow the target (chi-square p = {p:.2g})"
    return p


def _checked(fn: Callable) -> Callable:
    def wrapped(p, drafts, q, g):
        out = fn(p, drafts, q, g)
        assert isinstance(out, list) and 1 <= len(out) <= len(drafts) + 1, f"must return 1..k+1 tokens, got {out!r}"
        return [int(t) for t in out]

    return wrapped


# ---------------------------------------------------------------------- 2. the timeline
def plot_spec_timeline(trace: list[StepRecord], request_id: str, ax=None, max_steps: int | None = None,
                       title: str | None = None):
    """One request's steps on the time axis: each step's draft phase (grey) then its verify
    forward (blue); above it, one square per draft token, green if accepted, red if rejected,
    and the extra token every verification emits (dark). Returns the Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6), layout="constrained")
    steps = [(rec, e) for rec in trace for e in rec.entries if e.request_id == request_id]
    steps = steps[:max_steps] if max_steps else steps
    for rec, e in steps:
        d = rec.draft_time_s if e.num_spec_tokens else 0.0
        ax.broken_barh([(rec.start_s, d)], (0, 0.8), color="#999999")
        ax.broken_barh([(rec.start_s + d, rec.duration_s - d)], (0, 0.8),
                       color="#E69F00" if e.phase == "prefill" else "#56B4E9")
        slot = rec.duration_s / max(e.num_spec_tokens + 1, 1)
        for i in range(e.num_spec_tokens):
            ax.broken_barh([(rec.start_s + i * slot, slot * 0.9)], (1.0, 0.6),
                           color="#009E73" if i < e.num_accepted_tokens else "#D55E00")
        if e.sampled:
            i = e.num_accepted_tokens if e.num_spec_tokens else 0
            ax.broken_barh([(rec.start_s + i * slot, slot * 0.9)], (1.0, 0.6), color="#000000")
    ax.set_yticks([0.4, 1.3], ["forward", "tokens"])
    ax.set_xlabel("time (s)")
    ax.legend(handles=[Patch(color="#999999", label="draft (k steps of the draft model)"),
                       Patch(color="#56B4E9", label="verify (one target forward, k+1 tokens)"),
                       Patch(color="#E69F00", label="prefill"),
                       Patch(color="#009E73", label="draft token accepted"),
                       Patch(color="#D55E00", label="draft token rejected"),
                       Patch(color="#000000", label="target's token (bonus or correction)")],
              fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, -0.35))
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ---------------------------------------------------------------------- 3. running on real models
def make_spec_engine(target_runner, proposer=None, speculator=None, clock=None, *, max_num_seqs: int = 1,
                     num_blocks: int = 512, block_size: int = 16) -> Engine:
    """A paged engine; with a proposer, speculative (SpeculativeRunner over target_runner)."""
    lookahead = 0
    if proposer is None:
        executor = target_runner
    else:
        executor = SpeculativeRunner(target_runner, proposer, speculator)
        lookahead = executor.speculator.max_k if proposer.writes_kv else 0  # the draft's KV slots
    sched = PagedScheduler(max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=block_size,
                           num_lookahead_tokens=lookahead)
    executor.allocate_kv_cache(num_blocks, block_size)
    return Engine(sched, executor, clock)


def run_spec(name: str, requests: list[Request], target_runner, clock, proposer=None, speculator=None,
             max_num_seqs: int = 1, num_blocks: int = 512) -> tuple[dict, list[Request], Engine]:
    """Run fresh copies of ``requests``; returns (metrics row, requests, engine). The row has
    output throughput, TPOT, decode throughput (output tokens after the first per second of
    decoding) and, when speculating, the SpecDecodingStats."""
    reqs = [r.copy() for r in requests]
    engine = make_spec_engine(target_runner, proposer, speculator, clock, max_num_seqs=max_num_seqs, num_blocks=num_blocks)
    engine.generate(reqs)
    s = summarize(reqs, engine.trace)
    decode_s = sum(r.token_times_s[-1] - r.token_times_s[0] for r in reqs)
    row = {"run": name, "clock": engine.clock.kind, "max_num_seqs": max_num_seqs, "num_requests": len(reqs),
           "num_output_tokens": sum(r.num_output_tokens for r in reqs),
           "output_throughput_tok_s": s.output_throughput_tok_s,
           "decode_throughput_tok_s": sum(r.num_output_tokens - 1 for r in reqs) / decode_s if decode_s else None,
           "tpot_p50_s": s.tpot_p50_s, "ttft_p50_s": s.ttft_p50_s, "duration_s": s.duration_s, "num_steps": s.num_steps}
    stats = getattr(engine.executor, "stats", None)
    if proposer is not None and stats is not None:
        row["spec"] = stats.as_dict()
        row["k"] = repr(engine.executor.speculator)
    return row, reqs, engine


def k_sweep(requests: list[Request], target_runner, draft_runner, clock_factory: Callable, ks=(1, 2, 3, 4, 6),
            max_num_seqs: int = 1, adaptive_max_k: int | None = 6, ngram: bool = True,
            verify_cost_ratio: float = 1.0) -> tuple[list[dict], bool]:
    """No speculation, the draft at each fixed k, AdaptiveK (up to adaptive_max_k, told that a
    verify forward costs ``verify_cost_ratio`` decodes) and n-gram lookup, on the same requests.
    Returns (rows, every run produced the same tokens)."""
    rows, outputs = [], []
    base, reqs, _ = run_spec("no speculation", requests, target_runner, clock_factory(), max_num_seqs=max_num_seqs)
    rows.append(base)
    outputs.append([r.output_token_ids for r in reqs])
    runs = [(f"draft k={k}", lambda: DraftModelProposer(draft_runner), lambda k=k: FixedK(k)) for k in ks]
    if adaptive_max_k:
        runs.append((f"draft adaptive k<={adaptive_max_k}", lambda: DraftModelProposer(draft_runner),
                     lambda: AdaptiveK(max_k=adaptive_max_k, verify_cost_ratio=verify_cost_ratio)))
    if ngram:
        runs.append(("n-gram k=4", NgramProposer, lambda: FixedK(4)))
    for name, proposer, speculator in runs:
        row, reqs, _ = run_spec(name, requests, target_runner, clock_factory(), proposer(), speculator(), max_num_seqs=max_num_seqs)
        row["speedup"] = row["output_throughput_tok_s"] / base["output_throughput_tok_s"]
        row["decode_speedup"] = row["decode_throughput_tok_s"] / base["decode_throughput_tok_s"]
        rows.append(row)
        outputs.append([r.output_token_ids for r in reqs])
    return rows, all(o == outputs[0] for o in outputs)


def sim_verify_cost_ratio(k: int = 4, context: int = 128, cost_model=None) -> float:
    """The simulated clock's verify-vs-decode step time at batch 1 (k+1 vs 1 new tokens)."""
    from minibatch.clock import CostModel

    cm = cost_model or CostModel()
    return cm.forward_time_s(1, k + 1, context + k + 1) / cm.forward_time_s(1, 1, context + 1)


def print_rows(rows: list[dict]) -> None:
    """The k-sweep table: throughput, decode speedup, acceptance rate, mean acceptance length."""
    print(f"{'run':<24}{'out tok/s':>10}{'TPOT p50 ms':>12}{'decode x':>9}{'accept':>8}{'mean len':>9}")
    for r in rows:
        sp = r.get("spec", {})
        print(f"{r['run']:<24}{r['output_throughput_tok_s']:>10.1f}{r['tpot_p50_s'] * 1e3:>12.1f}"
              f"{r.get('decode_speedup', 1.0):>9.2f}{sp.get('acceptance_rate', float('nan')):>8.1%}"
              f"{sp.get('mean_acceptance_length', float('nan')):>9.2f}")


def predicted_speedup(alpha: float, k: int, verify_cost_ratio: float, draft_cost_ratio: float) -> float:
    """Batch-1 speedup over plain decoding: E[tokens](alpha, k) / (v + c k), in decode-step units."""
    from minibatch.spec import expected_tokens

    return expected_tokens(alpha, k) / (verify_cost_ratio + draft_cost_ratio * k) if k else 1.0


def break_even_alpha(k: int, verify_cost_ratio: float, draft_cost_ratio: float, target: float = 1.0) -> float:
    """The acceptance rate at which ``predicted_speedup`` reaches ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, k, verify_cost_ratio, draft_cost_ratio) < target else (lo, mid)
    return hi


def plot_speedup_vs_alpha(verify_cost_ratio: float, draft_cost_ratio: float, ks=(1, 2, 4, 6), ax=None,
                          measured: list[tuple[float, float, str]] = (), title: str | None = None):
    """Predicted batch-1 speedup against the acceptance rate for each k, for this machine's v and
    c; ``measured`` (alpha, speedup, label) points on top. Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    alphas = np.linspace(0, 0.98, 50)
    for k in ks:
        ax.plot(alphas, [predicted_speedup(a, k, verify_cost_ratio, draft_cost_ratio) for a in alphas], label=f"k={k}")
    for a, sp, label in measured:
        ax.plot(a, sp, "k*", ms=10)
        ax.annotate(label, (a, sp), xytext=(5, -12), textcoords="offset points", fontsize=8)
    return _speedup_axes(ax, "acceptance rate (alpha)", title)


def _speedup_axes(ax, xlabel: str, title: str | None):
    """The speedup plots' common finish: the no-gain line at 1, labels, legend, title."""
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ---------------------------------------------------------------------- 4. batch size (simulated)
def batch_sweep_sim(acceptance_rate: float = 0.7, ks=(2, 4), batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                    prompt_len: int = 64, output_len: int = 128, cost_model=None, draft_cost_model=None) -> list[dict]:
    """Speedup of speculative decoding over plain decoding vs batch size, on the simulated clock
    (SimExecutor: drafts accepted i.i.d. with ``acceptance_rate``). A larger batch makes each
    step compute-bound: verifying k+1 tokens per request then costs ~k+1 times a decode, so the
    speedup falls and crosses 1. Rows: {batch_size, k, speedup, plain_s, spec_s}."""
    from minibatch.sim.executor import SimExecutor
    from minibatch.clock import SimClock

    rows = []
    for B in batch_sizes:
        reqs = [Request(f"r{i}", [5 + i] * prompt_len, output_len, SamplingParams(ignore_eos=True)) for i in range(B)]
        times = {}
        for k in (0, *ks):
            ex = SimExecutor(acceptance_rate=acceptance_rate, seed=B, speculator=FixedK(k) if k else None)
            sched = PagedScheduler(max_num_seqs=B, num_blocks=B * (prompt_len + output_len) // 16 + 16,
                                   num_lookahead_tokens=k)
            engine = Engine(sched, ex, SimClock(cost_model, draft_cost_model))
            engine.generate([r.copy() for r in reqs])
            times[k] = engine.clock.now_s
        rows += [{"batch_size": B, "k": k, "speedup": times[0] / times[k], "plain_s": times[0], "spec_s": times[k]}
                 for k in ks]
    return rows


def plot_speedup_vs_batch(rows: list[dict], ax=None, measured: list[dict] | None = None, title: str | None = None):
    """Speedup vs batch size, one line per k; the dashed line is 1 (no gain). ``measured`` rows
    ({batch_size, speedup, label}) are drawn as points."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
    for k in sorted({r["k"] for r in rows}):
        pts = [(r["batch_size"], r["speedup"]) for r in rows if r["k"] == k]
        ax.plot(*zip(*pts), "o-", label=f"simulated, k={k}")
    for m in measured or []:
        ax.plot(m["batch_size"], m["speedup"], "k*", ms=10)
    if measured:
        ax.plot([], [], "k*", label=measured[0].get("label", "measured"))
    ax.set_xscale("log", base=2)
    return _speedup_axes(ax, "batch size (requests decoding together)", title)
