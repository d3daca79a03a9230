"""Config validation at its boundaries: each limit refuses the first value past it (naming the field)
and takes the value on it; the reading of config files and --set values in the corners."""

from __future__ import annotations

import argparse
import warnings

import pytest

from tformer import ConfigError, ModelConfig, MoEConfig, RopeConfig
from tformer.cli.options import input_lines, parse_overrides, resolve_train_config
from tformer.config import MAX_BPE_VOCAB, MAX_SIZE
from tformer.train.config import (
    DataConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    refuse_ignored_settings,
)
from tformer.train.presets import TRAIN_PRESETS, get_train_preset


def refused(build, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        build()
    assert needle in str(err.value), str(err.value)


# ---------------------------------------------------------------- model configs


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: RopeConfig(fraction=0.0), "RopeConfig.fraction must be in (0, 1], got 0.0"),
        (lambda: RopeConfig(original_max_seq_len=0), "RopeConfig.original_max_seq_len must be > 0, got 0"),
        (
            lambda: RopeConfig(yarn_beta_fast=32.0, yarn_beta_slow=0.0),
            "RopeConfig.yarn_beta_fast must be > yarn_beta_slow > 0, got 32.0",
        ),
        (lambda: MoEConfig(top_k=0), "MoEConfig.top_k must be in [1, n_experts=8], got 0"),
        (lambda: MoEConfig(n_experts=4, top_k=5), "MoEConfig.top_k must be in [1, n_experts=4], got 5"),
        (lambda: MoEConfig(n_shared=-1), "MoEConfig.n_shared must be >= 0, got -1"),
        (lambda: MoEConfig(n_group=3), "MoEConfig.n_group must be >= 1 and divide n_experts=8, got 3"),
        (  # 2 groups of 2 experts leave 2 selectable: top_k 3 cannot be met
            lambda: MoEConfig(n_experts=8, n_group=4, topk_group=1, top_k=3),
            "MoEConfig.topk_group must leave at least top_k=3 experts selectable, got 1",
        ),
        (
            lambda: MoEConfig(n_experts=4, top_k=2, n_group=4, topk_group=2, group_score="top2"),
            "MoEConfig.group_score 'top2' needs >= 2 experts per group (n_experts / n_group = 1), got 'top2'",
        ),
        (lambda: MoEConfig(jitter=-0.1), "MoEConfig.jitter must be in [0, 1)"),
        (
            lambda: MoEConfig(capacity_factor=0.0),
            "MoEConfig.capacity_factor must be a finite number > 0 (or null for dropless), got 0.0",
        ),
        (
            lambda: MoEConfig(eval_capacity_factor=0.0),
            "MoEConfig.eval_capacity_factor must be a finite number > 0 (or null for dropless), got 0.0",
        ),
        (lambda: MoEConfig(n_devices=3), "MoEConfig.n_devices must be >= 1 and divide n_experts=8, got 3"),
        (lambda: MoEConfig(n_devices=0), "MoEConfig.n_devices must be >= 1 and divide n_experts=8, got 0"),
    ]
    + [
        (lambda name=name: MoEConfig(**{name: -0.5}), f"MoEConfig.{name} must be >= 0, got -0.5")
        for name in (
            "aux_loss_coef",
            "device_loss_coef",
            "seq_aux_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
        )
    ],
)
def test_rope_and_moe_limits_name_the_field(build, needle: str) -> None:
    refused(build, needle)


def test_rope_and_moe_values_on_the_limits_are_taken() -> None:
    assert RopeConfig(fraction=1.0, original_max_seq_len=1).original_max_seq_len == 1
    assert RopeConfig(yarn_beta_fast=2.0, yarn_beta_slow=1.5).yarn_beta_slow == 1.5
    assert MoEConfig(n_experts=4, top_k=4).top_k == 4  # every expert
    assert MoEConfig(n_experts=8, n_group=4, topk_group=1, top_k=2).topk_group == 1  # exactly top_k left
    assert MoEConfig(n_experts=8, n_group=4, topk_group=2, group_score="top2").group_score == "top2"
    assert MoEConfig(jitter=0.0, n_shared=0, n_devices=8).n_devices == 8
    assert MoEConfig(capacity_factor=0.01, eval_capacity_factor=1.0).capacity_factor == 0.01
    assert MoEConfig(aux_loss_coef=0.0, z_loss_coef=0.0).aux_loss_coef == 0.0


@pytest.mark.parametrize("name", ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"])
def test_a_zero_size_names_the_field(name: str) -> None:
    refused(lambda: ModelConfig(**{name: 0}), f"ModelConfig.{name} must be >= 1, got 0")


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"head_dim": 0}, "ModelConfig.head_dim must be >= 1, got 0"),
        ({"n_kv_heads": 0}, "ModelConfig.n_kv_heads must be >= 1 and divide n_heads=8, got 0"),
        ({"norm_eps": 0.0}, "ModelConfig.norm_eps must be > 0, got 0.0"),
        ({"init_std": 0.0}, "ModelConfig.init_std must be > 0, got 0.0"),
        ({"n_classes": 0}, "ModelConfig.n_classes must be >= 1, got 0"),
        (
            {"arch": "encoder_decoder", "n_encoder_layers": 0},
            "ModelConfig.n_encoder_layers must be >= 1 (or null: same as n_layers), got 0",
        ),
    ],
)
def test_more_model_limits_name_the_field(changes: dict, needle: str) -> None:
    refused(lambda: ModelConfig(**changes), needle)


@pytest.mark.parametrize(
    "name", ["vocab_size", "src_vocab_size", "d_model", "d_ff", "max_seq_len", "n_classes", "head_dim"]
)
def test_every_size_stops_at_int32(name: str) -> None:
    seq2seq = {"arch": "encoder_decoder", "share_embeddings": False}
    refused(
        lambda: ModelConfig(**seq2seq, **{name: MAX_SIZE + 1}),
        f"ModelConfig.{name} must be at most 2,147,483,647, got {MAX_SIZE + 1}",
    )
    if name != "d_model":  # (a d_model that large is no multiple of n_heads)
        assert getattr(ModelConfig(**seq2seq, **{name: MAX_SIZE}), name) == MAX_SIZE


def test_separate_source_embeddings_may_have_their_own_vocabulary() -> None:
    cfg = ModelConfig(arch="encoder_decoder", share_embeddings=False, src_vocab_size=300)
    assert cfg.resolved_src_vocab_size == 300 and cfg.vocab_size == 32000


def test_a_saved_decoder_config_without_arch_drops_seq2seq_settings() -> None:
    """arch defaults to 'decoder': a stored config that leaves arch out and sets n_encoder_layers is a
    decoder's, and loads without it."""
    with pytest.warns(UserWarning, match=r"n_encoder_layers=4 dropped: arch 'decoder'"):
        cfg = ModelConfig.from_dict({"n_encoder_layers": 4})
    assert cfg == ModelConfig()


# ---------------------------------------------------------------- schema: types and files


def test_a_float_field_takes_no_bool() -> None:
    refused(lambda: ModelConfig(dropout=True), "ModelConfig.dropout must be float, got True")
    refused(lambda: RopeConfig(fraction=True), "RopeConfig.fraction must be float, got True")


@pytest.mark.parametrize("text", [".inf", "-.inf", "+.Inf", ".nan"])
def test_yaml_spellings_of_inf_and_nan_given_as_strings_are_not_finite(text: str) -> None:
    refused(
        lambda: ModelConfig().with_overrides({"dropout": text}),
        f"ModelConfig.dropout must be a finite number, got {text!r}",
    )


@pytest.mark.parametrize("text", ["0.1x", "1e-3 fast", "2.5.1"])
def test_a_string_that_only_starts_like_a_number_is_refused_by_name(text: str) -> None:
    refused(lambda: OptimConfig(lr=text), f"OptimConfig.lr must be float, got {text!r}")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_an_optional_float_says_finite_not_float_or_null(value: float) -> None:
    refused(
        lambda: MoEConfig(capacity_factor=value), "MoEConfig.capacity_factor must be a finite number, got"
    )


def test_a_yml_file_is_saved_as_yaml(tmp_path) -> None:
    cfg = ModelConfig(d_model=64, n_heads=4)
    cfg.save(tmp_path / "m.yml")
    text = (tmp_path / "m.yml").read_text()
    assert text == cfg.to_yaml() and not text.lstrip().startswith("{")
    assert ModelConfig.load(tmp_path / "m.yml") == cfg


def test_a_config_file_that_holds_no_mapping_names_the_file(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("- steps\n- 3\n")
    refused(
        lambda: TrainConfig.load(path),
        f"{path}: a TrainConfig file holds a mapping of its fields, got a list",
    )


def test_negative_numbers_read_as_negative(tmp_path) -> None:
    assert parse_overrides(["seed=-5", "x=-12", "y=+7"]) == {"seed": -5, "x": -12, "y": 7}
    path = tmp_path / "run.yaml"
    path.write_text("seed: -7\n")
    assert TrainConfig.load(path).seed == -7


def test_a_set_item_without_an_equals_sign_is_named() -> None:
    with pytest.raises(
        ConfigError, match=r"--set expects KEY=VALUE \(for example model.d_model=128\), got 'steps'"
    ):
        parse_overrides(["steps"])


def test_input_lines_split_at_line_ends_only_and_drop_the_last_empty_one() -> None:
    assert input_lines("a\nb\n") == ["a", "b"]
    assert input_lines("a\r\nb\rc") == ["a", "b", "c"]
    assert input_lines("a\u2028b\n\n") == ["a\u2028b", ""]  # an empty line inside is kept
    assert input_lines("") == []


def test_a_double_quoted_set_value_is_the_string_inside_the_quotes() -> None:
    assert parse_overrides(['data.corpus="a #b"', "q='c'"]) == {"data.corpus": "a #b", "q": "c"}


# ---------------------------------------------------------------- training configs


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (
            lambda: DataConfig(corpus="trans-de-en", dictionary_terms=-1),
            "DataConfig.dictionary_terms must be >= 0, got -1",
        ),
        (
            lambda: DataConfig(corpus="shakespeare", dictionary_terms=10),
            "DataConfig.dictionary_terms needs corpus 'trans-de-en' (corpus is 'shakespeare'), got 10",
        ),
        (lambda: DataConfig(vocab_size=259), "DataConfig.vocab_size must be from 260"),
        (lambda: DataConfig(vocab_size=MAX_BPE_VOCAB + 1), "DataConfig.vocab_size must be from 260"),
        (lambda: DataConfig(seq_len=1), "DataConfig.seq_len must be >= 2, got 1"),
        (
            lambda: DataConfig(max_train_docs=0),
            "DataConfig.max_train_docs must be >= 1 (or null for all), got 0",
        ),
        (
            lambda: DataConfig(src_vocab_size=259),
            "DataConfig.src_vocab_size must be from 260 to 1,048,576 (or null: vocab_size), got 259",
        ),
        (
            lambda: DataConfig(seq_len=64, max_tokens=63),
            "DataConfig.max_tokens must be >= seq_len=64, got 63",
        ),
        (lambda: OptimConfig(lr=0.0), "OptimConfig.lr must be finite and > 0, got 0.0"),
        (
            lambda: OptimConfig(weight_decay=-0.1),
            "OptimConfig.weight_decay must be finite and >= 0, got -0.1",
        ),
        (lambda: OptimConfig(eps=0.0), "OptimConfig.eps must be finite and > 0, got 0.0"),
        (lambda: OptimConfig(beta1=1.0), "OptimConfig.beta1 must be in [0, 1), got 1.0"),
        (lambda: OptimConfig(beta2=-0.1), "OptimConfig.beta2 must be in [0, 1), got -0.1"),
        (lambda: OptimConfig(warmup_steps=-1), "OptimConfig.warmup_steps must be >= 0, got -1"),
        (lambda: OptimConfig(min_lr_ratio=-0.1), "OptimConfig.min_lr_ratio must be in [0, 1], got -0.1"),
        (lambda: OptimConfig(grad_clip=-1.0), "OptimConfig.grad_clip must be finite and >= 0"),
        (
            lambda: ParallelConfig(timeout_s=0),
            "ParallelConfig.timeout_s must be from 1 to 1,000,000,000 (seconds), got 0",
        ),
        (lambda: ParallelConfig(tensor=0), "ParallelConfig.tensor must be >= 1"),
        (lambda: ParallelConfig(sequence=True), "ParallelConfig.sequence needs tensor > 1"),
        (
            lambda: ParallelConfig(param_dtype="bfloat16"),
            "ParallelConfig.param_dtype needs data='fsdp' (FSDP2 mixed precision), got 'bfloat16'",
        ),
        (lambda: TrainConfig(spike_factor=1.0), "TrainConfig.spike_factor must be 0 (off) or > 1, got 1.0"),
        (lambda: TrainConfig(spike_factor=0.5), "TrainConfig.spike_factor must be 0 (off) or > 1, got 0.5"),
        (lambda: TrainConfig(label_smoothing=1.0), "TrainConfig.label_smoothing must be in [0, 1), got 1.0"),
        (lambda: TrainConfig(sample_every=-1), "TrainConfig.sample_every must be >= 0"),
        (lambda: TrainConfig(sample_tokens=0), "TrainConfig.sample_tokens must be >= 1, got 0"),
        (lambda: TrainConfig(device="cudax"), "TrainConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (lambda: TrainConfig(device="cuda1"), "TrainConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ]
    + [
        (lambda name=name: TrainConfig(**{name: 0}), f"TrainConfig.{name} must be >= 1, got 0")
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "save_every",
            "keep_last",
            "log_every",
            "max_nonfinite",
        )
    ],
)
def test_training_limits_name_the_field(build, needle: str) -> None:
    refused(build, needle)


def test_training_values_on_the_limits_are_taken() -> None:
    assert DataConfig(vocab_size=260, src_vocab_size=260).vocab_size == 260
    assert DataConfig(vocab_size=MAX_BPE_VOCAB, src_vocab_size=MAX_BPE_VOCAB).vocab_size == MAX_BPE_VOCAB
    assert DataConfig(seq_len=2, max_train_docs=1).seq_len == 2
    assert DataConfig(seq_len=64, max_tokens=64).max_tokens == 64
    assert DataConfig(corpus="trans-de-en", dictionary_terms=0).dictionary_terms == 0
    edge = OptimConfig(
        weight_decay=0.0,
        beta1=0.0,
        beta2=0.0,
        warmup_steps=0,
        min_lr_ratio=1.0,
        decay_frac=1.0,
        grad_clip=0.0,
    )
    assert (edge.min_lr_ratio, edge.decay_frac, edge.grad_clip) == (1.0, 1.0, 0.0)
    assert OptimConfig(min_lr_ratio=0.0).min_lr_ratio == 0.0
    assert ParallelConfig(timeout_s=1, tensor=2, sequence=True).sequence
    assert ParallelConfig(data="fsdp", param_dtype="bfloat16").param_dtype == "bfloat16"
    assert TrainConfig(spike_factor=0.0).spike_factor == 0.0  # off
    assert (
        TrainConfig(spike_factor=1.5, label_smoothing=0.0, sample_every=0, sample_tokens=1).spike_factor
        == 1.5
    )
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert TrainConfig(device=device).device == device


def test_a_classifier_with_another_arch_is_named_as_the_task_names_it() -> None:
    """A non-encoder arch for classification is refused in the task's words ("classification needs
    model.arch 'encoder'") before anything is built: its pooling is not called "ignored" first."""
    classify = get_train_preset("tiny-classification")
    assert classify.model.pooling != "cls"
    refused(
        lambda: refuse_ignored_settings(classify.with_overrides({"model.arch": "decoder"})),
        "classification needs model.arch 'encoder', got 'decoder'",
    )


# ---------------------------------------------------------------- command line and presets


def args(*, preset=None, config=None, overrides=()) -> argparse.Namespace:
    return argparse.Namespace(preset=preset, config=config, overrides=list(overrides))


def test_the_preset_given_wins_over_the_default() -> None:
    cfg = resolve_train_config(args(preset="tiny-translation"), default_preset="tiny-lm")
    assert cfg == get_train_preset("tiny-translation")


def test_resuming_reads_the_runs_own_config_plus_set_unless_a_preset_is_given(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    get_train_preset("tiny-lm").replace(steps=7).save(run / "config.json")
    cfg = resolve_train_config(args(overrides=["log_every=3"]), "tiny-lm", resume_dir=run)
    assert (cfg.steps, cfg.log_every) == (7, 3)
    cfg = resolve_train_config(args(preset="tiny-classification"), "tiny-lm", resume_dir=run)
    assert cfg == get_train_preset("tiny-classification")


def test_every_preset_is_one_a_new_run_accepts() -> None:
    for name, preset in TRAIN_PRESETS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            refuse_ignored_settings(preset())
        assert get_train_preset(name) == preset()


def test_the_dense_shakespeare_preset_is_the_main_job_without_experts() -> None:
    moe, dense = get_train_preset("shakespeare"), get_train_preset("shakespeare-dense")
    assert moe.model.moe is not None and dense.model.moe is None
    assert dense == moe.replace(model=moe.model.replace(moe=None))


def test_the_main_job_has_the_documented_deepseekmoe_layout() -> None:
    """8 experts a quarter of the dense width, top-2, plus 1 shared expert of the same width: 3 x 172 =
    516 active hidden units per token; the first layer dense."""
    model = get_train_preset("shakespeare").model
    moe = model.moe
    assert moe.n_experts == 8 and moe.expert_width(model.d_ff) * 4 == model.d_ff
    active = moe.top_k * moe.expert_width(model.d_ff) + moe.n_shared * moe.shared_width(model.d_ff)
    assert active == 516
    assert [moe.is_moe_layer(i) for i in range(model.n_layers)] == [False, True, True, True]


def test_translation_smooths_labels_as_the_paper_and_bbc_pools_by_mean() -> None:
    assert get_train_preset("translation").label_smoothing == 0.1  # Vaswani et al. 2017, eps_ls = 0.1
    bbc = get_train_preset("bbc").model
    assert (bbc.arch, bbc.pooling) == ("encoder", "mean")


@pytest.mark.parametrize("key", ["x in MoEConfig.y", "x in ModelConfig.y; z", "plain"])
def test_an_unknown_nested_key_is_quoted_as_typed_and_placed_at_its_full_path(key: str) -> None:
    """The path of the config that holds an unknown key is written from the outermost config; the key's
    own text is left alone, even where it reads like a config path."""
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"model": {"moe": {key: 1}}})
    assert str(e.value).startswith(f"unknown key {key!r} in TrainConfig.model.moe; allowed: n_experts, top_k")
