"""Activation checkpointing's trade on CPU: the bytes of activations a training step keeps for its backward
and the step's time, for the model as built, `activation_checkpointing: selective` (each block keeps its
products' and attention's outputs and recomputes the rest in the backward) and `full` (each block keeps
its input and recomputes everything), tformer.model.recompute. Models: bench_lm.py's dense one (Pre-Norm,
RoPE, SwiGLU; d_model 512, 8 layers, 8 heads, FFN 1376, vocab 8192, batch 8 x 256, fp32), and with
`--moe` its DeepSeekMoE one (64 routed experts of width 344, top-6, 2 shared, the first layer dense).

The bytes are tformer.model.stats.activation_bytes: every tensor autograd saves for the backward and
every storage the forward made that is still alive when it returns (what selective checkpointing keeps
lives there), each storage once, the parameters left out; counted once per variant, apart from the
timed steps. The times are a round-robin of the variants in one process (harness.py): best time and the
paired median ratio to the model as built.

    PYTHONPATH=src python benchmarks/bench_recompute.py   # ~2 minutes, writes results/recompute.json
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lm import FULL, MOE, MOE_QUICK, QUICK, tformer_dense, tformer_moe  # noqa: E402
from harness import LoadMeter, print_table, round_robin, setup, summarize, write_json  # noqa: E402

from tformer.model.recompute import checkpoint_blocks  # noqa: E402
from tformer.model.stats import activation_bytes  # noqa: E402

VARIANTS = {"as built": None, "selective": "selective", "full": "full"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--moe", action="store_true", help="bench_lm.py's DeepSeekMoE model instead of the dense"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file name under benchmarks/results/")
    args = parser.parse_args()
    setup(args.threads)
    s = dict(QUICK if args.quick else FULL)
    rounds = 2 if args.quick else args.rounds
    torch.manual_seed(0)
    built = tformer_moe(s, MOE_QUICK if args.quick else MOE) if args.moe else tformer_dense(s)
    models = {}
    for name, mode in VARIANTS.items():
        models[name] = copy.deepcopy(built)
        if mode is not None:
            checkpoint_blocks(models[name], mode)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())

    def step(model: torch.nn.Module) -> None:
        loss(model).backward()
        model.zero_grad(set_to_none=True)

    saved = {}  # counted once, apart from the timed steps (the counting hooks run Python at every op)
    for name, model in models.items():
        saved[name] = activation_bytes(model, lambda model=model: loss(model))
        model.zero_grad(set_to_none=True)
    with LoadMeter() as load:
        times = round_robin({name: (lambda m=m: step(m)) for name, m in models.items()}, rounds)
    rows = []
    for name, row in summarize(times, "as built", tokens.numel()).items():
        rows.append({**row.as_dict(), "saved_mib": round(saved[name] / 2**20, 1),
                     "saved_vs_built": round(saved[name] / saved["as built"], 3)})  # fmt: skip
    model_name = "DeepSeekMoE" if args.moe else "dense"
    print_table(
        f"{model_name} training step, {tokens.shape[0]} x {tokens.shape[1]} tokens, fp32, {rounds} rounds",
        rows,
        [
            ("name", "variant", "s"),
            ("saved_mib", "kept for backward (MiB)", ".1f"),
            ("saved_vs_built", "x as built", ".3f"),
            ("best_s", "best s", ".3f"),
            ("speedup_paired_median", "speed vs as built (paired)", ".3f"),
        ],  # fmt: skip
    )
    print(load.line())
    out = args.out or (
        "recompute_quick.json" if args.quick else f"recompute{'_moe' if args.moe else ''}.json"
    )
    write_json(out, {"model": model_name, "config": s, "rows": rows, "load": load.result, "rounds": rounds})


if __name__ == "__main__":
    main()
