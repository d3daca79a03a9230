"""`generate` details the other engine tests leave open: rows of one batch that end at different steps
(what `on_step` reports, when the loop stops), and the model's training mode while and after decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from tformer import build_model
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.presets import tiny

from .test_engine import V, constant_logits_model

EOS, OTHER = 4, 7


def _ragged_ends(max_new: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    """(outputs, on_step reports) of a 3-row batch that draws EOS or token 7 with probability 1/2 each at
    every step (top-2 of a model whose logits put both at 5, every other token at 0), under the first seed
    whose rows end at different steps."""
    logits = [0.0] * 8
    logits[EOS] = logits[OTHER] = 5.0
    model = constant_logits_model(logits)
    prompts = [[9, 10], [11], [12, 13, 14]]
    for seed in range(50):
        steps: list[torch.Tensor] = []
        cfg = SamplingConfig(temperature=1.0, top_k=2, max_new_tokens=max_new, seed=seed)
        out = generate(model, prompts, cfg, eos_id=EOS, on_step=steps.append)
        if len({len(row) for row in out}) == len(prompts):  # every row ends at its own step
            return out, [s.tolist() for s in steps]
    raise AssertionError("no seed in 0..49 ends the rows at different steps")


def test_rows_ending_at_different_steps_each_run_until_their_own_eos() -> None:
    """A row stops at its own EOS, not at another row's: every row shorter than the budget was ended by
    EOS, and the loop runs until the last row ends (one step per token of the longest row, its EOS
    included, at most max_new_tokens)."""
    max_new = 12
    out, steps = _ragged_ends(max_new)
    for row in out:
        assert all(t == OTHER for t in row)  # only the two drawable tokens; EOS stripped
    ended = [len(row) < max_new for row in out]
    for r, row in enumerate(out):
        drawn = [s[r] for s in steps if s[r] >= 0]
        assert drawn == (row + [EOS] if ended[r] else row)  # each row's tokens as reported, EOS last
    assert len(steps) == min(max_new, max(len(row) + 1 if e else len(row) for row, e in zip(out, ended)))


def test_on_step_reports_minus_one_for_rows_that_have_ended() -> None:
    """Streaming reads on_step: a row that drew EOS is reported as -1 at every later step (its slot
    then holds no token of the row)."""
    out, steps = _ragged_ends()
    for r, row in enumerate(out):
        end = len(row)  # the step at which row r drew EOS (if it did)
        for s in steps[end + 1 :]:
            assert s[r] == -1
        for s in steps[: end + 1]:
            assert s[r] >= 0


@pytest.mark.parametrize("fast_decode", [True, False])
def test_a_model_in_training_mode_decodes_without_dropout_and_keeps_its_mode(fast_decode: bool) -> None:
    """Decoding runs in eval mode (no dropout): a model in training mode with dropout 0.5 gives the tokens
    its eval-mode copy gives; afterwards it (every submodule) is in training mode again, also when a
    callback raises mid-decoding."""
    torch.manual_seed(0)
    model = build_model(tiny().replace(vocab_size=V, dropout=0.5)).train()
    reference = copy.deepcopy(model).eval()
    prompts, cfg = [[5, 17, 33, 2, 9], [60, 3]], SamplingConfig(temperature=0.0, max_new_tokens=10)
    want = generate(reference, prompts, cfg, fast_decode=fast_decode)
    assert generate(model, prompts, cfg, fast_decode=fast_decode) == want
    assert all(m.training for m in model.modules())

    def fail(_ids) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, prompts, cfg, on_step=fail, fast_decode=fast_decode)
    assert all(m.training for m in model.modules())


def test_eos_ends_a_row_when_stop_strings_are_given_too() -> None:
    """Stop strings are checked besides EOS, not instead of it: a model whose top token is EOS ends at its
    first step (one on_step call, EOS stripped) with a stop string that never appears."""
    model = constant_logits_model([0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 3.0])
    steps: list[torch.Tensor] = []

    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6, stop_strings=("never",))
    assert generate(model, [[9, 10], [11]], cfg, eos_id=EOS, decode=decode, on_step=steps.append) == [[], []]
    assert [s.tolist() for s in steps] == [[EOS, EOS]]
