import contextlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests are skipped (not deselected) without CUDA, so the report shows them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory):
    """A saved tiny Qwen3.5 hybrid target (model + tokenizer with chat template)."""
    from dflash_train.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny_hybrid"), kind="hybrid", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A saved tiny Qwen3 target (pure attention, tied embeddings)."""
    from dflash_train.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny_qwen3"), kind="qwen3", seed=0)


@pytest.fixture(scope="session")
def train_task(tmp_path_factory):
    """A learnable chat task, a confident tiny hybrid target and a tokenization cache dir."""
    from tests.train_helpers import confident_tiny_target, write_repeat_task

    root = tmp_path_factory.mktemp("train_task")
    target = confident_tiny_target(root / "target")
    return {
        "target": str(target),
        "data": str(write_repeat_task(root / "data.jsonl")),
        "cache": str(root / "cache"),
    }


@pytest.fixture
def task(train_task):
    """The shared training task under the name the training tests use."""
    return train_task


@contextlib.contextmanager
def single_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One CPU thread: tiny matmuls run faster, and spawned ranks / subprocesses (which run with one
    thread too) use the same kernels, so losses compare bit for bit."""
    with single_cpu_thread():
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """``one_thread`` for a whole module: modules of tiny-model tests take it with
    ``pytestmark = pytest.mark.usefixtures("one_thread_module")``."""
    with single_cpu_thread():
        yield


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny tokenizer of ``dflash_train.tiny`` (chat template, mask token)."""
    from dflash_train.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def chatty_dir(tmp_path_factory, one_thread_module):
    """A tiny chat target trained to answer ``tests.chat_families.CHATTY_PROMPTS`` (the synth tests)."""
    from tests.chat_families import CHATTY_PROMPTS, train_chatty_target

    directory = tmp_path_factory.mktemp("chatty")
    return train_chatty_target(directory, CHATTY_PROMPTS, ["ok."] * len(CHATTY_PROMPTS), steps=150)
