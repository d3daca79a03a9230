"""`tformer experiment {norm,rope,moe}`: train a study's arms, write its report, print its summary.

tformer experiment norm --quick                      # seconds: tiny models, a few steps
tformer experiment moe --out runs/moe --seeds 3      # the full setting, about 30 minutes on 2 cores
tformer experiment rope --device cuda --steps 4000 --d-model 512
tformer experiment moe --report-only --out runs/moe  # rebuild the report from the run's logs
tformer experiment moe --resume --out runs/moe       # continue a stopped study: its finished arms are kept
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tformer.cli.options import (
    nonnegative_int,
    positive_int,
    refuse_torchrun,
    thread_count,
    warn,
    warn_oversubscribed,
)
from tformer.experiments import STUDIES
from tformer.schema import ConfigError

# CLI flag -> Setting field; a flag left out keeps the setting's value
OVERRIDES = {
    "seeds": "seeds",
    "steps": "steps",
    "d_model": "d_model",
    "n_layers": "n_layers",
    "lr": "lr",
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "warmup_steps": "warmup_steps",
    "vocab_size": "vocab_size",
    "device": "device",
    "max_train_docs": "max_train_docs",
}


def say_resume(args: argparse.Namespace, out: Path) -> None:
    """The command that continues a stopped study, on stderr (before `tformer experiment: interrupted`); with
    the study's --threads, which a resume compares with its own. Nothing where stderr is gone (a hang-up,
    lost output): the stop's own exit code stands."""
    if sys.stderr is None:
        return
    threads = f" --threads {args.threads}" if args.threads is not None else ""
    with contextlib.suppress(OSError):
        print(
            f"tformer experiment: stopped; `tformer experiment {args.study} --resume --out "
            f"{shlex.quote(str(out))}{threads}` continues the study (its finished arms are kept)",
            file=sys.stderr,
        )


@contextlib.contextmanager
def resume_said(args: argparse.Namespace, out: Path) -> Iterator[None]:
    """A --resume stopped again says how to continue, as the first run does."""
    try:
        yield
    except KeyboardInterrupt:
        say_resume(args, out)
        raise


@contextlib.contextmanager
def flags_named(args: argparse.Namespace):
    """A ConfigError or a study setting's ValueError about a setting the user gave as a flag
    (`OptimConfig.lr`, `NormSetting.lr` from --lr) names the flag."""
    try:
        yield
    except ValueError as err:
        given = {OVERRIDES[f] for f in OVERRIDES if getattr(args, f, None) is not None}

        def flag(m: re.Match) -> str:
            return "--" + m.group(2).replace("_", "-") if m.group(2) in given else m.group(0)

        text = re.sub(r"\b(\w+(?:Config|Setting))\.(\w+)", flag, str(err))
        if given:  # a bare `d_model=36` in a message about another field
            text = re.sub(
                rf"(?<![\w.-])({'|'.join(sorted(given))})(?==)",
                lambda m: "--" + m.group(1).replace("_", "-"),
                text,
            )
        if text == str(err):  # about nothing the user typed: as it was raised
            raise
        raise (ConfigError if isinstance(err, ConfigError) else ValueError)(text) from None


def depth_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated layer counts >= 1."""
    try:
        depths = tuple(positive_int(d.strip()) for d in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if len(set(depths)) != len(depths):
        raise argparse.ArgumentTypeError(f"a depth appears twice in {text!r} (its arms would train twice)")
    return depths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", choices=sorted(STUDIES), help="which claim to test")
    p.add_argument(
        "--quick", action="store_true", help="tiny models, a few steps, a small slice of the data: seconds"
    )
    p.add_argument("--out", default=None, help="run directory (default runs/experiments/<study>[-quick])")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    p.add_argument("--report-only", action="store_true", help="rebuild the report of the run in --out")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the stopped study in --out with its own settings: arms that finished are kept, the "
        "others trained (each arm is seeded on its own, so the result is an uninterrupted run's)",
    )
    p.add_argument("--seeds", type=positive_int, default=None, help="seeds 0..N-1 (full default 2, quick 1)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps of every arm")
    p.add_argument("--d-model", type=positive_int, default=None, help="model width of every arm")
    p.add_argument(
        "--n-layers", type=positive_int, default=None, help="layers (rope, moe; norm uses --depths)"
    )
    p.add_argument(
        "--depths", type=depth_list, default=None, help="norm: comma-separated depths, e.g. 6,12,24"
    )
    p.add_argument("--arch", default=None, choices=["decoder", "encoder_decoder"], help="norm: architecture")
    p.add_argument("--lr", type=float, default=None, help="one learning rate for every arm")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None, help="warm-up steps of every arm")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step")
    p.add_argument("--seq-len", type=positive_int, default=None, help="training context L")
    p.add_argument("--vocab-size", type=positive_int, default=None, help="BPE vocabulary of the study")
    p.add_argument(
        "--max-train-docs",
        type=positive_int,
        default=None,
        help="train on the first N works only (norm --arch encoder_decoder: the first N sentence pairs)",
    )
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument(
        "--threads",
        type=lambda text: thread_count(text, low=1),
        default=None,
        help="torch CPU threads for this run",
    )


def resolve_setting(args: argparse.Namespace, module):
    setting = module.QUICK if args.quick else module.FULL
    changes = {field: getattr(args, flag) for flag, field in OVERRIDES.items()}
    if getattr(args, "depths", None):
        changes["depths"] = args.depths
    if getattr(args, "arch", None):
        changes["arch"] = args.arch
    changes = getattr(module, "cli_changes", lambda c: c)(changes)  # a study's own reading of a flag
    known = set(setting.to_dict()) - set(getattr(module, "UNUSED_OPTIONS", ()))
    unused = sorted(k for k, v in changes.items() if v is not None and k not in known)
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise ValueError(f"experiment {args.study} has no option {flags}")

    def chosen(name: str):  # a setting after the flags (None: the study's own)
        return changes[name] if changes.get(name) is not None else getattr(setting, name, None)

    steps, warmup = chosen("steps"), chosen("warmup_steps")
    least = getattr(module, "MIN_WARMUP_STEPS", 0)
    if warmup is not None and warmup < least:  # before the steps' advice, which would lead here next
        raise ValueError(
            f"--warmup-steps must be >= {least}: the {args.study} study compares arms with and without a "
            f"warm-up of that many steps, got {warmup}"
        )
    after = getattr(module, "STEPS_AFTER_WARMUP", 0)  # steps a study's measures read after the warm-up
    if warmup is not None and steps - after < warmup:
        need = f" and leave {after} steps after them for the study's measures" if after else ""
        given = (
            f"--warmup-steps {warmup}"
            if args.warmup_steps is not None
            else f"the study's {warmup} warm-up steps"
        )
        fix = (
            f"give --warmup-steps at most {steps - after}, or --steps {warmup + after} or more"
            if steps > after
            else f"give --steps {warmup + after} or more"  # ("above {after}" had been too few)
        )
        raise ValueError(f"--steps {steps} must cover {given}{need}: {fix}")
    return setting.replace(**changes)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warn_if_computed_otherwise(saved: dict, threads: int | None, left: int) -> None:
    """A --resume whose torch version or CPU thread count differs from the one setting.json recorded (a
    study written before it recorded threads is not compared) says so: the arms left sum floats in another
    order, so their numbers can differ in the last digits from an uninterrupted study's."""
    import torch

    now = {"torch": torch.__version__, "threads": threads or torch.get_num_threads()}
    changed = {key: (saved[key], value) for key, value in now.items() if key in saved and saved[key] != value}
    if changed:
        what = ", ".join(f"{key} {was} -> {value}" for key, (was, value) in changed.items())
        hint = f"; --threads {saved['threads']} trains them as the first ones" if "threads" in changed else ""
        warn(
            "experiment",
            f"this --resume computes otherwise than the study's finished arms did ({what}): the {left} "
            f"arm{'s' if left != 1 else ''} left can differ from an uninterrupted study's in the last digits{hint}",
        )


def run(args: argparse.Namespace) -> int:
    refuse_torchrun("experiment", "every rank would train the same study into the same directory")
    # here, not at the top: `tformer --help` builds this command's options without importing torch
    from tformer.distributed.env import resolve_device
    from tformer.experiments.runner import DONE, check_complete, finished_arms
    from tformer.experiments.study_dir import (
        PREVIOUS,
        _study_files,
        drop_previous_study,
        prepare_run_dir,
        read_setting,
        resolved_device,
        restore_previous_study,
        setting_of,
        write_setting,
    )
    from tformer.model.transformer import check_fits
    from tformer.train.run_dir import outermost_missing

    module = importlib.import_module(STUDIES[args.study])
    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty: give a directory (without --out: runs/experiments/<study>)")
    out = Path(args.out or f"runs/experiments/{args.study}{'-quick' if args.quick else ''}")
    if args.report_only and args.resume:
        raise ValueError("give --report-only or --resume, not both")
    warn_oversubscribed("experiment", args.threads)
    if args.report_only or args.resume:
        option = "--report-only" if args.report_only else "--resume"
        given = [f for f in (*OVERRIDES, "depths", "arch") if getattr(args, f, None) is not None]
        given += ["threads"] if args.report_only and args.threads is not None else []
        if given or args.overwrite:  # --quick stays: it names the default --out of a quick run
            flags = [f"--{f.replace('_', '-')}" for f in given] + ["--overwrite"] * args.overwrite
            does = (
                "rebuilds the report from the run's logs"
                if args.report_only
                else "goes on with the run's own settings"
            )
            raise ValueError(
                f"{option} {does}; {', '.join(flags)} would change nothing (to train with other settings, "
                f"run without {option}" + (" into another --out)" if args.resume else ")")
            )
        saved = read_setting(out)
        if saved["study"] != args.study:
            raise ValueError(f"{out} holds a {saved['study']} run, not {args.study}")
        if args.quick and saved["mode"] != "quick":  # --quick had been dropped without a word
            raise ValueError(
                f"{out} holds a full {args.study} study, not a quick one; {option} goes on with the run's own "
                f"settings: drop --quick"
            )
    if args.resume:
        setting = setting_of(out, type(module.FULL))
        done = finished_arms(out, setting.steps)
        left = [arm.name for arm in module.make_arms(setting) if arm.name not in done]
        if left:
            warn_if_computed_otherwise(saved, args.threads, len(left))
            t0 = time.perf_counter()
            with torch_threads(args.threads), resume_said(args, out):
                module.run(setting, out)
            print(f"trained in {time.perf_counter() - t0:.1f} s")
        else:  # a finished study: its report is made again from the logs, as --report-only would
            print("every arm had finished: nothing to train")
    elif not args.report_only:
        with flags_named(args):
            setting = resolved_device(resolve_setting(args, module))
            resolve_device(setting.device)  # checked before anything is written: a device this machine lacks,
            for arm in module.make_arms(setting):  # an arm's model or optimizer setting out of range,
                check_fits(arm.model)  # a model larger than the machine (the arms before it would train)
        created = outermost_missing(out)
        out = prepare_run_dir(out, args.overwrite)
        write_setting(out, args.study, "quick" if args.quick else "full", setting, args.threads)
        t0 = time.perf_counter()
        try:
            with torch_threads(args.threads), flags_named(args):
                module.run(setting, out)
        except BaseException as err:  # failed or stopped before an arm finished (data, batch size): a
            # study that --overwrite moved aside comes back (interrupted too); else a failed run leaves
            # nothing behind (an interrupted one stays, for --resume)
            early = not any((out / "arms").glob(f"*/{DONE}"))  # no arm finished: nothing to resume
            if not early and (out / PREVIOUS).is_dir():  # the new study is resumable: say where the old is
                print(
                    f"tformer experiment: the study this --overwrite replaces is kept in {out / PREVIOUS} until "
                    "this one has its report (--resume continues this one; another --overwrite deletes it)",
                    file=sys.stderr,
                )
            restored = early and restore_previous_study(out)
            if not isinstance(err, Exception) and not restored:  # stopped (Ctrl-C, SIGTERM): it stays
                say_resume(args, out)
            if early and not restored and isinstance(err, Exception):
                if created is not None:
                    shutil.rmtree(created, ignore_errors=True)
                else:  # a directory of the user's: what the study wrote in it (no study was there before)
                    for path in _study_files(out):
                        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(
                            missing_ok=True
                        )
            raise
        print(f"trained in {time.perf_counter() - t0:.1f} s")
    saved = setting_of(out, type(module.FULL))
    check_complete(out, module.make_arms(saved), saved.steps)
    report, summary = module.report(out)
    md, page = report.write(out)
    drop_previous_study(out)  # a study --overwrite replaced: this one is whole now
    print(summary)
    print(f"report: {md} and {page}")
    return 0
