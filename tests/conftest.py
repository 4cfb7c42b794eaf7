"""Shared test fixtures."""

import minibatch  # noqa: F401  first: without CUDA it sets TRITON_INTERPRET=1 before anything imports triton
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, with one reason, where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (python -m minibatch gpu-check runs the cuda tests)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread, and a busy machine's thread contention can't slow them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def loaded(one_thread):
    """(model, tokenizer) of tiny-random-llama with a chat template (its tokenizer has none; a server reads the
    tokenizer's): what the server tests serve."""
    from minibatch.models import load_model

    model, tokenizer = load_model("tiny-random-llama")
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


# Eight requests, odd ones sharing a 19-token system prompt: the workload of the paged and chunked
# engine tests (prompt lengths without the system prompt, and max_new_tokens).
PROMPT_LENS = [5, 17, 9, 30, 3, 12, 21, 40]
MAX_NEW = [8, 3, 12, 6, 10, 5, 9, 20]


@pytest.fixture(scope="session", params=["tiny-random-llama", "tiny-random-gpt2"])
def paged_setup(request):
    """(model, ModelRunner, prompts, HF generate's greedy outputs by request_id "r0".."r7")."""
    from minibatch import ModelRunner, Request, SamplingParams
    from minibatch.reference import reference_outputs
    from minibatch.models import load_model

    model, tok = load_model(request.param)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, model.config.vocab_size, (19,), generator=g).tolist()
    prompts = [(system if i % 2 else []) + torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for i, n in enumerate(PROMPT_LENS)]
    reqs = [Request(f"r{i}", p, n, SamplingParams(ignore_eos=True)) for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
    return model, ModelRunner(model, tok), prompts, reference_outputs(model, reqs)


@pytest.fixture(scope="session", autouse=True)
def reference_cache_in_tmp(tmp_path_factory):
    """compare's cached HF generate outputs go to a temporary folder, not the user's cache."""
    folder = tmp_path_factory.mktemp("reference-cache")
    patch = pytest.MonkeyPatch()
    patch.setattr("minibatch.reference.default_cache_dir", lambda: folder)
    yield folder
    patch.undo()
