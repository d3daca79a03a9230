"""Config schema: validation errors name field, value and what is allowed; round trips; presets."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch

from tformer import PRESETS, ConfigError, ModelConfig, MoEConfig, RopeConfig, get_preset
from tformer.cli.options import parse_overrides
from tformer.train.config import OptimConfig, TrainConfig
from tformer.train.presets import get_train_preset


def test_defaults_are_the_paper_layer() -> None:
    cfg = ModelConfig()
    assert (cfg.norm_placement, cfg.positions, cfg.ffn, cfg.norm) == (
        "post",
        "sinusoidal",
        "relu",
        "layernorm",
    )


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"d_model": -3}, "ModelConfig.d_model must be >= 1, got -3"),
        (
            {"norm_placement": "middle"},
            "ModelConfig.norm_placement must be one of 'post', 'pre', got 'middle'",
        ),
        ({"dropout": 1.5}, "ModelConfig.dropout must be in [0, 1), got 1.5"),
        ({"n_heads": 7}, "ModelConfig.n_heads must divide d_model=512"),
        ({"n_kv_heads": 3}, "ModelConfig.n_kv_heads must be >= 1 and divide n_heads=8"),
        ({"d_model": "512"}, "ModelConfig.d_model must be int, got '512'"),
        ({"tie_embeddings": 1}, "ModelConfig.tie_embeddings must be bool, got 1"),
        ({"positions": "rope", "rope": RopeConfig(fraction=0.01)}, "even number >= 2"),
        (  # an encoder's depth is n_layers: the setting had been ignored silently
            {"arch": "encoder", "n_encoder_layers": 12},
            "ModelConfig.n_encoder_layers is for arch 'encoder_decoder' only (arch 'encoder' uses n_layers)",
        ),
        ({"arch": "decoder", "src_vocab_size": 300}, "(arch 'decoder' uses vocab_size); leave it null"),
        ({"attn_dropout": 1.0}, "ModelConfig.attn_dropout must be in [0, 1), got 1.0"),
        ({"dropout": 1.0}, "ModelConfig.dropout must be in [0, 1), got 1.0"),
        ({"d_model": True}, "ModelConfig.d_model must be int, got True"),  # a bool is no count
        (  # one shared embedding cannot have two vocabulary sizes
            {"arch": "encoder_decoder", "share_embeddings": True, "src_vocab_size": 300},
            "ModelConfig.src_vocab_size must equal vocab_size=32000 when share_embeddings is true, got 300",
        ),
        (
            {"positions": "rope", "n_heads": 64, "rope": RopeConfig(fraction=0.625)},
            "gives 5 rotated features of head_dim=8 (d_model=512 / n_heads=64); must be an even number >= 2",
        ),
    ],
)
def test_bad_values_name_the_field(changes: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**changes)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("cls", "changes", "needle"),
    [
        (RopeConfig, {"factor": 2.0}, "RopeConfig.factor must be 1.0 when scaling is 'none', got 2.0"),
        (RopeConfig, {"scaling": "linear", "factor": 0.5}, "RopeConfig.factor must be >= 1, got 0.5"),
        (RopeConfig, {"fraction": 1.5}, "RopeConfig.fraction must be in (0, 1], got 1.5"),
        (
            RopeConfig,
            {"scaling": "yarn", "factor": 4.0, "yarn_beta_fast": 1.0, "yarn_beta_slow": 32.0},
            "RopeConfig.yarn_beta_fast must be > yarn_beta_slow > 0",
        ),
        (RopeConfig, {"theta": 1.0}, "RopeConfig.theta must be > 1, got 1.0"),  # every angle 0
        (
            RopeConfig,
            {"scaling": "yarn", "factor": 4.0, "yarn_beta_fast": 8.0, "yarn_beta_slow": 8.0},
            "RopeConfig.yarn_beta_fast must be > yarn_beta_slow > 0",
        ),
        (OptimConfig, {"min_lr_ratio": 1.5}, "OptimConfig.min_lr_ratio must be in [0, 1], got 1.5"),
        (OptimConfig, {"decay_frac": 0.0}, "OptimConfig.decay_frac must be in (0, 1], got 0.0"),
    ],
)
def test_bad_rope_and_optimizer_values_name_the_field(cls, changes: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        cls(**changes)
    assert needle in str(err.value)


def test_a_saved_or_written_config_with_a_seq2seq_only_setting_loads_without_it() -> None:
    """The constructor refuses n_encoder_layers / src_vocab_size outside the encoder-decoder; a run saved
    when they were silently ignored (or a YAML file, or --set) still loads, with a warning."""
    with pytest.warns(UserWarning, match=r"n_encoder_layers=4, src_vocab_size=300 dropped: arch 'encoder'"):
        cfg = ModelConfig.from_dict({"arch": "encoder", "n_encoder_layers": 4, "src_vocab_size": 300})
    assert cfg == ModelConfig(arch="encoder")
    seq2seq = ModelConfig.from_dict({"arch": "encoder_decoder", "n_encoder_layers": 4})
    assert seq2seq.n_encoder_layers == 4


def test_nested_errors_name_the_path_from_the_outermost_config() -> None:
    with pytest.raises(
        ConfigError, match=r"^ModelConfig.rope.layout must be one of 'half', 'interleaved', got 'spiral'"
    ):
        ModelConfig.from_dict({"rope": {"layout": "spiral"}})
    with pytest.raises(
        ConfigError, match=r"^TrainConfig.model.moe.top_k must be in \[1, n_experts=4\], got 5"
    ):
        TrainConfig.from_dict({"model": {"moe": {"n_experts": 4, "top_k": 5}}})
    with pytest.raises(ConfigError, match=r"^TrainConfig.model.d_model must be >= 1, got 0"):
        TrainConfig().with_overrides({"model.d_model": 0})
    with pytest.raises(
        ConfigError, match=r"^TrainConfig.data.vocab_size must be from 260 .* to 1,048,576, got 10"
    ):
        TrainConfig().with_overrides({"data.vocab_size": 10**10})  # the BPE trainer had aborted the process
    with pytest.raises(
        ConfigError, match=r"^unknown key 'bogus' in TrainConfig.model.moe; allowed: n_experts"
    ):
        TrainConfig.from_dict({"model": {"moe": {"bogus": 1}}})
    with pytest.raises(ConfigError, match=r"^unknown key 'a ModelConfig.b' in TrainConfig.model.moe;"):
        TrainConfig.from_dict({"model": {"moe": {"a ModelConfig.b": 1}}})  # the key itself stays as typed
    # built directly, a nested config names its own class
    with pytest.raises(ConfigError, match=r"^MoEConfig.top_k must be in \[1, n_experts=4\], got 5"):
        MoEConfig(n_experts=4, top_k=5)


def test_unknown_keys_are_rejected_with_the_allowed_list() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'hidden_size' in ModelConfig; allowed: arch, vocab_size"
    ):
        ModelConfig.from_dict({"hidden_size": 3})
    with pytest.raises(ConfigError, match=r"unknown key 'base' in ModelConfig.rope; allowed: theta"):
        ModelConfig.from_dict({"rope": {"base": 3}})
    with pytest.raises(ConfigError, match="unknown key 'dim'"):
        ModelConfig().replace(dim=3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_dict_json_yaml(name: str, tmp_path) -> None:
    cfg = get_preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    for suffix in (".json", ".yaml"):
        cfg.save(tmp_path / f"c{suffix}")
        assert ModelConfig.load(tmp_path / f"c{suffix}") == cfg
    json.loads(cfg.to_json())  # plain JSON, nothing Python-specific


def test_configs_are_frozen() -> None:
    cfg = ModelConfig()
    with pytest.raises(AttributeError):
        cfg.d_model = 3  # type: ignore[misc]


def test_dotted_overrides() -> None:
    cfg = ModelConfig().with_overrides(
        {"d_model": 256, "rope.theta": 500000, "moe.n_experts": 4, "moe.top_k": 1}
    )
    assert cfg.d_model == 256 and cfg.rope.theta == 500000.0 and cfg.moe == MoEConfig(n_experts=4, top_k=1)
    with pytest.raises(ConfigError, match="unknown key 'thetaa'"):
        ModelConfig().with_overrides({"rope.thetaa": 1})


def test_ints_widen_to_float_and_floats_never_narrow() -> None:
    assert ModelConfig(dropout=0).dropout == 0.0
    with pytest.raises(ConfigError, match="ModelConfig.n_layers must be int, got 2.0"):
        ModelConfig(n_layers=2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ModelConfig.n_layers must be int, got np.float64"):
        ModelConfig(n_layers=np.float64(2.0))  # type: ignore[arg-type]


def test_numpy_numbers_are_taken_as_python_numbers() -> None:
    """A value read from an array (np.int64, np.float32) had been refused as 'must be int, got 2'."""
    cfg = ModelConfig(n_layers=np.int64(2), dropout=np.float32(0.25))
    assert type(cfg.n_layers) is int and type(cfg.dropout) is float and cfg.dropout == 0.25
    assert json.dumps(cfg.to_dict())  # stays JSON-ready
    with pytest.raises(ConfigError, match="must be int, got np.True_"):
        ModelConfig(n_layers=np.bool_(True))  # type: ignore[arg-type]
    cfg = ModelConfig(norm=np.str_("rmsnorm"), ffn=np.array(["relu", "swiglu"])[1])  # strings from an array
    assert type(cfg.norm) is str and cfg.norm == "rmsnorm" and type(cfg.ffn) is str and cfg.ffn == "swiglu"
    with pytest.raises(ConfigError, match="ModelConfig.norm must be one of"):
        ModelConfig(norm=np.str_("batchnorm"))


def test_exponent_floats_read_by_yaml_as_strings_are_floats(tmp_path) -> None:
    """PyYAML (YAML 1.1) reads `1e-3` as a string: in a --set value and in a config file it is a float
    (read as YAML 1.2 reads it; the schema also converts such a string from the Python API); strings that
    are not numbers stay errors, and int fields take no floats from strings either."""
    overrides = parse_overrides(["optim.lr=1e-3", "model.rope.theta=5E+5"])
    assert overrides["optim.lr"] == 1e-3
    assert ModelConfig().with_overrides({"rope.theta": "5e5"}).rope.theta == 5e5
    cfg = get_train_preset("tiny-lm").with_overrides(overrides)
    assert cfg.optim.lr == 1e-3 and cfg.model.rope.theta == 5e5
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")
    assert TrainConfig.load(path).optim.lr == 3e-4
    with pytest.raises(ConfigError, match="ModelConfig.d_model must be int, got '1e2'"):
        ModelConfig().with_overrides({"d_model": "1e2"})
    with pytest.raises(ConfigError, match="TrainConfig.optim.lr must be float, got 'fast'"):
        cfg.with_overrides({"optim.lr": "fast"})


@pytest.mark.parametrize(
    "build",
    [
        lambda v: ModelConfig(init_std=v),
        lambda v: ModelConfig(norm_eps=v),
        lambda v: RopeConfig(theta=v),
        lambda v: MoEConfig(routed_scaling=v),
        lambda v: MoEConfig(aux_loss_coef=v),
        lambda v: MoEConfig(jitter=v),
        lambda v: ModelConfig().with_overrides({"moe": {"n_experts": 4, "z_loss_coef": v}}),
    ],
)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_no_float_setting_takes_inf_or_nan(build, value: float) -> None:
    """inf and NaN gave models with NaN outputs, runs that stopped on non-finite losses, or a
    traceback from the router's noise; every float field now refuses them by name."""
    with pytest.raises(ConfigError, match=r"^\w+Config(\.\w+)+ must be a finite number, got"):
        build(value)


def test_moe_layout_must_place_an_moe_layer_and_jitter_below_one() -> None:
    with pytest.raises(ConfigError, match="first_dense=5 and every=1 leave no MoE layer among the model's 2"):
        ModelConfig(n_layers=2, moe=MoEConfig(first_dense=5))
    with pytest.raises(ConfigError, match=r"MoEConfig.jitter must be in \[0, 1\)"):
        MoEConfig(jitter=1.0)
    deep_encoder = ModelConfig(
        arch="encoder_decoder", n_layers=2, n_encoder_layers=4, moe=MoEConfig(first_dense=3)
    )
    assert deep_encoder.moe.is_moe_layer(3)  # only in the encoder: allowed


def test_from_json_and_from_yaml_name_a_malformed_text() -> None:
    with pytest.raises(ConfigError, match=r"not a valid JSON text for ModelConfig \(Expecting"):
        ModelConfig.from_json('{"d_model": 3,')
    with pytest.raises(ConfigError, match="not a valid YAML text for ModelConfig"):
        ModelConfig.from_yaml("d_model: [1,")
    with pytest.raises(ConfigError, match="ModelConfig must be a mapping, got list"):
        ModelConfig.from_yaml("- 1")
    for empty in ("", "# only a comment\n"):  # a mistake, not a request for the defaults
        with pytest.raises(ConfigError, match="the YAML text holds no fields"):
            ModelConfig.from_yaml(empty)
    assert ModelConfig.from_yaml("{}") == ModelConfig()


def test_set_takes_a_plain_string_as_typed() -> None:
    """YAML had cut a path at ' #' (a comment) and turned 'text: /p' into a mapping: both silently or
    obscurely wrong for a folder name; quoted strings, numbers, flow mappings and lists stay YAML."""
    got = parse_overrides(
        ["data.corpus=text:/tmp/notes #2", "x=text: /p", "q='a #b'", "m={n: 1}", "b=true", "l=[1, 2]"]
    )
    assert got == {
        "data.corpus": "text:/tmp/notes #2",
        "x": "text: /p",
        "q": "a #b",
        "m": {"n": 1},
        "b": True,
        "l": [1, 2],
    }


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'; available: paper-base, tiny"):
        get_preset("gpt5")


def test_a_seed_outside_torchs_range_names_the_field() -> None:
    from tformer.train.config import TrainConfig

    for seed in (2**64, -(2**63) - 1):  # torch.manual_seed had failed on them in the trainer
        with pytest.raises(ConfigError, match=r"TrainConfig.seed must be in \[-2\*\*63, 2\*\*64\)"):
            TrainConfig(seed=seed)
    assert TrainConfig(seed=-1).seed == -1 and TrainConfig(seed=2**64 - 1).seed == 2**64 - 1
    from tformer.generate.beam import SearchConfig
    from tformer.generate.sampling import SamplingConfig, make_generator

    for cls in (SamplingConfig, SearchConfig):  # one range for training, generate and translate
        with pytest.raises(ConfigError, match=rf"{cls.__name__}.seed must be in \[-2\*\*63, 2\*\*64\)"):
            cls(seed=2**64)
        for seed in (-(2**63), -1, 2**64 - 1):  # the whole range: each a seed torch's generators take
            make_generator(cls(seed=seed).seed)


def test_a_model_too_large_for_memory_names_its_sizes() -> None:
    from tformer import build_model
    from tformer.model.transformer import weight_count_bound
    from tformer.presets import deepseek_moe_small, llama_like, paper_base, tiny

    with pytest.raises(ValueError, match=r"does not fit in memory: its float32 weights alone take about .* GiB.*vocab_size=2147483647"):  # fmt: skip
        build_model(ModelConfig(vocab_size=2**31 - 1, d_model=4096, n_heads=8))
    t0 = (
        time.perf_counter()
    )  # a layer count typed with extra digits: refused at once (it had built for hours)
    with pytest.raises(ValueError, match=r"does not fit in memory.*n_layers=1000000000"):
        build_model(tiny().replace(n_layers=10**9))
    assert time.perf_counter() - t0 < 5
    long = tiny().replace(
        positions="learned", max_seq_len=2**31 - 1, d_model=4096
    )  # a table of positions: its length named
    with pytest.raises(
        ValueError, match=r"does not fit in memory.*max_seq_len=2147483647 \(position tables\)"
    ):
        build_model(long)
    wide = tiny().replace(moe=MoEConfig(n_experts=8, top_k=2, d_expert=2**30))  # the experts' width named
    with pytest.raises(ValueError, match=r"does not fit in memory.*moe.n_experts=8, moe.d_expert=1073741824"):
        build_model(wide)
    # shapes only, on the meta device: no memory asked, no refusal (a 5.9B-parameter config, 22 GiB in fp32)
    from tformer.model.stats import count_params

    assert count_params(llama_like(32000, 4096, 32, 32, 8, 11008, 2048))["total"] == 5_933_109_248
    # the estimate bounds the real count from above, and not by much
    for cfg in (tiny(), tiny("encoder"), tiny("encoder_decoder"), tiny().replace(ffn="relu", positions="learned"),
                llama_like(300, 64, 2, 4, 2, 128, 64), deepseek_moe_small(300, 64, 3), paper_base().replace(vocab_size=1000)):  # fmt: skip
        real = sum(p.numel() for p in build_model(cfg).parameters())
        assert real <= weight_count_bound(cfg) <= 1.5 * real
    for name in ("vocab_size", "max_seq_len", "d_ff"):  # beyond int32: named, not an overflow inside torch
        with pytest.raises(
            ConfigError,
            match=rf"ModelConfig.{name} must be at most 2,147,483,647, got 1000000000000000000000000000000",
        ):
            ModelConfig(**{name: 10**30})


def test_a_preset_name_that_is_not_a_string_is_named() -> None:
    from tformer.train.presets import get_train_preset

    with pytest.raises(ConfigError, match=r"unknown training preset \['x'\]; available: "):
        get_train_preset(["x"])  # had been "unhashable type: 'list'"


def test_a_setting_the_run_would_ignore_is_refused_when_it_starts(tmp_path) -> None:
    """data.max_tokens on a language model had been ignored without a word. Refused by a new run, not by
    the config itself: a run stored before the check still loads (its config reads as it was)."""
    from tformer.tasks import make_task
    from tformer.train.config import refuse_ignored_settings
    from tformer.train.loop import Trainer

    lm, classify = get_train_preset("tiny-lm"), get_train_preset("tiny-classification")
    stored = lm.with_overrides({"data.max_tokens": 64})  # a config may hold it (old runs do)
    assert TrainConfig.from_dict(stored.to_dict()).data.max_tokens == 64
    with pytest.raises(ConfigError, match=r"data.max_tokens is read by the translation and classification tasks only: task 'lm' would ignore it; leave it null, got 64"):  # fmt: skip
        refuse_ignored_settings(stored)
    with pytest.raises(ConfigError, match="data.max_tokens is read by"):
        Trainer(stored, tmp_path / "run", make_task("lm"), progress=False)
    assert not (tmp_path / "run").exists()  # nothing written
    with pytest.raises(ConfigError, match=r"data.tokenizer is read by the translation task only: task 'classification'.* leave it at 'joint', got 'separate'"):  # fmt: skip
        refuse_ignored_settings(classify.with_overrides({"data.tokenizer": "separate"}))
    with pytest.raises(ConfigError, match="model.share_embeddings is for arch 'encoder_decoder' only"):
        refuse_ignored_settings(lm.with_overrides({"model.share_embeddings": False}))
    refuse_ignored_settings(classify.with_overrides({"data.max_tokens": 512}))  # read there
    translation = get_train_preset("tiny-translation")
    separate = {"data.tokenizer": "separate", "data.src_vocab_size": 300}
    refuse_ignored_settings(translation.with_overrides(separate))
    with pytest.raises(ConfigError, match=r"data.src_vocab_size sizes the source vocabulary of data.tokenizer 'separate'.* got 300"):  # fmt: skip
        refuse_ignored_settings(translation.with_overrides({"data.src_vocab_size": 300}))  # joint
    for name, value in (("pooling", "mean"), ("n_classes", 7)):  # the classifier's head, outside it
        with pytest.raises(ConfigError, match=rf"model.{name} is read by arch 'encoder' \(classification\) only: arch 'encoder_decoder' would ignore it"):  # fmt: skip
            refuse_ignored_settings(translation.with_overrides({f"model.{name}": value}))
    refuse_ignored_settings(classify.with_overrides({"model.pooling": "cls"}))  # read there
    with pytest.raises(ConfigError, match="fused_loss is read by the lm and translation tasks only"):
        refuse_ignored_settings(classify.with_overrides({"fused_loss": True}))
    refuse_ignored_settings(translation.with_overrides({"fused_loss": True}))  # read there


def test_the_fused_loss_under_tensor_parallelism_is_named_as_unread() -> None:
    """Tensor parallelism splits the head by vocabulary and takes the logits path: fused_loss is then
    kept in the config but not read, and a new run warns of it (Trainer, with the other unread settings)."""
    from tformer.train.config import unread_settings

    lm = get_train_preset("tiny-lm").with_overrides({"fused_loss": True})
    assert unread_settings(lm) == []
    split = lm.with_overrides({"parallel.tensor": 2})
    assert [s for s in unread_settings(split) if s.startswith("fused_loss")] == [
        "fused_loss (True: tensor parallelism splits the head by vocabulary, so the steps take the logits "
        "and the vocabulary-parallel loss)"
    ]


def test_dictionary_alternatives_are_refused_outside_translation_and_unread_off_trans_de_en() -> None:
    """The translation preset sets data.dictionary_alternatives; with `data.corpus=libreoffice` it has
    nothing to add, so that run warns instead of failing. The tasks that never read it refuse it."""
    from tformer.train.config import refuse_ignored_settings, unread_settings

    with pytest.raises(ConfigError, match=r"data.dictionary_alternatives is read by the translation task only: task 'lm' would ignore it; leave it at False, got True"):  # fmt: skip
        refuse_ignored_settings(
            get_train_preset("tiny-lm").with_overrides({"data.dictionary_alternatives": True})
        )
    translation = get_train_preset("translation")
    assert translation.data.dictionary_alternatives and unread_settings(translation) == []
    refuse_ignored_settings(translation)
    libreoffice = translation.with_overrides({"data.corpus": "libreoffice"})
    refuse_ignored_settings(libreoffice)
    assert unread_settings(libreoffice) == [
        "data.dictionary_alternatives (True: read with corpus 'trans-de-en' only, not 'libreoffice')"
    ]


def test_bpe_dropout_settings_are_checked_and_read_by_translation_alone() -> None:
    """data.bpe_dropout is a rate below 1 (at 1 every word trains in bytes), the copies a count up to the
    cap; both are refused outside translation, and the copies without a rate are named as unread."""
    from tformer.train.config import MAX_BPE_DROPOUT_COPIES, refuse_ignored_settings, unread_settings

    translation = get_train_preset("tiny-translation")
    for value in (-0.1, 1.0):
        with pytest.raises(
            ConfigError, match=r"TrainConfig.data.bpe_dropout must be from 0 \(off\) to below 1"
        ):
            translation.with_overrides({"data.bpe_dropout": value})
    for value in (0, MAX_BPE_DROPOUT_COPIES + 1):
        with pytest.raises(ConfigError, match=rf"TrainConfig.data.bpe_dropout_copies must be from 1 to {MAX_BPE_DROPOUT_COPIES}"):  # fmt: skip
            translation.with_overrides({"data.bpe_dropout_copies": value})
    on = translation.with_overrides({"data.bpe_dropout": 0.1, "data.bpe_dropout_copies": 4})
    refuse_ignored_settings(on)
    assert unread_settings(on) == []
    assert unread_settings(translation.with_overrides({"data.bpe_dropout_copies": 4})) == [
        "data.bpe_dropout_copies (4: read with data.bpe_dropout > 0 only, not 0.0)"
    ]
    for name, value in (("bpe_dropout", 0.1), ("bpe_dropout_copies", 4)):
        with pytest.raises(ConfigError, match=rf"data.{name} is read by the translation task only: task 'classification' would ignore it"):  # fmt: skip
            refuse_ignored_settings(
                get_train_preset("tiny-classification").with_overrides({f"data.{name}": value})
            )


@pytest.mark.parametrize(
    "fmt, text", [("yaml", "steps: 3\nsteps: 1\n"), ("json", '{"optim": {"lr": 1, "lr": 2}}')]
)
def test_a_key_written_twice_in_a_config_file_is_named(tmp_path, fmt: str, text: str) -> None:
    """YAML and JSON readers keep the last value of a repeated key without a word; a config file must not."""
    path = tmp_path / f"run.{fmt}"
    path.write_text(text)
    with pytest.raises(
        ConfigError, match=rf"run.{fmt}: not a readable TrainConfig file \(the key '(steps|lr)' appears twice"
    ):
        TrainConfig.load(path)


def test_an_unknown_key_or_bad_value_in_a_config_file_names_the_file(tmp_path) -> None:
    """A --config file, or the config.json a resume reads: the message says which file to edit."""
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\noptim:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: unknown key 'lrr' in TrainConfig.optim; allowed: lr, "):  # fmt: skip
        TrainConfig.load(path)
    path.write_text('{"steps": -1}')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: TrainConfig.steps must be"):
        TrainConfig.load(path)


def test_yaml_anchors_and_merge_keys_still_read(tmp_path) -> None:
    """A merge key (`<<: *anchor`) overridden in the same mapping is not a key written twice."""
    path = tmp_path / "run.yaml"
    path.write_text("optim: {<<: &o {lr: 0.01, warmup_steps: 2}, lr: 0.02}\nsteps: 3\n")
    cfg = TrainConfig.load(path)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.steps) == (0.02, 2, 3)
    path.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ConfigError, match=r"a mapping key must be a plain value \(a string or a number\)"):
        TrainConfig.load(path)


def test_api_arguments_of_the_wrong_kind_are_type_errors(tmp_path) -> None:
    """They had been AttributeErrors from inside the functions (a wrong value stays a ValueError)."""
    from tformer import build_model
    from tformer.model.stats import fine_grained
    from tformer.presets import tiny
    from tformer.train.weights import load_weights, save_weights

    with pytest.raises(TypeError, match="overrides must be a dict of dotted keys"):
        tiny().with_overrides([("d_model", 64)])
    for call in (
        lambda: save_weights({"w": 1}, tmp_path / "w.safetensors"),
        lambda: load_weights("m", tmp_path / "w"),
    ):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
            call()
    with pytest.raises(TypeError, match="fine_grained: m must be an int, got 2.0"):
        fine_grained(tiny().replace(d_ff=64), 2.0, 1)
    assert build_model(fine_grained(tiny().replace(d_ff=64), 2, 1)) is not None
    from tformer.generate.sampling import sample_with_config
    from tformer.model.stats import flops_per_token

    with pytest.raises(TypeError, match="config must be a SamplingConfig, got dict"):
        sample_with_config(torch.zeros(1, 4), {"temperature": 0}, generator=None)
    with pytest.raises(TypeError, match="seq_len must be an int, got 32.0"):
        flops_per_token(tiny(), 32.0)
    with pytest.raises(ValueError, match="seq_len must be >= 1, got -5"):
        flops_per_token(tiny(), -5)
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        flops_per_token(tiny(), 0)
    assert flops_per_token(tiny(), np.int64(32)) == flops_per_token(tiny(), 32)


def test_numbers_are_read_as_yaml_1_2_and_json_read_them(tmp_path) -> None:
    """YAML 1.1 (PyYAML's default) had read steps=010 as 8 (octal), 1:30 as 90 (base 60) and yes / on as
    true, all without a word; a --set value and a config file now read numbers as YAML 1.2 does."""
    lm = get_train_preset("tiny-lm")
    assert lm.with_overrides(parse_overrides(["steps=010"])).steps == 10
    assert lm.with_overrides(parse_overrides(["steps=0x10"])).steps == 16  # hexadecimal as written
    assert lm.with_overrides(parse_overrides(["steps=100_000"])).steps == 100_000  # grouped as in Python
    with pytest.raises(ConfigError, match="TrainConfig.steps must be int, got '1:30'"):
        lm.with_overrides(parse_overrides(["steps=1:30"]))
    with pytest.raises(ConfigError, match="ModelConfig.bias must be bool, got 'yes'"):
        ModelConfig().with_overrides(parse_overrides(["bias=yes"]))
    for nan in ("nan", ".nan", "inf", "-.inf"):
        with pytest.raises(ConfigError, match="TrainConfig.optim.lr must be a finite number"):
            lm.with_overrides(parse_overrides([f"optim.lr={nan}"]))
    path = tmp_path / "run.yaml"
    path.write_text("steps: 010\nsave_every: 0o10\nmodel:\n  bias: true\n")
    cfg = TrainConfig.load(path)
    assert (cfg.steps, cfg.save_every, cfg.model.bias) == (10, 8, True)


def test_the_named_lm_presets_are_the_decoder_presets() -> None:
    """`tformer bench` lists LM_PRESETS (named so the command line's start-up builds no config)."""
    from tformer.train.presets import LM_PRESETS, TRAIN_PRESETS

    assert (
        tuple(name for name, preset in TRAIN_PRESETS.items() if preset().model.arch == "decoder")
        == LM_PRESETS
    )


def test_data_paths_resolve_from_the_config_file_then_the_working_directory(tmp_path, monkeypatch) -> None:
    """A config file's relative data paths are read from the file's folder, --set's from the working
    directory; the resolved config holds absolute paths, so a later --resume or eval from anywhere finds
    the same data."""
    from tformer.cli.main import build_parser
    from tformer.cli.options import resolve_train_config
    from tformer.train.resume import absolute_data_paths

    conf = tmp_path / "configs"
    conf.mkdir()
    (conf / "run.yaml").write_text("data:\n  corpus: text:notes/\n  path: pkg\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    args = build_parser().parse_args(["train", "--config", "../configs/run.yaml"])
    cfg = resolve_train_config(args, default_preset="tiny-lm")
    assert cfg.data.corpus == f"text:{conf / 'notes'}"
    assert cfg.data.path == str(conf / "pkg")

    args = build_parser().parse_args(
        ["train", "--config", str(conf / "run.yaml"), "--set", "data.corpus=pairs:de-en.tsv"]
    )
    cfg = absolute_data_paths(resolve_train_config(args, default_preset="tiny-lm"))  # as the Trainer does
    assert cfg.data.corpus == f"pairs:{elsewhere / 'de-en.tsv'}" and cfg.data.path == str(conf / "pkg")

    args = build_parser().parse_args(["train", "--preset", "tiny-lm", "--set", "data.corpus=text:/abs/x.txt"])
    assert resolve_train_config(args, default_preset="tiny-lm").data.corpus == "text:/abs/x.txt"
    args = build_parser().parse_args(["train", "--preset", "tiny-lm"])  # a registry name: untouched
    assert (
        resolve_train_config(args, default_preset="tiny-lm").data.corpus
        == get_train_preset("tiny-lm").data.corpus
    )


def test_an_override_into_an_unknown_or_plain_key_names_it_and_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"^unknown key 'unknown' in TrainConfig \(override 'unknown.key'\); allowed: task, model, data"):  # fmt: skip
        TrainConfig().with_overrides({"unknown.key": 1})
    with pytest.raises(ConfigError, match=r"^unknown key 'foo' in TrainConfig.model \(override 'model.foo.bar'\); allowed: arch,"):  # fmt: skip
        TrainConfig().with_overrides({"model.foo.bar": 1})
    with pytest.raises(
        ConfigError, match=r"^TrainConfig.steps is a setting, not a section: override 'steps.key'"
    ):
        TrainConfig().with_overrides({"steps.key": 1})
    with pytest.raises(ConfigError, match=r"^unknown key 'foo' in TrainConfig.model.moe \(override 'model.moe.foo.bar'\); allowed: n_experts, top_k,"):  # fmt: skip
        TrainConfig().with_overrides({"model.moe.foo.bar": 1})  # a null section: its class's fields
    moe = TrainConfig().with_overrides({"model.moe.top_k": 1})  # a null section is filled in, not refused
    assert moe.model.moe.top_k == 1


def test_a_yml_config_file_reads_as_yaml(tmp_path) -> None:
    path = tmp_path / "run.yml"
    path.write_text("steps: 7\nmodel:\n  d_model: 64\n  n_heads: 4\n")
    cfg = TrainConfig.load(path)
    assert cfg.steps == 7 and cfg.model.d_model == 64


def test_set_values_keep_what_follows_the_first_equals_sign_and_an_empty_one_is_null() -> None:
    assert parse_overrides(["data.corpus=text:a=b.txt", "model.moe=", " steps = 5"]) == {
        "data.corpus": "text:a=b.txt",
        "model.moe": None,
        "steps": 5,
    }


def test_preset_and_config_together_are_refused(tmp_path, capsys) -> None:
    from tformer.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\n")
    argv = [
        "train",
        "--preset",
        "tiny-lm",
        "--config",
        str(path),
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "give either --preset or --config, not both" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()
