"""Notebook 03's helpers: padding and FLOP counts checked by hand, the block-diagonal mask exactly,
padded == packed logits, and naive packing really changing logits and tokens (tiny random Llama)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch.testing import assert_close  # noqa: E402

from minibatch import ModelRunner, Request, SamplingParams  # noqa: E402
from minibatch.lessons.selective_batching import check_my_mask, draw_masks  # noqa: E402
from minibatch.experiments.selective_cost import ModelDims, forward_cost, num_padding_tokens  # noqa: E402
from minibatch.experiments.naive_packing import (block_diagonal_causal_mask, causal_mask, greedy,  # noqa: E402
                                                 packed_inputs, per_request_max_diff, row_forward)
from minibatch.viz.selective import draw_padded_vs_packed, draw_split_merge  # noqa: E402
from minibatch.experiments.selective import (next_token_alone, num_blocks_used, packed_logits,  # noqa: E402
                                             padded_forward, prefill_output, unpad)
from minibatch.models import attention_implementation, load_model  # noqa: E402
from minibatch.runner.batch import build_packed_batch  # noqa: E402
from minibatch.scheduler.base import Scheduler, SchedulerOutput  # noqa: E402
from minibatch.scheduler.output import ScheduledRequest  # noqa: E402

PROMPTS = [[72, 105, 112, 112, 115], [30, 31, 32, 33, 34, 35, 36, 37], [80, 81, 82]]  # lengths 5, 8, 3
LENS = [5, 8, 3]

pytestmark = pytest.mark.filterwarnings("error")  # the notebook must run without warnings


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random-llama")
    return model, ModelRunner(model, tokenizer)


def test_padding_and_flops_counted_by_hand():
    lens = [3, 1, 2]
    assert num_padding_tokens(lens) == 3  # (3, 3) = 9 token slots, 6 real
    dims = ModelDims(num_linear_params=10, num_layers=2, attn_dim=4)
    padded = forward_cost(lens, dims, "padded")
    # linear 2 * 10 * 9 = 180; pairs 3 rows * 3^2 = 27; attention 4 * 2 layers * 4 * 27 = 864
    assert (padded.num_computed_tokens, padded.num_padding_tokens, padded.num_attention_pairs) == (9, 3, 27)
    assert (padded.linear_flops, padded.attention_flops, padded.total_flops) == (180, 864, 1044)
    packed = forward_cost(lens, dims, "packed")
    # linear 2 * 10 * 6 = 120; pairs 3^2 + 1^2 + 2^2 = 14; attention 4 * 2 * 4 * 14 = 448
    assert (packed.num_computed_tokens, packed.num_padding_tokens, packed.num_attention_pairs) == (6, 0, 14)
    assert (packed.linear_flops, packed.attention_flops, packed.total_flops) == (120, 448, 568)
    row = forward_cost(lens, dims, "packed, row mask")  # one masked SDPA over the row: 6^2 = 36 pairs
    assert (row.num_attention_pairs, row.attention_flops, row.linear_flops) == (36, 1152, 120)
    with pytest.raises(ValueError, match="layout"):
        forward_cost(lens, dims, "ragged")


def test_model_dims_count_every_matmul_weight(tiny):
    model, _ = tiny
    # hidden 64, 4 heads x 16, 2 KV heads, MLP 128, 2 layers, untied LM head 512 x 64
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate/up/down
    assert ModelDims.of(model) == ModelDims(2 * per_layer + 512 * 64, num_layers=2, attn_dim=64)


def test_block_diagonal_causal_mask_is_exact():
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(block_diagonal_causal_mask([2, 1, 3]), expected)
    assert torch.equal(block_diagonal_causal_mask([4]), causal_mask(4))  # one request: plain causal


def test_the_mask_exercise_accepts_the_answer_and_rejects_wrong_ones(tiny, capsys):
    _, runner = tiny
    assert check_my_mask(block_diagonal_causal_mask, runner)
    # the naive causal mask is right only for a single request: [3] passes, [2, 1, 3] is the first failure
    assert not check_my_mask(lambda lens: causal_mask(sum(lens)), runner)
    assert not check_my_mask(lambda lens: block_diagonal_causal_mask(lens).int(), runner)  # bool, not 0/1 ints
    assert not check_my_mask(lambda lens: None, runner)  # an unfinished body
    no_causality = lambda lens: torch.block_diag(*[torch.ones(n, n) for n in lens]).bool()  # noqa: E731
    assert not check_my_mask(no_causality, runner)  # each request sees its own later tokens
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("correct:")
    assert lines[1].startswith("not yet: for seq_lens [2, 1, 3] one SDPA with your mask is")
    assert lines[2].startswith("not yet: for seq_lens [3] the mask must be (3, 3) torch.bool, got (3, 3) torch.int32")
    assert lines[3].startswith("not yet: my_block_diagonal_causal_mask(seq_lens) is not implemented yet")
    assert lines[4].startswith("not yet: for seq_lens [3] one SDPA with your mask is")


def test_prefill_output_gives_each_prompt_its_own_blocks():
    out = prefill_output([[1] * 5, [1] * 16, [1] * 17], block_size=16)
    assert out.block_tables == {"req-0": [0], "req-1": [1], "req-2": [2, 3]}
    assert [s.num_new_tokens for s in out.scheduled] == [5, 16, 17] and num_blocks_used(out) == 4


def test_padded_and_packed_forwards_give_the_same_logits(tiny):
    model, runner = tiny
    padded = padded_forward(model, PROMPTS)
    packed = packed_logits(runner, PROMPTS, block_size=4)
    assert padded.shape[:2] == (3, 8) and packed.shape[0] == sum(LENS)
    assert_close(unpad(padded, LENS), packed, atol=1e-4, rtol=1e-4)


def test_naive_packing_diverges_and_the_block_diagonal_mask_repairs_it(tiny):
    model, runner = tiny
    split = packed_logits(runner, PROMPTS)
    diffs = per_request_max_diff(row_forward(model, PROMPTS), split, LENS)
    assert diffs[0] < 1e-4  # the first request only sees itself, even under the naive causal mask
    assert min(diffs[1:]) > 1.0  # the others attend to earlier requests' tokens
    assert_close(row_forward(model, PROMPTS, block_diagonal_causal_mask(LENS)), split, atol=1e-4, rtol=1e-4)
    ids, positions = packed_inputs(PROMPTS)  # transformers detects packing from positions restarting at 0
    with attention_implementation(model, "sdpa"), torch.inference_mode():
        hf = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    assert_close(hf, split, atol=1e-4, rtol=1e-4)


def test_naive_packing_changes_the_generated_tokens(tiny):
    model, runner = tiny
    split = greedy(lambda seqs: packed_logits(runner, seqs), PROMPTS, num_new_tokens=4)
    naive = greedy(lambda seqs: row_forward(model, seqs), PROMPTS, num_new_tokens=4)
    # reference: each prompt alone, where plain causal attention is correct
    alone = [greedy(lambda seqs: row_forward(model, seqs), [p], num_new_tokens=4)[0] for p in PROMPTS]
    assert split == alone
    assert naive[0] == alone[0] and naive[1] != alone[1] and naive[2] != alone[2]


def test_mixed_step_metadata_and_tokens(tiny):
    """Notebook 03's step: A prefill 5, B decode (6 cached), C prefill 3; block_size 4."""
    model, runner = tiny
    params = SamplingParams(ignore_eos=True)
    a, b, c = (Request(n, p, max_new_tokens=4, sampling=params) for n, p in
               (("A", PROMPTS[0]), ("B", PROMPTS[1][:6]), ("C", PROMPTS[2])))
    runner.allocate_kv_cache(num_blocks=6, block_size=4)
    tables = {"A": [2, 5], "B": [0, 3], "C": [1]}
    step0 = SchedulerOutput([ScheduledRequest(b, 6, "prefill", 0)], block_tables={"B": tables["B"]})
    Scheduler.advance(step0, runner.execute(step0))
    step1 = SchedulerOutput([ScheduledRequest(a, 5, "prefill", 0), ScheduledRequest(b, 1, "decode", 1),
                             ScheduledRequest(c, 3, "prefill", 2)], block_tables=tables)
    batch = build_packed_batch(step1, runner.kv_cache)
    m = batch.attn_metadata
    assert m.cu_seqlens_q == [0, 5, 6, 9] and m.seq_lens == [5, 7, 3]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 6, 0, 1, 2]
    # block_table[pos // 4] * 4 + pos % 4: A pos 4 -> 5*4+0, B pos 6 -> 3*4+2, C -> block 1
    assert m.slot_mapping.tolist() == [8, 9, 10, 11, 20, 14, 4, 5, 6]
    assert batch.logits_indices.tolist() == [4, 5, 8]
    fig = draw_split_merge(step1, batch)
    assert sum(isinstance(p, Rectangle) for p in fig.axes[0].patches) == 9 + (5 + 7 + 3) + 9  # row, split, merge
    plt.close(fig)
    assert {rid: t for rid, (t,) in runner.execute(step1).sampled.items()} == next_token_alone(model, [a, b, c])


def test_figures_draw_one_cell_per_token():
    fig = draw_padded_vs_packed([3, 1, 2])
    assert sum(isinstance(p, Rectangle) for p in fig.axes[0].patches) == 3 * 3 + 6  # (B, T) grid + packed row
    plt.close(fig)
    fig = draw_masks([2, 1, 3])
    assert [sum(isinstance(p, Rectangle) for p in ax.patches) for ax in fig.axes] == [36, 36]
    plt.close(fig)
