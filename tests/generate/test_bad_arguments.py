"""The Python API's decoding entry points refuse bad arguments by name: generate (decoder LMs), search
(encoder-decoders), Translator and Classifier. Before, floats in a prompt were silently truncated to
ids, a string was taken as a list of its characters, an out-of-range pad or banned id failed deep
inside torch only when reached, and an out-of-range EOS was never reached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.generate.helpers import tiny_translator_and_classifier
from tformer import build_model
from tformer.generate import SamplingConfig
from tformer.generate.beam import SearchConfig, beam_search, search
from tformer.generate.engine import generate
from tformer.model.checks import NonFiniteOutputError
from tformer.presets import tiny

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=3)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return build_model(tiny().replace(vocab_size=32, max_seq_len=16)).eval()


@pytest.fixture(scope="module")
def seq2seq():
    torch.manual_seed(0)
    return build_model(tiny("encoder_decoder").replace(vocab_size=24, max_seq_len=16)).eval()


@pytest.mark.parametrize(
    "prompts, error, needle",
    [
        ([[1.7, 2.2]], TypeError, "prompt 0 holds 1.7: token ids are integers"),
        ([[1, True]], TypeError, "prompt 0 holds True"),
        ([np.array([1.0, 2.0])], TypeError, r"prompt 0 holds np.float64\(1.0\)"),
        ([1, 2, 3], TypeError, "prompt 0 must be a list of token ids, got int"),
        (["to be"], TypeError, "prompt 0 must be a list of token ids, got str"),
        ("to be", TypeError, "prompts must be a list of token-id lists"),
        (7, TypeError, "prompts must be a list of token-id lists"),
        ([[1, 2], []], ValueError, "prompt 1 is empty"),
        (torch.tensor([1, 2, 3]), TypeError, "got a 1-D tensor; wrap one prompt in a list"),
        (
            [torch.ones(2, 2, dtype=torch.long)],
            TypeError,
            "prompt 0 must be a list of token ids, got a 2-D Tensor",
        ),
        ([{1, 2}], TypeError, "prompt 0 must be a list of token ids, got set"),
        ([[1, 2, 3, 4, 5], [7, -1]], ValueError, r"prompt 1 holds id -1 at index 1; allowed ids are 0..31"),
        ([[1, 2**63]], ValueError, "prompt 0 holds id 9223372036854775808 at index 1"),
        ([[1, 32]], ValueError, "prompt 0 holds id 32 at index 1"),
        (
            [[1] * 16],
            ValueError,
            r"the prompt \(16 tokens\) leaves no room for new tokens .* context of 16 tokens",
        ),
    ],
)
def test_generate_refuses_prompts_that_are_not_lists_of_int_ids(lm, prompts, error, needle) -> None:
    with pytest.raises(error, match=needle):
        generate(lm, prompts, GREEDY)


def test_generate_takes_integer_ids_of_any_kind(lm) -> None:
    """Tuples, NumPy arrays and ints, tensors: the same tokens as plain lists."""
    want = generate(lm, [[1, 2, 3], [4, 5]], GREEDY, eos_id=30)
    for prompts in (
        [(1, 2, 3), (4, 5)],
        [np.array([1, 2, 3]), np.array([4, 5])],
        [torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
        (p for p in [[1, 2, 3], [4, 5]]),
    ):
        assert generate(lm, prompts, GREEDY, eos_id=np.int64(30), pad_id=np.int64(0)) == want


def test_generate_checks_its_ids_model_and_settings(lm, seq2seq) -> None:
    for kwargs, needle in (
        ({"pad_id": 99}, r"pad_id must be a token id in \[0, 32\), got 99"),
        ({"eos_id": 999}, r"eos_id must be a token id in \[0, 32\), got 999"),
        ({"eos_id": -1}, "eos_id must be a token id"),
    ):
        with pytest.raises(ValueError, match=needle):
            generate(lm, [[1, 2], [3]], GREEDY, **kwargs)
    with pytest.raises(
        ValueError, match="decoder LM, .*'encoder_decoder'.* with tformer.generate.beam.search$"
    ):
        generate(seq2seq, [[1, 2]], GREEDY)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, got dict"):
        generate(lm, [[1, 2]], {"temperature": 0.0})  # type: ignore[arg-type]
    assert len(generate(lm, [[1, 2], [3]], GREEDY, eos_id=31, pad_id=0)) == 2  # valid ids still work


def test_generate_names_a_model_whose_logits_are_not_finite() -> None:
    torch.manual_seed(0)
    model = build_model(tiny().replace(vocab_size=32, max_seq_len=16)).eval()
    with torch.no_grad():
        model.final_norm.weight[0] = float("nan")
    for sampling in (GREEDY, SamplingConfig(temperature=1.0, max_new_tokens=3)):  # greedy had returned id 0
        with pytest.raises(NonFiniteOutputError, match="logits after the prompt are NaN or infinite"):
            generate(model, [[1, 2]], sampling)


def test_every_search_and_the_classifier_name_outputs_that_are_not_finite() -> None:
    """A NaN model had given an empty translation by beam search and NaN probabilities, as results."""
    translator, classifier = tiny_translator_and_classifier()
    with torch.no_grad():
        translator.model.lm_head.weight[7] = float("nan")  # one vocabulary entry's logit
        classifier.model.head.bias[1] = float("inf")
    for cfg in (SearchConfig(beam_size=4), SearchConfig(method="greedy"), SearchConfig(method="sample")):
        with pytest.raises(NonFiniteOutputError, match="logits are NaN or infinite"):
            translator.translate(["the dog barked"], cfg)
    with pytest.raises(NonFiniteOutputError, match="class logits are NaN or infinite"):
        classifier.classify(["the market rose"])


def test_eval_refuses_scores_that_are_not_finite() -> None:
    from tformer.cli.evaluate import check_finite_scores

    check_finite_scores({"eval_loss": 2.5, "checkpoint_step": 4, "data": "x"})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteOutputError, match=f"the run's eval_loss is {bad}: the model's outputs"):
            check_finite_scores({"eval_loss": bad})


def test_callbacks_and_sampling_helpers_check_their_arguments(lm) -> None:
    from tformer.generate.sampling import apply_top_k, sample_next

    with pytest.raises(TypeError, match="decode must be a function"):  # had failed after a step
        generate(lm, [[1]], GREEDY.replace(stop_strings=("x",)), decode="abc")
    with pytest.raises(TypeError, match="on_step must be a function"):
        generate(lm, [[1]], GREEDY, on_step=3)
    logits = torch.zeros(2, 4)
    logits[1, 2] = float("nan")
    for temperature in (0.0, 1.0):  # greedy had picked the NaN's index, sampling failed inside torch
        with pytest.raises(ValueError, match="the logits of row 1 hold NaN or \\+inf"):
            sample_next(logits, temperature=temperature, generator=None)
    masked = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])  # -inf marks a masked token: fine
    assert int(sample_next(masked, temperature=0.0, generator=None)) == 2
    with pytest.raises(TypeError, match="top_k must be an int, got 2.5"):
        apply_top_k(torch.zeros(1, 4), 2.5)


def test_search_checks_its_ids_model_and_source(lm, seq2seq) -> None:
    src = torch.randint(3, 24, (2, 5))
    cfg = SearchConfig(method="greedy", max_len_a=0.0, max_len_b=4)
    ids = dict(bos_id=1, eos_id=2)
    with pytest.raises(ValueError, match=r"banned id must be a token id in \[0, 24\), got 99"):
        search(seq2seq, src, None, cfg, banned=[99], **ids)
    with pytest.raises(ValueError, match="banned ids cover the whole vocabulary of 24 tokens"):
        search(seq2seq, src, None, cfg, banned=range(24), **ids)
    with pytest.raises(ValueError, match="eos_id 2 is among the banned ids: no output could end"):
        search(seq2seq, src, None, cfg, banned=[0, 2], **ids)  # had run to max_len, never finished
    with pytest.raises(ValueError, match="eos_id must be a token id"):
        search(seq2seq, src, None, cfg, bos_id=1, eos_id=24)
    with pytest.raises(TypeError, match=r"src must be a \(batch, length\) tensor"):
        search(seq2seq, src[0], None, cfg, **ids)
    with pytest.raises(TypeError, match=r"src must be a \(batch, length\) tensor"):
        search(seq2seq, src.tolist(), None, cfg, **ids)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="src_mask must be a bool tensor of src's shape"):
        search(seq2seq, src, torch.ones(2, 4, dtype=torch.bool), cfg, **ids)
    with pytest.raises(ValueError, match="src_mask must be a bool tensor of src's shape"):
        search(seq2seq, src, torch.ones(2, 5), cfg, **ids)  # float: refused here, not inside the model
    with pytest.raises(TypeError, match="cfg must be a SearchConfig, got NoneType"):
        search(seq2seq, src, None, None, **ids)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="banned must be a list of token ids, got int"):
        search(seq2seq, src, None, cfg, banned=3, **ids)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beam_size must be an int >= 1, got 0"):
        beam_search(seq2seq, src, None, max_len=4, beam_size=0, **ids)
    assert search(seq2seq, src.int(), None, cfg, **ids) == search(seq2seq, src, None, cfg, **ids)  # int32 ids
    with pytest.raises(
        ValueError, match="encoder-decoder, .*'decoder'.* with tformer.generate.engine.generate$"
    ):
        search(lm, src, None, cfg, **ids)
    assert len(search(seq2seq, src, None, cfg, banned=[5], **ids)) == 2


def test_translator_and_classifier_take_lists_of_non_empty_strings() -> None:
    translator, classifier = tiny_translator_and_classifier()
    long_text = ["the market rose " * 20]
    for call in (lambda t: translator.translate(t, SearchConfig(method="greedy")), classifier.classify):
        with pytest.warns(
            UserWarning,
            match=r"1 text\(s\) longer than (31 tokens \(the model reads 32, the [EB]OS among them\)|32 tokens) were truncated \(index 0\)",
        ):
            assert len(call(long_text)) == 1
    for call in (lambda t: translator.translate(t, SearchConfig(method="greedy")), classifier.classify):
        with pytest.raises(TypeError, match=r"wrap one text in a list: \[text\]"):
            call("the market")
        with pytest.raises(ValueError, match="text 1 is empty"):
            call(["the market", "  "])
        with pytest.raises(TypeError, match="text 0 is a int, not a str"):
            call([3])
        assert len(call(["the market", "the dog"])) == 2
        assert len(call(t for t in ["the market", "the dog"])) == 2  # a generator is read once
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        classifier.probabilities([[5, 6]], batch_size=0)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_a_model_on_the_meta_device_is_named_before_any_compute(arch: str) -> None:
    """It had returned a meta tensor for CPU ids, or failed inside torch's `.item()` for meta ids."""
    with torch.device("meta"):
        model = build_model(tiny(arch))
    ids = torch.randint(0, 100, (1, 4))
    for given in (ids, ids.to("meta")):
        with pytest.raises(ValueError, match="the model is on the meta device"):
            model(given, given) if arch == "encoder_decoder" else model(given)
    if arch == "decoder":
        with pytest.raises(ValueError, match="the model is on the meta device"):
            generate(model, [[1, 2, 3]], SamplingConfig(max_new_tokens=2))
    if arch == "encoder_decoder":
        with pytest.raises(ValueError, match="the model is on the meta device"):
            search(model, ids, None, SearchConfig(method="greedy", max_len=3), bos_id=1, eos_id=2)


def test_translator_and_classifier_take_integer_ids_and_keep_the_models_mode() -> None:
    """Float ids had been truncated in silence; an error mid-way had left the model in eval mode."""
    translator, classifier = tiny_translator_and_classifier()
    tok, pair = classifier.tokenizer, translator.model
    search_cfg = SearchConfig(method="greedy", max_len=4)
    for call, what in (
        (classifier.probabilities, "text"),
        (lambda ids: translator.hypotheses(ids, search_cfg), "source"),
    ):
        with pytest.raises(TypeError, match=rf"{what} 0 holds 1.9: token ids are integers"):
            call([[1.9, 2.9]])
        with pytest.raises(
            ValueError, match=rf"{what} 1 holds id 999 at index 0; allowed ids are 0..{tok.vocab_size - 1}"
        ):
            call([[5, 6], [999]])

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    for model, call in ((classifier.model, lambda: classifier.probabilities([[5, 6]])),
                        (pair, lambda: translator.hypotheses([[5, 6]], search_cfg))):  # fmt: skip
        assert model.training  # as build_model returns it
        with pytest.MonkeyPatch.context() as patch:  # a batch that raises once the model is in eval mode
            patch.setattr(model, "forward", fails)
            patch.setattr(model, "encode", fails, raising=False)
            with pytest.raises(RuntimeError, match="out of memory"):
                call()
        assert model.training


def test_flags_take_true_or_false_not_a_truthy_string(lm, seq2seq) -> None:
    """compile="no" had run the compiled step (a truthy string), fast_decode="no" the fast path."""
    for flags in ({"compile": "no"}, {"fast_decode": "no"}, {"compile": 1}):
        with pytest.raises(TypeError, match=rf"{next(iter(flags))} must be True or False, got"):
            generate(lm, [[1]], GREEDY, **flags)
    src = torch.tensor([[3, 4, 5]])
    with pytest.raises(TypeError, match="fast_decode must be True or False, got 'no'"):
        search(
            seq2seq, src, None, SearchConfig(method="greedy", max_len=3), bos_id=1, eos_id=2, fast_decode="no"
        )
    with pytest.raises(TypeError, match="cached must be True or False, got 'no'"):
        beam_search(seq2seq, src, None, bos_id=1, eos_id=2, max_len=3, cached="no")


def test_the_low_level_searches_check_their_model_source_lengths_and_seed(lm, seq2seq) -> None:
    """beam_search / sample_search had taken max_len "4" or 3.7 (as 4 and 3) and min_len -5, and failed
    inside Python or torch on a list source, a decoder LM or a str seed."""
    from tformer.generate.beam import sample_search

    src, ids = torch.tensor([[3, 4, 5]]), dict(bos_id=1, eos_id=2)
    for fn in (beam_search, sample_search):
        for max_len in ("4", 3.7, True, torch.tensor([3.0])):
            with pytest.raises(TypeError, match="max_len must be an int or a \\(B,\\) integer tensor"):
                fn(seq2seq, src, None, max_len=max_len, **ids)
        with pytest.raises(
            ValueError, match="min_len must be an int >= 0 \\(0: EOS may come first\\), got -5"
        ):
            fn(seq2seq, src, None, max_len=3, min_len=-5, **ids)
        with pytest.raises(TypeError, match="src must be a \\(batch, length\\) tensor of token ids"):
            fn(seq2seq, [[3, 4]], None, max_len=3, **ids)
        with pytest.raises(ValueError, match=f"{fn.__name__} needs an encoder-decoder, got a model of arch 'decoder'"):  # fmt: skip
            fn(lm, src, None, max_len=3, **ids)
    for seed in ("x", 1.5):
        with pytest.raises(TypeError, match="seed must be an int"):
            sample_search(seq2seq, src, None, max_len=3, temperature=1.0, seed=seed, **ids)
    # a min_len the max_len leaves no room for is legal: the outputs end unfinished at max_len
    (hyp,) = beam_search(seq2seq, src, None, max_len=3, min_len=10, **ids)
    assert len(hyp.tokens) == 3 and not hyp.finished


def test_a_decode_function_that_returns_no_text_is_named(lm) -> None:
    """It had failed inside the stop-string check ("argument of type 'int' is not iterable")."""
    stops = SamplingConfig(temperature=0.0, max_new_tokens=3, stop_strings=["a"])
    with pytest.raises(TypeError, match="decode must return the text \\(a str\\) of the token ids it is given, got int"):  # fmt: skip
        generate(lm, [[1]], stops, decode=lambda ids: len(ids))
