"""Positions and long sequences: sinusoidal vs learned vs RoPE, and RoPE scaled at evaluation.

Arms (same decoder otherwise: Pre-Norm RMSNorm, SwiGLU, no dropout): positions "sinusoidal", "learned",
"rope", each trained on windows of L = seq_len tokens. Embeddings follow Vaswani et al. (N(0, 1/d) times
sqrt(d): unit scale), so an added sinusoidal table is not louder than the tokens it is added to (with
small GPT-style embeddings it would drown them, a handicap for the sinusoidal arm only). Evaluation on held-out text at lengths n L for n in
`eval_factors` (same tokens at every length: K windows of the longest length, cut into pieces):

    sinusoidal  the fixed table extends by formula (a model built with the longer max_seq_len)
    learned     built with max_seq_len = max(n) L from the start so the table exists; rows beyond L get no
                gradient and stay at their initial values
    rope        plain (no scaling: extrapolation), and PI ("linear"), "ntk", "yarn" with factor n applied at
                evaluation: the trained weights loaded into a model built with RopeConfig(scaling, factor=n,
                original_max_seq_len=L) and max_seq_len = max(n) L. No fine-tuning.

Logged per (arm, method, length): `position_eval` records with the mean loss at every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.ticker import NullLocator
from torch import nn

from tformer.config import ModelConfig, RopeConfig
from tformer.distributed.env import resolve_device
from tformer.experiments.report import (
    QUICK_NOTE,
    Report,
    Verdict,
    all_hold,
    fmt,
    lower,
    mean,
    panels,
    save_figure,
    series_style,
    stopped_note,
    text_table,
    training_units,
    verdict_lines,
)
from tformer.experiments.runner import Arm, ArmLog, Setting, StudyData, read_arms, run_arms, vocabulary_words
from tformer.experiments.study_dir import begin_study, read_setting, setting_of
from tformer.model import build_model

POSITIONS = ("sinusoidal", "learned", "rope")
SCALINGS = ("linear", "ntk", "yarn")
LABELS = {
    "sinusoidal": "sinusoidal",
    "learned": "learned",
    "rope": "RoPE",
    "rope+linear": "RoPE + PI",
    "rope+ntk": "RoPE + NTK",
    "rope+yarn": "RoPE + YaRN",
}
COLORS = {
    "sinusoidal": "tab:orange",
    "learned": "tab:green",
    "rope": "tab:blue",
    "rope+linear": "tab:purple",
    "rope+ntk": "tab:red",
    "rope+yarn": "tab:brown",
}


@dataclass(frozen=True)
class RopeSetting(Setting):
    d_ff: int = 344
    eval_factors: tuple[int, ...] = (1, 2, 4, 8)
    eval_windows: int = 16  # windows of the longest evaluation length, spread over the validation text
    bucket: int = 0  # positions per perplexity bucket in plots (0: L / 4)


FULL = RopeSetting(
    vocab_size=2048,
    seq_len=128,
    d_model=128,
    n_heads=4,
    n_layers=4,
    d_ff=344,
    batch_size=16,
    steps=400,
    lr=2e-3,
    warmup_steps=40,
    grad_clip=1.0,
    eval_every=100,
    eval_batches=8,
    seeds=2,
    eval_windows=32,
)
QUICK = FULL.replace(
    max_train_docs=2,
    vocab_size=512,
    seq_len=32,
    d_model=32,
    n_layers=2,
    d_ff=88,
    batch_size=8,
    steps=16,
    warmup_steps=4,
    eval_every=8,
    eval_batches=2,
    seeds=1,
    eval_windows=4,
)


def model_config(s: RopeSetting, positions: str) -> ModelConfig:
    longest = max(s.eval_factors) * s.seq_len
    return ModelConfig(
        arch="decoder",
        vocab_size=s.vocab_size,
        d_model=s.d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        d_ff=s.d_ff,
        max_seq_len=longest if positions == "learned" else s.seq_len,
        dropout=0.0,
        norm="rmsnorm",
        norm_placement="pre",
        positions=positions,
        ffn="swiglu",
        bias=False,
        embed_scale=True,  # token embeddings at unit scale, like the position tables they are added to
        tie_embeddings=True,
        init="xavier",
    )


def make_arms(s: RopeSetting, resolve=lambda cfg: cfg) -> list[Arm]:
    return [
        Arm(f"{p}-s{seed}", resolve(model_config(s, p)), s.optim(), seed, {"positions": p})
        for seed in range(s.seeds)
        for p in POSITIONS
    ]


# ----------------------------------------------------------------------------- evaluation by position
def eval_windows(data: StudyData, s: RopeSetting) -> torch.Tensor:
    """(K, max(n) L + 1) token windows evenly spread over the validation stream."""
    longest = max(s.eval_factors) * s.seq_len
    stream = data.task.val_ds.stream.long()
    if len(stream) < longest + 1:
        raise ValueError(f"validation text has {len(stream)} tokens, fewer than one window of {longest + 1}")
    starts = torch.linspace(0, len(stream) - longest - 1, s.eval_windows).long().unique()
    return torch.stack([stream[i : i + longest + 1] for i in starts.tolist()])


@torch.no_grad()
def position_losses(
    model: nn.Module, windows: torch.Tensor, length: int, batch_size: int, device: torch.device
) -> list[float]:
    """Mean next-token loss at each position 0..length-1 over all length-long pieces of the windows."""
    k, n = windows.shape
    pieces = (n - 1) // length
    ids = windows[:, : pieces * length].reshape(k * pieces, length)  # (P, T)
    targets = windows[:, 1 : pieces * length + 1].reshape(k * pieces, length)  # (P, T)
    total = torch.zeros(length, dtype=torch.float64)
    for i in range(0, len(ids), batch_size):
        x, y = ids[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
        logits = model(x).float()  # (b, T, V)
        loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (b, T)
        total += loss.sum(0).double().cpu()
    return (total / len(ids)).tolist()


def eval_model(trained: nn.Module, cfg: ModelConfig, longest: int, rope: RopeConfig, device) -> nn.Module:
    """The trained weights in a model built for `longest` positions with `rope` (buffers are rebuilt)."""
    model = build_model(cfg.replace(max_seq_len=longest, rope=rope)).to(device)
    model.load_state_dict(trained.state_dict())
    return model.eval()


def position_evals(arm: Arm, model: nn.Module, windows: torch.Tensor, s: RopeSetting) -> list[dict]:
    device = resolve_device(s.device)
    longest, records = max(s.eval_factors) * s.seq_len, []
    methods = ("none",) + (SCALINGS if arm.tags["positions"] == "rope" else ())
    for method in methods:
        for n in s.eval_factors:
            if method != "none" and n == 1:
                continue  # factor 1 is the unscaled model
            rope = (
                RopeConfig()
                if method == "none"
                else RopeConfig(scaling=method, factor=float(n), original_max_seq_len=s.seq_len)
            )
            m = eval_model(model, arm.model, longest, rope, device)
            batch = max(1, s.batch_size // n)
            records.append(
                {
                    "kind": "position_eval",
                    "method": method,
                    "factor": n,
                    "length": n * s.seq_len,
                    "position_loss": position_losses(m, windows, n * s.seq_len, batch, device),
                }
            )
    return records


def run(setting: RopeSetting, run_dir: str | Path) -> None:
    run_dir = begin_study(run_dir, "rope", setting, QUICK)
    data = StudyData.prepare(setting, run_dir)
    windows = eval_windows(data, setting)
    run_arms(
        make_arms(setting, data.resolve),
        data,
        setting,
        run_dir,
        after=lambda arm, model: position_evals(arm, model, windows, setting),
    )


# ----------------------------------------------------------------------------- measures
def variant(arm: ArmLog, method: str) -> str:
    return arm.tags["positions"] if method == "none" else f"rope+{method}"


def curves(arms: list[ArmLog]) -> dict[tuple[str, int, int], list[float]]:
    """(variant, seed, factor) -> per-position loss; scaled variants at factor 1 are plain RoPE's."""
    out = {}
    for a in arms:
        for r in a.kind("position_eval"):
            out[variant(a, r["method"]), a.seed, r["factor"]] = r["position_loss"]
    for (v, seed, n), losses in list(out.items()):
        if v == "rope" and n == 1:
            for m in SCALINGS:
                out.setdefault((f"rope+{m}", seed, 1), losses)
    return out


def ppl(losses: list[float]) -> float:
    return math.exp(min(mean(losses), 50.0)) if losses else math.nan


def beyond(losses: list[float], L: int) -> float:
    """Perplexity on positions >= L (the part no arm was trained on)."""
    return ppl(losses[L:])


def variants_in(c: dict) -> list[str]:
    order = ["sinusoidal", "learned", "rope", "rope+linear", "rope+ntk", "rope+yarn"]
    present = {k[0] for k in c}
    return [v for v in order if v in present]


# ----------------------------------------------------------------------------- verdicts
def verdicts(c: dict, s: RopeSetting) -> list[Verdict]:
    L, seeds = s.seq_len, range(s.seeds)
    longer = [n for n in s.eval_factors if n > 1]

    def cmp(a: str, b: str) -> list[bool | None]:
        return [
            None
            if (a, seed, n) not in c or (b, seed, n) not in c
            else lower(beyond(c[a, seed, n], L), beyond(c[b, seed, n], L))
            for seed in seeds
            for n in longer
        ]

    def show(v: str) -> str:
        return ", ".join(
            f"{n}L {fmt(mean([beyond(c[v, sd, n], L) for sd in seeds if (v, sd, n) in c]), 1)}"
            for n in longer
        )

    out = [
        Verdict(
            "RoPE handles sequences longer than its training context better than sinusoidal positions",
            "at every evaluated length > L, plain RoPE's perplexity on positions >= L is lower than "
            "sinusoidal's, for every seed",
            all_hold(cmp("rope", "sinusoidal")),
            f"perplexity beyond L (mean over seeds): RoPE {show('rope')}; sinusoidal {show('sinusoidal')}",
            "Su et al. 2021 (RoFormer); Press et al. 2022 found both extrapolate poorly",
        )
    ]
    for m, ref in (
        ("linear", "Chen et al. 2023 (PI) fine-tune after interpolating"),
        ("ntk", "NTK-aware scaling was proposed to work without fine-tuning"),
        ("yarn", "Peng et al. 2023 (YaRN)"),
    ):
        out.append(
            Verdict(
                f"{LABELS['rope+' + m]} at evaluation extends RoPE beyond L without fine-tuning",
                f"at every evaluated length > L, RoPE + {m}'s perplexity on positions >= L is lower "
                "than plain RoPE's, for every seed",
                all_hold(cmp(f"rope+{m}", "rope")),
                f"perplexity beyond L: {LABELS['rope+' + m]} {show('rope+' + m)}",
                ref,
            )
        )
    learned_fail = [
        None
        if ("learned", sd, n) not in c
        else lower(ppl(c["learned", sd, n][:L]), beyond(c["learned", sd, n], L))
        for sd in seeds
        for n in longer
    ]
    out.append(
        Verdict(
            "Learned absolute positions do not extend beyond the trained length",
            "at every evaluated length > L, the learned arm's perplexity on positions >= L is higher "
            "than on positions < L of the same windows, for every seed",
            all_hold(learned_fail),
            f"learned arm's perplexity on positions >= L: {show('learned')}; on positions < L of the same "
            "windows: "
            + ", ".join(
                f"{n}L {fmt(mean([ppl(c['learned', sd, n][:L]) for sd in seeds if ('learned', sd, n) in c]), 1)}"
                for n in longer
            ),
            "rows of the position table beyond L never receive a gradient",
        )
    )
    return out


# ----------------------------------------------------------------------------- plots and report
def fit_yscale(ax) -> None:
    """Log scale when the curves span more than a decade, linear (readable ticks) otherwise."""
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y) and y > 0]
    if ys and max(ys) / min(ys) > 10:
        ax.set_yscale("log")


def plot_positions(c: dict, s: RopeSetting, path: Path) -> Path:
    L, width = s.seq_len, s.bucket or max(1, s.seq_len // 4)
    longer = [n for n in s.eval_factors if n > 1] or list(s.eval_factors)
    fig, axes = panels(len(longer), width=4.6, height=3.6)
    for ax, n in zip(axes, longer):
        for i, v in enumerate(variants_in(c)):
            if (v, 0, n) not in c:
                continue
            losses = c[v, 0, n]
            starts = range(0, len(losses), width)
            ax.plot(
                [b + width / 2 for b in starts],
                [ppl(losses[b : b + width]) for b in starts],
                color=COLORS[v],
                label=LABELS[v],
                **series_style(i),  # RoPE and its scalings coincide where scaling changes nothing
            )
        fit_yscale(ax)
        ax.axvline(L, color="gray", ls=":", lw=1)
        ax.set(
            title=f"evaluated at {n}L = {n * L}", xlabel=f"position (buckets of {width})", ylabel="perplexity"
        )
        ax.grid(alpha=0.3)
    axes[-1].legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1)
    )  # beside the panels, off the curves
    fig.suptitle(f"Perplexity by position, trained at L = {L} (seed 0)")
    return save_figure(fig, path)


def plot_lengths(c: dict, s: RopeSetting, path: Path) -> Path:
    fig, axes = panels(2, width=4.8)
    for v in variants_in(c):
        ns = [n for n in s.eval_factors if any((v, sd, n) in c for sd in range(s.seeds))]
        whole = [mean([ppl(c[v, sd, n]) for sd in range(s.seeds) if (v, sd, n) in c]) for n in ns]
        axes[0].plot(ns, whole, "o-", color=COLORS[v], label=LABELS[v])
        far = [n for n in ns if n > 1]
        axes[1].plot(
            far,
            [mean([beyond(c[v, sd, n], s.seq_len) for sd in range(s.seeds) if (v, sd, n) in c]) for n in far],
            "o-",
            color=COLORS[v],
            label=LABELS[v],
        )
    for ax, title, ticks in zip(
        axes,
        ("whole window", "positions >= L only"),
        (list(s.eval_factors), [n for n in s.eval_factors if n > 1]),  # no positions >= L at 1L
    ):
        ax.set(xlabel="evaluation length / L", ylabel="perplexity", title=title)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        fit_yscale(ax)
        ax.grid(alpha=0.3)
    axes[-1].legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1)
    )  # beside the panels, off the points
    fig.suptitle("Perplexity vs evaluation length (mean over seeds)")
    return save_figure(fig, path)


def plot_training(arms: list[ArmLog], path: Path) -> Path:
    fig, axes = panels(1, width=6)
    for a in arms:
        if a.seed == 0:
            train = a.kind("train")
            axes[0].plot(
                [r["step"] for r in train],
                [r["loss"] for r in train],
                lw=1,
                color=COLORS[a.tags["positions"]],
                label=LABELS[a.tags["positions"]],
            )
    axes[0].set(xlabel="step", ylabel="training loss (nats/token)", title="Training at L (seed 0)")
    axes[0].grid(alpha=0.3)
    axes[0].legend()
    return save_figure(fig, path)


def table_rows(c: dict, s: RopeSetting) -> list[list[str]]:
    L, rows = s.seq_len, []
    for v in variants_in(c):
        for seed in range(s.seeds):
            cells = [fmt(ppl(c[v, seed, n]), 2) if (v, seed, n) in c else "-" for n in s.eval_factors]
            cells += [
                fmt(beyond(c[v, seed, n], L), 2) if (v, seed, n) in c else "-"
                for n in s.eval_factors
                if n > 1
            ]
            rows.append([LABELS[v], seed, *cells])
    return rows


def report(run_dir: Path) -> tuple[Report, str]:
    run_dir = Path(run_dir)
    meta = read_setting(run_dir)
    s = setting_of(run_dir, RopeSetting)
    arms = read_arms(run_dir)
    c = curves(arms)
    figs = [
        (
            plot_positions(c, s, run_dir / "rope_position_ppl.png"),
            "Perplexity by position (bucketed) at each evaluation length; dotted line: the training length L.",
        ),
        (
            plot_lengths(c, s, run_dir / "rope_length_ppl.png"),
            "Perplexity of the whole window and of the positions beyond L, by evaluation length.",
        ),
        (plot_training(arms, run_dir / "rope_training.png"), "Training loss at L, seed 0."),
    ]
    checks = verdicts(c, s)
    headers = [
        "variant",
        "seed",
        *[f"ppl @ {n}L" for n in s.eval_factors],
        *[f"ppl >= L @ {n}L" for n in s.eval_factors if n > 1],
    ]
    rows = table_rows(c, s)
    r = Report(f"Positions and long sequences ({meta['mode']} setting)", quick=meta["mode"] == "quick")
    if meta["mode"] == "quick":
        r.text(QUICK_NOTE)
    r.heading("Setup")
    r.bullets(
        [
            f"Data: {s.corpus} language modelling, BPE vocabulary {vocabulary_words(arms, s.vocab_size)}, "
            f"{training_units(run_dir, s.max_train_docs, 'works')}; trained on windows of "
            f"L = {s.seq_len} tokens.",
            f"Model: decoder, {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, SwiGLU {s.d_ff}, Pre-Norm "
            "RMSNorm, Xavier init, embeddings scaled by sqrt(d_model) (unit scale, like the added position "
            "tables), no dropout; only the position scheme differs.",
            f"Budget (every arm): {s.steps} steps of {s.batch_size} x {s.seq_len} tokens, AdamW lr {s.lr}, warm-up "
            f"{s.warmup_steps}, cosine to 10%, clipping {s.grad_clip}; seeds {', '.join(map(str, range(s.seeds)))}.",
            f"Evaluation: {s.eval_windows} windows of {max(s.eval_factors) * s.seq_len} held-out tokens, cut into "
            f"pieces of n L for n in {', '.join(map(str, s.eval_factors))}: the same tokens at every length. "
            "Scaled RoPE uses factor n at length n L on the same trained weights (no fine-tuning).",
            "Learned positions: table of max(n) L rows from the start; rows beyond L are never trained.",
        ]
    )
    r.heading("Verdicts")
    r.text(
        "Perplexity beyond L = exp(mean loss over positions >= L). Decided on this run's logged "
        "per-position losses (arms/*/metrics.jsonl, records `position_eval`)."
    )
    r.verdicts(checks)
    if (note := stopped_note(arms)) is not None:
        r.text(note)
    r.heading("Perplexity by evaluation length")
    r.table(headers, rows)
    r.heading("Training")
    r.table(
        ["arm", "final val loss at L", "training time (s, steps only)"],
        [[a.name, fmt(a.final_eval), fmt(a.kind("train")[-1]["time_s"], 1)] for a in arms],
    )
    r.heading("Plots")
    for path, caption in figs:
        r.figure(path, caption)
    summary = text_table(headers, rows) + "\n\n" + verdict_lines(checks, meta["mode"] == "quick")
    return r, summary
