"""`tformer generate`: sample text from a trained decoder, streaming to stdout."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tformer.cli.options import (
    input_lines,
    input_name,
    load_run_arg,
    named_as_flags,
    read_input_file,
    utf8_text,
    warn,
)
from tformer.generate.engine import check_prompts, generate, truncate_at_stop, truncate_prompts
from tformer.generate.sampling import SamplingConfig

DEFAULT_NEW_TOKENS = 200  # without --max-new-tokens: this many, or what the context leaves after the prompts


def newlines(text: str) -> str:
    """A prompt or stop string as typed on one line: \\n is a newline, \\\\ one backslash (so \\\\n is a
    backslash then n); any other backslash stays as it is."""
    return re.sub(r"\\(\\|n)", lambda m: "\n" if m.group(1) == "n" else "\\", text)


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    """The sampling options; without --max-new-tokens, DEFAULT_NEW_TOKENS (`run` fits it to the context)."""
    with named_as_flags("SamplingConfig", {"stop_strings": "--stop"}):
        return _sampling_config(args)


# the sampling options and their defaults when not given (None in argparse, to tell "given" apart)
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 50, "top_p": 1.0, "seed": 0}


def _sampling_config(args: argparse.Namespace) -> SamplingConfig:
    given = [name for name in SAMPLING_DEFAULTS if getattr(args, name) is not None]
    if args.temperature == 0:  # greedy as a temperature: what --greedy means
        given.remove("temperature")
    value = {name: SAMPLING_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
             for name in SAMPLING_DEFAULTS}  # fmt: skip
    cfg = SamplingConfig(  # every value given is checked, one --greedy ignores too: an error, not a warning
        temperature=value["temperature"],
        top_k=value["top_k"],
        top_p=value["top_p"],
        repetition_penalty=args.repetition_penalty,
        # without --max-new-tokens the budget is at least --min-new-tokens (`run` fits it to the context)
        max_new_tokens=max(DEFAULT_NEW_TOKENS, args.min_new_tokens)
        if args.max_new_tokens is None
        else args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        seed=value["seed"],
        stop_strings=tuple(newlines(utf8_text(s, "--stop")) for s in args.stop),  # "\n" as in prompts
    )
    if not args.greedy:
        return cfg
    if given:  # valid, but they change nothing: greedy draws nothing (scripts may pass them anyway)
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        verb = "applies" if len(given) == 1 else "apply"
        warn("generate", f"{flags} {verb} to sampling only: ignored with --greedy")
    return cfg.replace(temperature=0.0)


def read_prompts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The prompts, and how messages name each: "the prompt", or its line of the prompts file (empty
    lines are skipped with a warning, so the n-th prompt need not be on line n)."""
    if args.prompts_file is not None:
        if args.prompt is not None:
            raise ValueError("give --prompt or --prompts-file, not both")
        path = Path(args.prompts_file)
        prompts, names, where = [], [], input_name(path)
        for number, line in enumerate(input_lines(read_input_file(path)), 1):
            if line.strip():
                prompts.append(newlines(line))
                names.append(f"the prompt on line {number} of {where}")
            else:
                warn("generate", f"{where}: line {number} is empty: skipped")
        if not prompts:
            raise ValueError(f"prompts file {where} holds no non-empty line")
        return prompts, names
    if args.prompt is None:
        raise ValueError("no prompt: give --prompt TEXT or --prompts-file FILE")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give --prompt TEXT (or --prompts-file FILE)")
    return [newlines(utf8_text(args.prompt, "--prompt"))], ["the prompt"]


def _named(message: str, names: list[str]) -> str:
    """check_prompts' message with its prompt ("prompt 3", the API's index, or "the prompt") named as the
    command line names it (`read_prompts`)."""
    m = re.match(r"(?:the prompt|prompt (\d+))\b(.*)", message, re.S)
    return message if m is None else names[int(m.group(1) or 0)] + m.group(2)


class TextStream:
    """Writes generated text as its tokens arrive. A character whose UTF-8 bytes span several byte-level
    tokens decodes to U+FFFD until its last byte arrives, so text ending in U+FFFD waits for the next
    token (`finish` writes whatever is left). With stop strings, text that could be the start of one
    waits until it is known not to be, and nothing from a stop string on is written."""

    def __init__(self, decode, out, stops: tuple[str, ...] = ()) -> None:
        self.decode, self.out, self.stops = decode, out, stops
        self.tokens: list[int] = []
        self.written = 0  # characters of decode(tokens) already written

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self._flush(final=False)

    def finish(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.decode(self.tokens)
        if text.endswith("\ufffd") and not final:
            return
        end = len(truncate_at_stop(text, self.stops))
        if end == len(text) and not final:  # no stop string yet: hold back a tail that may begin one
            end -= max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        if end > self.written:
            self.out.write(text[self.written : end])
            self.out.flush()
            self.written = end


def run(args: argparse.Namespace) -> int:
    from tformer.runs import require_task

    samples = args.num_samples
    if samples > 1 and (args.greedy or args.temperature == 0):  # (before sampling_from_args warns of the
        # options greedy decoding ignores)
        raise ValueError(
            f"--num-samples {samples} with greedy decoding would print the same text {samples} times"
        )
    sampling = sampling_from_args(args)
    prompts, names = read_prompts(args)
    run_ = load_run_arg(args, "generate")
    require_task(run_, "lm", "language-model")
    tok = run_.tokenizer
    encoded = [tok.encode(p) for p in prompts]
    context = run_.model.cfg.max_seq_len
    if args.max_new_tokens is None:  # the default: as many as the context leaves, up to DEFAULT_NEW_TOKENS
        room = context - max(len(ids) for ids in encoded)
        if args.truncate_prompt:  # a prompt cut to fit keeps at least half the context for new tokens
            room = max(room, context // 2)  # (and less of itself for --min-new-tokens: cut below)
        elif 0 < room < sampling.min_new_tokens:  # (no room at all: the prompt is named below)
            raise ValueError(
                f"--min-new-tokens {sampling.min_new_tokens} does not fit: the model's context of {context} "
                f"tokens leaves {room} after the prompt"
            )
        new = min(DEFAULT_NEW_TOKENS, max(1, room))
        sampling = sampling.replace(max_new_tokens=max(new, sampling.min_new_tokens))
    if args.truncate_prompt:
        try:
            encoded, cut = truncate_prompts(encoded, sampling.max_new_tokens, context)
        except ValueError as err:  # named as the option the user typed (without --max-new-tokens, the
            # count comes from --min-new-tokens)
            flag = "--max-new-tokens" if args.max_new_tokens is not None else "--min-new-tokens"
            raise ValueError(str(err).replace("max_new_tokens=", f"{flag} ")) from None
        for i in cut:
            print(
                f"tformer generate: warning: {names[i]} is longer than the context allows "
                f"({context} tokens with {sampling.max_new_tokens} new tokens): only its last "
                f"{len(encoded[i])} tokens are used",
                file=sys.stderr,
            )
    stream = args.stream and len(prompts) == 1 and samples == 1
    streamed = TextStream(tok.decode, sys.stdout, sampling.stop_strings)

    def on_step(ids) -> None:
        if int(ids[0]) >= 0 and int(ids[0]) != tok.eos_id:
            streamed.add(int(ids[0]))

    try:  # before printing anything; named as the options the user typed
        check_prompts(encoded, sampling.max_new_tokens, context)
    except ValueError as err:
        message = _named(str(err), names)
        if args.max_new_tokens is None:  # the number the default chose is not the user's
            message = re.sub(r" with max_new_tokens=\d+", "", message)
        message = message.replace("max_new_tokens=", "--max-new-tokens ").replace(
            "lower max_new_tokens", "lower --max-new-tokens"
        )
        if "context" in message:
            message += " (or pass --truncate-prompt to keep a prompt's last tokens)"
        raise ValueError(message) from None
    import torch

    from tformer.model.compiled_step import why_not_compiled

    with torch.no_grad():  # as generate asks (grad mode is one of the reasons it checks)
        compiles = args.compile and why_not_compiled(run_.model) is None
    if compiles:  # the first step waits for the compiler: say so rather than seem stuck (a model it cannot
        # compile decodes eagerly, with generate's own warning)
        print(
            "tformer generate: compiling the decoding step with torch.compile (~35-40 s the first time on 2 "
            "CPU cores, a few s when torch's on-disk cache holds it)",
            file=sys.stderr,
            flush=True,
        )
    if stream:
        sys.stdout.write(prompts[0])
    outputs = generate(
        run_.model,
        [ids for ids in encoded for _ in range(samples)],  # a prompt's samples: rows of one batch, one stream
        sampling,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        decode=tok.decode,
        on_step=on_step if stream else None,
        compile=args.compile,
    )
    if stream:
        streamed.finish()
        sys.stdout.write("\n")
        return 0
    for row, ids in enumerate(outputs):
        i, j = divmod(row, samples)
        text = truncate_at_stop(tok.decode(ids), sampling.stop_strings)
        where = [f"prompt {i + 1} of {len(prompts)}"] * (len(prompts) > 1)
        where += [f"sample {j + 1} of {samples}"] * (samples > 1)
        if where:
            print(f"--- {', '.join(where)} ---")
        print(prompts[i] + text)
    return 0
