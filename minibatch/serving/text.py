"""Incremental detokenization with stop strings, for streaming.

The tokens of one request arrive a few at a time. Their text is decoded incrementally, as vLLM's
detokenizer does: only the tokens since the last settled point, from the settled point before it (a
token's text can depend on its neighbour, and one character may span several byte tokens); the
text that window adds is appended. Text that may still become a stop string, or that ends in an
incomplete UTF-8 character, is held back until it is settled. Also here: :func:`load_tokenizer`, a tokenizer without
its model (the load generator counts tokens with it).
"""

from __future__ import annotations


class TextAssembler:
    """Turns token ids into text deltas for one request, decoding only the newest tokens at each step (vLLM's
    incremental detokenization: the whole output decoded at every step costs O(n) a token, 2 ms at 8000 tokens).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` with ``skip_special_tokens``, ``clean_up_tokenization_spaces``).
        stop: stop strings; the text ends before the first one found (OpenAI's ``stop``; the
            stop string itself is not returned).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
        min_tokens: vLLM's ``min_tokens``: a stop string counts only where it ends after this many tokens' text.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may start a stop string
        self.token_ids: list[int] = []
        # incremental detokenization (vLLM's): the text of token_ids[:read_offset] is settled in `settled`; each feed
        # decodes only token_ids[prefix_offset:], and the text it adds is what follows the decode of
        # token_ids[prefix_offset:read_offset] (a token's text can depend on the one before: a leading space)
        self.settled, self.prefix_offset, self.read_offset = "", 0, 0
        self.sent = 0  # characters of the text already returned
        self.checked = 0  # characters of the text no stop string may end in any more (looked at, or before min_tokens)
        self.stopped = False

    def feed(self, token_ids, final: bool = False) -> tuple[str, bool]:
        """Add ``token_ids``; returns (new text, whether a stop string was found). ``final``:
        the request has finished, so everything held back is released.

        A stop string counts only where it ends in text new since the last call, and after the text of the first
        ``min_tokens`` tokens (vLLM v1's rule; stop token ids count from there too); the ``hold`` characters before
        the newest text are kept back, so no character of a stop string is ever sent. Characters not yet complete (a
        multi-byte character split between tokens decodes to U+FFFD for now) are neither sent nor looked at."""
        if self.stopped:
            return "", True
        self.token_ids += list(token_ids)
        prefix, window = (self.tokenizer.decode(self.token_ids[self.prefix_offset:end], clean_up_tokenization_spaces=
                                                False, skip_special_tokens=self.skip_special_tokens)
                          for end in (self.read_offset, None))  # (a clean-up would change text already settled)
        text = self.settled + window[len(prefix):]
        if final or (len(window) > len(prefix) and not window.endswith("\ufffd")):  # complete characters: settle
            self.settled, self.prefix_offset, self.read_offset = text, self.read_offset, len(self.token_ids)
        stable = len(text) if final else len(text.rstrip("\ufffd"))  # an incomplete character waits for its bytes
        if self.stop and len(self.token_ids) > self.min_tokens:
            hits = [i for s in self.stop if (i := text.find(s, max(0, self.checked - len(s) + 1), stable)) >= 0]
            if hits:  # each starts at or after self.sent: nothing of it was sent
                self.stopped = True
                piece, self.sent = text[self.sent:min(hits)], min(hits)
                return piece, True
        self.checked = stable
        end = stable if final else stable - self.hold
        if end <= self.sent:
            return "", False
        piece, self.sent = text[self.sent:end], end
        return piece, False


def template_role(tokenizer, role: str) -> str:
    """The role a message of ``role`` takes in ``tokenizer``'s chat template: OpenAI's ``developer`` is the newer name
    for ``system`` (its Chat Completions reference), so it becomes ``system`` unless the template names the
    ``developer`` role itself (as vLLM's server does); a template written for system/user/assistant would otherwise
    put a role the model never saw in training into the prompt, after its default system prompt."""
    if role == "developer" and "developer" not in str(getattr(tokenizer, "chat_template", None) or ""):
        return "system"
    return role


def template_tokens_per_message(tokenizer) -> int:
    """The fewest special tokens (chat markers, which never merge with a message's text) one more message adds to
    a prompt under ``tokenizer``'s chat template, over the roles the server accepts; 0 when there is no template
    or it cannot tell (a server can then refuse a list of messages that cannot fit before reading each one)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    counts = []
    for role in ("system", "user", "assistant", "developer"):
        try:
            one, two = (tokenizer.apply_chat_template([{"role": role, "content": "x"}] * n, add_generation_prompt=True)
                        for n in (1, 2))
        except Exception:  # noqa: BLE001 -- a template that refuses a role (or two in a row) tells nothing
            return 0
        ids = [list(getattr(x, "input_ids", x)) for x in (one, two)]
        counts.append(sum(t in special for t in ids[1]) - sum(t in special for t in ids[0]))
    return max(0, min(counts, default=0))


def load_tokenizer(name: str):
    """A tokenizer only (no model weights): our tiny byte-level one, SmolLM2's from the converted cache
    (else straight from its GGUF file), or ``AutoTokenizer.from_pretrained`` of a local dir / hub id.

    Raises:
        ValueError: the tokenizer cannot be loaded (names --tokenizer).
    """
    from transformers import AutoTokenizer

    from minibatch.gguf import cache_entry_problem, gguf_location, smollm2_cache_path
    from minibatch.hf_load import quiet_loading
    from minibatch.models import tiny_tokenizer

    if name.startswith("tiny-random-"):
        return tiny_tokenizer()
    try:
        with quiet_loading():
            if name.startswith("smollm2-135m"):  # the draft shares the target's tokenizer
                path = smollm2_cache_path()
                if path.exists() and cache_entry_problem(path) is None:
                    return AutoTokenizer.from_pretrained(path)
                directory, file = gguf_location()
                return AutoTokenizer.from_pretrained(directory, gguf_file=file)
            return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # OSError (not found / offline), ValueError, ...
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {name!r} ({type(e).__name__}: "
                         f"{str(e)[:200]})") from e
