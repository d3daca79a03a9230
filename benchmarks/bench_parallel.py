"""Tensor parallelism with and without sequence parallelism: activation memory and step time per rank.

Run under torchrun (each rank one thread: 2 ranks fill a 2-core machine):

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_parallel.py            # ~3 minutes here
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_parallel.py --quick    # smoke check

Every variant is the same dense Pre-Norm RoPE SwiGLU decoder LM (`llama_like`, the shape of
bench_lm.py's dense model unless --quick), built from one seed and split over all ranks as one
tensor-parallel group (`parallel.tensor=W`), its LM head split by vocabulary and the loss computed
from the split logits inside the trainer's micro-batch context, as `tformer train` does; the second
adds `parallel.sequence=true`; the third is the second with the sublayers' gathered inputs kept whole
for backward (`sequence.KEEP_GATHERED`, as before 2026-12-01 afternoon; by default each rank keeps its
positions and gathers them again in backward); the fourth computes the loss from whole logits (the head's output
all-gathered, as outside a training step and as the trainer did before 2026-12-01 afternoon); the
fifth leaves the head whole on every rank (the plan without its "vocab" style), as it was before the
head was split. With --moe the model is bench_lm.py's DeepSeekMoE LM, and the variants are tensor
parallelism with every rank computing its slice of each expert's width and of the shared experts (as
`tformer train` runs it) and with every rank computing the experts and shared experts whole (as before
2026-12-01 afternoon). The loss is the trainer's `cross_entropy_sum` with label smoothing 0.1, over the
target count. Measured on each rank, in one process group, round-robin (harness.py):

  saved bytes   what one forward and its loss keep for backward on this rank (`saved_tensors_hooks`; a
                DTensor counts its local piece), split into parameters and everything else (activations)
  step time     forward, loss, backward, AdamW, zero_grad; paired median ratio to plain TP

The first loss of every variant is printed: they compute the same model. Time over gloo on a CPU says
little about NCCL on GPUs; the activation bytes are what sequence parallelism is for and carry over.
The load line counts this job's other ranks as foreign CPU (2 ranks on 2 cores: ~50%).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import LoadMeter, print_table, round_robin, setup, summarize, write_json  # noqa: E402

from tformer.config import MoEConfig  # noqa: E402
from tformer.distributed import expert_width, sequence  # noqa: E402
from tformer.distributed.env import init_distributed  # noqa: E402
from tformer.distributed.expert_width import whole_experts_reason  # noqa: E402
from tformer.distributed.parallelize import parallelize  # noqa: E402
from tformer.distributed.plans import make_plan  # noqa: E402
from tformer.model import build_model  # noqa: E402
from tformer.presets import llama_like  # noqa: E402
from tformer.tasks.losses import cross_entropy_sum  # noqa: E402
from tformer.train.config import OptimConfig, ParallelConfig  # noqa: E402
from tformer.train.optim import make_optimizer  # noqa: E402

FULL = dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, d_ff=1376, batch=8, seq=256, rounds=5)
# bench_lm.py's DeepSeekMoE LM (--moe): first layer dense, then 64 experts of 344, top-6, 2 shared
MOE = MoEConfig(n_experts=64, top_k=6, d_expert=344, n_shared=2, first_dense=1, score_func="sigmoid",
                norm_topk=True, routed_scaling=1.0, aux_loss_coef=0.0)  # fmt: skip
QUICK = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, batch=2, seq=32, rounds=2)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


SMOOTHING = 0.1


def loss(model, ids, targets):
    total, count = cross_entropy_sum(model(ids), targets, SMOOTHING)
    return total / count


def saved_bytes(model, ids, targets, context) -> dict[str, int]:
    """Bytes one forward and its loss keep alive for backward on this rank: the storages of the saved
    tensors, each counted once (q/k/v save one input), split into parameters and the rest."""
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = {"parameters": 0, "activations": 0}

    def pack(t):
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total["parameters" if storage.data_ptr() in params else "activations"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        loss(model, ids, targets)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, a smoke check")
    p.add_argument("--moe", action="store_true", help="the DeepSeekMoE LM: experts split by width vs whole")
    args = p.parse_args()
    if "RANK" not in os.environ:
        sys.exit("run under torchrun: torchrun --standalone --nproc_per_node 2 benchmarks/bench_parallel.py")
    setup(threads=1)
    s = QUICK if args.quick else FULL
    env = init_distributed(ParallelConfig(), "cpu")
    world, rank = env.world_size, env.rank
    cfg = llama_like(
        s["vocab_size"], s["d_model"], s["n_layers"], s["n_heads"], d_ff=s["d_ff"], max_seq_len=s["seq"]
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab_size"], (s["batch"], s["seq"] + 1), generator=g)
    ids, targets = ids[:, :-1], ids[:, 1:]
    steps, memory, first_loss = {}, {}, {}
    plain = make_plan(ParallelConfig(tensor=world), world)
    whole_head = replace(plain, tp_styles=tuple(s for s in plain.tp_styles if s[1] != "vocab"))
    sp = make_plan(ParallelConfig(tensor=world, sequence=True), world)
    variants = {  # name: (plan, the loss reads split logits, sequence.KEEP_GATHERED, experts split by width)
        "tensor parallel": (plain, True, False, True),
        "+ sequence parallel": (sp, True, False, True),
        "SP, gathered inputs kept": (sp, True, True, True),
        "TP, loss from whole logits": (plain, False, False, True),
        "TP, head not split": (whole_head, False, False, True),
    }
    if args.moe:
        cfg = cfg.replace(moe=MOE)
        shared_whole = replace(plain, tp_styles=tuple(s for s in plain.tp_styles if ".shared" not in s[0]))
        variants = {"TP, experts split by width": (plain, True, False, True),
                    "TP, experts and shared whole": (shared_whole, True, False, False)}  # fmt: skip
    for name, (plan, split, keep, by_width) in variants.items():
        torch.manual_seed(0)
        model = build_model(cfg)
        sequence.KEEP_GATHERED = keep
        if not by_width:  # the experts whole on every rank, as before they were split
            expert_width.whole_experts_reason = lambda layer, degree: "benchmarked whole"
        par = parallelize(model, plan, env, torch.device("cpu"))
        sequence.KEEP_GATHERED, expert_width.whole_experts_reason = False, whole_experts_reason
        optimizer = par.adapt_optimizer(make_optimizer(model, OptimConfig(fused=False)))
        # the trainer's micro-batch context: a vocabulary-split head keeps its logits split within
        context = partial(par.comm.micro_batch, par.model, True) if split else contextlib.nullcontext
        memory[name] = saved_bytes(par.model, ids, targets, context)
        with torch.no_grad(), context():
            first_loss[name] = float(loss(par.model, ids, targets))

        def step(model=par.model, optimizer=optimizer, context=context) -> None:
            with context():
                loss(model, ids, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
    with LoadMeter() as load:
        times = round_robin(steps, s["rounds"], progress=rank == 0)
    rows = summarize(times, next(iter(variants)), s["batch"] * s["seq"])
    table = []
    for name, row in rows.items():
        mib = {k: v / 2**20 for k, v in memory[name].items()}
        table.append({**row.as_dict(), "activations_mib": mib["activations"], "parameters_mib": mib["parameters"],
                      "first_loss": first_loss[name]})  # fmt: skip
    base = table[0]["activations_mib"]
    for r in table:
        r["activations_vs_tp"] = r["activations_mib"] / base
    if rank == 0:
        shape = f"d_model {s['d_model']}, {s['n_layers']} layers, batch {s['batch']} x {s['seq']}"
        print_table(
            f"tensor parallel over {world} ranks (gloo, 1 thread each), {shape}; per rank:",
            table,
            [("name", "variant", "s"), ("best_s", "best s", ".3f"), ("median_s", "median s", ".3f"),
             ("speedup_paired_median", "x TP (paired)", ".3f"), ("activations_mib", "saved activations MiB", ".1f"),
             ("activations_vs_tp", "x TP", ".3f"), ("parameters_mib", "saved params MiB", ".1f"),
             ("first_loss", "first loss", ".6f")],
        )  # fmt: skip
        print(load.line(), f"(the machine's other {world - 1} rank(s) of this job count as foreign CPU)")
        out = "parallel_moe" if args.moe else "parallel"
        write_json(f"{out}_quick.json" if args.quick else f"{out}.json",
                   {"shape": s, "world_size": world, "rows": table, "times_s": times, "load": load.result})  # fmt: skip
    dist.barrier()
    env.shutdown()


if __name__ == "__main__":
    main()
