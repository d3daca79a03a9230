"""`tformer eval`: loss, perplexity and bits per character of a trained LM on a split or a text file;
translation and classification runs are scored by their task module (`evaluate_run`, `format_result`)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tformer.cli.options import input_lines, input_name, load_run_arg, read_input_file, warn
from tformer.data.datasets import PackedLMDataset
from tformer.model.checks import check_finite_scores

LM_MAX_BATCHES = 1000  # a language model's split sampled by default (batches of windows)


def run(args: argparse.Namespace) -> int:
    from tformer.tasks.lm import evaluate_lm

    given = [flag for flag, value in (("--split", args.split), ("--text-file", args.text_file),
                                      ("--pairs-file", args.pairs_file), ("--labelled-file", args.labelled_file))
             if value is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(
            f"give one of --split, --text-file, --pairs-file and --labelled-file, not {' and '.join(given)}"
        )
    args.split = args.split or "test"
    # read before the model loads: (source, reference) or (label, text) pairs
    if args.pairs_file is not None:
        items = read_tab_file(args.pairs_file, "source<TAB>reference pair", split_at_every_tab=True)
    elif args.labelled_file is not None:
        items = read_tab_file(args.labelled_file, "label<TAB>text line", split_at_every_tab=False)
    else:
        items = None
    run_ = load_run_arg(args, "eval")
    cfg = run_.train_config
    if cfg.task != "lm":
        return run_task_eval(run_, args, items)
    if items is not None:
        flag = given[0]
        raise ValueError(
            f"{flag} is for {FILE_TASKS[flag]} runs; this is an lm run (--text-file scores a text)"
        )
    if args.text_file is not None:
        path = Path(args.text_file)
        text = read_input_file(path)
        path = input_name(path)
        if not text.strip():
            raise ValueError(f"text file {path} is empty")
        stream = len(run_.tokenizer.encode(text)) + 1  # the tokens and the EOS after them
        seq_len = min(cfg.data.seq_len, stream - 1)
        if seq_len < cfg.data.seq_len:  # shorter than one training window: one shorter window
            warn("eval", f"{path} holds {stream} tokens with its EOS, fewer than one window of the run's "
                 f"data.seq_len + 1 = {cfg.data.seq_len + 1}: scored as one window of {seq_len} predictions "
                 "(less context than the splits' windows, so not comparable with them)")  # fmt: skip
        # every prediction of the text scored: its tail after the last whole window too
        ds = PackedLMDataset.from_texts(run_.tokenizer, [text], seq_len, f"text file {path}", score_tail=True)
        chars, what = len(text) + 1, str(path)
    else:
        from tformer.tasks.corpus import joins_pieces, load_task_corpus, warn_if_split_changed
        from tformer.tasks.translation import run_dir_of

        corpus = load_task_corpus(cfg.data, "lm")
        warn_if_split_changed(run_dir_of(run_.checkpoint), corpus, args.split)
        # the train split as the run trained on it: data.max_train_docs's documents (it had scored them all)
        limit = cfg.data.max_train_docs if args.split == "train" else None
        texts = corpus.lm_texts(args.split, limit, join=joins_pieces(run_dir_of(run_.checkpoint), corpus))
        name = f"the {args.split} split of {cfg.data.corpus!r}"
        ds = PackedLMDataset.from_texts(run_.tokenizer, texts, cfg.data.seq_len, name)
        chars, what = sum(len(t) + 1 for t in texts), f"{cfg.data.corpus} {args.split} split"
    device = next(run_.model.parameters()).device  # --device
    if args.max_batches is not None:
        max_batches = args.max_batches
    else:  # a text file: every prediction; a split: a sample of LM_MAX_BATCHES batches
        max_batches = None if args.text_file is not None else LM_MAX_BATCHES
    result = evaluate_lm(run_.model, ds, chars, cfg.batch_size, max_batches, device, cfg.fused_loss)
    result = {
        "data": what,
        "checkpoint_step": run_.step,
        "averaged_steps": list(run_.averaged_steps),
        **result,
    }
    check_finite_scores(result)
    if args.json:
        print(json.dumps(result))
    else:
        part = ""
        if result["windows_scored"] < result["windows"]:  # --max-batches took a sample
            part = f" | {result['windows_scored']} of its {result['windows']} windows (--max-batches)"
        print(
            f"{what} ({run_.weights_words()}): loss {result['eval_loss']:.4f} nats/token | perplexity "
            f"{result['perplexity']:.2f} | {result['bits_per_char']:.3f} bits/char | "
            f"{result['predictions']:,} prediction{'s' if result['predictions'] != 1 else ''}{part}"
        )
    return 0


FILE_TASKS = {"--pairs-file": "translation", "--labelled-file": "classification"}


def run_task_eval(run_, args: argparse.Namespace, items: list[tuple[str, str]] | None) -> int:
    """Translation and classification runs: their task module's evaluate_run / format_result (on the
    --pairs-file's or --labelled-file's `items`: evaluate_pairs / evaluate_labelled)."""
    import importlib

    task = run_.train_config.task
    if args.text_file is not None:
        raise ValueError(f"--text-file is for language-model runs; this is a {task} run")
    flag = "--pairs-file" if args.pairs_file is not None else "--labelled-file"
    if items is not None and task != FILE_TASKS[flag]:
        raise ValueError(f"{flag} is for {FILE_TASKS[flag]} runs; this is a {task} run")
    module = importlib.import_module(f"tformer.tasks.{task}")
    if items is not None:
        path = Path(args.pairs_file or args.labelled_file)
        name = input_name(path)
        from tformer.runs import path_digest

        # a file's outputs carry a digest of its path: same-named files in two folders keep theirs apart
        # (its name cut to 96 bytes: the output names stay well under the file system's 255)
        plain = re.sub(r"[/\\\0]", "_", path.stem).encode("utf-8", "surrogateescape")[:96]
        plain = plain.decode("utf-8", "ignore") or "file"
        device = str(path.expanduser().absolute()).startswith(("/dev/", "/proc/"))  # /dev/stdin, /dev/fd/N
        digest = path_digest(path.expanduser(), resolve=not device)  # (resolved, a new pipe every time)
        stem = "stdin" if name == "stdin" else f"{plain}-{digest}"
        score = module.evaluate_pairs if task == "translation" else module.evaluate_labelled
        result = score(run_, items, stem, max_batches=args.max_batches)
        result["data"] = f"{'pairs' if task == 'translation' else 'labelled'} file {name}"
    else:
        result = module.evaluate_run(run_, args.split, max_batches=args.max_batches)
    check_finite_scores(result)
    print(json.dumps(result) if args.json else module.format_result(result))
    return 0


def read_tab_file(path: str | Path, what: str, split_at_every_tab: bool) -> list[tuple[str, str]]:
    """A test set of the user's, two fields a line: `source<TAB>reference` pairs (exactly one tab), or
    `label<TAB>text` lines (split at the first tab: a text may hold more). Empty lines are skipped; any
    other line without a tab where one is needed, or with an empty field, is an error naming it."""
    from tformer.data.corpus_base import is_blank

    path = Path(path).expanduser()
    items = []
    for number, line in enumerate(input_lines(read_input_file(path)), 1):
        if is_blank(line) and "\t" not in line:  # (a tab alone holds two empty fields)
            continue
        sides = line.split("\t") if split_at_every_tab else line.split("\t", 1)
        if len(sides) != 2 or is_blank(sides[0]) or is_blank(sides[1]):
            found = f"{len(sides) - 1} tabs" if len(sides) != 2 else "an empty side"
            raise ValueError(
                f"{input_name(path)} line {number}: expected one {what}, found {found}: {line[:60]!r}"
            )
        items.append((sides[0], sides[1]))
    if not items:
        raise ValueError(f"{input_name(path)} holds no {what}")
    return items
