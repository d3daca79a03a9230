"""The MoE study's report, built from the run directory's logs only (see experiments/moe.py)."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from tformer.experiments.moe import ARMS, MoESetting
from tformer.experiments.report import (
    QUICK_NOTE,
    Report,
    Verdict,
    all_hold,
    fmt,
    fmt_count,
    less,
    lower,
    mean,
    panels,
    pyplot,
    save_figure,
    series_style,
    stopped_note,
    text_table,
    training_units,
    verdict_lines,
)
from tformer.experiments.runner import ArmLog, read_arms, scored_windows, vocabulary_words
from tformer.experiments.study_dir import read_setting, setting_of

COLORS = {
    "dense": "black",
    "switch": "tab:orange",
    "gshard": "tab:green",
    "deepseekmoe": "tab:blue",
    "deepseekmoe-noshared": "tab:purple",
    "deepseekmoe-lossfree": "tab:red",
}
MOE_ARMS = ARMS[1:]


def by_name(arms: list[ArmLog]) -> dict[tuple[str, int], ArmLog]:
    return {(a.tags["ffn"], a.seed): a for a in arms}


def one(arm: ArmLog, kind: str) -> dict | None:
    found = arm.kind(kind)
    return found[-1] if found else None


def smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc = (acc + [x])[-k:]
        out.append(mean([v for v in acc if math.isfinite(v)]))
    return out


# ----------------------------------------------------------------------------- measures
def max_vio_global(arm: ArmLog) -> float:
    """MaxVio of the held-out load, averaged over MoE layers."""
    r = one(arm, "routing_eval")
    return mean([layer["max_vio"] for layer in r["layers"].values()]) if r else math.nan


def max_vio_train(arm: ArmLog, tail: float = 0.2) -> float:
    """Per-batch MaxVio averaged over MoE layers and over the last `tail` of training steps."""
    train = [r for r in arm.kind("train") if r.get("max_vio")]
    last = train[int(len(train) * (1 - tail)) :]
    return mean([mean(list(r["max_vio"].values())) for r in last])


def disable_record(arm: ArmLog, ratio: float) -> dict | None:
    """The arm's disable_top record at `ratio`, None if there is none or it disabled no expert (a ratio
    too small for the arm's expert count; logs before n_disabled was recorded count as measured)."""
    for r in arm.kind("disable_top"):
        if abs(r["ratio"] - ratio) < 1e-9:
            return r if r.get("n_disabled", 1) > 0 else None
    return None


def disable_increase(arm: ArmLog, ratio: float) -> float:
    r = disable_record(arm, ratio)
    return math.nan if r is None else r["loss"] - r["base_loss"]


def disabled_share(arm: ArmLog, ratio: float) -> float:
    """The share of the arm's routed experts a token actually loses at `ratio` (the nominal ratio for old logs)."""
    r = disable_record(arm, ratio)
    if r is None:
        return math.nan
    return r["n_disabled"] / r["n_experts"] if "n_experts" in r else ratio


def train_loads(arm: ArmLog) -> dict[str, list[float]]:
    """Share of assignments per expert over the whole run, per MoE layer: each routing window's shares
    weighted by its steps (every step routes the same number of assignments), so a short last window
    (steps not a multiple of the evaluation cadence, an arm stopped early) counts for what it holds."""
    sums: dict[str, list[float]] = {}
    previous = 0
    for r in sorted(arm.kind("routing"), key=lambda r: r["step"]):
        steps, previous = r["step"] - previous, r["step"]
        for layer, shares in r["load"].items():
            prev = sums.get(layer, [0.0] * len(shares))
            sums[layer] = [a + steps * b for a, b in zip(prev, shares)]
    return {k: [x / max(1e-12, sum(v)) for x in v] for k, v in sums.items()}


# ----------------------------------------------------------------------------- verdicts
def verdicts(arms: list[ArmLog], s: MoESetting) -> list[Verdict]:
    got = by_name(arms)
    seeds = range(s.seeds)

    def below(a: str, b: str, measure=lambda x: x.final_eval, compare=lower) -> list[bool | None]:
        """Arm a's measure below arm b's, per seed (`lower`: losses, a diverged one worst; `less`: others)."""
        return [
            None
            if (a, sd) not in got or (b, sd) not in got
            else compare(measure(got[a, sd]), measure(got[b, sd]))
            for sd in seeds
        ]

    def show(names, measure=lambda x: x.final_eval, digits=4) -> str:
        """Each arm's mean over seeds, and with several seeds each seed's value (the rules read those)."""
        out = []
        for n in names:
            values = [measure(got[n, sd]) for sd in seeds if (n, sd) in got]
            each = f" (seeds: {' / '.join(fmt(v, digits) for v in values)})" if len(values) > 1 else ""
            out.append(f"{n} {fmt(mean(values), digits)}{each}")
        return "; ".join(out)

    no_shared = [
        None
        if ("deepseekmoe", sd) not in got or one(got["deepseekmoe", sd], "no_shared") is None
        else lower(
            one(got["deepseekmoe", sd], "no_shared")["base_loss"],
            one(got["deepseekmoe", sd], "no_shared")["loss"],
        )
        for sd in seeds
    ]
    increase = mean(
        [
            one(got["deepseekmoe", sd], "no_shared")["loss"]
            - one(got["deepseekmoe", sd], "no_shared")["base_loss"]
            for sd in seeds
            if ("deepseekmoe", sd) in got and one(got["deepseekmoe", sd], "no_shared")
        ]
    )
    compared = [  # ratios at which both arms lost at least one expert
        r
        for r in s.disable_ratios
        if all(
            disable_record(got[a, sd], r) for a in ("gshard", "deepseekmoe") for sd in seeds if (a, sd) in got
        )
    ]
    redundancy = [
        None
        if ("deepseekmoe", sd) not in got or ("gshard", sd) not in got
        else less(disable_increase(got["gshard", sd], r), disable_increase(got["deepseekmoe", sd], r))
        for sd in seeds
        for r in compared
    ]
    skipped = [r for r in s.disable_ratios if r not in compared]
    return [
        Verdict(
            "MoE raises capacity at constant compute",
            "Switch, GShard and DeepSeekMoE each reach a lower final validation loss than the dense model "
            "with the same active parameters and FLOPs per token, for every seed",
            all_hold(below("switch", "dense") + below("gshard", "dense") + below("deepseekmoe", "dense")),
            "final val loss (mean over seeds): " + show(("dense", "switch", "gshard", "deepseekmoe")),
            "Switch / GShard: lower loss than dense at equal FLOPs",
        ),
        Verdict(
            "DeepSeekMoE beats GShard at equal total and active parameters",
            "DeepSeekMoE's final validation loss is lower than GShard's, for every seed",
            all_hold(below("deepseekmoe", "gshard")),
            "final val loss: " + show(("gshard", "deepseekmoe")),
            "DeepSeekMoE 2B: Pile loss 1.808 vs GShard 1.867",
        ),
        Verdict(
            "Shared expert isolation helps (trained without it)",
            "DeepSeekMoE's final validation loss is lower than the same model trained without the shared "
            "expert, for every seed",
            all_hold(below("deepseekmoe", "deepseekmoe-noshared")),
            "final val loss: " + show(("deepseekmoe", "deepseekmoe-noshared")),
            "DeepSeekMoE ablation: isolating a shared expert lowers the loss",
        ),
        Verdict(
            "The shared expert cannot be replaced by a routed one",
            "removing the trained shared expert and routing each token to one more expert (same compute) "
            "raises the held-out loss, for every seed",
            all_hold(no_shared),
            f"held-out loss increase: {fmt(increase)} nats (mean over seeds)",
            "DeepSeekMoE 2B: Pile loss 1.808 -> 2.414",
        ),
        Verdict(
            "Fine-grained experts are less redundant (more specialised) than GShard's",
            "disabling each token's top-ranked routed experts (the same share of all routed experts: "
            f"{', '.join(fmt(r, 4) for r in compared) or 'none'}, where both lose at least one) raises "
            "DeepSeekMoE's held-out loss more than GShard's, at every ratio and seed",
            all_hold(redundancy),
            "; ".join(
                f"ratio {fmt(r, 4)}: "
                + show(("gshard", "deepseekmoe"), lambda a, r=r: disable_increase(a, r))
                for r in compared
            )
            + (
                f" (ratio {', '.join(fmt(r, 4) for r in skipped)}: not compared, an arm would lose no expert)"
                if skipped
                else ""
            ),
            "DeepSeekMoE: its loss rises faster than GShard x1.5's as top experts are disabled",
        ),
        Verdict(
            "Auxiliary-loss-free balancing balances the load better",
            "the loss-free arm's held-out MaxVio (mean over MoE layers) is lower than the auxiliary-loss "
            "arm's, for every seed",
            all_hold(below("deepseekmoe-lossfree", "deepseekmoe", max_vio_global, less)),
            "MaxVio_global: " + show(("deepseekmoe", "deepseekmoe-lossfree"), max_vio_global, 3),
            "Wang et al. 2024 (1B): MaxVio_global 0.04 (loss-free) vs 0.72 (aux loss)",
        ),
        Verdict(
            "... without costing loss",
            "the loss-free arm's final validation loss is no higher than the auxiliary-loss arm's, for "
            "every seed",
            all_hold([None if x is None else not x for x in below("deepseekmoe", "deepseekmoe-lossfree")]),
            "final val loss: " + show(("deepseekmoe", "deepseekmoe-lossfree")),
            "Wang et al. 2024 (1B): perplexity 9.50 (loss-free) vs 9.56",
        ),
    ]


# ----------------------------------------------------------------------------- plots
def plot_loss(arms: list[ArmLog], path: Path) -> Path:
    fig, axes = panels(2, width=5.2, height=3.8, sharey=True)
    for i, a in enumerate(x for x in arms if x.seed == 0):
        name, train, evals = a.tags["ffn"], a.kind("train"), a.kind("eval")
        for ax, key in zip(axes, ("step", "time_s")):
            ax.plot(
                [r[key] for r in train],
                smooth([r["loss"] for r in train]),
                color=COLORS[name],
                lw=1,
                alpha=0.6,
            )
            ax.plot(
                [r[key] for r in evals],
                [r["eval_loss"] for r in evals],
                color=COLORS[name],
                label=name,
                **series_style(i, markers=True),
            )
    axes[0].set(xlabel="step", ylabel="loss (nats/token)", title="vs steps")
    axes[1].set(xlabel="training wall-clock (s)", title="vs wall-clock")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Validation loss (markers) and training loss (faint lines, moving average of 10), seed 0")
    return save_figure(fig, path)


def plot_heatmaps(arms: list[ArmLog], path: Path) -> Path:
    chosen = [a for a in arms if a.seed == 0 and a.tags["ffn"] in MOE_ARMS]
    fig, axes = panels(len(chosen), width=3.2, height=3.2, layout="constrained")
    grids, names = {}, []
    for a in chosen:
        loads = train_loads(a)
        names = list(loads)
        grids[a.name] = [[x * len(v) for x in v] for v in loads.values()]  # load / uniform load
    hi = max([x for g in grids.values() for row in g for x in row] + [2.0])
    plt = pyplot()
    im = None
    for i, (ax, a) in enumerate(zip(axes, chosen)):
        im = ax.imshow(
            grids[a.name],
            aspect="auto",
            origin="lower",
            cmap="magma",
            vmin=0.0,
            vmax=hi,
            interpolation="nearest",
        )
        ax.set(title=a.tags["ffn"], xlabel="expert")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yticks(range(len(names)), [n.split(".")[1] for n in names] if i == 0 else [])
    axes[0].set_ylabel("layer")
    if im is not None:
        fig.colorbar(im, ax=axes, label="load / uniform load", shrink=0.9)
    fig.suptitle("Expert load over training (1 = uniform), seed 0")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_max_vio(arms: list[ArmLog], path: Path) -> Path:
    fig, axes = panels(1, width=6.5, height=3.8)
    for a in arms:
        if a.seed == 0 and a.tags["ffn"] in MOE_ARMS:
            train = [r for r in a.kind("train") if r.get("max_vio")]
            axes[0].plot(
                [r["step"] for r in train],
                smooth([mean(list(r["max_vio"].values())) for r in train]),
                color=COLORS[a.tags["ffn"]],
                label=a.tags["ffn"],
                lw=1.2,
            )
    axes[0].set(
        xlabel="step",
        ylabel="MaxVio (mean over layers)",
        yscale="log",
        title="Per-batch MaxVio in training (moving average of 10), seed 0",
    )
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def plot_disable(arms: list[ArmLog], s: MoESetting, path: Path) -> Path:
    fig, axes = panels(1, width=5.5, height=3.8)
    got = by_name(arms)
    for name in MOE_ARMS:
        points = [(0.0, 0.0)]  # a ratio that disables no expert of this arm is left out
        for r in s.disable_ratios:
            runs = [got[name, sd] for sd in range(s.seeds) if (name, sd) in got]
            if runs and all(disable_record(a, r) for a in runs):
                points.append((disabled_share(runs[0], r), mean([disable_increase(a, r) for a in runs])))
        axes[0].plot(*zip(*points), "o-", color=COLORS[name], label=name)
    axes[0].set(
        xlabel="share of its routed experts each token loses (its top-ranked)",
        ylabel="held-out loss increase (nats)",
        title="Redundancy test (mean over seeds)",
    )
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- report
def size_rows(arms: list[ArmLog]) -> list[list[str]]:
    rows = []
    for a in arms:
        if a.seed != 0:
            continue
        size, moe = one(a, "size"), a.model.get("moe")
        layout = (
            "dense FFN"
            if moe is None
            else (
                f"{moe['n_experts']} x {moe['d_expert']} top-{moe['top_k']}"
                + (f" + {moe['n_shared']} shared x {moe['d_shared']}" if moe["n_shared"] else "")
            )
        )
        rows.append(
            [
                a.tags["ffn"],
                layout,
                fmt_count(size["total"]),
                fmt_count(size["active"]),
                fmt_count(size["flops_per_token"]),
            ]
        )
    return rows


def result_rows(arms: list[ArmLog], s: MoESetting) -> list[list[str]]:
    rows = []
    ratio = s.disable_ratios[len(s.disable_ratios) // 2] if s.disable_ratios else None
    for a in arms:
        train, ns = a.kind("train"), one(a, "no_shared")
        routed = a.model.get("moe") is not None
        rows.append(
            [
                a.name,
                fmt(a.final_eval),
                fmt(train[-1]["time_s"], 1),
                fmt(1000 * train[-1]["time_s"] / len(train), 1),
                fmt(max_vio_global(a), 3) if routed else "-",  # "-": does not apply to the arm
                fmt(max_vio_train(a), 3) if routed else "-",
                fmt(disable_increase(a, ratio), 4) if ratio is not None and disable_record(a, ratio) else "-",
                fmt(ns["loss"] - ns["base_loss"], 4) if ns else "-",
            ]
        )
    return rows


def preference_tables(r: Report, arms: list[ArmLog], shown: int = 12) -> None:
    for a in arms:
        ev = one(a, "routing_eval")
        if a.seed != 0 or ev is None:
            continue
        layer, data = list(ev["layers"].items())[-1]
        order = sorted(
            range(len(data["prefers"])),
            key=lambda e: -(data["prefers"][e][0][1] if data["prefers"][e] else -1),
        )
        rows = [
            [
                e,
                fmt(100 * data["load"][e], 1),
                ", ".join(f"{tok!r} {share:.2f} ({n})" for tok, share, n in data["prefers"][e] if share > 0),
            ]
            for e in order[:shown]
        ]
        r.text(
            f"**{a.tags['ffn']}**, `{layer}`: the {min(shown, len(order))} of {len(order)} experts with the "
            "most concentrated top token (all are in metrics.jsonl, record `routing_eval`)."
        )
        r.table(
            ["expert", "load %", "top tokens: share of the token's occurrences routed here (occurrences)"],
            rows,
        )


def report(run_dir: Path) -> tuple[Report, str]:
    run_dir = Path(run_dir)
    meta = read_setting(run_dir)
    s = setting_of(run_dir, MoESetting)
    arms = read_arms(run_dir)
    figs = [
        (plot_loss(arms, run_dir / "moe_loss.png"), "Loss vs steps and vs training wall-clock."),
        (
            plot_heatmaps(arms, run_dir / "moe_load_heatmap.png"),
            "Expert load per layer over the whole run; 1 = uniform.",
        ),
        (plot_max_vio(arms, run_dir / "moe_maxvio.png"), "MaxVio = max load / mean load - 1, per batch."),
        (
            plot_disable(arms, s, run_dir / "moe_disable.png"),
            "Loss increase when each token's top-ranked routed experts are disabled (it gets its next ones).",
        ),
    ]
    checks = verdicts(arms, s)
    res_headers = [
        "arm",
        "final val loss",
        "train time (s, steps only)",
        "ms / step",
        "MaxVio held-out",
        "MaxVio train (last 20%)",
        f"loss +, top {fmt(s.disable_ratios[len(s.disable_ratios) // 2], 4)} disabled",
        "loss +, shared removed",
    ]
    r = Report(
        f"Mixture-of-Experts at constant compute ({meta['mode']} setting)", quick=meta["mode"] == "quick"
    )
    if meta["mode"] == "quick":
        r.text(QUICK_NOTE)
    r.heading("Setup")
    r.bullets(
        [
            f"Data: {s.corpus} language modelling, BPE vocabulary {vocabulary_words(arms, s.vocab_size)}, "
            f"{training_units(run_dir, s.max_train_docs, 'works')}, windows of {s.seq_len}; "
            f"validation loss on {scored_windows(arms, s.eval_batches * s.batch_size)} windows spread over the held-out works.",
            f"Model: decoder, {s.n_layers} layers (every FFN slot MoE in the MoE arms), d_model {s.d_model}, "
            f"{s.n_heads} heads, SwiGLU experts, Pre-Norm RMSNorm, RoPE, no dropout; active FFN width {s.d_ff} in "
            f"every arm. DeepSeekMoE: granularity m = {s.granularity}, one shared expert, `fine_grained` from GShard.",
            f"Balance: auxiliary loss coefficient {s.aux_loss_coef} (all MoE arms but the loss-free one, which has "
            f"0 and bias_update_rate {s.bias_update_rate}); dropless routing (no capacity limit).",
            f"Budget (every arm): {s.steps} steps of {s.batch_size} x {s.seq_len} tokens, AdamW lr {s.lr}, warm-up "
            f"{s.warmup_steps}, cosine to 10%, clipping {s.grad_clip}; seeds {', '.join(map(str, range(s.seeds)))}; "
            f"fp32 on {s.device}. Wall-clock is measured on a possibly shared machine: compare it with care.",
            f"Held-out analyses on {s.analysis_batches} validation batches: loads, preferred tokens (tokens seen at "
            f"least {s.min_token_count} times), redundancy test, shared-expert removal.",
        ]
    )
    r.heading("Verdicts")
    r.text("Decided by the stated rule on this run's logged numbers (arms/*/metrics.jsonl).")
    r.verdicts(checks)
    if (note := stopped_note(arms)) is not None:
        r.text(note)
    r.heading("Size and compute per arm")
    r.text(
        "From `tformer.model.stats`: parameters (total, and active per token) and forward matmul FLOPs per "
        f"token at sequence length {s.seq_len} (causal)."
    )
    size_headers = ["arm", "FFN slot", "total params", "active params", "FLOPs / token"]
    r.table(size_headers, size_rows(arms))
    r.heading("Results")
    r.table(res_headers, result_rows(arms, s))
    r.heading("Plots")
    for path, caption in figs:
        r.figure(path, caption)
    r.heading("Which tokens each expert prefers (last MoE layer, seed 0)")
    preference_tables(r, arms)
    summary = (
        text_table(size_headers, size_rows(arms))
        + "\n\n"
        + text_table(res_headers[:2] + res_headers[4:5], [[x[0], x[1], x[4]] for x in result_rows(arms, s)])
        + "\n\n"
        + verdict_lines(checks, meta["mode"] == "quick")
    )
    return r, summary
