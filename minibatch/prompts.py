"""Prompt text for demos and traces: hand-written chat messages and their chat-template token ids.

:func:`demo_prompts` gives 16 chat messages of varied length and topic (our own words), so demos and
text traces (``workload.make_trace(tokenizer=...)``) run the model on real text; :func:`chat_prompt_ids`
turns one message into the token ids of a user turn, as a chat model expects it.
"""

from __future__ import annotations

# Hand-written chat prompts (our own words) so demos run the model on real text.
DEMO_PROMPTS: tuple[str, ...] = (
    "What is the capital of Australia?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "Explain what a hash table is to someone who has never programmed.",
    "Write a haiku about a cat watching snow fall.",
    "Why is the sky blue? Keep it short.",
    "Summarize the following paragraph in one sentence: The town council met on Tuesday to "
    "discuss the new bike lanes on Main Street. Shop owners worried that losing parking would "
    "hurt business, while cyclists said the lanes would make the street safer and bring more "
    "people downtown. After two hours of debate the council agreed to a six-month trial and "
    "will count both bike traffic and shop sales before deciding.",
    "In Python, what is the difference between a list and a tuple, and when should I use each?",
    "My function returns None instead of the sum. What is wrong?\n\n"
    "def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    print(s)\n",
    "Translate to French: 'The train leaves at seven, so please do not be late.'",
    "I have eggs, spinach, an onion and some cheese. What can I cook for dinner in 20 minutes?",
    "Write a polite email to my landlord asking when the broken heater will be repaired. It has "
    "been two weeks and the nights are getting cold.",
    "What are the pros and cons of working from home?",
    "Explain the difference between latency and throughput with an everyday example.",
    "Write a SQL query that returns the five customers who spent the most money last year, "
    "given tables orders(id, customer_id, amount, created_at) and customers(id, name).",
    "Tell me a short story about a robot who learns to garden.",
    "How do vaccines train the immune system? Explain it step by step for a high-school student.",
)


def demo_prompts() -> list[str]:
    """The hand-written demo prompts (16 chat messages of varied length and topic)."""
    return list(DEMO_PROMPTS)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as a user chat turn, ready for generation.

    Uses the tokenizer's chat template (``add_generation_prompt=True``) when it has one, else a
    plain ``encode``. The template adds tokens (roles, a system prompt), so the length differs
    from ``len(tokenizer.encode(text))``.
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))
