"""Activation checkpointing's trade on CPU: the bytes of tensors a training step keeps for its backward
and the step's time, with every block recomputed in the backward (`activation_checkpointing: true`,
tformer.model.recompute) against the model as built, on bench_lm.py's dense model (Pre-Norm, RoPE,
SwiGLU; d_model 512, 8 layers, 8 heads, FFN 1376, vocab 8192, batch 8 x 256, fp32).

The bytes are the activations autograd keeps for the backward (tformer.model.stats.activation_bytes: a
saved-tensors hook sees every tensor saved; each storage counted once, the parameters left out).
The times are a round-robin of the two in one process (harness.py): best time and the paired median
ratio.

    PYTHONPATH=src python benchmarks/bench_recompute.py   # ~1 minute, writes results/recompute.json
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import LoadMeter, print_table, round_robin, setup, summarize, write_json  # noqa: E402

from tformer import build_model, get_preset  # noqa: E402
from tformer.model.recompute import checkpoint_blocks  # noqa: E402
from tformer.model.stats import activation_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    setup()
    cfg = get_preset("llama-like").replace(
        d_model=512, n_layers=8, n_heads=8, d_ff=1376, vocab_size=8192, max_seq_len=256, dropout=0.0
    )
    built = build_model(cfg)
    recomputed = copy.deepcopy(built)
    checkpoint_blocks(recomputed)
    tokens = torch.randint(0, cfg.vocab_size, (8, 256))

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())

    def step(model: torch.nn.Module) -> None:
        loss(model).backward()
        model.zero_grad(set_to_none=True)

    # counted once, apart from the timed steps (the counting hook runs Python at every saved tensor)
    saved = {name: activation_bytes(m, lambda m=m: loss(m)) for name, m in (("as built", built),
                                                                           ("blocks recomputed", recomputed))}  # fmt: skip
    for m in (built, recomputed):
        m.zero_grad(set_to_none=True)
    with LoadMeter() as load:
        times = round_robin({"as built": lambda: step(built), "blocks recomputed": lambda: step(recomputed)},
                            args.rounds)  # fmt: skip
    rows = []
    for name, row in summarize(times, "as built", tokens.numel()).items():
        rows.append({**row.as_dict(), "saved_mib": round(saved[name] / 2**20, 1)})
    print_table(
        f"training step, {tokens.shape[0]} x {tokens.shape[1]} tokens, fp32, {args.rounds} rounds",
        rows,
        [
            ("name", "variant", "s"),
            ("saved_mib", "kept for backward (MiB)", ".1f"),
            ("best_s", "best s", ".3f"),
            ("speedup_paired_median", "speed vs as built (paired)", ".3f"),
        ],  # fmt: skip
    )
    print(load.line())
    write_json("recompute.json", {"rows": rows, "load": load.result, "rounds": args.rounds})


if __name__ == "__main__":
    main()
