"""The experiments' building blocks on tiny inputs: report rendering, measurements, verdict rules,
the MoE arms' compute match and the routing interventions."""

from __future__ import annotations

import math

import pytest
import torch

from tformer.cli.main import main
from tformer.config import ModelConfig, MoEConfig
from tformer.experiments import moe, norm
from tformer.experiments.report import (
    Report,
    Verdict,
    all_hold,
    fmt,
    less,
    lower,
    stopped_note,
    text_table,
    training_units,
)
from tformer.experiments.runner import ArmLog, Setting, layer_groups
from tformer.experiments.study_dir import drop_previous_study, prepare_run_dir, restore_previous_study
from tformer.model import build_model
from tformer.model.moe import moe_layers
from tformer.model.stats import count_params, flops_per_token
from tformer.presets import tiny


def test_fmt_and_all_hold():
    assert fmt(1.234567) == "1.2346" and fmt(math.nan) == "nan" and fmt(math.inf) == "inf" and fmt(3) == "3"
    assert all_hold([True, True]) is True
    assert all_hold([True, False, None]) is False
    assert all_hold([True, None]) is None and all_hold([]) is None


def test_report_renders_markdown_and_self_contained_html(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    fig.savefig(tmp_path / "p.png")
    plt.close(fig)
    r = Report("T <1>")
    r.text("a `code` and **bold** <tag>")
    r.table(["a", "b"], [["x|y", 1]])
    r.figure(tmp_path / "p.png", "cap")
    r.verdicts([Verdict("c", "rule", False, "ev", "ref")])
    md, page = r.write(tmp_path)
    text = md.read_text()
    assert "| x\\|y | 1 |" in text and "![cap](p.png)" in text and "**not reproduced**" in text
    html = page.read_text()
    assert "<code>code</code>" in html and "<strong>bold</strong>" in html and "&lt;tag&gt;" in html
    assert "data:image/png;base64," in html and "T &lt;1&gt;" in html


def test_text_table_aligns_columns():
    out = text_table(["arm", "loss"], [["a", "1.0"], ["bbb", "10.25"]]).splitlines()
    assert out[0] == "arm   loss" and out[2] == "a      1.0" and out[3] == "bbb  10.25"


def test_layer_groups_cover_every_parameter_once():
    for arch in ("decoder", "encoder_decoder"):
        model = build_model(tiny(arch))
        groups = layer_groups(model)
        ids = [id(p) for ps in groups.values() for p in ps]
        assert sorted(ids) == sorted(id(p) for p in model.parameters())
        blocks = [g for g in groups if "blocks." in g]
        assert len(blocks) == (2 if arch == "decoder" else 4)


def test_setting_validation():
    with pytest.raises(ValueError, match="n_heads"):
        Setting(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="warmup_steps"):
        Setting(steps=10, warmup_steps=20)
    with pytest.raises(ValueError, match="depths"):
        norm.NormSetting(depths=())
    assert norm.QUICK.replace(steps=None, seeds=3).seeds == 3  # None = keep


def arm_log(losses: list[float], placement="post", warmup=False) -> ArmLog:
    records = [{"kind": "train", "step": i + 1, "loss": x, "grad_norm": 1.0} for i, x in enumerate(losses)]
    return ArmLog("a", 0, {"placement": placement, "depth": 2, "warmup": warmup}, {}, records)


def test_divergence_events_rule():
    arm = arm_log([5.0, 6.0, 4.0, 5.5, math.nan, 3.0])
    assert norm.divergence_events(arm, warmup_steps=0) == [2, 4, 5]
    assert norm.divergence_events(arm, warmup_steps=3) == [4, 5]  # only after the warm-up window


def test_moe_arms_match_active_compute():
    s = moe.QUICK
    cfgs = moe.arm_configs(s, lambda c: c.replace(vocab_size=300))
    dense = count_params(cfgs["dense"])["active"]
    flops = flops_per_token(cfgs["dense"], s.seq_len, causal=True)
    for name, cfg in cfgs.items():
        size = count_params(cfg)
        assert size["active"] == pytest.approx(dense, rel=0.05), name
        assert flops_per_token(cfg, s.seq_len, causal=True) == pytest.approx(flops, rel=0.05), name
    totals = {n: count_params(c)["total"] for n, c in cfgs.items() if n != "dense"}
    assert max(totals.values()) == pytest.approx(min(totals.values()), rel=0.02)  # same capacity
    assert cfgs["deepseekmoe"].moe.n_shared == 1 and cfgs["deepseekmoe-noshared"].moe.n_shared == 0
    assert (
        cfgs["deepseekmoe-lossfree"].moe.aux_loss_coef == 0
        and cfgs["deepseekmoe-lossfree"].moe.bias_update_rate > 0
    )


def small_moe() -> tuple[ModelConfig, torch.nn.Module]:
    cfg = tiny().replace(vocab_size=64, moe=MoEConfig(n_experts=8, top_k=2, d_expert=16, n_shared=1))
    return cfg, build_model(cfg).eval()


def test_disable_top_experts_skips_each_tokens_best():
    cfg, model = small_moe()
    x = torch.randint(0, 64, (2, 10))
    seen, handles = moe.capture_routing(model)
    model(x)
    best = {k: v[0][:, 0] for k, v in seen.items()}  # each token's best expert
    for h in handles:
        h.remove()
    hooks = moe.disable_top_experts(model, ratio=1 / 8)  # 1 of 8 experts off per token
    seen, handles = moe.capture_routing(model)  # registered after: sees the altered routing
    with torch.no_grad():
        model(x)
    for h in hooks + handles:
        h.remove()
    for k, idx in seen.items():
        assert not (idx[0] == best[k][:, None]).any()
    assert moe.disable_top_experts(model, ratio=0.0) == []


def test_without_shared_loads_every_other_weight():
    cfg, model = small_moe()
    ablated = moe.without_shared(model, cfg, torch.device("cpu"))
    assert all(layer.router.top_k == 3 for _, layer in moe_layers(ablated))
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert not torch.allclose(model(x), ablated(x))
        assert torch.equal(model.tok_embed.weight, ablated.tok_embed.weight)


def test_cli_rejects_an_option_the_study_lacks(capsys):
    assert main(["experiment", "moe", "--quick", "--depths", "2,4", "--out", "/nonexistent/x"]) == 2
    assert "has no option --depths" in capsys.readouterr().err
    assert main(["experiment", "norm", "--quick", "--n-layers", "3", "--out", "/nonexistent/x"]) == 2
    assert "has no option --n-layers" in capsys.readouterr().err


def test_max_train_docs_of_the_encoder_decoder_norm_study_limits_its_pairs():
    """--max-train-docs with --arch encoder_decoder had been accepted and ignored (that study reads
    max_train_pairs)."""
    import argparse

    from tformer.cli.experiment import OVERRIDES, resolve_setting

    flags = dict.fromkeys(OVERRIDES) | {"depths": None, "quick": True, "study": "norm"}
    args = argparse.Namespace(**(flags | {"arch": "encoder_decoder", "max_train_docs": 50}))
    setting = resolve_setting(args, norm)
    assert setting.arch == "encoder_decoder" and setting.max_train_pairs == 50
    args = argparse.Namespace(**(flags | {"arch": None, "max_train_docs": 1}))
    assert resolve_setting(args, norm).max_train_docs == 1  # the decoder's works, as before


def test_overwrite_removes_everything_a_study_wrote_and_other_runs_are_refused(tmp_path):
    """A tokenizer, data manifest or plot of the previous study must not outlive --overwrite (the new
    study would train on the old vocabulary); a training run's directory is not a study's."""
    study = tmp_path / "study"
    (study / "arms" / "a").mkdir(parents=True)
    for name in ("setting.json", "data.json", "tokenizer.json", "report.md", "report.html", "norm_loss.png"):
        (study / name).write_text("old")
    (study / "notes.txt").write_text("the user's")
    (study / "photo.png").write_text("the user's")
    with pytest.raises(ValueError, match="already holds an experiment run; pass --overwrite"):
        prepare_run_dir(study, overwrite=False)
    assert prepare_run_dir(study, overwrite=True) == study
    # the old study aside (given back if the new one fails before its first arm), the user's files kept
    assert sorted(p.name for p in study.iterdir()) == [".previous-study", "notes.txt", "photo.png"]
    assert sorted(p.name for p in (study / ".previous-study").iterdir()) == [
        "arms", "data.json", "norm_loss.png", "report.html", "report.md", "setting.json", "tokenizer.json"
    ]  # fmt: skip
    (study / "setting.json").write_text("new")  # the new study fails before an arm finished
    assert restore_previous_study(study)
    assert (study / "setting.json").read_text() == "old" and (study / "report.md").exists()
    assert not (study / ".previous-study").exists() and not restore_previous_study(study)
    prepare_run_dir(study, overwrite=True)
    drop_previous_study(study)  # the new study got under way: the old one goes
    assert sorted(p.name for p in study.iterdir()) == ["notes.txt", "photo.png"]
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "thesis.tex").write_text("the user's")
    with pytest.warns(UserWarning, match="already holds other files; the study writes its own beside them"):
        prepare_run_dir(other, overwrite=False)
    assert (other / "thesis.tex").read_text() == "the user's"
    for name in ("report.md", "data.json", "norm_losses.png"):  # a user's files under names a study writes
        mine = tmp_path / f"mine-{name}"
        mine.mkdir()
        (mine / name).write_text("the user's")
        with pytest.raises(
            ValueError, match=f"holds {name}, which a study would replace: choose another --out"
        ):
            prepare_run_dir(mine, overwrite=False)
        assert (mine / name).read_text() == "the user's"
    (study / "arms").mkdir()  # a study stopped before its report
    with pytest.raises(
        ValueError,
        match="holds an experiment run that did not finish .*; continue it with --resume, or pass --overwrite",
    ):
        prepare_run_dir(study, overwrite=False)
    trained = tmp_path / "train-run"
    (trained / "checkpoints").mkdir(parents=True)
    (trained / "tokenizer.json").write_text("{}")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="holds checkpoints, tokenizer.json of something else"):
            prepare_run_dir(trained, overwrite=overwrite)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lr", "nan"], "--lr must be a finite number"),  # named as the flag, not OptimConfig.lr
        (["--vocab-size", "10"], "--vocab-size must be from 260"),  # found while the first arm starts
        (
            ["--batch-size", "100000"],
            "makes no full batch per process (100000 samples) in epoch 0: lower the batch size",
        ),
        (
            ["--steps", "3"],
            "--steps 3 must cover the study's 4 warm-up steps and leave 2 steps after them for the study's measures: give --warmup-steps at most 1, or --steps 6 or more",
        ),
        (  # no warm-up fits: the steps are what to change (it had said "--warmup-steps at most -1")
            ["--steps", "1"],
            "--steps 1 must cover the study's 4 warm-up steps and leave 2 steps after them for the study's measures: give --steps 6 or more",
        ),
    ],
)
def test_a_study_that_fails_before_training_leaves_no_directory(argv, needle, tmp_path, capsys):
    """The corrected command can then run into the same --out without --overwrite."""
    out = tmp_path / "runs" / "study"
    assert main(["experiment", "norm", "--quick", "--threads", "1", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_a_width_rope_cannot_rotate_names_the_flag(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["experiment", "moe", "--quick", "--d-model", "36", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        "gives 9 rotated features of head_dim=9 (--d-model=36 / n_heads=4)" in err and "Traceback" not in err
    ), err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA would run it")
def test_a_study_on_a_missing_device_is_one_line(tmp_path, capsys):
    assert main(["experiment", "rope", "--quick", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
    assert "has no CUDA device" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_moe_train_loads_weight_each_routing_window_by_its_steps():
    """50 steps all on expert 0, then a 10-step window all on expert 1: 50/60 and 10/60 of the
    assignments (equal weights per window had read 0.5 / 0.5)."""
    from tformer.experiments.moe_report import train_loads

    records = [
        {"kind": "routing", "step": 50, "load": {"blocks.1": [1.0, 0.0]}},
        {"kind": "routing", "step": 60, "load": {"blocks.1": [0.0, 1.0]}},
    ]
    loads = train_loads(ArmLog("a", 0, {}, {}, records))["blocks.1"]
    assert loads == pytest.approx([50 / 60, 10 / 60])


def test_comparisons_treat_nan_as_diverged_or_undecided():
    """NaN compares False to everything: a rule written as `a < b` had decided claims on diverged or
    missing numbers (a study at lr 1e300 came out "reproduced")."""
    assert lower(1.0, 2.0) is True and lower(2.0, 1.0) is False
    assert lower(1.0, math.nan) is True and lower(math.nan, 1.0) is False  # a diverged loss is the worst
    assert lower(math.inf, 1.0) is False and lower(math.nan, math.inf) is None and lower(None, 1.0) is None
    assert less(1.0, 2.0) is True and less(math.nan, 2.0) is None and less(1.0, None) is None


def norm_grid(eval_loss: dict, train_after: float, steps: int = 6) -> list:
    """Arms of a one-depth, one-seed norm study: each with init gradients, `steps` train records (loss 5
    at step 1, then train_after) and a final eval loss eval_loss[(placement, warmup)]."""
    arms = []
    for (placement, warmup), final in eval_loss.items():
        grads = {"blocks.0": 1.0, "blocks.1": 2.0 if placement == "post" else 0.5}
        records = [{"kind": "init_grads", "layer_grad_norms": grads}]
        records += [
            {"kind": "train", "step": i, "loss": 5.0 if i == 1 else train_after, "grad_norm": float(i)}
            for i in range(1, steps + 1)
        ]
        records.append({"kind": "eval", "step": steps, "eval_loss": final})
        tags = {"placement": placement, "depth": 2, "warmup": warmup}
        arms.append(ArmLog(f"{placement}-{warmup}", 0, tags, {}, records))
    return arms


def test_norm_verdicts_on_diverged_arms_are_not_reproduced_by_nan():
    s = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=2)
    nan_everywhere = {(p, w): math.nan for p in ("post", "pre") for w in (True, False)}
    checks = {v.claim: v for v in norm.verdicts(norm_grid(nan_everywhere, math.nan), s)}
    assert checks["Pre-Norm converges faster"].holds is None  # both diverged: nothing to compare
    assert checks["Post-Norm needs learning-rate warm-up more than Pre-Norm"].holds is None
    assert checks["Post-Norm without warm-up diverges"].holds is False  # Pre-Norm diverged too
    # Post-Norm diverging without warm-up (only there) is what the warm-up claim says
    post_fails = {("post", True): 3.0, ("post", False): math.nan, ("pre", True): 2.9, ("pre", False): 2.95}
    checks = {v.claim: v for v in norm.verdicts(norm_grid(post_fails, 4.0), s)}
    assert checks["Post-Norm needs learning-rate warm-up more than Pre-Norm"].holds is True
    assert checks["Pre-Norm converges faster"].holds is True
    # a saved study without steps after its warm-up still reports: those measures are inconclusive
    short = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=6)
    checks = {v.claim: v for v in norm.verdicts(norm_grid(post_fails, 4.0), short)}
    assert checks["Pre-Norm's gradients are steadier during training"].holds is None
    assert checks["Post-Norm without warm-up diverges"].holds is None


def test_the_report_names_stopped_arms_and_the_works_trained_on(tmp_path):
    arms = norm_grid({("post", False): math.nan, ("pre", False): 3.0}, 4.0)
    arms[0].records.append({"kind": "stopped", "step": 11, "reason": "10 non-finite steps in a row"})
    assert stopped_note(arms).startswith(
        "**1 of 2 arms stopped before the budget**: post-False at step 11 (10 non-finite steps in a row)."
    )
    assert stopped_note(arms[1:]) is None
    (tmp_path / "data.json").write_text('{"counts": {"train": 38, "val": 2, "test": 2}}')
    assert training_units(tmp_path, 1000, "works") == "all 38 training works (1,000 asked)"
    assert training_units(tmp_path, 2, "works") == "2 of the 38 training works"
    assert training_units(tmp_path, None, "works") == "all 38 training works"
    assert training_units(tmp_path / "none", 5, "pairs") == "5 training pairs"  # no manifest: as asked


def test_a_failed_overwrite_gives_the_finished_study_back(tmp_path, capsys):
    """--overwrite had deleted the finished study before the new one failed on its data: nothing of either
    was left to --resume or report."""
    study = tmp_path / "study"
    (study / "arms" / "a").mkdir(parents=True)
    for name in ("setting.json", "data.json", "tokenizer.json", "report.md", "norm_loss.png"):
        (study / name).write_text("old")
    argv = ["experiment", "norm", "--quick", "--threads", "1", "--batch-size", "100000", "--overwrite"]
    assert main([*argv, "--out", str(study)]) == 2
    assert "makes no full batch per process" in capsys.readouterr().err
    assert sorted(p.name for p in study.iterdir()) == [
        "arms", "data.json", "norm_loss.png", "report.md", "setting.json", "tokenizer.json"
    ]  # fmt: skip
    assert all((study / n).read_text() == "old" for n in ("setting.json", "report.md", "tokenizer.json"))
    assert [p.name for p in (study / "arms").iterdir()] == ["a"]


def moe_grid(final: dict, max_vio: dict, no_shared_rise: float, disable_rise: dict) -> list:
    """One seed of the MoE study's arms: final eval losses, held-out MaxVio, the no-shared ablation's
    loss rise (DeepSeekMoE) and the loss rises when each token's top experts are disabled."""
    arms = []
    for name, loss in final.items():
        records = [{"kind": "eval", "step": 10, "eval_loss": loss}]
        if name in max_vio:
            records.append({"kind": "routing_eval", "layers": {"blocks.0.ffn": {"max_vio": max_vio[name]}}})
        if name == "deepseekmoe":
            records.append({"kind": "no_shared", "base_loss": loss, "loss": loss + no_shared_rise})
        for ratio in (0.25,):
            if name in disable_rise:
                rec = {
                    "kind": "disable_top",
                    "ratio": ratio,
                    "base_loss": loss,
                    "loss": loss + disable_rise[name],
                }
                records.append(rec | {"n_disabled": 1})
        arms.append(ArmLog(name, 0, {"ffn": name}, {}, records))
    return arms


def test_moe_verdicts_follow_their_rules_both_ways():
    from tformer.experiments import moe_report

    s = moe.FULL.replace(seeds=1, disable_ratios=(0.25,))
    final = {"dense": 3.0, "switch": 2.9, "gshard": 2.8, "deepseekmoe": 2.7, "deepseekmoe-noshared": 2.75,
             "deepseekmoe-lossfree": 2.69}  # fmt: skip
    vio = {"deepseekmoe": 0.7, "deepseekmoe-lossfree": 0.05, "gshard": 0.5}
    holds = {v.claim: v.holds for v in moe_report.verdicts(moe_grid(final, vio, 0.3, {"gshard": 0.1, "deepseekmoe": 0.4}), s)}  # fmt: skip
    assert all(h is True for h in holds.values()), holds
    # each claim's numbers turned around
    worse = final | {
        "deepseekmoe": 2.85,
        "deepseekmoe-lossfree": 2.9,
    }  # above GShard and no-shared; loss-free costs
    turned = moe_report.verdicts(moe_grid(worse, {"deepseekmoe": 0.05, "deepseekmoe-lossfree": 0.7}, -0.1, {"gshard": 0.4, "deepseekmoe": 0.1}), s)  # fmt: skip
    holds = {v.claim: v.holds for v in turned}
    assert holds.pop("MoE raises capacity at constant compute") is True  # all still below dense
    assert all(h is False for h in holds.values()), holds


def test_rope_verdicts_follow_their_rules_both_ways():
    """Per-position losses (3.0 inside the trained length L, the given value beyond it): each claim holds
    on numbers that support it and fails on the same numbers turned around."""
    from tformer.experiments import rope

    s = rope.QUICK.replace(seeds=1, eval_factors=(1, 2))
    L = s.seq_len

    def grid(beyond: dict, inside: float = 3.0) -> dict:
        return {(v, 0, n): [inside] * L + [loss] * (n - 1) * L for v, loss in beyond.items() for n in (1, 2)}

    good = {
        "sinusoidal": 6.0,
        "rope": 5.0,
        "rope+linear": 4.0,
        "rope+ntk": 4.5,
        "rope+yarn": 3.5,
        "learned": 7.0,
    }
    holds = {v.claim: v.holds for v in rope.verdicts(grid(good), s)}
    assert len(holds) == 5 and all(h is True for h in holds.values()), holds
    bad = {
        "sinusoidal": 4.0,
        "rope": 5.0,
        "rope+linear": 6.0,
        "rope+ntk": 5.5,
        "rope+yarn": 7.0,
        "learned": 2.0,
    }
    holds = {v.claim: v.holds for v in rope.verdicts(grid(bad), s)}
    assert all(h is False for h in holds.values()), holds


def test_norm_gradient_verdicts_follow_their_rules_both_ways():
    """The init-gradient and gradient-steadiness claims on synthetic arms: Post-Norm's last/first block
    gradient 2.0 vs Pre-Norm's 0.5, and steady vs jumpy gradient norms after warm-up, then turned around."""
    s = norm.NormSetting(depths=(2,), seeds=1, steps=8, warmup_steps=2)
    finals = {(p, w): 3.0 for p in ("post", "pre") for w in (True, False)}
    claims = ("At initialisation Post-Norm's gradients grow toward the output layer; Pre-Norm's do not",
              "Pre-Norm's gradients are steadier during training")  # fmt: skip
    for turned in (False, True):
        arms = norm_grid(finals, 4.0, steps=8)
        for arm in arms:
            jumpy = (arm.tags["placement"] == "post") != turned
            for r in arm.records:
                if r["kind"] == "train":
                    r["grad_norm"] = (1.0 if r["step"] % 2 else 3.0) if jumpy else 2.0
                if r["kind"] == "init_grads" and turned:
                    r["layer_grad_norms"]["blocks.1"] = 0.5 if arm.tags["placement"] == "post" else 2.0
        holds = {v.claim: v.holds for v in norm.verdicts(arms, s)}
        assert [holds[c] for c in claims] == [not turned] * 2, holds
