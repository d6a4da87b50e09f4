"""The generation engine under ``torch.compiler.set_stance("force_eager")``, the stance in which the
in-training held-out evaluation generates its continuations (``train/heldout_eval.py``,
``untouched_training_state``).

In that stance every torch.compile'd function runs uncompiled, FlexAttention's kernel too: torch's
unfused reference then builds ``torch.tensor(-inf, device=cuda)`` in every call, a copy from unpinned
host memory, and the capture of the decode step failed on it ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture"). So training with ``eval.prompts`` stopped before its first step
on CUDA while regen, synth and eval (no stance: flex compiled) ran. The engine's defaults follow the
stance now (the eager step, grouped attention), and flex in CUDA graphs is refused there by name.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate.compiled_step import default_compile_decode, eager_forced
from dflash_train.generate.decode_attention import check_flex_compiles, default_decode_attention
from dflash_train.generate.engine import SlotEngine
from dflash_train.generate.sampling import Sampling
from dflash_train.tiny import build_tiny_target, sharpen
from dflash_train.train.heldout_eval import untouched_training_state

pytestmark = pytest.mark.usefixtures("one_thread_module")

CUDA = torch.device("cuda")  # a device object only: no GPU needed to ask for its defaults


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 64, (n,), generator=gen).tolist() for n in (3, 7, 12, 5, 9, 2, 11)]


def test_the_held_out_stance_gives_the_engine_a_capturable_step_on_cuda():
    """Inside the held-out evaluation's context a CUDA engine defaults to the eager step and grouped
    attention; outside (regen, synth, eval) to the compiled step with flex, as before."""
    assert not eager_forced()
    assert default_decode_attention(CUDA, hybrid=False) == "flex"
    assert default_compile_decode(CUDA, hybrid=False)
    with untouched_training_state(torch.device("cpu")):
        assert eager_forced()
        assert default_decode_attention(CUDA, hybrid=False) == "grouped"
        assert not default_compile_decode(CUDA, hybrid=False)
    assert default_decode_attention(CUDA, hybrid=False) == "flex"  # the stance is left as it was


def test_flex_in_cuda_graphs_is_refused_under_the_stance_only():
    check_flex_compiles("flex", CUDA, use_cuda_graphs=True)  # compiled: capturable
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(ValueError, match="grouped"):
            check_flex_compiles("flex", CUDA, use_cuda_graphs=True)
        check_flex_compiles("grouped", CUDA, use_cuda_graphs=True)
        check_flex_compiles("flex", CUDA, use_cuda_graphs=False)  # nothing captured
        check_flex_compiles("flex", torch.device("cpu"), use_cuda_graphs=True)


def test_the_engine_refuses_flex_graphs_under_the_stance_before_any_step():
    """The check is made per call (an engine built outside the stance may be called inside it), before
    any forward: here a CPU engine posing as a graphed CUDA one must stop at the check."""
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1))
    engine = SlotEngine(model, num_slots=3, kv_bucket=8, decode_attention="flex", use_cuda_graphs=False)
    engine.device, engine.use_cuda_graphs = CUDA, True
    with torch.compiler.set_stance("force_eager"), pytest.raises(ValueError, match="force_eager"):
        engine.generate(
            prompts(), list(range(7)), max_new_tokens=8, stop_ids={5}, pad_id=0, sampling=Sampling()
        )
    assert engine.num_steps == 0


@pytest.mark.gpu
def test_held_out_continuations_run_in_cuda_graphs_in_the_training_stance():
    """What ``build_heldout_eval`` runs: ``greedy_continuations`` inside ``untouched_training_state`` on
    CUDA (before: the first capture failed on flex's host copy). fp32, so the tokens are those of the
    default engine outside the stance (compiled step, flex), and of the same engine without graphs."""
    from dflash_train.eval.generate import greedy_continuations

    torch._dynamo.reset()
    model = sharpen(build_tiny_target("qwen3", vocab_size=64, seed=1)).cuda()
    rows, options = prompts(), dict(max_new_tokens=24, eos_token_ids={5}, pad_token_id=0, batch_size=3)
    with untouched_training_state(CUDA):
        held_out = greedy_continuations(model, rows, **options)
        engine = SlotEngine(model, num_slots=3)
        assert (engine.decode_attention, engine.compile_decode, engine.use_cuda_graphs) == (
            "grouped",
            False,
            True,
        )
        graphed = engine.generate(
            rows, list(range(7)), max_new_tokens=24, stop_ids={5}, pad_id=0, sampling=Sampling()
        )
        assert engine.graphs.num_captures > 0
    assert held_out == greedy_continuations(model, rows, **options)
    ungraphed = SlotEngine(
        model, num_slots=3, use_cuda_graphs=False, compile_decode=False, decode_attention="grouped"
    )
    plain = ungraphed.generate(
        rows, list(range(7)), max_new_tokens=24, stop_ids={5}, pad_id=0, sampling=Sampling()
    )
    assert graphed == plain
