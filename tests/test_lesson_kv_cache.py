"""Notebook 00b's exercise checks (minibatch.lessons.kv_cache): the decode-step check accepts the right answer and
refuses each plausible wrong one with a "not yet:" that names what failed; the prediction check says "too high" or
"too low" and gives the count only with show_answer=True; the student edition never hands out the answer; the step
timer records one time per forward (tiny random Llama with GQA; a few seconds)."""

import ast
import math
from pathlib import Path

import nbformat
import pytest
import torch

from minibatch.lessons import kv_cache
from minibatch_course.editions import edition
from minibatch.lessons.kv_cache import check_decode_step, check_num_positions, step_timer
from minibatch.models import load_model

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "00b_kv_cache.ipynb"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    model, _ = load_model("tiny-random-llama")  # 4 query heads, 2 KV heads: GQA as in SmolLM2
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    return model


@pytest.fixture(scope="module")
def token_ids(model):
    return torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()


# ------------------------------------------------------------------ a student's answers, right and wrong
def project(model, attn, x, positions):
    """The notebook's project: q (num_heads, T, d), k, v (num_kv_heads, T, d), q and k rotated by RoPE."""
    T, d = x.shape[0], attn.head_dim
    q, k, v = (p(x).view(T, -1, d).transpose(0, 1) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    cos, sin = model.model.rotary_emb(x, positions[None])
    cos, sin = cos[0], sin[0]

    def rotate(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    return rotate(q), rotate(k), v


def attend(q, k, v, offset_mask=True):
    """The notebook's attend (``offset_mask=False``: the square mask a student might write, tril without offset)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    T_q, T_k = q.shape[1], k.shape[1]
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    visible = torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q if offset_mask else 0)
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).reshape(T_q, -1)


def answer(model, mistake=None):
    """decode_step_with_cache as a student writes it, right (mistake None) or with one plausible mistake."""
    def decode_step_with_cache(attn, x_new, position, cache):
        q, k, v = project(model, attn, x_new, torch.tensor([0 if mistake == "rope_at_zero" else position]))
        old_k, old_v = cache["k"], cache["v"]
        if mistake != "no_append":
            cache["k"], cache["v"] = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
        keys, values = {"no_append": (old_k, old_v), "before_append": (old_k, old_v),
                        "new_only": (k, v)}.get(mistake, (cache["k"], cache["v"]))
        if mistake == "no_append":
            keys, values = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)  # right output, cache not kept
        heads = attend(q, keys, values, offset_mask=mistake != "square_mask")
        return heads if mistake == "no_o_proj" else attn.o_proj(heads)

    return decode_step_with_cache


def test_the_right_answer_is_correct(model, token_ids, capsys):
    assert check_decode_step(answer(model), model, token_ids, num_decode_steps=4)
    assert capsys.readouterr().out.startswith("correct: 4 decode steps of layer 0 match")


def test_the_right_answer_is_correct_in_every_layer(model, token_ids, capsys):
    assert check_decode_step(answer(model), model, token_ids, num_decode_steps=4, layer=1)


@pytest.mark.parametrize("mistake, said", [
    ("no_append", "the cache holds 8 positions, expected 9: append the new token's k and v"),
    ("before_append", "attention over the earlier positions only, without the new token itself"),
    ("new_only", "attention over the new token alone"),
    ("square_mask", "attention over position 0 alone (a square causal mask"),
    ("no_o_proj", "the heads before the output projection"),
    ("rope_at_zero", "is not the new token's key rotated by RoPE at 8"),
])
def test_each_plausible_mistake_is_refused_with_what_failed(model, token_ids, capsys, mistake, said):
    assert not check_decode_step(answer(model, mistake), model, token_ids, num_decode_steps=4)
    out = capsys.readouterr().out
    assert out.startswith("not yet: ") and said in out, out


def test_a_stub_or_a_crash_says_not_yet(model, token_ids, capsys):
    def stub(attn, x_new, position, cache):
        ...

    def crashes(attn, x_new, position, cache):
        return attn.q_proj(cache["k"])  # a shape error

    assert not check_decode_step(..., model, token_ids)
    assert not check_decode_step(stub, model, token_ids)
    assert not check_decode_step(crashes, model, token_ids)
    lines = capsys.readouterr().out.splitlines()
    stub_line = "not yet: decode_step_with_cache is not implemented yet"
    assert [line.split(". Hint")[0] for line in lines[:2]] == [stub_line] * 2
    assert lines[2].startswith("not yet: your code raised RuntimeError")


# ------------------------------------------------------------------ the prediction
def test_the_prediction_check_says_a_direction_and_the_count_only_when_asked(capsys):
    assert check_num_positions(348, 40, 8)
    assert not check_num_positions(47, 40, 8)
    assert not check_num_positions(400, 40, 8)
    assert not check_num_positions(320, 40, 8, show_answer=True)
    assert not check_num_positions(..., 40, 8)
    correct, low, high, shown, stub = capsys.readouterr().out.splitlines()
    assert correct == "correct: the loop computes 40 + 41 + ... + 47 = 348 positions"
    assert low.startswith("not yet: my_prediction is too low (to see the answer") and "348" not in low
    assert high.startswith("not yet: my_prediction is too high") and "348" not in high
    assert "is too low; the engine: 348" in shown
    assert stub.startswith("not yet: my_prediction is not implemented yet") and "348" not in stub


# ------------------------------------------------------------------ the student edition
def test_the_student_edition_never_hands_out_the_answer():
    student = edition(nbformat.read(NOTEBOOK, as_version=4), student=True)
    assert not hasattr(kv_cache, "decode_step_with_cache")
    uses = []
    for i, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "decode_step_with_cache":
                assert [type(s) for s in node.body] == [ast.Expr] and node.body[0].value.value is ..., \
                    "the student edition's decode_step_with_cache is a stub"
            if isinstance(node, ast.ImportFrom) and any(a.name == "decode_step_with_cache" for a in node.names):
                uses.append(f"cell {i} imports it")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "my_prediction" for t in node.targets):
                assert isinstance(node.value, ast.Constant) and node.value.value is ..., "my_prediction is a stub"
    assert not uses, uses


def test_the_step_timer_records_one_time_per_forward(model, token_ids):
    with step_timer(model) as times:
        for n in (3, 5):
            model(input_ids=torch.tensor([token_ids[:n]]), use_cache=False)
    assert len(times) == 2 and all(t > 0 for t in times)
    model(input_ids=torch.tensor([token_ids[:3]]), use_cache=False)  # the hooks are gone
    assert len(times) == 2
