"""Top-p draws by an exact threshold (generate/nucleus.py): the nucleus is exactly the sorted
definition's (ties at the threshold included), draws follow the renormalised nucleus, a row draws the
same in any batch, and the compiled draw (the sort-free search the compiled decode step traces) is
the eager one (its threshold read off a sort)."""

import pytest
import torch

from dflash_train.eval.static_session import capture_graph
from dflash_train.generate import nucleus
from dflash_train.generate.nucleus import draw_below_limit, mass_limit, masses, nucleus_mask, nucleus_tokens
from dflash_train.generate.sampling import Sampling, choose_tokens, row_streams, row_uniforms, step_keys

TOP_PS = [1.0, 0.99, 0.5, 1e-6]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort descending (stable: ties by token id), keep the tokens whose preceding
    mass is below top_p; masses as the sampler weighs them (integers, so the sums are exact)."""
    limit = mass_limit(top_p)
    if limit is None:
        return torch.ones_like(probs, dtype=torch.bool)
    order = probs.sort(dim=-1, descending=True, stable=True).indices
    sorted_masses = masses(probs).gather(-1, order)
    inside = (sorted_masses.cumsum(-1) - sorted_masses) < limit
    return torch.zeros_like(inside).scatter(-1, order, inside)


def float64_sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The same definition on the float probabilities, summed in float64 (top_p 1: everything, as
    the sampler has always read it; a float sum may exceed 1 before the last tokens)."""
    if top_p >= 1:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = probs.double().sort(dim=-1, descending=True, stable=True)
    inside = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(inside).scatter(-1, order, inside)


def logits_of(kind: str, num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(num_rows, vocab, generator=generator) * 4
    if kind == "ties":  # a few distinct values: thousands of exact ties, at the threshold too
        return torch.randint(0, 5, (num_rows, vocab), generator=generator).float()
    return torch.zeros(num_rows, vocab)  # flat: the whole vocabulary tied


@pytest.mark.parametrize("vocab", [64, 49152])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("kind", ["random", "ties", "flat"])
def test_the_nucleus_is_the_sorted_definitions(vocab, temperature, kind):
    num_rows = 16 if vocab == 64 else 3
    probs = torch.softmax(logits_of(kind, num_rows, vocab, seed=vocab) / temperature, dim=-1)
    sizes = []
    for top_p in TOP_PS:
        got = nucleus_mask(probs, top_p)
        assert torch.equal(got, sorted_nucleus(probs, top_p)), (
            top_p,
            got.sum(-1),
            sorted_nucleus(probs, top_p).sum(-1),
        )
        if kind == "random":  # no boundary within rounding of top_p: the float definition agrees
            assert torch.equal(got, float64_sorted_nucleus(probs, top_p))
        sizes.append(got.sum(-1))
    assert (sizes[0] == vocab).all() and (sizes[-1] == 1).all()  # top_p 1: everything; 1e-6: the top token
    assert (sizes[1] > sizes[2]).any() and (sizes[2] > 1).any()  # the cases in between do cut


def test_ties_at_the_threshold_admit_the_lowest_token_ids_first():
    flat = torch.softmax(torch.zeros(1, 64), dim=-1)  # 1/64 each, exactly: the mass before id j is j/64
    assert nucleus_mask(flat, 0.5)[0].nonzero().squeeze(-1).tolist() == list(range(32))
    # 0.25 on id 40, 0.125 on six ids, the rest spread thin: top_p 0.45 keeps id 40 and two of the
    # six (0.25 + 0.125 < 0.45, 0.25 + 2 * 0.125 >= 0.45), the two lowest ids
    probs = torch.full((1, 64), 0.125 / 57)
    probs[0, 40] = 0.25
    tied = [3, 9, 17, 41, 50, 63]
    probs[0, tied] = 0.125
    assert nucleus_mask(probs, 0.45)[0].nonzero().squeeze(-1).tolist() == [3, 9, 40]
    assert nucleus_mask(probs.flip(-1), 0.45)[0].nonzero().squeeze(-1).tolist() == [
        0,
        13,
        23,
    ]  # ties now at 0, 13, 22, ...; 0.25 at 23


def test_uniforms_walk_the_nucleus_in_token_id_order():
    probs = torch.tensor([[0.1, 0.6, 0.05, 0.25]]).expand(8, 4).contiguous()
    # id-order CDF 0.1, 0.7, 0.75, 1.0 (the sorted sampler walked 0.6, 0.85, 0.95, 1.0: ids 1, 3, 0, 2)
    uniforms = torch.tensor([0.0, 0.05, 0.11, 0.5, 0.69, 0.72, 0.76, 0.999])
    assert choose_tokens(probs.log(), uniforms, Sampling(temperature=1.0)).tolist() == [
        0,
        0,
        1,
        1,
        1,
        2,
        3,
        3,
    ]
    # top_p 0.9: before id 0 (sorted third) lies 0.85, before id 2 0.95: the nucleus is ids 0, 1, 3,
    # its id-order CDF 0.1, 0.7, 0.95 of 0.95
    uniforms = torch.tensor([0.0, 0.1, 0.11, 0.5, 0.73, 0.74, 0.9, 0.999])
    nucleus = Sampling(temperature=1.0, top_p=0.9)
    assert choose_tokens(probs.log(), uniforms, nucleus).tolist() == [0, 0, 1, 1, 1, 3, 3, 3]


def test_draws_follow_the_renormalised_nucleus():
    probs = torch.softmax(logits_of("random", 1, 512, seed=7) / 2.0, dim=-1)  # ~120 tokens in 0.9
    num_draws = 16_000
    for top_p in (0.9, 1.0):
        inside = float64_sorted_nucleus(probs, top_p)[0]
        want = torch.where(inside, probs[0].double(), 0.0)
        expected = want / want.sum() * num_draws
        grid = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws  # stratified uniforms
        counts = torch.bincount(
            nucleus_tokens(probs.expand(num_draws, -1), grid.float(), top_p), minlength=512
        )
        assert (counts - expected).abs().max() <= 1.5  # inverse CDF: each token's share, +-1
        assert counts[~inside].sum() == 0
        # the hashed uniforms: chi-square over tokens expected >= 5 times (the rest pooled)
        hashed = row_uniforms(row_streams(5, torch.arange(num_draws)), step_keys(3, "cpu")[2])
        counts = torch.bincount(nucleus_tokens(probs.expand(num_draws, -1), hashed, top_p), minlength=512)
        big = expected >= 5
        pooled = (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum().clamp(min=1e-9)
        chi_square = ((counts[big] - expected[big]) ** 2 / expected[big]).sum() + pooled
        degrees = int(big.sum())
        assert chi_square < degrees + 6 * (2 * degrees) ** 0.5  # mean degrees, sd sqrt(2 degrees)


def test_a_row_draws_the_same_in_any_batch_and_position():
    logits = logits_of("random", 12, 2048, seed=3)
    logits[5] = logits_of("ties", 1, 2048, seed=4)[0]
    keys = torch.arange(100, 112)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=11)
    streams = row_streams(sampling.seed, keys)
    step = step_keys(8, "cpu")[6]
    together = choose_tokens(logits, row_uniforms(streams, step), sampling)
    order = torch.tensor([7, 5, 0, 11, 3])
    subset = choose_tokens(logits[order], row_uniforms(streams[order], step), sampling)
    assert torch.equal(subset, together[order])
    alone = [
        choose_tokens(logits[r : r + 1], row_uniforms(streams[r : r + 1], step), sampling) for r in range(12)
    ]
    assert torch.equal(torch.cat(alone), together)
    other_keys = choose_tokens(logits, row_uniforms(row_streams(sampling.seed, keys + 50), step), sampling)
    assert not torch.equal(other_keys, together)


def test_the_compiled_draw_does_not_sort_the_vocabulary(monkeypatch):
    """Traced into a compiled region the threshold is searched: a sort there fails the trace."""

    def refuse(*args, **kwargs):
        raise AssertionError("the compiled draw sorted")

    probs = torch.softmax(logits_of("random", 4, 1024, seed=1), dim=-1)
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(nucleus, "sorted_threshold", refuse)
    torch._dynamo.reset()
    traced = torch.compile(draw_below_limit, fullgraph=True, backend="aot_eager")
    tokens = traced(probs, uniforms, mass_limit(0.9))
    assert tokens.shape == (4,) and bool(((tokens >= 0) & (tokens < 1024)).all())
    with pytest.raises(AssertionError, match="sorted"):
        draw_below_limit(probs, uniforms, mass_limit(0.9))  # eagerly it reads the threshold off a sort


def test_the_draw_traced_into_a_compiled_region_is_the_eager_one():
    """What the compiled decode step traces into its graph (the masked-sum rounds), with a dynamic
    batch and a changing limit; inductor's CPU code for one limit, on random and tied rows."""
    torch._dynamo.reset()
    draws = [
        (torch.softmax(logits_of(kind, rows, 2048, seed=rows) / 0.9, dim=-1), rows)
        for kind, rows in [("random", 6), ("ties", 3), ("flat", 6), ("random", 1)]
    ]
    traced = torch.compile(draw_below_limit, fullgraph=True, backend="aot_eager")
    generated = torch.compile(draw_below_limit, fullgraph=True)
    for top_p in (0.9, 0.5, 1.0):
        for probs, rows in draws:
            uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(rows))
            torch._dynamo.maybe_mark_dynamic(probs, 0)
            torch._dynamo.maybe_mark_dynamic(uniforms, 0)
            eager = draw_below_limit(probs, uniforms, mass_limit(top_p))
            assert torch.equal(traced(probs, uniforms, mass_limit(top_p)), eager)
            if top_p == 0.9:
                assert torch.equal(generated(probs, uniforms, mass_limit(top_p)), eager)


@pytest.mark.parametrize("top_p", [0.999999, 0.99, 0.9, 0.5, 1e-6])
def test_the_sort_and_the_search_find_the_same_nucleus_and_draw(top_p):
    """The eager threshold (one sort) and the compiled one (the masked-sum search, run eagerly here)
    on random, tied and flat rows and a row whose tail weighs nothing: the same masses above, the
    same nucleus bounds wherever the nucleus is not the whole row, and the same tokens."""
    rows = [
        torch.softmax(logits_of(kind, 2, 4096, seed=7) / 0.8, dim=-1) for kind in ("random", "ties", "flat")
    ]
    steep = torch.softmax(torch.linspace(0, 60, 4096)[None], dim=-1)  # most masses floor to 0
    probs = torch.cat([*rows, steep])
    patterns, weights, limit = probs.view(torch.int32), masses(probs), mass_limit(top_p)
    searched = nucleus.searched_threshold(patterns, weights, limit)
    ordered = nucleus.sorted_threshold(patterns, weights, limit)
    whole = sorted_nucleus(probs, top_p).all(-1, keepdim=True)
    for got, want in zip(ordered, searched, strict=True):
        assert torch.equal(torch.where(whole, 0, got), torch.where(whole, 0, want))
    uniforms = torch.rand(len(probs), generator=torch.Generator().manual_seed(1))
    eager = draw_below_limit(probs, uniforms, limit)  # the sort
    torch._dynamo.reset()  # each limit is a recompilation: no earlier test's entries count
    traced = torch.compile(draw_below_limit, fullgraph=True, backend="aot_eager")  # the search
    assert torch.equal(eager, traced(probs, uniforms, limit))
    assert bool(sorted_nucleus(probs, top_p).gather(1, eager[:, None]).all())


@pytest.mark.gpu
def test_the_sampler_replays_in_a_cuda_graph_with_new_inputs():
    """The draw captured in a CUDA graph (after eager warm-ups on the capture stream, as the decode
    step does), replayed over new logits and uniforms, interleaved with eager calls of other batch
    sizes and another top_p: every replay gives the eager draw on the same inputs, from the nucleus."""
    device = torch.device("cuda")
    sampling = Sampling(temperature=0.7, top_p=0.9)
    logits = torch.empty(64, 49152, device=device)
    uniforms = torch.empty(64, device=device)
    tokens = torch.empty(64, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(0)

    def refill(kind: str) -> None:
        if kind == "ties":
            logits.copy_(torch.randint(0, 5, logits.shape, device=device, generator=generator).float())
        else:
            logits.copy_(torch.randn(logits.shape, device=device, generator=generator) * 4)
        uniforms.copy_(torch.rand(uniforms.shape, device=device, generator=generator))

    def step() -> None:
        tokens.copy_(choose_tokens(logits, uniforms, sampling))

    refill("random")
    graph, _ = capture_graph(step)  # the project's capture: two warm-up steps on a side stream
    for kind in ("random", "ties", "random", "ties"):
        refill(kind)
        graph.replay()
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        assert torch.equal(tokens, draw_below_limit(probs, uniforms, mass_limit(sampling.top_p)))
        assert bool(sorted_nucleus(probs, sampling.top_p).gather(1, tokens[:, None]).all())
        other = choose_tokens(logits[:5], uniforms[:5], Sampling(temperature=1.0, top_p=0.5))
        probs_other = torch.softmax(logits[:5], dim=-1)
        assert torch.equal(other, draw_below_limit(probs_other, uniforms[:5], mass_limit(0.5)))
