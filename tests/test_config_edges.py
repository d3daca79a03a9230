"""Audit findings in config reading and checking: overrides that reach inside a null setting, settings a
task ignores, a task's model arch named up front, YAML round trips of strings that look like other
values, duplicate keys in --set, config file suffixes in any case, and the bound on MoE widths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tformer import ConfigError, MoEConfig
from tformer.cli.main import main
from tformer.cli.options import parse_overrides
from tformer.config import MAX_SIZE
from tformer.schema import yaml_value
from tformer.train.config import TrainConfig, refuse_ignored_settings
from tformer.train.presets import get_train_preset


def train_errors(argv: list[str], capsys, tmp_path: Path, monkeypatch) -> str:
    """The one stderr line of a `tformer train` refused with exit status 2."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
    return err


# ---------------------------------------------------------------- 1: overrides inside a null setting


@pytest.mark.parametrize(
    ("key", "setting"),
    [
        ("model.head_dim.a.b", "TrainConfig.model.head_dim"),
        ("model.n_kv_heads.a.b", "TrainConfig.model.n_kv_heads"),
        ("data.path.x", "TrainConfig.data.path"),
        ("data.max_tokens.x.y", "TrainConfig.data.max_tokens"),
        ("model.rope.original_max_seq_len.a.b", "TrainConfig.model.rope.original_max_seq_len"),
        ("steps.x", "TrainConfig.steps"),
    ],
)
def test_an_override_inside_a_null_setting_says_it_is_a_setting(key: str, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        get_train_preset("tiny-lm").with_overrides({key: 1})
    assert str(err.value) == f"{setting} is a setting, not a section: override {key!r} reaches inside it"


def test_a_null_section_is_still_set_field_by_field() -> None:
    cfg = get_train_preset("tiny-lm").with_overrides({"model.moe.n_experts": 4, "model.moe.top_k": 1})
    assert (cfg.model.moe.n_experts, cfg.model.moe.top_k) == (4, 1)
    with pytest.raises(ConfigError, match=r"unknown key 'nope' in TrainConfig.model.moe \(override"):
        get_train_preset("tiny-lm").with_overrides({"model.moe.nope.x": 1})


def test_an_override_inside_a_mapping_given_to_a_setting_says_it_is_a_setting() -> None:
    with pytest.raises(ConfigError, match=r"^TrainConfig.data.path is a setting, not a section"):
        TrainConfig().with_overrides({"data.path": {"a": 1}, "data.path.b.c": 1})


def test_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tformer", "train", "--preset", "tiny-lm", "--set", "model.head_dim.a.b=1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "TrainConfig.model.head_dim is a setting, not a section" in done.stderr


# ---------------------------------------------------------------- 2: settings a task ignores


def test_data_direction_is_refused_outside_translation() -> None:
    with pytest.raises(ConfigError) as err:
        refuse_ignored_settings(get_train_preset("tiny-lm").with_overrides({"data.direction": "xx-yy"}))
    assert str(err.value) == (
        "data.direction is read by the translation task only: task 'lm' would ignore it; leave it at "
        "'de-en', got 'xx-yy'"
    )
    refuse_ignored_settings(get_train_preset("tiny-translation").with_overrides({"data.direction": "en-de"}))


def test_sample_tokens_is_refused_outside_the_lm_task() -> None:
    for preset in ("tiny-translation", "tiny-classification"):
        with pytest.raises(ConfigError, match=r"^sample_tokens sizes the lm task's samples only.*got 50$"):
            refuse_ignored_settings(get_train_preset(preset).replace(sample_tokens=50))
        refuse_ignored_settings(get_train_preset(preset))
    refuse_ignored_settings(get_train_preset("tiny-lm").replace(sample_tokens=50))


# ---------------------------------------------------------------- 5: a task's arch, up front


@pytest.mark.parametrize(
    ("preset", "arch", "said"),
    [
        ("shakespeare", "encoder", "language modelling needs model.arch 'decoder', got 'encoder'"),
        ("tiny-translation", "decoder", "translation needs model.arch 'encoder_decoder', got 'decoder'"),
        ("tiny-classification", "decoder", "classification needs model.arch 'encoder', got 'decoder'"),
    ],
)
def test_a_task_refuses_another_arch_before_anything_is_built(preset: str, arch: str, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        refuse_ignored_settings(get_train_preset(preset).with_overrides({"model.arch": arch}))
    assert str(err.value).startswith(said + ": task ")


def test_train_names_the_arch_before_training_a_tokenizer(capsys, tmp_path: Path, monkeypatch) -> None:
    import tformer.tasks.lm as lm

    def never(*args, **kwargs):
        raise AssertionError("a tokenizer was trained before the arch was checked")

    monkeypatch.setattr(lm, "train_tokenizer", never)
    err = train_errors(
        ["--preset", "shakespeare", "--set", "model.arch=encoder"], capsys, tmp_path, monkeypatch
    )
    assert "language modelling needs model.arch 'decoder', got 'encoder'" in err


# ---------------------------------------------------------------- 3: MoE widths


@pytest.mark.parametrize("name", ["d_expert", "d_shared"])
def test_moe_widths_are_bounded_as_the_model_widths_are(name: str) -> None:
    assert getattr(MoEConfig(**{name: MAX_SIZE}), name) == MAX_SIZE
    with pytest.raises(ConfigError) as err:
        MoEConfig(**{name: MAX_SIZE + 1})
    assert str(err.value) == f"MoEConfig.{name} must be from 1 to {MAX_SIZE:,} (or null), got {MAX_SIZE + 1}"
    with pytest.raises(ConfigError, match=rf"MoEConfig.{name} must be from 1 to"):
        MoEConfig(**{name: 0})


# ---------------------------------------------------------------- 4: YAML round trips


LOOKALIKES = ["1e5", "0o17", "true", "null", "~", "2024-12-01", "010", "0x10", "yes", "1:30", "="]


@pytest.mark.parametrize("text", LOOKALIKES)
def test_a_string_that_looks_like_another_value_round_trips_through_yaml(text: str, tmp_path: Path) -> None:
    cfg = TrainConfig().with_overrides({"data.path": text})
    cfg.save(tmp_path / "run.yaml")
    assert TrainConfig.load(tmp_path / "run.yaml").data.path == text
    assert TrainConfig.from_yaml(cfg.to_yaml()) == cfg


def test_plain_strings_stay_plain_in_yaml() -> None:
    assert (
        "  path: corpus/de-en.txt\n"
        in TrainConfig().with_overrides({"data.path": "corpus/de-en.txt"}).to_yaml()
    )


def test_a_date_is_a_string() -> None:
    assert yaml_value("2024-12-01") == "2024-12-01"
    assert parse_overrides(["data.path=2024-12-01"]) == {"data.path": "2024-12-01"}
    assert TrainConfig.from_yaml("data: {path: 2024-12-01}").data.path == "2024-12-01"


# ---------------------------------------------------------------- 7: a key twice in --set


def test_a_key_twice_in_a_set_mapping_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_overrides(["model.moe={n_experts: 4, n_experts: 16}"])
    assert str(err.value) == (
        "--set model.moe={n_experts: 4, n_experts: 16}: the key 'n_experts' appears twice in one mapping "
        "(which value is meant?)"
    )
    assert parse_overrides(["model.moe={n_experts: 4, top_k: 1}"]) == {
        "model.moe": {"n_experts": 4, "top_k": 1}
    }


# ---------------------------------------------------------------- 9: file suffixes in any case


@pytest.mark.parametrize("name", ["OK.YAML", "ok.Yml", "OK.JSON"])
def test_config_file_suffixes_are_read_in_any_case(name: str, tmp_path: Path) -> None:
    cfg = TrainConfig(steps=7).with_overrides({"data.path": "1e5"})
    cfg.save(tmp_path / name)
    text = (tmp_path / name).read_text()
    assert text.lstrip().startswith("{") == name.lower().endswith(".json")
    assert TrainConfig.load(tmp_path / name) == cfg


def test_an_upper_case_yaml_file_is_read_as_yaml(tmp_path: Path) -> None:
    (tmp_path / "OK.YAML").write_text("steps: 5\n")
    assert TrainConfig.load(tmp_path / "OK.YAML").steps == 5


# ---------------------------------------------------------------- 10: --set's help


def test_set_help_says_what_reads_as_null(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "~, null and an empty value mean null" in shown and "data.path=$HOME/corpus" in shown
    assert parse_overrides(["data.path=~"]) == {"data.path": None}  # the meaning stays


def test_a_mapping_given_to_a_set_section_changes_only_the_keys_it_names() -> None:
    """`--set 'model.moe={top_k: 4}'` on the main job's preset had replaced its MoE section: the
    fine-grained width, the shared expert and the dense first layer fell back to the class defaults
    without a word (full-width experts, no shared one). Named keys change, the others stay, inner sections
    likewise; a null section is still built from its defaults; a wrong key is still named."""
    main_job = get_train_preset("shakespeare")
    moe = main_job.with_overrides(parse_overrides(["model.moe={top_k: 4}"])).model.moe
    assert moe == main_job.model.moe.replace(top_k=4) and moe.d_expert == 172 and moe.n_shared == 1
    model = main_job.with_overrides(parse_overrides(["model={d_model: 96, moe: {n_shared: 2}}"])).model
    assert model == main_job.model.replace(d_model=96, moe=main_job.model.moe.replace(n_shared=2))
    tiny = get_train_preset("tiny-lm")
    assert tiny.model.moe is None
    built = tiny.with_overrides(parse_overrides(["model.moe={n_experts: 4, top_k: 2}"])).model.moe
    assert built == MoEConfig(n_experts=4, top_k=2)  # from the defaults, as before
    assert tiny.with_overrides({"model.moe": None}).model.moe is None
    assert main_job.with_overrides({"model.moe": None}).model.moe is None  # a section can still be removed
    with pytest.raises(ConfigError, match=r"unknown key 'd_modl' in TrainConfig.model; allowed: arch"):
        tiny.with_overrides(parse_overrides(["model={d_modl: 32}"]))
