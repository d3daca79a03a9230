"""Public API misuse that a read-and-run audit found answered with torch's errors, an AttributeError or a
silently wrong result: each is now a named ValueError / TypeError, or the right result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tformer import ConfigError
from tformer.data.datasets import ClassificationDataset, Seq2SeqDataset
from tformer.data.loader import make_bucket_loader
from tformer.eval.bleu import score_translations
from tformer.eval.classification import score_classification
from tformer.generate.sampling import apply_temperature, apply_top_p, make_generator, sample_next


def test_evaluation_arguments_are_named_before_any_run_is_read() -> None:
    from tformer.tasks import classification, translation

    for module in (translation, classification):  # checked first: no run is needed to see them refused
        with pytest.raises(ValueError, match=r"unknown split 'dev'; the splits are train, val, test"):
            module.evaluate_run("no/such/run", "dev")
        for bad in (0, -1, 1.5, True):  # 0 had scored nothing (an LM's read as a perfect score)
            with pytest.raises(ValueError, match=r"max_batches must be an integer >= 1 \(or None"):
                module.evaluate_run("no/such/run", "test", max_batches=bad)


def test_evaluation_counts_may_be_numpy_integers() -> None:
    from tformer.tasks.stream import check_eval_args

    for fine in (np.int64(3), 3, None):  # the whole split with None
        check_eval_args(fine, "test")


def test_a_trained_runs_task_evaluation_and_load_run(trained_run) -> None:
    from tformer.runs import load_run
    from tformer.tasks import make_task

    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    run = load_run(trained_run)  # builds a model, whose random init the checkpoint replaces
    assert torch.equal(torch.rand(3), want)  # the caller's RNG stream is where it was
    task = make_task("lm")
    task.setup(run.train_config, trained_run, torch.device("cpu"), resume=True)
    with pytest.raises(ValueError, match="max_batches must be an integer >= 1"):
        task.evaluate(run.model, 0)  # had returned eval_loss 0.0, perplexity 1.0
    assert task.evaluate(run.model, 1)["eval_loss"] > 0


def test_expert_parallelism_and_plans_check_their_arguments() -> None:
    from tests.conftest import tiny
    from tformer import MoEConfig, build_model
    from tformer.distributed.expert_parallel import apply_expert_parallel
    from tformer.distributed.plans import make_plan
    from tformer.train.config import ParallelConfig

    model = build_model(tiny().replace(moe=MoEConfig(n_experts=4, top_k=2)))
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 5"):
        apply_expert_parallel(model, 5, 2)  # had left every expert weight with 0 experts
    with pytest.raises(RuntimeError, match="initialise a process group first"):
        apply_expert_parallel(model, 0, 1)  # had failed in the next forward, inside torch.distributed
    assert model.blocks[0].ffn.experts.up_proj.shape[0] == 4  # untouched by the refusals
    for bad in (0, -1):
        with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
            make_plan(ParallelConfig(), bad)


def test_datasets_and_loaders_refuse_what_they_would_bend() -> None:
    with pytest.raises(ValueError, match=r"labels must be class ids \(ints >= 0\): label 0 is 0.5"):
        ClassificationDataset([[1, 2, 3]], [0.5], max_len=4)  # had become class 0
    for bad in (0, -1):  # -1 had dropped the last token, 0 made an empty sequence
        with pytest.raises(ValueError, match="max_len must be an integer >= 1"):
            ClassificationDataset([[1, 2, 3]], [0], max_len=bad)
    ds = ClassificationDataset([[1, 2], [3]], np.array([1, 0]), max_len=4)  # NumPy / tensor labels are fine
    assert ds[0][1].item() == 1 and ClassificationDataset([[1]], torch.tensor([2]), 4)[0][1].item() == 2
    with pytest.raises(ValueError, match="max_tgt_len must be an integer >= 2"):
        Seq2SeqDataset([([1], [2])], max_src_len=4, max_tgt_len=1)
    with pytest.raises(ValueError, match="lengths has 2 entries for a dataset of 3 items"):
        make_bucket_loader(ClassificationDataset([[1], [2], [3]], [0, 1, 0], 4), lengths=[1, 1], batch_size=2)


def test_scoring_functions_take_arrays_and_refuse_what_they_would_misread() -> None:
    scores = score_classification(np.array([0, 1, 1]), torch.tensor([0, 1, 0]), ["a", "b"])
    assert scores.accuracy == pytest.approx(2 / 3)
    assert scores == score_classification([0, 1, 1], [0, 1, 0], ["a", "b"])
    with pytest.raises(TypeError, match="y_pred must hold class ids"):
        score_classification([0, 1], [0.0, 1.0], ["a", "b"])
    with pytest.raises(ValueError, match="labels must be distinct class names"):
        score_classification([0, 1], [0, 1], ["a", "a"])  # per_class had kept one of the two
    with pytest.raises(TypeError, match="hypotheses must be a list of sentences"):
        score_translations("the cat", "the dog")  # had scored letters as sentences
    with pytest.raises(ValueError, match="unknown BLEU tokenize 'xx'; sacrebleu has .*13a"):
        score_translations(["a"], ["a"], tokenize="xx")


def test_corpus_names_and_split_fractions_are_checked() -> None:
    from tformer.data.corpora import corpus_task, load_corpus

    for call in (lambda: load_corpus(3), lambda: corpus_task(None)):
        with pytest.raises(TypeError, match="a corpus name is a str"):
            call()
    with pytest.raises(ValueError, match=r"val_frac must be a fraction in \[0, 1\), got -0.1"):
        load_corpus("bbc-news", val_frac=-0.1)  # had made a 5-text validation split
    with pytest.raises(ValueError, match="val_frac 0.6 \\+ test_frac 0.5 leave nothing to train on"):
        load_corpus("bbc-news", val_frac=0.6, test_frac=0.5)


def test_sampling_helpers_name_a_bad_argument() -> None:
    logits = torch.zeros(2, 5)
    for call, needle in (
        (lambda: apply_temperature(logits, "1"), "temperature must be a number, got str"),
        (lambda: apply_top_p(logits, None), "top_p must be a number, got NoneType"),
        (lambda: sample_next(logits, temperature=None, generator=None), "temperature must be a number"),
        (lambda: sample_next(logits, generator=3), "generator must be a torch.Generator"),
        (lambda: make_generator("1"), "seed must be an int, got str"),
    ):
        with pytest.raises(TypeError, match=needle):
            call()
    with pytest.raises(ValueError, match=r"logits must be \(B, V\) with V >= 1, got shape \(2, 0\)"):
        sample_next(torch.zeros(2, 0), generator=None)
    with pytest.raises(ValueError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
        make_generator(2**70)


def test_an_override_key_that_is_not_a_name_is_a_type_error() -> None:
    from tformer.train.config import TrainConfig

    with pytest.raises(TypeError, match="override keys are dotted field names"):
        TrainConfig().with_overrides({1: 5})
    assert issubclass(ConfigError, ValueError)


def test_beam_and_sample_search_check_their_ids_as_search_does() -> None:
    from tformer import build_model
    from tformer.generate.beam import beam_search, sample_search
    from tformer.presets import tiny

    model = build_model(tiny("encoder_decoder").replace(vocab_size=30)).eval()
    src = torch.randint(4, 30, (2, 5))
    with pytest.raises(ValueError, match="banned id .*50"):  # had raised IndexError from the logits
        beam_search(model, src, None, bos_id=1, eos_id=2, max_len=4, banned=[50])
    with pytest.raises(ValueError, match="eos_id .*99"):  # had been accepted: no output could end
        sample_search(model, src, None, bos_id=1, eos_id=99, max_len=4)
    with pytest.raises(ValueError, match="banned ids cover the whole vocabulary of 30 tokens"):
        beam_search(model, src, None, bos_id=1, eos_id=2, max_len=4, banned=range(30))
    assert (
        len(beam_search(model, src, None, bos_id=1, eos_id=2, max_len=4, banned=[2])) == 2
    )  # runs to max_len


def test_switches_take_true_or_false_not_a_truthy_string(trained_run, tmp_path) -> None:
    """strict="no" and resume="yes" are truthy: they had switched the option on. Each is a TypeError now,
    before anything is read or written."""
    from tformer.runs import find_checkpoint, load_run
    from tformer.train.checkpoint import load_checkpoint
    from tformer.train.loop import Trainer
    from tformer.train.presets import get_train_preset
    from tformer.train.weights import import_torch_weights, load_weights

    ckpt = find_checkpoint(trained_run)
    model = load_run(trained_run).model
    for flag in ("strict", "restore_rng", "verify"):
        with pytest.raises(TypeError, match=rf"{flag} must be True or False, got 'no'"):
            load_checkpoint(ckpt, model, **{flag: "no"})
    for flag in ("strict", "trust_pickle"):
        with pytest.raises(TypeError, match=rf"{flag} must be True or False, got 1"):
            load_weights(model, ckpt / "model.safetensors", **{flag: 1})
    with pytest.raises(TypeError, match=r"trust_pickle must be True or False, got 'no'"):
        import_torch_weights(tmp_path / "weights.pt", trust_pickle="no")
    with pytest.raises(TypeError, match=r"resume must be True or False, got 'yes'"):
        Trainer(get_train_preset("tiny-lm"), tmp_path / "run", task=None, resume="yes")
    assert not (tmp_path / "run").exists()


def test_kv_cache_reorder_names_a_bad_index_and_leaves_the_cache_as_it_was() -> None:
    """reorder had passed any index to index_select: torch's own error, or a float index's, from deep inside."""
    from tformer.model.cache import KVCache

    cache = KVCache(2, 8)
    for layer in range(2):
        cache.update(layer, torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5))
    before = [t[:, :, :4].clone() for t in cache.k + cache.v]  # the filled slots
    bad = {
        r"1-D int64 tensor of the batch rows to keep, got torch.float32 tensor of shape \(2,\)": torch.tensor(
            [0.0, 1]
        ),
        r"1-D int64 tensor of the batch rows to keep, got torch.int64 tensor of shape \(1, 2\)": torch.tensor(
            [[0, 1]]
        ),
        r"1-D int64 tensor of the batch rows to keep, got \[0, 1\]": [0, 1],
        r"picks rows 0 to 3; the cache holds rows 0 to 2": torch.tensor([0, 3]),
        r"picks rows -1 to 1; the cache holds rows 0 to 2": torch.tensor([-1, 1]),
    }
    for message, index in bad.items():
        with pytest.raises(ValueError, match=message):
            cache.reorder(index)
    with pytest.raises(ValueError, match=r"reorder's index is on meta, the cache on cpu"):
        cache.reorder(torch.tensor([0, 1], device="meta"))
    with pytest.raises(TypeError, match=r"source must be the memory states \(a tensor\) or None, got list"):
        cache.reorder(torch.tensor([2, 0]), source=[1])
    assert all(torch.equal(a[:, :, :4], b) for a, b in zip(cache.k + cache.v, before))
    cache.reorder(torch.tensor([2, 0], dtype=torch.int32))  # int32 is an index too
    assert torch.equal(cache.k[1][:, :, :4], before[1].index_select(0, torch.tensor([2, 0])))
