"""Requests: what a client asks for (prompt, sampling) and the engine-side state.

The state follows vLLM's unifying idea (Kwon et al., SOSP'23; vLLM v1 scheduler): each request
has ``num_computed_tokens`` (tokens whose KV is in the cache); a step gives it ``num_new_tokens``.
A prefill is many new tokens, a decode is one. The engine only *stamps events* on a request
(arrival, first scheduled, each token, finish); ``minibatch.metrics`` turns them into TTFT, TPOT,
ITL and E2E.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MAX_PRIORITY = 2**31 - 1  # |priority|: aging adds seconds / aging_s to it as a float
MAX_LOGPROBS = 20  # most top logprobs per output token (OpenAI's top_logprobs and vLLM's default limit)
MAX_ARRIVAL_S = 1e9  # ~31 years: past that, float seconds lose the step times' precision


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # arrived (or not yet), no KV in the cache
    RUNNING = "running"  # admitted: holds KV slots, scheduled every step
    PREEMPTED = "preempted"  # lost its KV (recompute preemption): waits to be computed again
    SWAPPED = "swapped"  # its KV was copied to CPU memory (swap preemption): waits to come back
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    temperature == 0 is greedy (argmax). Otherwise logits / temperature, then top-k (0 = off),
    then top-p nucleus filtering (1.0 = off), then a draw from the request's own
    ``torch.Generator`` seeded with ``seed``, one draw per output token. A seeded request gets the
    same tokens whatever batch it runs in, under every non-speculative policy (with or without
    preemption) and under ``spec_ngram`` whatever k (n-gram drafts are checked against the
    target's own draws), up to the float rounding of the logits. Under ``spec`` (a draft model)
    the tokens depend on the schedule -- k, which positions were verified against drafts,
    preemptions -- because the rejection sampler draws differently from a plain decode; a run is
    still reproducible and its tokens follow exactly the target's distribution
    (``minibatch.spec.rejection_sampler``).
    ``ignore_eos`` makes a request run to exactly ``max_new_tokens`` (as vLLM's benchmarks do,
    so every policy does the same work on a trace).
    ``logprobs`` (vLLM's name): also record, for every output token, the log probabilities of the
    ``logprobs`` most likely tokens and of the sampled one, under the model's raw distribution
    (log_softmax in float32 of the logits before temperature, top-k and top-p), in
    ``Request.logprobs``; None (default): none. In [0, 20].
    ``stop_token_ids`` (vLLM's extension): more token ids that finish a request (finish_reason "stop",
    the token kept in the output, as EOS is), whatever ``ignore_eos``; ids in [0, 2**31), a repeated one kept once.
    ``min_tokens`` (vLLM's extension): the first ``min_tokens`` output tokens cannot be EOS or a stop
    token id (their logits are set to -inf before sampling, as vLLM's min-tokens logits processor does),
    so a request runs at least that long; <= the request's max_new_tokens; speculative policies refuse it.

    temperature is 0 or in [1e-5, 100] (below 1e-5, logits / temperature overflow float32; ask
    for 0, greedy, instead).

    Raises:
        TypeError: a field of the wrong type (a bool or str where a number is wanted).
        ValueError: a field out of range (the message names the field and its allowed range).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self):
        from minibatch.checks import FieldTypeError, check_int, check_real

        temperature = check_real(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        if 0 < temperature < MIN_TEMPERATURE:  # logits / 1e-40 overflow float32
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                             f"got {self.temperature!r}")
        values = dict(temperature=temperature, top_k=check_int(self.top_k, "top_k (0 = off)", 0),
                      top_p=check_real(self.top_p, "top_p", 0.0, 1.0, low_open=True),
                      seed=None if self.seed is None else check_int(self.seed, "seed", 0, 2**63 - 1),
                      logprobs=None if self.logprobs is None else check_int(self.logprobs, "logprobs", 0, MAX_LOGPROBS))
        if not isinstance(self.ignore_eos, bool):
            raise FieldTypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise FieldTypeError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        values["stop_token_ids"] = tuple(dict.fromkeys(  # each id once, in order: every output token is checked
            check_int(t, "stop_token_ids[]", 0, 2**31 - 1) for t in self.stop_token_ids))
        values["min_tokens"] = check_int(self.min_tokens, "min_tokens", 0)
        for name, value in values.items():  # plain Python numbers from here on (numpy, 0-d tensors in)
            object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One generation request and its engine-side state.

    Args:
        request_id: unique name.
        prompt_token_ids: the prompt, token ids (length >= 1).
        max_new_tokens: output length cap (>= 1); finish_reason "length" when reached.
        sampling: a :class:`SamplingParams`.
        arrival_time_s: when the request reaches the server, seconds from the trace start (>= 0).
            The engine never schedules a request before this time.
        prompt_text: optional text of the prompt, for demos.
        parent_request_id: parallel sampling (vLLM's ``n > 1``): this request samples another
            continuation of the parent's (identical) prompt. The paged scheduler then forks the
            parent's KV blocks (copy-on-write; Kwon et al., SOSP'23 §4.4) instead of computing the prompt again.
        priority: for the ``priority`` queue policy: lower is served first (vLLM's convention);
            any int, default 0.
        num_speculative_tokens: speculative decoding: this request's k, overriding the
            engine's choice (0: never speculate); None (default): the engine decides.
        num_external_computed_tokens: KV of the first this-many prompt tokens arrives from elsewhere
            (disaggregated serving, DistServe OSDI'24 and Splitwise ISCA'24: a prefill replica computed it;
            vLLM's KV connector calls them external computed tokens): the paged schedulers give it blocks
            without computing it. In [0, len(prompt_token_ids)); a recompute preemption loses it (the prompt is
            computed again).

    Raises:
        TypeError: a field of the wrong type: request_id not a str, token ids that are not ints
            (floats, bools, strings, nested lists), a float max_new_tokens, a non-int priority, a
            ``sampling`` that is not a SamplingParams (FieldTypeError, a TypeError).
        ValueError: a field out of range: an empty prompt or an id < 0, max_new_tokens outside
            [1, 2**20], arrival_time_s outside [0, 1e9], priority outside [-(2**31 - 1), 2**31 - 1],
            num_speculative_tokens outside [0, 64], sampling.min_tokens > max_new_tokens,
            num_external_computed_tokens outside [0, len(prompt_token_ids)). Ids >= the model's vocab_size are
            refused by ``Engine.add_request``.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time_s: float = 0.0
    prompt_text: str | None = None
    parent_request_id: str | None = None
    priority: int = 0
    num_speculative_tokens: int | None = None
    num_external_computed_tokens: int = 0

    # --- state (vLLM names) ---
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, with sampling.logprobs
    finish_reason: str | None = None  # "stop" (EOS, a stop token id) | "length" (max_new_tokens)
    eos_token_ids: tuple[int, ...] = ()  # filled by the engine from the model unless ignore_eos
    num_preemptions: int = 0
    # speculative decoding (vLLM v1): drafts for the next step, and (drafted, accepted) per verification
    spec_token_ids: list[int] = field(default_factory=list)
    spec_history: list[tuple[int, int]] = field(default_factory=list)

    # --- event stamps, seconds on the engine clock ---
    first_scheduled_time_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_time_s: float | None = None
    # a weak reference to the engine this request was added to: one engine owns a request's state (another
    # engine gets request.copy())
    owner: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        from minibatch.checks import MAX_TOKENS, FieldTypeError, check_int, check_real, check_str, check_token_ids

        check_str(self.request_id, "request_id")
        where = f"request {self.request_id!r}: "
        try:
            self.prompt_token_ids = check_token_ids(self.prompt_token_ids, "prompt_token_ids")
            self.max_new_tokens = check_int(self.max_new_tokens, "max_new_tokens", 1, MAX_TOKENS)
            if not isinstance(self.sampling, SamplingParams):
                raise FieldTypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
            self.arrival_time_s = check_real(self.arrival_time_s, "arrival_time_s", 0.0, MAX_ARRIVAL_S)
            if self.prompt_text is not None and not isinstance(self.prompt_text, str):
                raise FieldTypeError(f"prompt_text must be a str or None, got {type(self.prompt_text).__name__}")
            check_str(self.parent_request_id, "parent_request_id", allow_none=True)
            self.priority = check_int(self.priority, "priority", -MAX_PRIORITY, MAX_PRIORITY)
            if self.num_speculative_tokens is not None:
                self.num_speculative_tokens = check_int(self.num_speculative_tokens, "num_speculative_tokens", 0, 64)
            self.num_external_computed_tokens = check_int(self.num_external_computed_tokens,
                                                          "num_external_computed_tokens", 0,
                                                          len(self.prompt_token_ids) - 1)
            if self.sampling.min_tokens > self.max_new_tokens:
                raise ValueError(f"min_tokens ({self.sampling.min_tokens}) must be <= max_new_tokens "
                                 f"({self.max_new_tokens})")
        except (TypeError, ValueError) as e:
            raise type(e)(where + str(e)) from None

    # --- derived values ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold: Orca's reservation, prompt + max_new_tokens."""
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def first_token_time_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    def stops_at(self, token_id: int, index: int) -> bool:
        """Whether ``token_id`` as output token number ``index`` (0-based) finishes the request: EOS (unless
        ignore_eos) or one of ``sampling.stop_token_ids``, once ``sampling.min_tokens`` tokens precede it."""
        if index < self.sampling.min_tokens:
            return False
        eos = not self.sampling.ignore_eos and token_id in self.eos_token_ids
        return eos or token_id in self.sampling.stop_token_ids

    def banned_token_ids(self) -> tuple[int, ...]:
        """Token ids the next output token may not be (``sampling.min_tokens`` not reached yet): EOS (unless
        ignore_eos) and the stop token ids; () otherwise."""
        if self.num_output_tokens >= self.sampling.min_tokens:
            return ()
        return self.sampling.stop_token_ids + (() if self.sampling.ignore_eos else self.eos_token_ids)

    def append_token(self, token_id: int) -> None:
        """Append a sampled token and finish the request if it hit EOS, a stop token id or max_new_tokens."""
        self.output_token_ids.append(int(token_id))
        if self.stops_at(token_id, self.num_output_tokens - 1):
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = RequestStatus.FINISHED

    def copy(self) -> "Request":
        """A fresh request with the same inputs and no state."""
        return Request(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            arrival_time_s=self.arrival_time_s,
            prompt_text=self.prompt_text,
            parent_request_id=self.parent_request_id,
            priority=self.priority,
            num_speculative_tokens=self.num_speculative_tokens,
            num_external_computed_tokens=self.num_external_computed_tokens,
        )


def fork_requests(request: Request, n: int, seeds: list[int] | None = None) -> list[Request]:
    """Parallel sampling: ``request`` plus ``n - 1`` children sampling the same prompt (ids ``{id}.1`` ..
    ``{id}.{n-1}``), whose KV blocks share the prompt's until a write copies them (copy-on-write; Kwon et al.,
    SOSP'23 §4.4). Each gets its own seed: ``seeds[i]``, by default the request's seed + i (an unseeded request
    counts as seed 0, so the forks of two unseeded prompts share seeds 0..n-1). ``request`` itself is changed in
    place: its ``sampling`` gets ``seeds[0]``.

    Raises:
        ValueError: n outside [1, MAX_NUM_SEQS], or len(seeds) != n. FieldTypeError: n not an int.
    """
    from minibatch.checks import MAX_NUM_SEQS, check_int

    check_int(n, "n", 1, MAX_NUM_SEQS)
    if seeds is None:
        base = request.sampling.seed or 0
        seeds = [base + i for i in range(n)]
    if len(seeds) != n:
        raise ValueError(f"seeds must hold n = {n} seeds, got {len(seeds)}")
    out = [request]
    request.sampling = dataclasses.replace(request.sampling, seed=seeds[0])
    for i in range(1, n):
        child = request.copy()
        child.request_id = f"{request.request_id}.{i}"
        child.sampling = dataclasses.replace(request.sampling, seed=seeds[i])
        child.parent_request_id = request.request_id
        out.append(child)
    return out
