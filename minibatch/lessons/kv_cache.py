"""Exercise checks for notebook 00b_kv_cache: the KV cache from first principles.

* :func:`check_num_positions`: a prediction of how many token positions a generation loop without a cache computes
  (it says "too high" or "too low", and gives the count only when asked with ``show_answer=True``);
* :func:`check_decode_step`: the student's ``decode_step_with_cache(attn, x_new, position, cache)``, one decode step
  of one attention layer. The check fills the cache with the first positions' k and v itself (the prefill), calls
  the student's function for each later position, and compares every output with the real layer run over the
  whole sequence without a cache (HF's own attention, with a causal mask). A wrong answer is told which property
  failed: the cache's length, the key written for the new position, or which wrong set of positions the new token
  attended to.

Nothing here is the solution: the check runs the model's layer and, to name a mistake, the attention of a few
plausible wrong answers (:func:`attention_over`). Also here: :func:`step_timer` and :func:`plot_step_times`, the
per-step wall times of section 5.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from minibatch.lessons import exercise


@exercise.check(hint="step i feeds the model the prompt plus the i tokens generated before it")
def check_num_positions(prediction, num_prompt_tokens: int, max_new_tokens: int, show_answer: bool = False) -> str:
    """Exercise: ``prediction``, the token positions a loop without a cache computes to generate ``max_new_tokens``
    tokens after a ``num_prompt_tokens``-token prompt (each step runs the model on the whole sequence so far)."""
    counted = sum(num_prompt_tokens + i for i in range(max_new_tokens))  # step i: the prompt + i generated tokens
    answer = (f"the loop computes {num_prompt_tokens} + {num_prompt_tokens + 1} + ... + "
              f"{num_prompt_tokens + max_new_tokens - 1} = {counted} positions")
    exercise.expect(prediction, counted, "my_prediction", show_answer=show_answer)
    return answer


def rope_of(model):
    """The model's rotary embedding module: ``rope(x, position_ids)`` gives (cos, sin), each (1, T, head_dim)."""
    return model.model.rotary_emb


def layer_inputs(model, token_ids: list[int], layer: int = 0) -> torch.Tensor:
    """The normalised input of attention layer ``layer`` for ``token_ids``, computed without a cache: (T, hidden)."""
    with torch.inference_mode():
        ids = torch.tensor([token_ids])  # (1, T)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[layer]  # (1, T, hidden)
        return model.model.layers[layer].input_layernorm(hidden)[0]


def rotated_qkv(attn, rope, x: torch.Tensor, positions: torch.Tensor):
    """q (num_heads, T, head_dim) and k, v (num_kv_heads, T, head_dim) of rows ``x`` (T, hidden), q and k rotated
    by RoPE at ``positions`` (T,): the projections of HF's Llama attention, for the check's diagnostics."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T, d = x.shape[0], attn.head_dim
    q, k, v = (proj(x).view(T, -1, d).transpose(0, 1) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    cos, sin = rope(x, positions[None])  # (1, T, head_dim) each
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)  # (1, heads, T, head_dim)
    return q[0], k[0], v


def attention_over(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_proj: bool = True) -> torch.Tensor:
    """The layer's output (1, hidden) for one query q (num_heads, 1, head_dim) attending to every row of k, v
    (num_kv_heads, n, head_dim), no mask (``o_proj=False``: the heads before the output projection): used to
    recognise which positions a wrong answer attended to."""
    group = q.shape[0] // k.shape[0]  # GQA: query heads per KV head
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # (num_heads, n, head_dim)
    weights = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).softmax(-1)  # (num_heads, 1, n)
    heads = (weights @ v).transpose(0, 1).reshape(1, -1)  # (1, num_heads * head_dim)
    return attn.o_proj(heads) if o_proj else heads  # (1, hidden)


def uncached_attention(model, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """The real layer's attention output (T, hidden) over the whole sequence ``x`` (T, hidden), causal mask."""
    attn, T = model.model.layers[layer].self_attn, x.shape[0]
    positions = torch.arange(T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]  # (1, 1, T, T): 0 on and below the diagonal
    with torch.inference_mode():
        out, _ = attn(x[None], position_embeddings=rope_of(model)(x[None], positions[None]), attention_mask=causal)
    return out[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def _diagnose(attn, q, k, v, position: int, output: torch.Tensor) -> str:
    """Why ``output`` for ``position`` is wrong, when it matches a plausible mistake; k, v hold positions
    0..position (the right ones, rotated)."""
    wrong = {"the new token alone": (slice(position, position + 1), "attend over every cached position"),
             "the earlier positions only, without the new token itself": (
                 slice(0, position), "append the new k, v before attending (a token attends to itself)"),
             "position 0 alone (a square causal mask applied to one query)": (
                 slice(0, 1), "with one query, the new token sees every cached position: no mask is needed")}
    for name, (rows, fix) in wrong.items():
        if _close(output, attention_over(attn, q, k[:, rows], v[:, rows])):
            return f"position {position}'s output is the attention over {name}: {fix}"
    if _close(output, attention_over(attn, q, k, v, o_proj=False)):
        return f"position {position}'s output is the heads before the output projection: apply attn.o_proj"
    return f"position {position}'s output differs from the attention without a cache"


@exercise.check(hint="compute q, k, v of the new token only; append its k and v to the cache; attend over the "
                     "whole cache (GQA: each KV head serves a group of query heads); apply o_proj")
def check_decode_step(decode_step_with_cache, model, token_ids: list[int], num_decode_steps: int = 8,
                      layer: int = 0) -> str:
    """Exercise: ``decode_step_with_cache(attn, x_new, position, cache)`` runs one decode step of attention layer
    ``layer``: x_new (1, hidden) is the new token's normalised input at ``position``, ``cache`` a dict of "k" and
    "v", each (num_kv_heads, position, head_dim) holding the earlier positions (k rotated by RoPE); it appends the
    new k, v to ``cache`` and returns the layer's output (1, hidden). The last ``num_decode_steps`` positions of
    ``token_ids`` are decoded after a prefill of the others, and compared with the layer run without a cache."""
    if not callable(decode_step_with_cache):
        raise exercise.NotYet("decode_step_with_cache is not implemented yet")
    attn = model.model.layers[layer].self_attn
    x = layer_inputs(model, token_ids, layer)  # (T, hidden)
    expected = uncached_attention(model, x, layer)  # (T, hidden)
    num_prefill = len(token_ids) - num_decode_steps
    if num_prefill < 1:
        raise ValueError(f"num_decode_steps must be below len(token_ids) = {len(token_ids)}, got {num_decode_steps}")
    with torch.inference_mode():
        q, k, v = rotated_qkv(attn, rope_of(model), x, torch.arange(len(token_ids)))  # every position, for diagnosis
        cache = {"k": k[:, :num_prefill].clone(), "v": v[:, :num_prefill].clone()}  # the prefill's KV
        for position in range(num_prefill, len(token_ids)):
            output = exercise.require(decode_step_with_cache(attn, x[position:position + 1], position, cache),
                                      "decode_step_with_cache")
            assert tuple(output.shape) == (1, x.shape[1]), \
                f"position {position}: it returned shape {tuple(output.shape)}, expected (1, {x.shape[1]})"
            length = cache["k"].shape[1]
            assert length == position + 1 and cache["v"].shape[1] == position + 1, \
                (f"after decoding position {position} the cache holds {length} positions, expected {position + 1}: "
                 "append the new token's k and v to it")
            assert _close(cache["k"][:, position], k[:, position]), \
                f"the cache's k at position {position} is not the new token's key rotated by RoPE at {position}"
            assert _close(output, expected[position:position + 1]), \
                _diagnose(attn, q[:, position:position + 1], k[:, :position + 1], v[:, :position + 1], position,
                          output)
    return (f"{num_decode_steps} decode steps of layer {layer} match the layer run without a cache; the cache grew "
            f"from {num_prefill} to {len(token_ids)} positions")


@contextlib.contextmanager
def step_timer(model):
    """While active, the wall time (s) of every forward of ``model`` is appended to the list it yields."""
    times: list[float] = []
    pre = model.register_forward_pre_hook(lambda module, args: times.append(-time.perf_counter()))
    post = model.register_forward_hook(lambda module, args, out: times.append(times.pop() + time.perf_counter()))
    try:
        yield times
    finally:
        pre.remove()
        post.remove()


def plot_step_times(step_times_s: dict[str, list[float]], title: str):
    """One line per loop: the wall time of each step (ms) against the step index; returns the figure."""
    import matplotlib.pyplot as plt

    from minibatch.viz.plots import PALETTE

    colors = {0: PALETTE["padding"], 1: PALETTE["decode"]}
    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    for i, (label, times) in enumerate(step_times_s.items()):
        ax.plot(range(len(times)), [t * 1e3 for t in times], marker="o", markersize=3, color=colors.get(i),
                label=f"{label}: {sum(times):.2f} s in all")
    ax.set_xlabel("step (0 = the first forward, which sees the whole prompt)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(frameon=False, fontsize=9)
    return fig
