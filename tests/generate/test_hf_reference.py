"""Generation against Hugging Face `transformers`, which someone else wrote: its logits processors
(temperature, top-k, top-p, repetition penalty) on random logits, and whole `generate` calls of a tiny
Llama whose weights are copied into tformer: greedy (with and without a repetition penalty, equal and
ragged prompts) and seeded sampling, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.model.helpers import tiny_llama_pair
from tformer.generate.engine import generate
from tformer.generate.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)


def random_logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 200, generator=g) * 3, torch.randint(0, 200, (8, 12), generator=g)


def assert_same_filter(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """The same tokens kept, with the same values."""
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    torch.testing.assert_close(ours[ours.isfinite()], theirs[theirs.isfinite()], rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_equals_hf(temperature: float) -> None:
    logits, ids = random_logits()
    theirs = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    torch.testing.assert_close(apply_temperature(logits, temperature), theirs, rtol=1e-7, atol=0)


@pytest.mark.parametrize("k", [1, 5, 50, 199])
def test_top_k_equals_hf(k: int) -> None:
    logits, ids = random_logits(1)
    assert_same_filter(apply_top_k(logits, k), TopKLogitsWarper(k)(ids, logits.clone()))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_keeps_ties_as_hf_does(k: int) -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0], [1.0, 1.0, 0.0, 1.0, 5.0]])
    ids = torch.zeros(2, 1, dtype=torch.long)
    assert_same_filter(apply_top_k(logits, k), TopKLogitsWarper(k)(ids, logits.clone()))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_equals_hf(p: float) -> None:
    logits, ids = random_logits(2)
    ours = apply_top_p(logits, p)
    assert_same_filter(ours, TopPLogitsWarper(p)(ids, logits.clone()))
    assert ours.isfinite().sum(-1).min() >= 1 and ours.isfinite().sum(-1).max() < logits.shape[-1]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_hf(penalty: float) -> None:
    logits, ids = random_logits(3)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert not torch.equal(theirs, logits)
    assert_same_filter(apply_repetition_penalty(logits, ids, penalty), theirs)


@pytest.fixture(scope="module")
def llama_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return tiny_llama_pair(bos_token_id=None, eos_token_id=None, pad_token_id=0)


def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new: int, **options) -> list[list[int]]:
    """HF generate on left-padded prompts (pad 0, masked), `new` tokens each, no EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **options)
    return out[:, width:].tolist()


PROMPTS = {
    "equal": [[5, 17, 33, 2, 9, 41], [60, 3, 3, 71, 12, 8]],
    "ragged": [[5, 17, 33, 2, 9, 41], [60, 3], [88, 14, 29, 7]],
}


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("prompts", sorted(PROMPTS))
@pytest.mark.parametrize("penalty", [1.0, 1.8])
def test_greedy_generation_equals_hf(llama_pair, prompts: str, penalty: float, fast_decode: bool) -> None:
    ours, hf = llama_pair
    theirs = hf_generate(hf, PROMPTS[prompts], 24, do_sample=False, repetition_penalty=penalty)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=penalty, max_new_tokens=24)
    assert generate(ours, PROMPTS[prompts], sampling, fast_decode=fast_decode) == theirs


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 10},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.5},
    ],
)
def test_seeded_sampling_draws_what_hf_draws_under_the_same_seed(llama_pair, options: dict) -> None:
    """Both draw with torch.multinomial from the same filtered distribution, one call per step: the
    same seed gives the same tokens (HF draws from the global generator, tformer from its own)."""
    ours, hf = llama_pair
    prompts = PROMPTS["equal"]
    torch.manual_seed(1234)
    hf_options = {"top_k": 0, "top_p": 1.0} | options
    theirs = hf_generate(hf, prompts, 24, do_sample=True, **hf_options)
    drawn = generate(ours, prompts, SamplingConfig(seed=1234, max_new_tokens=24, **options))
    assert drawn == theirs
    torch.manual_seed(99)
    assert hf_generate(hf, prompts, 24, do_sample=True, **hf_options) != theirs  # the seed matters


@pytest.mark.parametrize("fast_decode", [True, False])
def test_min_new_tokens_holds_eos_back_as_hf_does(llama_pair, fast_decode: bool) -> None:
    """EOS is the token greedy decoding picks second: with min_new_tokens=5 neither side may draw it
    before the 6th token; both then stop where HF's MinNewTokensLengthLogitsProcessor lets it through."""
    ours, hf = llama_pair
    prompts = PROMPTS["ragged"]
    free = generate(ours, prompts, SamplingConfig(temperature=0.0, max_new_tokens=24))
    eos = free[0][1]
    early = generate(ours, prompts, SamplingConfig(temperature=0.0, max_new_tokens=24), eos_id=eos)
    assert len(early[0]) == 1  # without the minimum, row 0 ends at its second token
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=24, min_new_tokens=5)
    held = generate(ours, prompts, sampling, eos_id=eos, fast_decode=fast_decode)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        min_new_tokens=5,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )[:, width:].tolist()
    theirs = [row[: row.index(eos)] if eos in row else row for row in out]  # tformer strips EOS and after
    assert held == theirs
    assert all(len(row) >= 5 and eos not in row[:5] for row in held)
    assert len(held[0]) > 1
