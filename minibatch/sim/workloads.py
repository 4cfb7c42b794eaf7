"""The calibration workloads (``python -m minibatch calibrate``): which steps are measured to fit the simulator's
cost model. :data:`FULL` covers the grid the fit needs (Vidur §4 profiles the same axes per operator):

* decode batches of 1..64 requests at short and long context (batch size, context read),
* whole prefills of one or many prompts (prefill tokens, up to ~2k tokens in a step), and many
  short prompts in one step (rows of a few tokens, each its own attention call),
* speculative verify steps (n-gram lookup on repeating prompts: 1 + k tokens per row),
* chunked prefill mixed with decodes on a Poisson trace with ShareGPT lengths (mixed steps),
* static batches of 1..32 padded requests, up to 64 decode steps (the padded layout).

:data:`QUICK` (``calibrate --quick``) keeps every axis at fewer sizes and steps. None of these is a validation
trace: ``benchmarks/validate_sim.py`` checks the fit on traces made with other seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minibatch.request import Request, SamplingParams

GREEDY = SamplingParams(ignore_eos=True)


@dataclass
class Scenario:
    """One calibration workload: ``policy`` (a make_engine name) over ``requests``."""

    name: str
    policy: str
    requests: list[Request]
    kwargs: dict

    @property
    def layout(self) -> str:
        from minibatch.policies import get_policy

        return get_policy(self.policy).layout


def _requests(name: str, lengths: list[tuple[int, int]], rng: np.random.Generator, vocab_size: int,
              spacing_s: float = 0.0) -> list[Request]:
    return [Request(f"{name}-{i:03d}", rng.integers(3, vocab_size, size=p).tolist(), o, GREEDY,
                    arrival_time_s=i * spacing_s) for i, (p, o) in enumerate(lengths)]


@dataclass(frozen=True)
class Grid:
    """Which sizes the calibration workloads cover (:data:`FULL`, or :data:`QUICK` for ``calibrate --quick``)."""

    decode_batches: tuple = (1, 2, 4, 8, 16, 32, 64)
    decode_steps: int = 10
    long_batches: tuple = (1, 4, 8)
    short_rows: tuple = (4, 16, 32)
    verify: tuple = ((1, 24), (4, 24), (16, 24), (32, 24), (4, 256), (16, 128))
    prefill_lens: tuple = (3, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
    groups: tuple = ((2, 128), (4, 64), (8, 32), (2, 384), (4, 192), (3, 256), (6, 96))
    chunked_requests: int = 24
    chunked_budgets: tuple = (96, 512)
    static_batches: tuple = (1, 2, 4, 8, 16, 32)
    static_batches_each: int = 3
    static_max_steps: int = 64
    static_long: bool = True  # a batch of 4 padded to one 768-token prompt
    draft: tuple = ((1, 24), (4, 24), (16, 24), (32, 24), (1, 300), (8, 200))


FULL = Grid()
# Every axis at fewer sizes and steps (about a quarter of FULL's measuring time): each layout's terms still see small
# and large values (benchmarks/validate_sim.py --resimulate --profile compares the two fits on held-out traces).
QUICK = Grid(decode_batches=(1, 4, 16, 64), decode_steps=5, long_batches=(1, 8), short_rows=(4, 32),
             verify=((1, 24), (16, 24), (4, 256)), prefill_lens=(8, 64, 256, 1024),
             groups=((4, 64), (2, 384), (6, 96)), chunked_requests=6, chunked_budgets=(192,),
             static_batches=(1, 4, 16), static_batches_each=2, static_max_steps=24, static_long=False,
             draft=((1, 24), (16, 24), (1, 300), (8, 200)))


def scenarios(vocab_size: int, scale: float = 1.0, seed: int = 1234, grid: Grid = FULL) -> list[Scenario]:
    """The calibration workloads over ``grid``'s sizes. scale < 1 shrinks batch sizes and lengths (tests, tiny
    models)."""
    from minibatch.workload import make_trace

    rng = np.random.default_rng(seed)

    def s(x: int) -> int:
        return max(1, round(x * scale))

    big = dict(max_num_seqs=128, n_slots=1 << 16)
    out = []
    for b in sorted({s(b) for b in grid.decode_batches}):  # decode batches, short context
        out.append(Scenario(f"decode-b{b}", "paged", _requests(f"d{b}", [(s(24), grid.decode_steps)] * b, rng,
                                                               vocab_size), big))
    for b in sorted({s(b) for b in grid.long_batches}):  # long context (and big multi-prompt prefills)
        out.append(Scenario(f"long-b{b}", "paged", _requests(f"l{b}", [(s(320), 6)] * b, rng, vocab_size), big))
    for b in sorted({s(b) for b in grid.short_rows}):  # many short multi-token rows in one step
        out.append(Scenario(f"short-rows-b{b}", "paged", _requests(f"r{b}", [(5, 3)] * b, rng, vocab_size), big))
    for b, p in sorted({(s(b), s(p)) for b, p in grid.verify}):
        # speculative verify steps (1 + k tokens per row): n-gram lookup on a repeating prompt always finds drafts
        pattern = rng.integers(3, vocab_size, size=8).tolist()
        reqs = [Request(f"v{b}-{p}-{i:03d}", (pattern * (p // 8 + 1))[:p], 12, GREEDY) for i in range(b)]
        out.append(Scenario(f"verify-b{b}-p{p}", "spec_ngram", reqs, dict(big, num_speculative_tokens=4)))
    prefills = [(s(p), 2) for p in grid.prefill_lens]
    out.append(Scenario("prefill", "paged", _requests("p", prefills, rng, vocab_size, spacing_s=1e6), big))  # alone
    # B prompts of P tokens together
    reqs = [Request(f"g{b}x{p}-{i}", rng.integers(3, vocab_size, size=s(p)).tolist(), 2, GREEDY, arrival_time_s=1e6 * g)
            for g, (b, p) in enumerate(grid.groups) for i in range(s(b))]
    out.append(Scenario("group-prefill", "paged", reqs, big))
    mixed = make_trace(s(grid.chunked_requests), rate_per_s=4.0, max_prompt_len=s(256), max_output_len=s(256),
                       output_scale=0.25 * scale,
                       vocab_size=vocab_size, seed=seed)
    for budget in grid.chunked_budgets:  # chunked prefill: chunks mixed with decodes
        reqs = [Request(f"c{budget}-{r.request_id}", r.prompt_token_ids, r.max_new_tokens, GREEDY,
                        arrival_time_s=r.arrival_time_s) for r in mixed]
        out.append(Scenario(f"chunked-{budget}", "chunked", reqs, dict(big, max_num_batched_tokens=s(budget))))
    static_sizes = sorted({s(b) for b in grid.static_batches})
    for b in static_sizes:  # static: padded (B, T) batches, long decodes
        n = b if b == static_sizes[-1] else grid.static_batches_each * b  # a few batches each, one of the largest
        lengths = [(int(rng.integers(s(16), s(256) + 1)), int(rng.integers(4, max(4, s(grid.static_max_steps)) + 1)))
                   for _ in range(n)]
        out.append(Scenario(f"static-b{b}", "static", _requests(f"s{b}", lengths, rng, vocab_size),
                            dict(batch_size=b, max_wait_s=0.0)))
    if grid.static_long:
        lengths = [(s(768), 24), (s(64), 24), (s(128), 8), (s(32), 16)]  # one long prompt pads the whole batch
        out.append(Scenario("static-long-b4", "static", _requests("sl", lengths, rng, vocab_size),
                            dict(batch_size=4, max_wait_s=0.0)))
    return out


def draft_scenarios(vocab_size: int, scale: float = 1.0, seed: int = 4321, grid: Grid = FULL) -> list[Scenario]:
    """Speculative decoding with a draft model (k = 4) at batch 1..32, short and long prompts:
    the draft's forwards (its prompt catch-up included) are what these measure."""
    rng = np.random.default_rng(seed)
    out = []
    for b, p in grid.draft:
        b, p = max(1, round(b * scale)), max(2, round(p * scale))
        out.append(Scenario(f"draft-b{b}-p{p}", "spec", _requests(f"dr{b}-{p}", [(p, 16)] * b, rng, vocab_size),
                            dict(max_num_seqs=128, n_slots=1 << 16, num_speculative_tokens=4)))
    return out
