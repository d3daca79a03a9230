"""`generate`'s own bookkeeping: positions of left-padded rows, when EOS may come, stop strings, and
when the loop ends; on models whose next-token logits are known by construction."""

from __future__ import annotations

import pytest
import torch

from tformer import build_model
from tformer.generate.engine import generate, truncate_at_stop
from tformer.generate.sampling import SamplingConfig
from tformer.presets import tiny

V = 97


def constant_logits_model(logits: list[float]) -> torch.nn.Module:
    """A decoder whose next-token logits are `logits` (padded with 0) after any input: the final
    LayerNorm's weight is 0 and its bias a unit vector, which the head maps to the logits."""
    torch.manual_seed(0)
    model = build_model(tiny().replace(vocab_size=V, norm="layernorm", tie_embeddings=False)).eval()
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.bias.zero_()
        model.final_norm.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[: len(logits), 0] = torch.tensor(logits)
    return model


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_a_left_padded_row_decodes_as_it_does_alone_with_absolute_positions(positions, fast_decode) -> None:
    """Each row's prompt takes positions 0..n-1 and its first new token n, whatever the padding; the
    position table is made to dominate the embedding so a shift by one changes the tokens."""
    torch.manual_seed(0)
    model = build_model(tiny().replace(vocab_size=V, positions=positions, embed_scale=True)).eval()
    if positions == "learned":
        with torch.no_grad():
            model.input_positions.pos_embed.weight.normal_(0.0, 3.0)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    long, short = [5, 17, 33, 2, 9, 41, 8], [60, 3]
    alone = [generate(model, [p], cfg, fast_decode=fast_decode)[0] for p in (long, short)]
    assert generate(model, [long, short], cfg, fast_decode=fast_decode) == alone
    assert alone[1] != generate(model, [[0, *short]], cfg, fast_decode=fast_decode)[0]  # positions matter


@pytest.mark.parametrize("minimum", [0, 1, 3])
def test_eos_comes_exactly_when_min_new_tokens_allows_and_the_loop_stops_there(minimum) -> None:
    """EOS (id 4) is the model's top token at every step: the output is the minimum's worth of the next
    best token (id 7), then EOS (stripped); no step runs after every row ended."""
    model = constant_logits_model([0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 3.0])
    steps = []
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, min_new_tokens=minimum)
    out = generate(model, [[9, 10], [11]], cfg, eos_id=4, on_step=steps.append)
    assert out == [[7] * minimum, [7] * minimum]
    assert len(steps) == minimum + 1 and steps[-1].tolist() == [4, 4]


def test_the_pad_slots_of_a_ragged_batch_are_no_history_for_the_repetition_penalty() -> None:
    """Token 0 is the model's favourite: alone, the short row picks it first (then, penalised, id 5); in
    a batch its left padding must not count as having seen token 0."""
    model = constant_logits_model([2.0, 0.0, 0.0, 0.0, 0.0, 1.9, 1.8])
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=3, repetition_penalty=50.0)
    long, short = [9, 10, 11, 12], [13]
    alone = generate(model, [short], cfg, pad_id=20)[0]
    assert alone == [0, 5, 6]
    assert generate(model, [long, short], cfg, pad_id=20) == [generate(model, [long], cfg)[0], alone]


def test_a_stop_string_completed_inside_a_token_ends_the_row() -> None:
    """Each token decodes to "<id>": a stop string "<7" is whole once id 7 is drawn, with ">" after it in
    the same token; the row ends there (the caller cuts the text at the stop string)."""
    model = constant_logits_model([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])

    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    cfg = SamplingConfig(temperature=0.0, max_new_tokens=5, stop_strings=("<7",))
    out = generate(model, [[9]], cfg, decode=decode)
    assert out == [[7]]
    assert truncate_at_stop(decode(out[0]), cfg.stop_strings) == ""


def test_truncate_at_stop_cuts_at_the_first_of_several_stop_strings() -> None:
    assert truncate_at_stop("to be or not to be", ["not", "or"]) == "to be "
    assert truncate_at_stop("to be or not to be", ["xyz"]) == "to be or not to be"
    assert truncate_at_stop("to be", ["to"]) == ""
