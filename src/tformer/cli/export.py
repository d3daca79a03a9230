"""`tformer export`: a trained decoder LM as a Hugging Face `transformers` model directory (config,
safetensors weights, tokenizer), checked logit for logit against the run before it is written."""

from __future__ import annotations

import argparse

from tformer.cli.options import load_run_arg


def run(args: argparse.Namespace) -> int:
    from tformer.export import _transformers, check_out, export_hf

    check_out(args.out)  # a missing package or a taken --out is named before the run is loaded
    _transformers()
    run_ = load_run_arg(args, "export")
    done = export_hf(run_, args.out, dtype=args.dtype)
    saved = (
        f"; saved in {args.dtype}, reloaded it is within {done.saved_logit_diff:.1e} of them (its rounding)"
        if args.dtype != "float32"
        else ""
    )
    print(
        f"exported {run_.weights_words()} as {done.architecture} ({done.parameters:,} parameters) to "
        f"{done.path}; in float32 its logits equal the run's to {done.max_logit_diff:.1e}{saved}\n"
        f"load it with transformers.AutoModelForCausalLM.from_pretrained({str(done.path)!r}) and "
        f"AutoTokenizer.from_pretrained(...)"
    )
    return 0
