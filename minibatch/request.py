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
import operator
from dataclasses import dataclass, field


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
    then top-p nucleus filtering (1.0 = off), then a draw from a ``torch.Generator`` seeded with
    ``seed`` so a request's samples are reproducible whatever batch it runs in.
    ``ignore_eos`` makes a request run to exactly ``max_new_tokens`` (as vLLM's benchmarks do,
    so every policy does the same work on a trace).

    Raises:
        ValueError: a field out of range (the message names the field and its allowed range).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

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
            parent's KV blocks (copy-on-write) instead of computing the prompt again.
        priority: for the ``priority`` queue policy: lower is served first (vLLM's convention);
            any int, default 0.
        num_speculative_tokens: speculative decoding: this request's k, overriding the
            engine's choice (0: never speculate); None (default): the engine decides.

    Raises:
        ValueError: empty prompt, max_new_tokens < 1, arrival_time_s < 0 or a non-int priority.
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

    # --- state (vLLM names) ---
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_new_tokens)
    eos_token_ids: tuple[int, ...] = ()  # filled by the engine from the model unless ignore_eos
    num_preemptions: int = 0

    # --- event stamps, seconds on the engine clock ---
    first_scheduled_time_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_time_s: float | None = None

    def __post_init__(self):
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if len(self.prompt_token_ids) < 1:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must hold >= 1 token")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        try:
            if isinstance(self.priority, bool):
                raise TypeError
            self.priority = operator.index(self.priority)
        except TypeError:
            raise ValueError(f"request {self.request_id!r}: priority must be an int, got {self.priority!r}") from None
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"request {self.request_id!r}: num_speculative_tokens must be >= 0 or None, "
                             f"got {self.num_speculative_tokens}")
        if not self.arrival_time_s >= 0.0:
            raise ValueError(
                f"request {self.request_id!r}: arrival_time_s must be >= 0, got {self.arrival_time_s}"
            )

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

    def append_token(self, token_id: int) -> None:
        """Append a sampled token and finish the request if it hit EOS or max_new_tokens."""
        self.output_token_ids.append(int(token_id))
        if not self.sampling.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = RequestStatus.FINISHED

    def reset(self) -> None:
        """Forget all engine state so the same request can run again under another policy."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids = []
        self.finish_reason = None
        self.first_scheduled_time_s = None
        self.token_times_s = []
        self.finish_time_s = None
        self.num_preemptions = 0

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
        )


def fork_requests(request: Request, n: int, seeds: list[int] | None = None) -> list[Request]:
    """Parallel sampling: ``request`` plus ``n - 1`` children sampling the same prompt
    (ids ``{id}.1`` .. ``{id}.{n-1}``, each with its own seed, default request seed + i).

    Raises:
        ValueError: n < 1, or len(seeds) != n.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
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
