"""Post-Norm vs Pre-Norm (Xiong et al., 2020, "On Layer Normalization in the Transformer Architecture").

Arms: norm_placement {post, pre} x depth x {with, without} learning-rate warm-up x seed, everything
else equal: the original Transformer's choices (LayerNorm, sinusoidal positions, ReLU FFN, Xavier init,
scaled and tied embeddings, no dropout), one learning rate, one cosine schedule, no gradient clipping
(clipping would hide the instability the study looks for). Measured: per-layer gradient norms at
initialisation and during training, loss curves, divergence events.

Divergence event: a training step after the warm-up window (step > warmup_steps, the same window for
every arm) whose loss is non-finite or above the arm's initial loss (its step-1 loss).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from tformer.config import ModelConfig
from tformer.experiments.report import (
    QUICK_NOTE,
    Report,
    Verdict,
    all_hold,
    fmt,
    less,
    lower,
    mean,
    panels,
    pyplot,
    save_figure,
    stopped_note,
    text_table,
    training_units,
    verdict_lines,
)
from tformer.experiments.runner import (
    Arm,
    ArmLog,
    Setting,
    StudyData,
    block_names,
    read_arms,
    run_arms,
    scored_windows,
    vocabulary_words,
)
from tformer.experiments.study_dir import begin_study, read_setting, setting_of
from tformer.train.config import DataConfig

PLACEMENTS = ("post", "pre")
UNUSED_OPTIONS = ("n_layers",)  # the depths are `depths`


def cli_changes(changes: dict) -> dict:
    """--max-train-docs of the encoder-decoder arms: the first N training pairs."""
    if changes.get("arch") == "encoder_decoder" and changes.get("max_train_docs") is not None:
        changes = {**changes, "max_train_pairs": changes["max_train_docs"], "max_train_docs": None}
    return changes


TRANSLATION_CORPUS = "trans-de-en"
COLORS = {"post": "tab:red", "pre": "tab:blue"}


# the gradient-norm variation needs two steps after the warm-up window (a new study is held to it; one saved
# before still reports, its measures inconclusive)
STEPS_AFTER_WARMUP = 2
MIN_WARMUP_STEPS = 1  # its arms with warm-up would otherwise be the arms without


@dataclass(frozen=True)
class NormSetting(Setting):
    depths: tuple[int, ...] = (6, 12, 24)
    d_ff: int = 256
    arch: str = "decoder"  # or "encoder_decoder": translation (trans-de-en), n_layers = depth on each side
    max_train_pairs: int | None = None  # encoder_decoder: the first N training pairs (None: all)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"depths must be a non-empty list of positive ints, got {self.depths}")
        if self.arch not in ("decoder", "encoder_decoder"):
            raise ValueError(f"arch must be 'decoder' or 'encoder_decoder', got {self.arch!r}")
        if self.warmup_steps < 1:  # the warm-up arms would be the arms without warm-up
            raise ValueError(
                f"warmup_steps (--warmup-steps) must be >= 1: the study compares arms with and without a "
                f"warm-up of that many steps, got {self.warmup_steps}"
            )


FULL = NormSetting(
    vocab_size=2048,
    seq_len=64,
    d_model=64,
    n_heads=4,
    d_ff=256,
    depths=(6, 12, 24),
    batch_size=16,
    steps=250,
    lr=1e-3,
    warmup_steps=50,
    grad_clip=0.0,
    eval_every=50,
    eval_batches=8,
    seeds=2,
)
QUICK = FULL.replace(
    max_train_docs=2,
    max_train_pairs=2000,
    vocab_size=512,
    d_model=32,
    d_ff=64,
    depths=(2, 4),
    batch_size=8,
    steps=16,
    warmup_steps=4,
    eval_every=8,
    eval_batches=2,
    seeds=1,
)


def model_config(s: NormSetting, depth: int, placement: str) -> ModelConfig:
    """The original Transformer's choices at the study's width; vocabulary sizes come from the data."""
    return ModelConfig(
        arch=s.arch,
        vocab_size=s.vocab_size,
        d_model=s.d_model,
        n_layers=depth,
        n_heads=s.n_heads,
        d_ff=s.d_ff,
        max_seq_len=s.seq_len,
        dropout=0.0,
        norm="layernorm",
        norm_placement=placement,
        positions="sinusoidal",
        ffn="relu",
        bias=True,
        embed_scale=True,
        tie_embeddings=True,
        init="xavier",
    )


def arm_name(placement: str, depth: int, warmup: bool, seed: int) -> str:
    return f"{placement}-L{depth}-{'warmup' if warmup else 'nowarmup'}-s{seed}"


def make_arms(s: NormSetting, resolve=lambda cfg: cfg) -> list[Arm]:
    arms = []
    for seed in range(s.seeds):
        for depth in s.depths:
            for placement in PLACEMENTS:
                for warmup in (True, False):
                    optim = s.optim(warmup_steps=s.warmup_steps if warmup else 0)
                    tags = {"placement": placement, "depth": depth, "warmup": warmup}
                    arms.append(
                        Arm(
                            arm_name(placement, depth, warmup, seed),
                            resolve(model_config(s, depth, placement)),
                            optim,
                            seed,
                            tags,
                        )
                    )
    return arms


def study_data(s: NormSetting, run_dir: Path) -> StudyData:
    """Shakespeare LM for the decoder; German -> English sentence pairs for the encoder-decoder."""
    if s.arch == "decoder":
        return StudyData.prepare(s, run_dir)
    data = DataConfig(
        corpus=TRANSLATION_CORPUS,
        direction="de-en",
        vocab_size=s.vocab_size,
        seq_len=s.seq_len,
        max_train_docs=s.max_train_pairs,
    )
    return StudyData(s, run_dir, task="translation", data=data)


def run(setting: NormSetting, run_dir: str | Path) -> None:
    run_dir = begin_study(run_dir, "norm", setting, QUICK)
    data = study_data(setting, run_dir)
    run_arms(make_arms(setting, data.resolve), data, setting, run_dir)


# ----------------------------------------------------------------------------- measures
def init_block_norms(arm: ArmLog, output_stack: bool = False) -> list[float]:
    """Per-block gradient norms at initialisation, input to output (encoder then decoder blocks);
    with output_stack, only the stack next to the output (the decoder of an encoder-decoder)."""
    norms = arm.kind("init_grads")[0]["layer_grad_norms"]
    names = block_names(norms)
    if output_stack:
        stack = names[-1].rsplit(".", 1)[0]
        names = [n for n in names if n.rsplit(".", 1)[0] == stack]
    return [norms[b] for b in names]


def init_ratio(arm: ArmLog) -> float:
    """Gradient norm of the block next to the output over the first block of its stack, at initialisation
    (NaN for a stack of one block, whose ratio is 1 by construction and says nothing)."""
    norms = init_block_norms(arm, output_stack=True)
    if len(norms) < 2:
        return math.nan
    return norms[-1] / norms[0] if norms[0] > 0 else math.inf


def divergence_events(arm: ArmLog, warmup_steps: int) -> list[int]:
    train = arm.kind("train")
    if not train:
        return []
    initial = train[0]["loss"]
    return [
        r["step"]
        for r in train
        if r["step"] > warmup_steps and (not math.isfinite(r["loss"]) or r["loss"] > initial)
    ]


def grad_norm_cv(arm: ArmLog, warmup_steps: int) -> float:
    """Coefficient of variation (std / mean) of the global gradient norm after the warm-up window."""
    g = [
        r["grad_norm"]
        for r in arm.kind("train")
        if r["step"] > warmup_steps and math.isfinite(r["grad_norm"])
    ]
    return statistics.pstdev(g) / statistics.mean(g) if len(g) > 1 else math.nan


def final_bleu(arm: ArmLog) -> float:
    evals = arm.kind("eval")
    return evals[-1].get("bleu", math.nan) if evals else math.nan


def final_train_loss(arm: ArmLog, last: int = 10) -> float:
    losses = [r["loss"] for r in arm.kind("train")][-last:]
    return mean(losses)


# ----------------------------------------------------------------------------- verdicts
class Grid:
    """The arms by (placement, depth, warm-up, seed); a rule over a missing arm gives None."""

    def __init__(self, arms: list[ArmLog], s: NormSetting) -> None:
        self.s, self.w = s, s.warmup_steps
        self.arms = {(a.tags["placement"], a.tags["depth"], a.tags["warmup"], a.seed): a for a in arms}

    def cases(self, fn, warmups=(True,)) -> list[bool | None]:
        """fn(post, pre) for every depth, warm-up setting and seed (None where an arm is missing)."""
        out = []
        for seed in range(self.s.seeds):
            for depth in self.s.depths:
                for warm in warmups:
                    post, pre = (self.arms.get((p, depth, warm, seed)) for p in PLACEMENTS)
                    out.append(None if post is None or pre is None else fn(post, pre))
        return out

    def cost(self, placement: str, depth: int, seed: int, measure, diverges: bool = False) -> float | None:
        """measure(no warm-up arm) - measure(warm-up arm); None where an arm is missing or the measure has
        no value (NaN). `diverges`: a loss, whose non-finite value without warm-up (and a finite one with)
        is a cost of +inf, and a non-finite one with warm-up only (dropping it helped) a cost of -inf: a
        diverged loss counts as worse than any finite one."""
        with_w, no_w = (self.arms.get((placement, depth, warm, seed)) for warm in (True, False))
        if with_w is None or no_w is None:
            return None
        after, before = measure(no_w), measure(with_w)
        if diverges and math.isfinite(after) != math.isfinite(before):
            return math.inf if math.isfinite(before) else -math.inf
        return after - before if math.isfinite(after) and math.isfinite(before) else None

    def by_depth(self, fn, placement: str, warmup: bool = True, digits: int = 3) -> str:
        """'L6 x, L12 y': fn averaged over seeds at each depth."""
        return ", ".join(
            f"L{d} {fmt(mean([fn(a) for k, a in self.arms.items() if k[:3] == (placement, d, warmup)]), digits)}"
            for d in self.s.depths
        )

    def cost_by_depth(self, placement: str, measure) -> str:
        costs = {
            d: [self.cost(placement, d, sd, measure) for sd in range(self.s.seeds)] for d in self.s.depths
        }
        return ", ".join(f"L{d} {fmt(mean([c for c in v if c is not None]), 3)}" for d, v in costs.items())


def warmup_cost_rule(g: Grid, measure, sign: float, diverges: bool = False) -> list[bool | None]:
    """Dropping warm-up costs Post-Norm (sign * cost > 0) more than it costs Pre-Norm, per depth and seed
    (None where a cost is unknown, or both placements' arms diverged on the same side: neither costs
    more)."""
    out = []
    for seed in range(g.s.seeds):
        for depth in g.s.depths:
            post, pre = (g.cost(p, depth, seed, measure, diverges) for p in ("post", "pre"))
            unknown = post is None or pre is None or (post == pre and math.isinf(post))
            out.append(None if unknown else sign * post > max(0.0, sign * pre))
    return out


def divergence_rule(g: Grid) -> list[bool | None]:
    """At the largest depth, Post-Norm without warm-up diverges and no Pre-Norm arm does, per seed."""
    out = []
    for seed in range(g.s.seeds):
        post = g.arms.get(("post", max(g.s.depths), False, seed))
        pre = [a for k, a in g.arms.items() if k[0] == "pre" and k[3] == seed]
        calm = not any(divergence_events(a, g.w) for a in pre)
        observed = post is not None and any(r["step"] > g.w for r in post.kind("train"))
        out.append(bool(divergence_events(post, g.w)) and calm if observed else None)  # no step after warm-up
    return out


XIONG = "Xiong et al. 2020"


def init_grows(post: float, pre: float) -> bool | None:
    """Post-Norm's ratio > 1 >= Pre-Norm's; None if either is NaN (no gradient norms logged)."""
    return None if math.isnan(post) or math.isnan(pre) else post > 1.0 >= pre


def verdicts(arms: list[ArmLog], s: NormSetting) -> list[Verdict]:
    g, w = Grid(arms, s), s.warmup_steps
    events = {
        p: sum(len(divergence_events(a, w)) for k, a in g.arms.items() if k[0] == p) for p in PLACEMENTS
    }
    out = [
        Verdict(
            "At initialisation Post-Norm's gradients grow toward the output layer; Pre-Norm's do not",
            "gradient norm of the last block / the first block (of the decoder, for an encoder-decoder) at "
            "initialisation is > 1 for Post-Norm and <= 1 for Pre-Norm, at every depth and seed",
            all_hold(g.cases(lambda post, pre: init_grows(init_ratio(post), init_ratio(pre)))),
            f"ratio last/first (mean over seeds): Post {g.by_depth(init_ratio, 'post')}; "
            f"Pre {g.by_depth(init_ratio, 'pre')}",
            f"{XIONG}, Fig. 3: Post-LN gradients grow with the layer index, Pre-LN's stay flat",
        ),
        Verdict(
            "Pre-Norm converges faster",
            "Pre-Norm's final validation loss (the end point of the same budget, standing in for speed) is "
            "lower than Post-Norm's at every depth, with and without warm-up, for every seed",
            all_hold(g.cases(lambda post, pre: lower(pre.final_eval, post.final_eval), (True, False))),
            "final val loss (mean over seeds), with warm-up: "
            f"Post {g.by_depth(lambda a: a.final_eval, 'post', digits=4)}; "
            f"Pre {g.by_depth(lambda a: a.final_eval, 'pre', digits=4)}; without: "
            f"Post {g.by_depth(lambda a: a.final_eval, 'post', False, 4)}; "
            f"Pre {g.by_depth(lambda a: a.final_eval, 'pre', False, 4)}",
            f"{XIONG}: Pre-LN without warm-up reaches Post-LN's BLEU sooner",
        ),
        Verdict(
            "Post-Norm needs learning-rate warm-up more than Pre-Norm",
            "dropping warm-up raises Post-Norm's final validation loss, and by more than it raises (or "
            "lowers) Pre-Norm's, at every depth and seed",
            all_hold(warmup_cost_rule(g, lambda a: a.final_eval, +1.0, diverges=True)),
            f"val loss without - with warm-up: Post {g.cost_by_depth('post', lambda a: a.final_eval)}; "
            f"Pre {g.cost_by_depth('pre', lambda a: a.final_eval)}",
            f"{XIONG}: Post-LN without warm-up 8.45 BLEU vs about 34 with warm-up (IWSLT14 De-En)",
        ),
        Verdict(
            "Post-Norm without warm-up diverges",
            f"at the largest depth ({max(s.depths)}) every seed's Post-Norm arm without warm-up has a divergence "
            "event and no Pre-Norm arm has one",
            all_hold(divergence_rule(g)),
            f"divergence events in all arms: Post {events['post']}, Pre {events['pre']}",
            f"{XIONG}: Post-LN training without warm-up fails to converge",
        ),
        Verdict(
            "Pre-Norm's gradients are steadier during training",
            "coefficient of variation of the gradient norm after the warm-up window is lower for Pre-Norm "
            "than for Post-Norm at every depth, schedule and seed",
            all_hold(
                g.cases(lambda post, pre: less(grad_norm_cv(pre, w), grad_norm_cv(post, w)), (True, False))
            ),
            f"CV with warm-up: Post {g.by_depth(lambda a: grad_norm_cv(a, w), 'post')}; "
            f"Pre {g.by_depth(lambda a: grad_norm_cv(a, w), 'pre')}; without: "
            f"Post {g.by_depth(lambda a: grad_norm_cv(a, w), 'post', False)}; "
            f"Pre {g.by_depth(lambda a: grad_norm_cv(a, w), 'pre', False)}",
        ),
    ]
    if s.arch == "encoder_decoder":
        out.append(
            Verdict(
                "Without warm-up Post-Norm loses BLEU, Pre-Norm much less",
                "dropping warm-up lowers Post-Norm's final greedy BLEU, and by more than Pre-Norm's, at every "
                "depth and seed",
                all_hold(warmup_cost_rule(g, final_bleu, -1.0)),
                f"BLEU (0-100) with warm-up: Post {g.by_depth(final_bleu, 'post')}; Pre {g.by_depth(final_bleu, 'pre')}; "
                f"without: Post {g.by_depth(final_bleu, 'post', False)}; "
                f"Pre {g.by_depth(final_bleu, 'pre', False)}",
                f"{XIONG} (IWSLT14 De-En): Post-LN 8.45 BLEU without warm-up vs about 34 with",
            )
        )
    return out


# ----------------------------------------------------------------------------- plots
def plot_init_grads(arms: list[ArmLog], s: NormSetting, path: Path) -> Path:
    fig, axes = panels(len(s.depths))
    for ax, depth in zip(axes, s.depths):
        for a in arms:
            if a.tags["depth"] == depth and a.tags["warmup"]:
                norms = init_block_norms(a)
                p = a.tags["placement"]
                ax.plot(
                    range(1, len(norms) + 1),
                    norms,
                    "o-",
                    color=COLORS[p],
                    ms=3,
                    alpha=1.0 if a.seed == 0 else 0.4,
                    label=f"{p}-norm" if a.seed == 0 else None,
                )
        if s.arch != "decoder":  # blocks 1..depth are the encoder's, then the decoder's
            ax.axvline(depth + 0.5, color="gray", lw=0.8, ls=":")
            ax.text(depth + 0.5, 1.0, " decoder", transform=ax.get_xaxis_transform(), va="top", fontsize=7)
        ax.set(
            title=f"{depth} layers" + (" per side" if s.arch != "decoder" else ""),
            xlabel="block (1 = next to the input)"
            + ("\nencoder, then decoder" if s.arch != "decoder" else ""),
            ylabel="gradient norm",
            yscale="log",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Per-block gradient norm at initialisation")
    return save_figure(fig, path)


def _curves(arms, s, path, key, ylabel, title, logy=False) -> Path:
    fig, axes = panels(len(s.depths))
    for ax, depth in zip(axes, s.depths):
        for a in arms:
            if a.tags["depth"] != depth or a.seed != 0:
                continue
            p, warm = a.tags["placement"], a.tags["warmup"]
            steps = [r["step"] for r in a.kind("train")]
            ax.plot(
                steps,
                [r[key] for r in a.kind("train")],
                color=COLORS[p],
                ls="-" if warm else "--",
                lw=1,
                label=f"{p}, {'warm-up' if warm else 'no warm-up'}",
            )
        if s.warmup_steps:
            ax.axvline(s.warmup_steps, color="gray", lw=0.8, ls=":")
        ax.set(title=f"{depth} layers (seed 0)", xlabel="step", ylabel=ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_layer_grads(arms: list[ArmLog], s: NormSetting, path: Path) -> Path:
    """Per-block gradient norm over training at the largest depth (seed 0), one heat map per arm."""
    depth = max(s.depths)
    chosen = [a for a in arms if a.tags["depth"] == depth and a.seed == 0]
    fig, axes = panels(len(chosen), width=3.6)
    plt = pyplot()
    grids = {}
    for a in chosen:
        train = a.kind("train")
        names = block_names(train[0]["layer_grad_norms"])
        grids[a.name] = [[math.log10(max(r["layer_grad_norms"][n], 1e-12)) for r in train] for n in names]
    cells = [v for g in grids.values() for row in g for v in row if math.isfinite(v)]
    lo, hi = (min(cells), max(cells)) if cells else (0.0, 1.0)
    for ax, a in zip(axes, chosen):
        train, grid = a.kind("train"), grids[a.name]
        im = ax.imshow(
            grid,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=lo,
            vmax=hi,
            extent=(train[0]["step"] - 0.5, train[-1]["step"] + 0.5, 0.5, len(grid) + 0.5),
        )
        ax.set(
            title=f"{a.tags['placement']}, {'warm-up' if a.tags['warmup'] else 'no warm-up'}",
            xlabel="step",
            ylabel="block",
        )
        plt.colorbar(im, ax=ax, label="log10 gradient norm")
    fig.suptitle(f"Per-block gradient norm during training, {depth} layers")
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- report
def arm_rows(arms: list[ArmLog], s: NormSetting) -> list[list[str]]:
    rows = []
    for a in arms:
        events = divergence_events(a, s.warmup_steps)
        rows.append(
            [
                a.name,
                a.tags["placement"],
                a.tags["depth"],
                "yes" if a.tags["warmup"] else "no",
                a.seed,
                fmt(a.kind("train")[0]["loss"]),
                fmt(final_train_loss(a)),
                fmt(a.final_eval),
                f"{len(events)}" + (f" (first at {events[0]})" if events else ""),
                fmt(init_ratio(a), 3),
                fmt(grad_norm_cv(a, s.warmup_steps), 3),
            ]
            + ([fmt(final_bleu(a), 2)] if s.arch == "encoder_decoder" else [])
        )
    return rows


def data_line(s: NormSetting, run_dir: Path, arms: list[ArmLog]) -> str:
    if s.arch == "encoder_decoder":
        pairs = training_units(run_dir, s.max_train_pairs, "pairs")
        return (
            f"Data: {TRANSLATION_CORPUS} German -> English, {pairs}, joint BPE vocabulary "
            f"{vocabulary_words(arms, s.vocab_size)}, at most {s.seq_len} tokens per side; validation loss and greedy BLEU on "
            f"{s.eval_batches * s.batch_size} validation pairs spread over the split; depth = layers in the "
            "encoder and in the decoder."
        )
    return (
        f"Data: {s.corpus} language modelling, byte-level BPE vocabulary {vocabulary_words(arms, s.vocab_size)}, "
        f"{training_units(run_dir, s.max_train_docs, 'works')}, windows of {s.seq_len} "
        f"tokens; validation loss on {scored_windows(arms, s.eval_batches * s.batch_size)} windows spread over the held-out works."
    )


ARM_HEADERS = [
    "arm",
    "placement",
    "layers",
    "warm-up",
    "seed",
    "initial loss",
    "train loss (mean of the last 10 steps)",
    "final val loss",
    "divergence events",
    "init grad last/first",
    "grad-norm CV",
]


def report(run_dir: Path) -> tuple[Report, str]:
    run_dir = Path(run_dir)
    meta = read_setting(run_dir)
    s = setting_of(run_dir, NormSetting)
    arms = read_arms(run_dir)
    figs = [
        plot_init_grads(arms, s, run_dir / "norm_init_grads.png"),
        _curves(arms, s, run_dir / "norm_loss.png", "loss", "training loss (nats/token)", "Training loss"),
        _curves(
            arms,
            s,
            run_dir / "norm_grad_norm.png",
            "grad_norm",
            "gradient norm",
            "Global gradient norm",
            logy=True,
        ),
        plot_layer_grads(arms, s, run_dir / "norm_layer_grads.png"),
    ]
    checks = verdicts(arms, s)
    task = "" if s.arch == "decoder" else ", encoder-decoder translation"
    r = Report(f"Post-Norm vs Pre-Norm ({meta['mode']} setting{task})", quick=meta["mode"] == "quick")
    if meta["mode"] == "quick":
        r.text(QUICK_NOTE)
    r.heading("Setup")
    r.bullets(
        [
            data_line(s, run_dir, arms),
            f"Model: {s.arch.replace('_', '-')}, d_model {s.d_model}, {s.n_heads} heads, ReLU FFN {s.d_ff}, LayerNorm, sinusoidal "
            f"positions, Xavier init, no dropout; depths {', '.join(map(str, s.depths))}.",
            f"Budget (every arm): {s.steps} steps of {s.batch_size} x {s.seq_len} tokens, AdamW lr {s.lr}, "
            f"weight decay {s.weight_decay}, cosine to 10%; warm-up arms: linear warm-up over {s.warmup_steps} "
            f"steps; gradient clipping {'off' if s.grad_clip == 0 else s.grad_clip}; fp32 on {s.device}.",
            f"Seeds: {', '.join(str(i) for i in range(s.seeds))} (a seed fixes the initial weights and the batch "
            "order; Post- and Pre-Norm arms of one seed see the same batches).",
            "Divergence event: a step after the warm-up window (the same window for every arm) whose training "
            "loss is non-finite or above the arm's step-1 loss.",
        ]
    )
    r.heading("Verdicts")
    r.text(
        "Each claim is decided by the stated rule on this run's logged numbers (arms/*/metrics.jsonl). "
        "Small models trained for minutes test the direction of an effect, not its published size."
    )
    r.verdicts(checks)
    if (note := stopped_note(arms)) is not None:
        r.text(note)
    r.heading("Arms")
    r.table(
        ARM_HEADERS + (["final BLEU (greedy, 0-100)"] if s.arch == "encoder_decoder" else []),
        arm_rows(arms, s),
    )
    r.heading("Plots")
    captions = [
        "Gradient norm of each block's parameters at initialisation (mean over the init batches); "
        "faint lines: other seeds.",
        "Training loss per step, seed 0; dotted line: end of the warm-up window.",
        "Gradient norm (before clipping) per step, seed 0; dotted line: end of the warm-up window.",
        "Gradient norm of each block during training at the largest depth, seed 0.",
    ]
    for path, caption in zip(figs, captions):
        r.figure(path, caption)
    summary = text_table(
        ["arm", "val loss", "events", "init last/first"],
        [[row[0], row[7], row[8], row[9]] for row in arm_rows(arms, s)],
    )
    summary += "\n\n" + verdict_lines(checks, meta["mode"] == "quick")
    return r, summary
