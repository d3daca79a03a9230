"""The studies' details, each against a formula written out here, on synthetic arms or a stubbed
`StudyData` and a tiny model (no corpus, no real study): `train_arm`'s seed, budget, schedule, final
evaluation and auxiliary loss; the order arms are read back in; load shares; which config switch each
arm flips; each report column, plot series and printed summary read from the right arm and record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.experiments.test_parts import moe_grid, norm_grid, small_moe
from tformer.config import MoEConfig
from tformer.experiments import moe, norm, rope
from tformer.experiments.report import Report, fmt, fmt_count
from tformer.experiments.runner import Arm, ArmLog, LoadWindow, Setting, read_arms, read_records, train_arm
from tformer.experiments.study_dir import prepare_run_dir
from tformer.model import build_model
from tformer.model.stats import count_params, flops_per_token
from tformer.presets import tiny


# ----------------------------------------------------------------------------- runner, stubbed data
class FakeStream:
    def __init__(self, seed: int, vocab: int, batch: int, seq: int) -> None:
        self.g = torch.Generator().manual_seed(1000 + seed)
        self.vocab, self.batch, self.seq = vocab, batch, seq

    def next_batch(self, device):
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.g)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)


class FakeData:
    """StudyData's interface (stream, loss, evaluate) on random tokens: a seed fixes the batches."""

    def __init__(self, vocab: int = 64, batch: int = 2, seq: int = 8) -> None:
        self.vocab, self.batch, self.seq = vocab, batch, seq
        self.evals = 0

    def stream(self, seed: int) -> FakeStream:
        return FakeStream(seed, self.vocab, self.batch, self.seq)

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"), y.numel()

    @torch.no_grad()
    def evaluate(self, model):
        self.evals += 1
        x, y = self.stream(99).next_batch(torch.device("cpu"))
        loss, n = self.loss(model, (x, y))
        return {"eval_loss": float(loss) / n, "perplexity": math.exp(float(loss) / n)}


def _train(tmp_path, arm, setting, index=0, sub="run"):
    train_arm(arm, FakeData(), setting, tmp_path / sub, index=index)
    return read_records(tmp_path / sub / "arms" / arm.name / "metrics.jsonl")


def test_train_arm_same_seed_same_run_whatever_its_index(tmp_path):
    """Arms of one seed share initial weights and batches: the arm's place in the study changes nothing
    (kills a seed or data stream taken from the arm's index)."""
    s = Setting(steps=4, warmup_steps=1, eval_every=2, device="cpu")
    arm = Arm("a", tiny().replace(vocab_size=64), s.optim(), seed=3)
    first = _train(tmp_path, arm, s, index=0, sub="r0")
    later = _train(tmp_path, arm, s, index=5, sub="r5")
    key = lambda rs: [(r["step"], r["loss"]) for r in rs if r["kind"] == "train"]  # noqa: E731
    assert key(first) == key(later)


def test_train_arm_budget_schedule_and_final_evaluation(tmp_path):
    """steps not a multiple of eval_every: the last step is still evaluated; the cosine schedule of the
    study's budget ends at lr x min_lr_ratio on the last step; the logged loss is the task loss alone."""
    s = Setting(steps=5, warmup_steps=1, eval_every=2, device="cpu")
    cfg = tiny().replace(vocab_size=64, moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, aux_loss_coef=0.5))
    arm = Arm("m", cfg, s.optim(), seed=0)
    records = _train(tmp_path, arm, s)
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    assert evals == [2, 4, 5]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert train[-1]["lr"] == pytest.approx(s.lr * 0.1)  # cosine to 10% over exactly `steps`
    # step 1's loss: the task loss of the seeded initial model on the stream's first batch, no aux term
    data = FakeData()
    torch.manual_seed(0)
    model = build_model(cfg)
    stream = data.stream(0)
    with torch.no_grad():  # the init-gradient batches come from a stream of their own
        loss, n = data.loss(model, stream.next_batch(torch.device("cpu")))
    assert train[0]["aux_loss"] > 0
    assert train[0]["loss"] == pytest.approx(float(loss) / n, rel=1e-5)


def test_read_arms_keeps_the_training_order_not_the_names(tmp_path):
    for index, name in enumerate(["zeta", "alpha", "mid"]):
        d = tmp_path / "arms" / name
        d.mkdir(parents=True)
        (d / "arm.json").write_text(
            json.dumps({"index": index, "name": name, "seed": 0, "tags": {}, "model": {}})
        )
        (d / "metrics.jsonl").write_text("")
    assert [a.name for a in read_arms(tmp_path)] == ["zeta", "alpha", "mid"]


def test_load_window_shares_are_assignment_shares():
    w = LoadWindow()
    w.add({"blocks.0": {"load": [0.5, 0.25, 0.25, 0.0], "assignments": 8}})
    w.add({"blocks.0": {"load": [0.0, 0.0, 0.5, 0.5], "assignments": 8}})
    counts = [4, 2, 6, 4]
    rec = w.flush(7)
    assert rec["step"] == 7 and rec["load"]["blocks.0"] == pytest.approx([c / sum(counts) for c in counts])
    assert w.flush(8) is None  # emptied


def test_overwrite_moves_every_studys_plots(tmp_path):
    study = tmp_path / "study"
    (study / "arms").mkdir(parents=True)
    names = ["norm_loss.png", "rope_training.png", "moe_loss.png", "moe_load_heatmap.png"]
    for n in names:
        (study / n).write_text("old")
    prepare_run_dir(study, overwrite=True)
    assert not any((study / n).exists() for n in names)
    assert sorted(p.name for p in (study / ".previous-study").iterdir()) == sorted(["arms", *names])


# ----------------------------------------------------------------------------- report helpers
def test_fmt_count_units():
    for n in (999, 12_345, 250_000, 1_500_000, 2.5e9):
        unit, scale = next(((u, sc) for u, sc in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if n >= sc), ("", 1))
        assert fmt_count(n) == (f"{n / scale:.3g}{unit}" if unit else f"{n:.0f}")
    assert fmt_count(250_000) == "250k"


def test_markdown_table_separator_has_a_cell_per_column():
    r = Report("t")
    r.table(["a", "b", "c"], [[1, 2, 3]])
    lines = r.to_markdown().splitlines()
    sep = next(line for line in lines if line.startswith("|---"))
    assert sep.count("---") == 3 and lines[lines.index(sep) - 1].count("|") == sep.count("|")


# ----------------------------------------------------------------------------- norm arms and report
def test_norm_arms_flip_only_placement_and_warmup():
    s = norm.QUICK.replace(seeds=2)
    arms = norm.make_arms(s)
    assert len(arms) == 2 * len(s.depths) * 2 * 2
    for a in arms:
        assert a.model.norm_placement == a.tags["placement"] and a.model.n_layers == a.tags["depth"]
        assert a.optim.warmup_steps == (s.warmup_steps if a.tags["warmup"] else 0)
        assert a.model.positions == "sinusoidal" and a.model.norm == "layernorm" and a.model.ffn == "relu"
        assert a.optim.replace(warmup_steps=0) == s.optim(warmup_steps=0)
        assert a.name.endswith(f"-s{a.seed}")
    assert {a.seed for a in arms} == {0, 1}


def test_norm_arm_rows_columns_come_from_their_records():
    arms = norm_grid({("post", True): 3.1, ("pre", True): 2.9}, 4.0, steps=14)
    for a in arms:  # distinct train losses: 5.0, 4.0 ... plus a step index
        for r in a.kind("train"):
            r["loss"] = 5.0 - 0.1 * r["step"]
    s = norm.NormSetting(depths=(2,), seeds=1, steps=14, warmup_steps=2)
    for a, row in zip(arms, norm.arm_rows(arms, s)):
        losses = [r["loss"] for r in a.kind("train")]
        assert row[5] == fmt(losses[0])  # initial loss
        assert row[6] == fmt(sum(losses[-10:]) / 10)  # mean of the last 10 steps
        assert row[7] == fmt(a.final_eval)


def _write_arms(run_dir: Path, arms, study: str, mode: str, setting) -> None:
    (run_dir / "setting.json").write_text(
        json.dumps({"study": study, "mode": mode, "setting": setting.to_dict()})
    )
    for i, a in enumerate(arms):
        d = run_dir / "arms" / a.name
        d.mkdir(parents=True)
        meta = {"index": i, "name": a.name, "seed": a.seed, "tags": a.tags, "model": a.model}
        (d / "arm.json").write_text(json.dumps(meta))
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a.records))


def test_norm_summary_prints_the_val_loss(tmp_path, monkeypatch):
    arms = norm_grid({("post", True): 3.25, ("pre", True): 2.75}, 4.0)
    s = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=2)
    _write_arms(tmp_path, arms, "norm", "full", s)
    for fn in ("plot_init_grads", "_curves", "plot_layer_grads"):
        monkeypatch.setattr(norm, fn, lambda *a, **k: Path("x.png"))
    _, summary = norm.report(tmp_path)
    lines = summary.splitlines()
    assert lines[0].split()[:3] == ["arm", "val", "loss"]
    for a in arms:
        row = next(line for line in lines if line.startswith(a.name + " "))
        assert row.split()[1] == fmt(a.final_eval)


def test_norm_loss_curves_are_labelled_by_their_arm(monkeypatch):
    figs = []
    monkeypatch.setattr(norm, "save_figure", lambda fig, path: figs.append(fig) or path)
    arms = norm_grid({(p, w): 3.0 for p in ("post", "pre") for w in (True, False)}, 4.0)
    for i, a in enumerate(arms):
        for r in a.kind("train"):
            r["loss"] = float(i)
    s = norm.NormSetting(depths=(2,), seeds=1, steps=6, warmup_steps=2)
    norm._curves(arms, s, Path("x.png"), "loss", "loss", "t")
    lines = {
        ln.get_label(): list(ln.get_ydata())
        for ln in figs[0].axes[0].get_lines()
        if not ln.get_label().startswith("_")
    }
    for i, a in enumerate(arms):
        label = f"{a.tags['placement']}, {'warm-up' if a.tags['warmup'] else 'no warm-up'}"
        assert lines[label] == [float(i)] * 6


# ----------------------------------------------------------------------------- rope arms, evaluation, table
def test_rope_arms_differ_only_in_positions_and_share_seeds():
    s = rope.QUICK.replace(seeds=2)
    arms = rope.make_arms(s)
    for a in arms:
        assert a.model.positions == a.tags["positions"]
        longest = max(s.eval_factors) * s.seq_len
        assert a.model.max_seq_len == (longest if a.tags["positions"] == "learned" else s.seq_len)
        assert a.name == f"{a.tags['positions']}-s{a.seed}"
    for seed in range(2):
        assert sorted(a.tags["positions"] for a in arms if a.seed == seed) == sorted(rope.POSITIONS)


def test_rope_scaled_evaluation_uses_the_length_factor(monkeypatch):
    seen = []
    monkeypatch.setattr(rope, "eval_model", lambda model, cfg, longest, rc, device: seen.append(rc) or rc)
    monkeypatch.setattr(rope, "position_losses", lambda m, w, length, b, d: [0.0] * length)
    s = rope.QUICK.replace(eval_factors=(1, 2, 4))
    arm = Arm("rope-s0", rope.model_config(s, "rope"), s.optim(), 0, {"positions": "rope"})
    records = rope.position_evals(arm, None, None, s)
    for r, rc in zip(records, seen):
        assert r["length"] == r["factor"] * s.seq_len
        if r["method"] == "none":
            assert rc.scaling in (None, "none")
        else:
            assert rc.scaling == r["method"] and rc.factor == r["factor"]
            assert rc.original_max_seq_len == s.seq_len


def test_rope_table_rows_whole_window_and_beyond_L():
    s = rope.QUICK.replace(seeds=1, eval_factors=(1, 2))
    L = s.seq_len
    c = {("rope", 0, 1): [1.0] * L, ("rope", 0, 2): [1.0] * L + [2.0] * L,
         ("rope+linear", 0, 2): [1.0] * L + [1.5] * L}  # fmt: skip
    arm = ArmLog("rope-s0", 0, {"positions": "rope"}, {}, [
        {"kind": "position_eval", "method": m, "factor": n, "position_loss": c[v, 0, n]}
        for (v, _, n) in c for m in [("none" if v == "rope" else "linear")]
    ])  # fmt: skip
    rows = {r[0]: r for r in rope.table_rows(rope.curves([arm]), s)}
    assert rows["RoPE"][2:] == [fmt(math.exp(1.0), 2), fmt(math.exp(1.5), 2), fmt(math.exp(2.0), 2)]
    assert rows["RoPE + PI"][2:] == [fmt(math.exp(1.0), 2), fmt(math.exp(1.25), 2), fmt(math.exp(1.5), 2)]


# ----------------------------------------------------------------------------- moe arms, analyses, report
def test_moe_arms_one_per_name_and_seed():
    s = moe.QUICK.replace(seeds=2)
    arms = moe.make_arms(s)
    assert sorted((a.tags["ffn"], a.seed) for a in arms) == sorted((n, sd) for n in moe.ARMS for sd in (0, 1))
    assert all(a.name == f"{a.tags['ffn']}-s{a.seed}" for a in arms)


def test_moe_size_record_is_causal_flops_and_counts():
    s = moe.QUICK
    cfg = moe.base_config(s).replace(vocab_size=300)
    out = moe.analyses(Arm("dense-s0", cfg, s.optim(), 0, {"ffn": "dense"}), None, None, [], s)
    assert out == [
        {"kind": "size", **count_params(cfg), "flops_per_token": flops_per_token(cfg, s.seq_len, causal=True)}
    ]


def test_routing_eval_max_vio_is_max_over_mean_load():
    cfg, model = small_moe()

    class Tok:
        def decode(self, ids):
            return str(ids[0])

    from tformer.data.datasets import collate_lm  # noqa: F401

    class B:
        def __init__(self, ids):
            self.ids = ids

    batches = [B(torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i))) for i in range(2)]
    s = moe.QUICK.replace(min_token_count=1)
    rec = moe.routing_eval(model, batches, Tok(), s, torch.device("cpu"))
    for layer in rec["layers"].values():
        load = layer["load"]
        assert sum(load) == pytest.approx(1.0)
        assert layer["max_vio"] == pytest.approx(max(load) / (sum(load) / len(load)) - 1.0)


def test_moe_max_vio_train_reads_the_last_fifth():
    train = [
        {"kind": "train", "step": i, "loss": 1.0, "max_vio": {"a": float(i), "b": float(i) + 2}}
        for i in range(1, 11)
    ]
    arm = ArmLog("a", 0, {"ffn": "gshard"}, {}, train)
    from tformer.experiments.moe_report import max_vio_train

    assert max_vio_train(arm) == pytest.approx(((9 + 11) / 2 + (10 + 12) / 2) / 2)


def _moe_arms():
    s = moe.QUICK.replace(seeds=1, disable_ratios=(0.125, 0.25, 0.5))
    final = {n: 3.0 - 0.1 * i for i, n in enumerate(moe.ARMS)}
    arms = moe_grid(final, {n: 0.5 for n in moe.ARMS[1:]}, 0.3, {})
    for a in arms:
        name = a.tags["ffn"]
        cfg = moe.arm_configs(s, lambda c: c.replace(vocab_size=300))[name]
        a.model = cfg.to_dict()
        a.records += [
            {
                "kind": "train",
                "step": k,
                "loss": 4.0,
                "time_s": 0.5 * k,
                "max_vio": {"blocks.0": 2.0, "blocks.1": 4.0},
            }
            for k in range(1, 11)
        ]
        a.records.append({"kind": "size", **count_params(cfg), "flops_per_token": 1.0e6})
        for j, ratio in enumerate(s.disable_ratios):  # a different rise per ratio
            a.records.append({"kind": "disable_top", "ratio": ratio, "n_disabled": 1, "n_experts": 8,
                              "base_loss": 3.0, "loss": 3.0 + 0.1 * (j + 1)})  # fmt: skip
        a.records.append({"kind": "routing_eval", "layers": {
            "blocks.0.ffn": {"load": [0.5, 0.5], "max_vio": 0.1, "prefers": [[["a", 0.5, 3]], [["b", 0.9, 4]]]},
            "blocks.1.ffn": {"load": [0.25, 0.75], "max_vio": 0.5, "prefers": [[["c", 0.5, 3]], [["d", 0.9, 4]]]},
        }})  # fmt: skip
    return arms, s


def test_moe_result_and_size_rows_come_from_their_records():
    from tformer.experiments import moe_report

    arms, s = _moe_arms()
    mid = s.disable_ratios[len(s.disable_ratios) // 2]
    for a, row in zip(arms, moe_report.result_rows(arms, s)):
        rise = next(r["loss"] - r["base_loss"] for r in a.kind("disable_top") if r["ratio"] == mid)
        assert row[6] == fmt(rise, 4)
        ns = [r for r in a.records if r["kind"] == "no_shared"]
        assert row[7] == (fmt(ns[-1]["loss"] - ns[-1]["base_loss"], 4) if ns else "-")
    for a, row in zip(arms, moe_report.size_rows(arms)):
        size = a.kind("size")[-1]
        assert row[2:4] == [fmt_count(size["total"]), fmt_count(size["active"])]


def test_moe_plots_and_summary(tmp_path, monkeypatch):
    from tformer.experiments import moe_report

    arms, s = _moe_arms()
    figs = []
    monkeypatch.setattr(moe_report, "save_figure", lambda fig, path: figs.append(fig) or path)
    moe_report.plot_max_vio(arms, tmp_path / "v.png")
    labels = [ln.get_label() for ln in figs[0].axes[0].get_lines()]
    assert labels == list(moe.ARMS[1:])
    r = Report("t")
    moe_report.preference_tables(r, arms)
    texts = [args[0] for kind, args in r.blocks if kind == "text"]
    assert all("`blocks.1.ffn`" in t for t in texts) and len(texts) == len(arms)
    # the printed summary's third column is the held-out MaxVio (mean over layers)
    _write_arms(tmp_path, arms, "moe", "full", s)
    for fn in ("plot_loss", "plot_heatmaps", "plot_max_vio", "plot_disable"):
        monkeypatch.setattr(moe_report, fn, lambda *a, **k: Path("x.png"))
    _, summary = moe_report.report(tmp_path)
    row = [line for line in summary.splitlines() if line.startswith("switch ")][-1]  # results, not sizes
    assert row.split()[-1] == fmt((0.1 + 0.5) / 2, 3)


def test_train_arm_trains_the_router_on_the_auxiliary_loss(tmp_path):
    """The balance loss is part of what is minimised: the same arm with and without it (same seed, same
    batches) has the same step-1 loss and a different step-2 loss."""
    s = Setting(steps=2, warmup_steps=0, eval_every=2, device="cpu", lr=1e-2)
    runs = {}
    for coef in (0.0, 1.0):
        cfg = tiny().replace(
            vocab_size=64, moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, aux_loss_coef=coef)
        )
        records = _train(tmp_path, Arm(f"c{coef}", cfg, s.optim(), seed=0), s, sub=f"r{coef}")
        runs[coef] = [r["loss"] for r in records if r["kind"] == "train"]
    assert runs[0.0][0] == runs[1.0][0] and runs[0.0][1] != runs[1.0][1]
