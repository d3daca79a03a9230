"""The experiments' training loop: every arm of a study trains on the same data, seeds and budget, and
logs what the studies read into `arms/<name>/metrics.jsonl`.

It is built from the shared parts (a `tformer.tasks` task for data, loss and validation: `LMTask` by
default; `make_optimizer`, `make_scheduler`, `moe_aux_loss`, `update_expert_biases`) and adds what the Trainer does not measure: per-layer gradient norms read
between backward and the optimizer step, and the MoE routing loads of every step.

Run directory of a study:
    setting.json             the Setting (and which study, which mode)
    tokenizer.json, data.json
    arms/<name>/arm.json     the arm: model and optimizer configs, seed, tags
    arms/<name>/metrics.jsonl
    *.png, report.md, report.html

Records in metrics.jsonl (one JSON object a line; studies add their own kinds):
    init_grads  layer_grad_norms {group: norm} at initialisation, averaged over `batches` batches
    train       step, loss, aux_loss, lr, grad_norm (before clipping), layer_grad_norms, time_s
                (training wall-clock so far, evaluation excluded), finite; MoE: max_vio {layer: v}
    routing     MoE only, at each evaluation: the share of assignments per expert over the steps since
                the previous one, {layer: [share, ...]}
    eval        step, eval_loss, perplexity, time_s
    stopped     step, reason (too many non-finite steps in a row)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tformer.config import MAX_BPE_VOCAB, ModelConfig
from tformer.distributed.env import resolve_device
from tformer.json_files import first_bad_line, read_json, read_json_lines
from tformer.model import build_model
from tformer.model.moe import (
    discard_expert_counts,
    moe_aux_loss,
    moe_layers,
    moe_routing_stats,
    update_expert_biases,
)
from tformer.tasks import make_task
from tformer.tasks.corpus import JOINED, write_manifest
from tformer.tasks.stream import BatchStream
from tformer.train.config import DataConfig, OptimConfig, TrainConfig
from tformer.train.optim import make_optimizer, make_scheduler

METRICS = "metrics.jsonl"
ARM = "arm.json"
DONE = "DONE"  # written into an arm's directory once it trained and its analyses ran (what --resume keeps)
SETTING = "setting.json"
MAX_SEEDS = 1000  # more than any study here could train (each seed is every arm again)
MODES = ("quick", "full")


# ----------------------------------------------------------------------------- setting
@dataclass(frozen=True)
class Setting:
    """What every arm of a study shares: data, model width, budget, seeds. Studies subclass it."""

    corpus: str = "shakespeare"
    max_train_docs: int | None = None  # None: every training work
    vocab_size: int = 2048
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    batch_size: int = 16
    steps: int = 300
    lr: float = 1e-3
    warmup_steps: int = 30
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 8
    seeds: int = 2
    device: str = "cpu"
    max_nonfinite: int = 10  # an arm stops after this many non-finite steps in a row

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "seq_len",
            "d_model",
            "n_heads",
            "n_layers",
            "batch_size",
            "steps",
            "eval_every",
            "eval_batches",
            "seeds",
            "max_nonfinite",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")
        name = type(self).__name__
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        if self.lr <= 0:  # (NaN and inf: OptimConfig names them)
            raise ValueError(f"{name}.lr must be > 0, got {self.lr}")
        if not 260 <= self.vocab_size <= MAX_BPE_VOCAB:  # checked before the study writes anything
            raise ValueError(
                f"{name}.vocab_size must be from 260 (256 bytes + 4 special tokens) to {MAX_BPE_VOCAB:,}, "
                f"got {self.vocab_size}"
            )
        if self.seeds > MAX_SEEDS:
            raise ValueError(
                f"{name}.seeds must be at most {MAX_SEEDS:,} (each seed trains every arm), got {self.seeds:,}"
            )

    def replace(self, **changes: Any) -> Setting:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the setting") -> Setting:
        """The setting a study's setting.json records: every field, each of its own type (a file written
        by hand or by another version names what is wrong, with `where`)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: 'setting' must be a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = sorted(set(fields) - set(data))
        if missing:
            raise ValueError(f"{where}: the setting lacks {', '.join(missing)}")
        values = {}
        for name, f in fields.items():
            value, default = data[name], f.default
            if isinstance(value, list):
                value = tuple(value)
            kinds = {tuple: (tuple,), float: (int, float), int: (int,), str: (str,), bool: (bool,)}
            want = kinds.get(type(default), (int,) if default is None else (type(default),))
            ok = (value is None and (default is None or "None" in str(f.type))) or (
                isinstance(value, want) and not (isinstance(value, bool) and bool not in want)
            )
            if isinstance(value, tuple) and ok:
                ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            if not ok:
                raise ValueError(f"{where}: setting {name} = {json.dumps(data[name])} is not a {f.type}")
            values[name] = value
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    def optim(self, **changes: Any) -> OptimConfig:
        """The one optimizer setting of the study (cosine to 10% after linear warm-up)."""
        base = OptimConfig(
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
            weight_decay=self.weight_decay,
            schedule="cosine",
            min_lr_ratio=0.1,
        )
        return base.replace(**changes)


@dataclass
class Arm:
    """One model trained under a study's budget: `tags` say what the study varies (JSON values)."""

    name: str
    model: ModelConfig
    optim: OptimConfig
    seed: int
    tags: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "tags": self.tags,
            "model": self.model.to_dict(),
            "optim": self.optim.to_dict(),
        }


# ----------------------------------------------------------------------------- data
class StudyData:
    """The task every arm of a study trains on (a `tformer.tasks` object: LM on a corpus by default,
    translation for encoder-decoder arms), set up once: one tokenizer, one train and one validation set.

    `stream(seed)` gives the training batches (the same seed gives every arm the same batches in the same
    order), `resolve(cfg)` fills in the vocabulary sizes the tokenizer decided, `evaluate(model)` is the
    task's own validation (loss, perplexity; BLEU for translation)."""

    def __init__(
        self, setting: Setting, run_dir: Path, task: str = "lm", data: DataConfig | None = None
    ) -> None:
        data = data or DataConfig(
            corpus=setting.corpus,
            vocab_size=setting.vocab_size,
            seq_len=setting.seq_len,
            max_train_docs=setting.max_train_docs,
        )
        self.cfg = TrainConfig(
            task=task,
            data=data,
            steps=setting.steps,
            batch_size=setting.batch_size,
            eval_batches=setting.eval_batches,
            device=setting.device,
            dtype="float32",
        )
        self.device = resolve_device(setting.device)
        self.task = make_task(task)
        self.task.setup(self.cfg, Path(run_dir), self.device)
        if hasattr(self.task, "corpus"):  # the task's manifest plus the study's data settings, and how it
            # packs one file's pieces (left out, a study continued later had packed a text: file otherwise)
            write_manifest(
                run_dir,
                self.task.corpus,
                max_train_docs=data.max_train_docs,
                vocab_size=data.vocab_size,
                seq_len=data.seq_len,
                **({JOINED: True} if getattr(self.task, "join", False) else {}),
            )

    @classmethod
    def prepare(cls, setting: Setting, run_dir: Path) -> StudyData:
        """Language modelling on `setting.corpus` (the default study data)."""
        return cls(setting, run_dir)

    def stream(self, seed: int) -> BatchStream:
        return self.task.train_loader(self.cfg.replace(seed=seed))

    def resolve(self, model: ModelConfig) -> ModelConfig:
        return self.task.model_config(self.cfg.replace(model=model))

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        return self.task.loss(model, batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        model.eval()
        result = self.task.evaluate(model, self.cfg.eval_batches)
        model.train()
        return result


# ----------------------------------------------------------------------------- measurements
def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameters by block ("blocks.0", ..., "decoder.blocks.5"); the rest under "embed" (token and
    position tables, before the first block) and "head" (final norm, output projection)."""
    groups: dict[str, list[nn.Parameter]] = {"embed": []}
    for name, p in model.named_parameters():
        found = re.match(r"^(.*blocks\.\d+)\.", name)
        key = found.group(1) if found else ("embed" if "embed" in name or "positions" in name else "head")
        groups.setdefault(key, []).append(p)
    head = groups.pop("head", [])
    return {**groups, "head": head} if head else groups


def block_names(groups: Iterable[str]) -> list[str]:
    return [g for g in groups if re.search(r"blocks\.\d+$", g)]


@torch.no_grad()
def group_grad_norms(groups: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    """L2 norm of each group's gradient (0 for a group without gradient)."""
    out = {}
    for name, params in groups.items():
        grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
        out[name] = float(torch.stack(grads).norm()) if grads else 0.0
    return out


def init_grad_norms(model: nn.Module, batches: list, data: StudyData, groups: dict) -> dict[str, Any]:
    """Per-layer gradient norms of the task loss at initialisation, averaged over `batches`."""
    sums: dict[str, float] = {}
    for batch in batches:
        loss, n = data.loss(model, batch)
        (loss / n).backward()
        for k, v in group_grad_norms(groups).items():
            sums[k] = sums.get(k, 0.0) + v / len(batches)
        model.zero_grad(set_to_none=True)
    for _, layer in moe_layers(model):  # these forwards are measurements, not training: forget their loads
        layer.router.tokens_per_expert.zero_()
        layer.router.window_tokens.zero_()
    return {"kind": "init_grads", "batches": len(batches), "layer_grad_norms": sums}


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class JsonlLog:
    """Appends records to a metrics.jsonl (non-finite floats are written as NaN / Infinity)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    return read_json_lines(path)  # a line a killed arm left half-written is skipped


class DamagedArmError(ValueError):
    """A finished arm's metrics.jsonl (its DONE marker is written after its last record) holds a line that
    is not a whole record: the file was cut short or edited since, and a report would read part of it."""


def damaged_arms(run_dir: Path) -> dict[str, str]:
    """The arms of a run with their DONE marker whose metrics.jsonl holds a line that is not a whole
    record (read_records would skip it, and a report would not say so): {arm: what is wrong, with the
    file}. A half-written line in an arm without its marker is what a killed arm leaves: not damage."""
    arms_dir = Path(run_dir) / "arms"
    damaged = {}
    for arm_dir in sorted(arms_dir.iterdir()) if arms_dir.is_dir() else []:
        metrics = arm_dir / METRICS
        line = first_bad_line(metrics) if (arm_dir / DONE).is_file() and metrics.is_file() else None
        if line is not None:
            damaged[arm_dir.name] = (
                f"{metrics} is damaged: line {line} is not a whole record (cut short or edited after the arm "
                "finished)"
            )
    return damaged


# ----------------------------------------------------------------------------- the loop
class LoadWindow:
    """Sums each MoE layer's per-step expert loads between two evaluations (empty without MoE)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, stats: dict[str, dict]) -> None:
        for layer, s in stats.items():
            counts = [x * s["assignments"] for x in s["load"]]
            prev = self.sums.get(layer, [0.0] * len(counts))
            self.sums[layer] = [a + b for a, b in zip(prev, counts)]

    def flush(self, step: int) -> dict[str, Any] | None:
        if not self.sums:
            return None
        shares = {k: [c / max(1.0, sum(v)) for c in v] for k, v in self.sums.items()}
        self.sums = {}
        return {"kind": "routing", "step": step, "load": shares}


def instrumented_step(
    model: nn.Module, loss_fn, batch, optimizer, scheduler, grad_clip: float, groups: dict
) -> dict:
    """Loss -> backward -> per-layer gradient norms -> clip -> step (skipped when non-finite).
    `loss_fn(model, batch)` -> (sum of per-target losses, number of targets), as a task's `loss`."""
    task_loss, n = loss_fn(model, batch)
    aux = moe_aux_loss(model)
    (task_loss / n + aux).backward()
    layer_norms = group_grad_norms(groups)  # between backward and the optimizer step
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf))
    loss = float(task_loss.detach()) / n
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        update_expert_biases(model)
    else:
        discard_expert_counts(model)
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return {
        "loss": loss,
        "aux_loss": float(aux.detach()),
        "lr": lr,
        "grad_norm": grad_norm,
        "layer_grad_norms": layer_norms,
        "finite": finite,
    }


def train_arm(
    arm: Arm, data: StudyData, setting: Setting, run_dir: Path, index: int = 0, init_batches: int = 2
) -> nn.Module:
    """Train one arm (the study's `index`-th) under the study's budget, logging into run_dir/arms/<name>/
    (anything an unfinished earlier attempt left there is replaced); return the model."""
    device = resolve_device(setting.device)
    arm_dir = Path(run_dir) / "arms" / arm.name
    shutil.rmtree(arm_dir, ignore_errors=True)
    arm_dir.mkdir(parents=True)
    (arm_dir / ARM).write_text(json.dumps({"index": index, **arm.to_dict()}, indent=2))
    log = JsonlLog(arm_dir / METRICS)
    torch.manual_seed(arm.seed)
    model = build_model(arm.model).to(device).train()
    groups = layer_groups(model)
    first = data.stream(arm.seed)
    log.write(init_grad_norms(model, [first.next_batch(device) for _ in range(init_batches)], data, groups))
    optimizer = make_optimizer(model, arm.optim)
    scheduler = make_scheduler(optimizer, setting.steps, arm.optim)
    stream, window, clock, bad = data.stream(arm.seed), LoadWindow(), 0.0, 0
    has_moe = bool(moe_layers(model))
    for step in range(1, setting.steps + 1):
        batch = stream.next_batch(device)
        t0 = now(device)
        record = instrumented_step(model, data.loss, batch, optimizer, scheduler, arm.optim.grad_clip, groups)
        clock += now(device) - t0
        record = {"kind": "train", "step": step, **record, "time_s": clock}
        if has_moe:
            stats = moe_routing_stats(model)
            window.add(stats)
            record["max_vio"] = {k: s["max_vio"] for k, s in stats.items()}
        log.write(record)
        bad = 0 if record["finite"] else bad + 1
        stop = bad >= setting.max_nonfinite
        if step % setting.eval_every == 0 or step == setting.steps or stop:
            for r in (
                window.flush(step),
                {"kind": "eval", "step": step, **data.evaluate(model), "time_s": clock},
            ):
                if r is not None:
                    log.write(r)
        if stop:
            log.write({"kind": "stopped", "step": step, "reason": f"{bad} non-finite steps in a row"})
            break
    return model.eval()


# ----------------------------------------------------------------------------- reading a run
@dataclass
class ArmLog:
    """An arm as the report sees it: its arm.json and its records, read back from the run directory."""

    name: str
    seed: int
    tags: dict[str, Any]
    model: dict[str, Any]
    records: list[dict[str, Any]]

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def final_eval(self) -> float:
        evals = self.kind("eval")
        return evals[-1]["eval_loss"] if evals else math.nan

    @property
    def stopped(self) -> bool:
        return bool(self.kind("stopped"))


def read_arms(run_dir: Path) -> list[ArmLog]:
    """Every arm of a run, in the order they were trained."""
    metas = []
    if not (Path(run_dir) / "arms").is_dir():
        raise ValueError(f"{run_dir} holds no arms/ folder: the study trained no arm (run it with --resume)")
    for arm_dir in (Path(run_dir) / "arms").iterdir():
        if (arm_dir / ARM).exists() and (arm_dir / METRICS).exists():
            metas.append((read_json(arm_dir / ARM), arm_dir / METRICS))
    metas.sort(key=lambda m: m[0]["index"])
    return [ArmLog(m["name"], m["seed"], m["tags"], m["model"], read_records(path)) for m, path in metas]


def vocabulary_words(arms: list[ArmLog], asked: int) -> str:
    """The vocabulary the arms trained with, for a report: "2048", or where the tokenizer learned fewer
    tokens than the setting asked, "5,983 (60,000 asked: the training text held no more merges)"."""
    learned = min((a.model.get("vocab_size", asked) for a in arms), default=asked)
    return (
        f"{learned}"
        if learned == asked
        else f"{learned:,} ({asked:,} asked: the training text held no more merges)"
    )


def scored_windows(arms: list[ArmLog], asked: int) -> int:
    """How many validation windows an evaluation scored (its records' `windows_scored`: fewer than
    eval_batches x batch_size asked where the split holds fewer)."""
    return next((r["windows_scored"] for a in arms for r in a.kind("eval") if "windows_scored" in r), asked)


def finished_arms(run_dir: Path, steps: int, damaged: dict[str, str] | None = None) -> set[str]:
    """The arms of a run that trained to the end (or were stopped by the non-finite rule) and ran their
    analyses (their DONE marker). An arm with its marker but a metrics file that does not show the end
    (damaged, cut short) or holds a line that is not a whole record is not finished: --resume trains it
    again. `damaged`: `damaged_arms(run_dir)` where the caller has it already."""
    arms_dir = Path(run_dir) / "arms"
    analysed = {d.name for d in arms_dir.iterdir() if (d / DONE).is_file()} if arms_dir.is_dir() else set()
    analysed -= (damaged_arms(run_dir) if damaged is None else damaged).keys()
    done = set()
    for log in read_arms(run_dir) if analysed else []:
        last = max((r["step"] for r in log.records if r.get("kind") in ("eval", "stopped")), default=0)
        if log.name in analysed and (last == steps or log.stopped):
            done.add(log.name)
    return done


def check_complete(run_dir: Path, arms: list[Arm], steps: int) -> None:
    """Every arm of the study trained to the end (or stopped by the non-finite rule) and ran its
    analyses (its DONE marker): a report of an interrupted study would compare arms that are not there,
    or drop an arm whose analyses were cut short from its tables. A finished arm whose metrics.jsonl was
    damaged since (a line that is not a whole record) is a DamagedArmError naming the file."""
    damaged = list(damaged_arms(run_dir).values())
    if damaged:
        more = f" (and {len(damaged) - 1} more arms' metrics.jsonl)" if len(damaged) > 1 else ""
        raise DamagedArmError(
            f"{damaged[0]}{more}; a report would read part of the arm: train it again with --resume"
        )
    done = finished_arms(run_dir, steps, damaged={})  # (none damaged: checked above)
    missing = [a.name for a in arms if a.name not in done]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(
            f"the study in {run_dir} is incomplete: {len(arms) - len(missing)} of {len(arms)} arms finished "
            f"(not {shown}; was it stopped?); continue it with --resume, or start over with --overwrite"
        )


def run_arms(arms: list[Arm], data: StudyData, setting: Setting, run_dir: Path, after=None) -> None:
    """Train every arm in order, one progress line each; `after(arm, model)` runs a study's extra
    measurements on the trained model (its records go to the same metrics.jsonl). Arms that finished in
    an earlier attempt at this run (--resume) are kept: each arm is seeded on its own, so training only
    the others gives what one uninterrupted run gives; an arm with its DONE marker whose metrics are
    damaged or cut short is trained again, with a warning naming the file."""
    damaged = damaged_arms(run_dir)
    done = finished_arms(run_dir, setting.steps, damaged)
    for i, arm in enumerate(arms, 1):
        metrics = Path(run_dir) / "arms" / arm.name / METRICS
        t0 = time.perf_counter()
        if arm.name not in done:
            if (metrics.parent / DONE).is_file():  # a marker over damaged metrics: trained again
                wrong = damaged.get(
                    arm.name, f"{metrics} does not show the arm's end (cut short, or missing)"
                )
                warnings.warn(f"{wrong}; the arm is trained again", UserWarning, stacklevel=2)
                (metrics.parent / DONE).unlink()
            model = train_arm(arm, data, setting, run_dir, index=i - 1)
            if after is not None:
                with metrics.open("a") as f:
                    for record in after(arm, model):
                        f.write(json.dumps(record) + "\n")
            (metrics.parent / DONE).write_text("")
        evals = [r for r in read_records(metrics) if r["kind"] == "eval"]
        final = f"{evals[-1]['eval_loss']:.4f}" if evals else "-"
        how = (
            "kept from the earlier attempt"
            if arm.name in done
            else (f"{time.perf_counter() - t0:.1f} s with evaluations and analyses")
        )
        print(f"[{i}/{len(arms)}] {arm.name}: val loss {final} ({how})", flush=True)
