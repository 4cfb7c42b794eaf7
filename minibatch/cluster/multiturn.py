"""Multi-turn chats: conversations whose turn t's prompt is every earlier turn, with its answer, plus a new message.

The turn structure (how many turns, how long each user message and each answer) is resampled from real ShareGPT
conversations (``minibatch/data/sharegpt_multiturn.json``, lengths only, built by
``scripts/build_sharegpt_multiturn.py``). ShareGPT has no timestamps, so time is modelled: conversations start as
a Poisson process of ``rate_per_s``, and the user sends turn t + 1 a think time after turn t's answer has finished
(exponential, mean ``think_time_s``): a closed loop, as in vLLM's and SGLang's multi-turn benchmarks. So a turn's
request can only be made when the previous turn finishes, with that turn's real output tokens in its prompt: the
cluster driver (``minibatch.cluster.cluster``) calls :meth:`Conversation.next_request` then. An optional system
prompt of ``system_prompt_len`` tokens, the same for every conversation, starts every prompt.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from minibatch.request import Request, SamplingParams

MULTITURN_PATH = Path(__file__).resolve().parent.parent / "data" / "sharegpt_multiturn.json"


@functools.lru_cache(maxsize=1)
def load_turns() -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per conversation, (user tokens, answer tokens) per turn, from ``sharegpt_multiturn.json``.

    Raises:
        FileNotFoundError: the data file is missing (run scripts/build_sharegpt_multiturn.py)."""
    if not MULTITURN_PATH.exists():
        raise FileNotFoundError(f"{MULTITURN_PATH} missing: run scripts/build_sharegpt_multiturn.py")
    data = json.loads(MULTITURN_PATH.read_text(encoding="utf-8"))
    return tuple(tuple((int(u), int(a)) for u, a in conv) for conv in data["turns"])


@dataclass
class Conversation:
    """One chat. user_turns: the token ids of each user message (the first one after the system prompt);
    output_lens: max_new_tokens of each answer; think_times_s: the user's pause before each turn after the first.
    ``turns`` holds the Request of every turn made so far."""

    conversation_id: str
    start_time_s: float
    system_prompt: list[int]
    user_turns: list[list[int]]
    output_lens: list[int]
    think_times_s: list[float]
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(ignore_eos=True))
    turns: list[Request] = field(default_factory=list)
    truncated: bool = False  # a turn would not fit in max_model_len: the conversation ended early

    def fresh(self) -> "Conversation":
        """This conversation with no turn made yet (each run of the same conversations starts from one)."""
        return replace(self, turns=[], truncated=False)

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    def next_request(self, now_s: float, max_model_len: int | None = None) -> Request | None:
        """The next turn's request, sent at ``now_s`` (first turn: its start time; later: the previous turn's
        finish time + the think time), or None when the conversation is over (all turns made, or the next turn
        would exceed ``max_model_len``: then ``truncated`` is set)."""
        t = len(self.turns)
        if t == self.num_turns:
            return None
        if t == 0:
            prompt, arrival = self.system_prompt + self.user_turns[0], self.start_time_s
        else:
            last = self.turns[-1]
            prompt, arrival = last.all_token_ids + self.user_turns[t], now_s + self.think_times_s[t - 1]
        if max_model_len is not None and len(prompt) + self.output_lens[t] > max_model_len:
            self.truncated = True
            return None
        self.turns.append(Request(f"{self.conversation_id}-t{t}", prompt, self.output_lens[t], self.sampling,
                                  arrival_time_s=arrival))
        return self.turns[-1]


def make_conversations(num_conversations: int, *, rate_per_s: float = 1.0, think_time_s: float = 5.0,
                       max_turns: int = 8, max_user_len: int = 256, max_output_len: int = 256,
                       output_scale: float = 1.0, system_prompt_len: int = 0, vocab_size: int = 49152,
                       seed: int = 0, multi_turn_only: bool = True) -> list[Conversation]:
    """``num_conversations`` reproducible conversations "conv-000", "conv-001", ... (see the module docstring).

    Args:
        rate_per_s: conversation starts per second (Poisson). think_time_s: mean pause between an answer and the
            next user turn (exponential). max_turns: longer conversations keep their first max_turns turns.
        max_user_len, max_output_len: caps on each message's and answer's tokens; output_scale multiplies answer
            lengths before the cap (CPU-sized runs keep the distribution's shape).
        system_prompt_len: tokens of a system prompt shared by every conversation (0: none).
        multi_turn_only: resample only conversations with at least two turns (the prefix reuse this workload is
            about); False: as they come (most ShareGPT conversations have one or two turns).
        seed: split into three streams (starts, conversations, token ids): same arguments, same conversations.

    Raises:
        ValueError: a count, length or time out of range (the message names it).
    """
    from minibatch.checks import check_int, check_real

    check_int(num_conversations, "num_conversations", 1, 1_000_000)
    check_real(rate_per_s, "rate_per_s", 0.0, 1e6, low_open=True)
    check_real(think_time_s, "think_time_s", 0.0, 1e6)
    check_int(max_turns, "max_turns", 1, 1000)
    check_int(max_user_len, "max_user_len", 1, 1 << 20)
    check_int(max_output_len, "max_output_len", 1, 1 << 20)
    check_real(output_scale, "output_scale", 0.0, 1000.0, low_open=True)
    check_int(system_prompt_len, "system_prompt_len", 0, 1 << 20)
    check_int(vocab_size, "vocab_size", 4, 1 << 31)
    pool = [c for c in load_turns() if len(c) >= 2 or not multi_turn_only]
    rng_start, rng_conv, rng_tok = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    starts = np.cumsum(rng_start.exponential(1.0 / rate_per_s, size=num_conversations))
    starts -= starts[0]  # the first conversation starts at 0 s
    system = rng_tok.integers(3, vocab_size, size=system_prompt_len).tolist()
    out = []
    for i, k in enumerate(rng_conv.integers(0, len(pool), size=num_conversations)):
        turns = pool[k][:max_turns]
        gaps = rng_conv.exponential(think_time_s, size=len(turns) - 1) if think_time_s else [0.0] * (len(turns) - 1)
        out.append(Conversation(
            f"conv-{i:03d}", float(starts[i]), system,
            [rng_tok.integers(3, vocab_size, size=min(max(u, 1), max_user_len)).tolist() for u, _ in turns],
            [min(max(1, int(np.ceil(a * output_scale))), max_output_len) for _, a in turns], [float(g) for g in gaps]))
    return out
