"""What streaming text costs the server per token: the server's TextAssembler (incremental detokenization, vLLM's
way: only the newest tokens are decoded) against decoding the whole output at every token (what it did before),
on SmolLM2's tokenizer, one token per step, for outputs of ``--lengths`` tokens (README.md's text as the output).

    python benchmarks/detokenize.py --json data/cpu/detokenize.json

Both ways must give the same text (checked). Times are milliseconds for the whole output, and microseconds per
token; the server runs this on its event loop for every request at every step.
"""

from __future__ import annotations

import time
from pathlib import Path

from minibatch.checks import MAX_TOKENS, OneLineParser, ints_arg, output_file_arg, run_script
from minibatch.report import environment, machine_load, write_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=ints_arg(1, MAX_TOKENS), default="1000,4000,8000",
                   help="output lengths in tokens (default: 1000,4000,8000)")
    p.add_argument("--json", type=output_file_arg, default=None, help="write the result here")
    args = p.parse_args()
    from minibatch.serving.bench import load_tokenizer
    from minibatch.serving.text import TextAssembler

    tokenizer = load_tokenizer("smollm2-135m")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    ids = tokenizer.encode(text * (1 + max(args.lengths) * 8 // len(text)), add_special_tokens=False)
    load_before = machine_load()
    rows = []
    for n in args.lengths:
        out, assembler, t0 = "", TextAssembler(tokenizer), time.perf_counter()
        for k in range(n):
            out += assembler.feed([ids[k]], final=k == n - 1)[0]
        incremental = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
        every_step = time.perf_counter() - t0
        if out != whole:
            raise ValueError(f"the incremental text of {n} tokens differs from the whole decode")
        rows.append({"tokens": n, "incremental_ms": round(incremental * 1e3, 1),
                     "whole_decode_every_token_ms": round(every_step * 1e3, 1),
                     "incremental_us_per_token": round(incremental / n * 1e6, 1),
                     "whole_decode_us_per_token": round(every_step / n * 1e6, 1)})
        print(f"{n} tokens: incremental {rows[-1]['incremental_ms']} ms, the whole output decoded at every token "
              f"{rows[-1]['whole_decode_every_token_ms']} ms ({every_step / incremental:.0f}x)")
    lengths = ",".join(map(str, args.lengths))
    write_json({"command": f"python benchmarks/detokenize.py --lengths {lengths}"
                           + (f" --json {args.json}" if args.json else ""),
                "environment": environment(load_before), "tokenizer": "smollm2-135m", "rows": rows}, args.json)


if __name__ == "__main__":
    run_script(main)
