"""The exercises need understanding: no student-edition cell hands the student the function its exercise asks for,
a prediction check answers a miss with a direction and shows the answer only when asked (``show_answer=True``), and
every check refuses a plausible wrong answer and accepts the right one (SimExecutor runs; a few seconds)."""

import ast
import re
from pathlib import Path

import nbformat
import pytest
import torch

from minibatch import Request, SimClock, SimExecutor, make_engine
from minibatch.experiment import run
from minibatch.records import first_steps
from minibatch.lessons import chunked_prefill, exercise, iteration_batching, paged_kv, speculative, static_batching
from minibatch.experiments.chunked import budget_sweep
from minibatch.experiments.paged_kv import GREEDY
from minibatch_course.editions import BEGIN, build

ROOT = Path(__file__).resolve().parents[1]
COURSE = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if p.stem != "00_tour"]  # the tour has no exercise
DEF = re.compile(r"^\s*def (\w+)\(", re.M)


def answer_functions(nb) -> set[str]:
    """The functions an exercise asks for: each ``def my_NAME`` of a cell with a solution block gives NAME."""
    return {name.removeprefix("my_") for cell in nb.cells if cell.cell_type == "code"
            and any(BEGIN.match(line) for line in cell.source.split("\n")) for name in DEF.findall(cell.source)}


def handed_out(source: str, names: set[str], own: set[str] = frozenset()) -> list[str]:
    """Where ``source`` imports one of ``names`` from minibatch, or uses it (a call, a reference, an attribute);
    a bare name in ``own`` (the student's own function, e.g. 07's ``best_batch``) may be used."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minibatch"):
            found += [f"imports {a.name} from {node.module}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Name) and node.id in names - own:
            found.append(f"uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"uses .{node.attr}")
    return found


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("editions")
    build(ROOT / "notebooks", out)
    return out / "student"


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.stem)
def test_no_student_cell_imports_or_calls_the_function_its_exercise_asks_for(path, student):
    source = nbformat.read(path, as_version=4)
    names = answer_functions(source)
    own = {n for c in source.cells if c.cell_type == "code" for n in DEF.findall(c.source)}
    nb = nbformat.read(student / path.name, as_version=4)
    problems = [f"cell {i}: {what}" for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
                for what in handed_out(cell.source, names, own)]
    assert not problems, f"{path.name} hands out the answer to its exercise ({sorted(names)}):\n" + "\n".join(problems)


def test_the_scan_catches_the_imports_the_review_found():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "def my_rejection_sample(p, d, q, g):\n    # BEGIN SOLUTION\n    return []\n    # END SOLUTION")])
    names = answer_functions(nb)
    assert names == {"rejection_sample"}
    assert handed_out("from minibatch.spec import rejection_sample\nx = 1", names)  # 06's import cell
    assert handed_out("hist = f({'ok': rejection_sample})", names)
    assert handed_out("m = row_forward(model, short, lesson.block_diagonal_causal_mask(lens))",
                      {"block_diagonal_causal_mask"})  # 03, two cells before its exercise
    assert not handed_out("_ = check(my_rejection_sample)", names)
    assert not handed_out("_ = check(best_batch)", {"best_batch"}, own={"best_batch"})  # 07: the student's own
    assert handed_out("from minibatch.lessons.benchmarks import best_batch", {"best_batch"}, own={"best_batch"})


# ------------------------------------------------------------------ exercise.expect
@pytest.mark.parametrize("answer, measured, words, said", [
    (3, 5, ("too low", "too high"), "my_prediction is too low"),
    (9, 5, ("too early", "too late"), "my_prediction is too late"),
    ({"static": 8, "orca": 7}, {"static": 9, "orca": 7}, ("too early", "too late"),
     "my_prediction['static'] is too early"),
    ({"step 1": {"A": 0}}, {"step 1": {"A": 5}}, ("too low", "too high"), "my_prediction['step 1']['A'] is too low"),
    ([1, 2, 3], [1, 3, 3], ("too low", "too high"), "has 1 of 3 entries wrong"),
    ({"a", "b"}, {"a", "c"}, ("too low", "too high"), "has 1 wrong entry and misses 1"),
])
def test_a_miss_gives_a_direction_not_the_answer(answer, measured, words, said):
    with pytest.raises(AssertionError) as e:
        exercise.expect(answer, measured, words=words)
    assert said in str(e.value) and "show_answer=True" in str(e.value)
    assert repr(measured) not in str(e.value)
    with pytest.raises(AssertionError, match="the engine: "):
        exercise.expect(answer, measured, words=words, show_answer=True)
    assert exercise.expect(measured, measured) == measured


def test_a_check_prints_the_answer_only_when_asked(capsys):
    trace = run("static", static_batching.sim_requests([3, 9, 5, 9, 2, 7]), SimExecutor(), batch_size=3).records
    assert not static_batching.check_padding_rows(10, trace)  # only the first batch's padding
    assert not static_batching.check_padding_rows(10, trace, show_answer=True)
    assert static_batching.check_padding_rows(19, trace)
    first, second, _ = capsys.readouterr().out.splitlines()
    assert "my_answer is too low" in first and "19" not in first
    assert "the engine: 19" in second


# ------------------------------------------------------------------ one plausible wrong answer per check
def test_01_start_steps():
    runs = {p: run(p, static_batching.sim_requests([3, 9, 5, 9, 2, 7]), SimExecutor(),
                   config={"batch_size": 3, "max_num_seqs": 3}).records for p in ("static", "orca")}
    assert not static_batching.check_start_steps({"static": 8, "orca": 7}, runs, "req-5")  # the first batch's end
    assert static_batching.check_start_steps({"static": 9, "orca": 7}, runs, "req-5")


def test_02_head_of_line_prediction(capsys):
    trace = iteration_batching.hol_run()
    assert not iteration_batching.check_hol_prediction({"L": 10, "s": 10}, trace)  # s "fits" once b leaves
    assert "['s'] is too early" in capsys.readouterr().out
    assert iteration_batching.check_hol_prediction({"L": 10, "s": 30}, trace)


def _skip_ahead(running, waiting, n_rsrv, max_num_seqs, n_slots, skip=True, cap=True, count=True):
    batch = list(running)
    for req in waiting:
        if cap and len(batch) == max_num_seqs:
            break
        if n_rsrv + req.max_num_tokens > n_slots:
            if skip:
                continue
            break
        n_rsrv += req.max_num_tokens if count else 0
        batch.append(req)
    return batch, n_rsrv


@pytest.mark.parametrize("wrong", [dict(skip=False), dict(cap=False), dict(count=False)],
                         ids=["algorithm 1's break", "no max_num_seqs", "n_rsrv not grown"])
def test_02_skip_ahead_refuses_plausible_mistakes(wrong):
    assert not iteration_batching.check_skip_ahead(lambda *args: _skip_ahead(*args, **wrong))


def test_02_skip_ahead_accepts_the_variant_and_shows_the_starvation(capsys):
    assert iteration_batching.check_skip_ahead(_skip_ahead)
    assert "it starves" in capsys.readouterr().out
    assert not iteration_batching.check_skip_ahead(lambda *args: None)


def test_02_replay_matches_the_orca_engine():
    reqs = iteration_batching.sim_requests(iteration_batching.HOL_REQUESTS)
    replayed = iteration_batching.replay(lambda *a: _skip_ahead(*a, skip=False), reqs, 4, 100, 60)
    assert replayed == first_steps(iteration_batching.hol_run())


def test_04_fork_prediction(capsys):
    trace = paged_kv.fork_run()
    assert not paged_kv.check_fork_prediction({"step 1": 13, "step 4": 8}, trace, 16)  # forgets copy-on-write
    assert not paged_kv.check_fork_prediction({"step 1": 11, "step 4": 4}, trace, 16)  # no sharing at all
    out = capsys.readouterr().out
    assert "['step 1'] is too high" in out and "['step 4'] is too low" in out
    assert paged_kv.check_fork_prediction({"step 1": 11, "step 4": 8}, trace, 16)


def test_04_first_preemption():
    crowded = [Request(f"p{i}", [5] * n, 12, GREEDY) for i, n in enumerate([5, 6, 7])]
    engine = make_engine("paged", SimExecutor(), SimClock(), max_num_seqs=8, n_slots=32, block_size=4)
    engine.generate(crowded)
    assert not paged_kv.check_first_preemption({"step": 4, "preempted": "p0"}, engine.trace)  # the one needing it
    assert paged_kv.check_first_preemption({"step": 4, "preempted": "p2"}, engine.trace)


def test_05_step_plan(capsys):
    trace = chunked_prefill.compete_run(16)
    wrong = {"step 1": {"d": 1, "A": 5, "B": 10}, "step 2": {"d": 1, "A": 0, "B": 15}}  # A never decodes
    assert not chunked_prefill.check_step_plan(wrong, trace)
    assert "['step 2']['A'] is too low" in capsys.readouterr().out
    assert not chunked_prefill.check_step_plan({"step 1": {"d": 1, "A": 0, "B": 15}, "step 2": wrong["step 2"]}, trace)
    assert chunked_prefill.check_step_plan({"step 1": {"d": 1, "A": 5, "B": 10}, "step 2": {"d": 1, "A": 1, "B": 10}},
                                           trace)


def test_05_budget_prediction(capsys):
    from minibatch.workload import make_trace

    trace = make_trace(24, rate_per_s=2.0, lengths="sharegpt", max_prompt_len=256, output_scale=0.25,
                       max_output_len=256, num_long_prompts=2, long_prompt_len=1536, seed=0)
    budgets = (64, 128, 256, 512)
    rows = {r["budget"]: r for r in budget_sweep(trace, SimExecutor(), SimClock, budgets, baselines=())}
    target = (rows[128]["itl_p99_s"] + rows[256]["itl_p99_s"]) / 2
    assert rows[64]["itl_p99_s"] < target < rows[256]["itl_p99_s"]
    assert not chunked_prefill.check_budget_prediction(256, trace, budgets, target)
    assert not chunked_prefill.check_budget_prediction(64, trace, budgets, target)
    out = capsys.readouterr().out
    assert "is too high" in out and "is too low" in out
    assert chunked_prefill.check_budget_prediction(128, trace, budgets, target)


# ------------------------------------------------------------------ 06: the rejection sampler
def right(target_probs, drafts, draft_probs, g):
    out = []
    for i, x in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        if float(torch.rand(1, generator=g)) * float(q[x]) < float(p[x]):
            out.append(x)
            continue
        residual = (p - q).clamp_min(0)
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=g))]
    return out + [int(torch.multinomial(target_probs[len(drafts)], 1, generator=g))]


def no_bonus(p, drafts, q, g):
    out = right(p, drafts, q, g)
    return out[:len(drafts)] if len(out) > len(drafts) else out


def bonus_from_the_wrong_row(p, drafts, q, g):
    out = right(p, drafts, q, g)
    if len(out) > len(drafts):
        out[-1] = int(torch.multinomial(p[len(drafts) - 1], 1, generator=g))
    return out


def too_long(p, drafts, q, g):
    return right(p, drafts, q, g) + [0]


def resample_from_p(p, drafts, q, g):
    from minibatch.spec.rejection_sampler import naive_sample

    return naive_sample(p, drafts, q, g)


@pytest.mark.parametrize("wrong, prop", [(no_bonus, "bonus token"), (bonus_from_the_wrong_row, "bonus token"),
                                         (too_long, "output length"), (resample_from_p, "distribution")])
def test_06_the_sampler_check_names_the_property_that_failed(wrong, prop, capsys):
    assert not speculative.check_my_rejection_sample(wrong, n=4000)
    assert capsys.readouterr().out.startswith(f"{exercise.NOT_YET} {prop}:")


def test_06_the_sampler_check_accepts_a_correct_sampler():
    from minibatch.spec import rejection_sample

    assert speculative.check_my_rejection_sample(right, n=4000)
    assert speculative.check_my_rejection_sample(rejection_sample, n=4000)
    assert not speculative.check_my_rejection_sample(lambda *args: None, n=4000)


def test_06_all_accepted_gives_k_plus_one_tokens():
    p, drafts, q = speculative._bonus_case()
    g = torch.Generator().manual_seed(0)
    assert all(len(right(p, drafts, q, g)) == len(drafts) + 1 for _ in range(50))
    with pytest.raises(AssertionError, match="bonus token"):
        speculative.check_bonus_token(no_bonus)
    speculative.check_bonus_token(right)


def test_04_free_blocks_count_a_shared_block_once():
    trace = paged_kv.fork_run()
    assert paged_kv.free_blocks(trace[0], 16) == 13  # the parent's 3 blocks
    assert paged_kv.free_blocks(trace[1], 16) == 11  # + one copy-on-write copy per child; the 2 full blocks shared
