"""One rank of a distributed test: `torchrun --standalone --nproc_per_node 2 worker.py SCENARIO OUT_DIR`.

Each scenario runs several checks and writes `OUT_DIR/<scenario>.rank<r>.json`; the pytest side
(test_distributed.py) asserts on the files. Scenarios:
  parity   DDP, FSDP2, EP+DDP, EP+FSDP2 gradients and two full steps vs a single-process reference
           on the union of the ranks' batches; the EP layer alone vs the full MoE (zero sends and
           experts without tokens); an expert without tokens on one rank (DDP, FSDP2); a NaN loss
           on one rank (every rank skips); the MoE bias update and routing statistics are global;
           FSDP2 bf16 mixed precision; gradient accumulation (DDP reduces once per step)
  resume1  Trainer runs to step 8, saving at 4 and 8 while training goes on (DDP dense, sync save;
           EP+FSDP2 MoE with dropout, bias updates, async save); a 1-process DCP checkpoint
           resumed by 2 ranks (1 -> 2)
  resume2  the step-4 saves resumed in new processes and a new process group, to step 8; a 2-rank
           checkpoint and its full state left for the 1-process load on the pytest side (2 -> 1)
  resume3  (3 ranks) a 2-rank DDP save and a 2-rank tensor-parallel one opened by 3 DDP ranks: which
           RNG stream each rank restores, the loader position rescaled
  tensor, tensor2d  tensor (and sequence) parallelism vs one process (worker_tensor.py)
"""

from __future__ import annotations

import copy
import gc
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from worker_common import B, Batch, T, full, global_batch, max_diff, moe_model_cfg, rank_part, step_args
from worker_resume import resume1, resume2, resume3
from worker_tensor import tensor, tensor2d

from tformer.distributed.env import init_distributed
from tformer.distributed.expert_parallel import apply_expert_parallel
from tformer.distributed.parallelize import global_routing_stats, parallelize
from tformer.distributed.plans import make_plan
from tformer.model import build_model
from tformer.model.moe import MoE
from tformer.tasks.lm import lm_loss_sum
from tformer.train.config import OptimConfig, ParallelConfig
from tformer.train.optim import make_optimizer
from tformer.train.step import train_step


def parity(env, out_dir: Path, out: dict) -> None:
    rank, world = env.rank, env.world_size
    cfg = moe_model_cfg()
    torch.manual_seed(0)
    ref = build_model(cfg)
    ocfg = OptimConfig(lr=1e-2, fused=False, warmup_steps=0)
    ref_opt = make_optimizer(ref, ocfg)
    ref_args = step_args(ref, ref_opt)
    batch0 = global_batch(world, 0)
    loss, n = lm_loss_sum(ref, batch0)
    (loss / n).backward()
    ref_grads = copy.deepcopy(ref)  # holds the reference gradients (deepcopy leaves .grad behind)
    for p, q in zip(ref.parameters(), ref_grads.parameters()):
        q.grad = p.grad.clone()
    ref.zero_grad(set_to_none=True)
    ref_results = []
    for step in range(2):
        ref_args[2] = [global_batch(world, step)]
        ref_results.append(train_step(*ref_args))
    for data, experts in [("ddp", "replicate"), ("fsdp", "replicate"), ("ddp", "shard"), ("fsdp", "shard")]:
        mode = f"{'ep+' if experts == 'shard' else ''}{data}"
        torch.manual_seed(0)
        model = build_model(cfg)
        plan = make_plan(ParallelConfig(data=data, experts=experts), world)
        par = parallelize(model, plan, env, torch.device("cpu"))
        sliced = set(par.rank_local)
        opt = par.adapt_optimizer(make_optimizer(model, ocfg))
        local = rank_part(batch0, rank)
        loss, _ = lm_loss_sum(par.model, local)
        (loss * world / batch0.targets.numel()).backward()
        grad_diff = max_diff(model, ref_grads, sliced, "grad")
        model.zero_grad(set_to_none=True)
        args = step_args(par.model, opt, par.comm)
        results = []
        for step in range(2):
            args[2] = [rank_part(global_batch(world, step), rank)]
            results.append(train_step(*args))
        biases = [
            float((a.router.expert_bias - b.router.expert_bias).abs().max())
            for a, b in zip(
                [m for m in model.modules() if isinstance(m, MoE)],
                [m for m in ref.modules() if isinstance(m, MoE)],
            )
        ]
        out[mode] = {
            "grad_diff": grad_diff,
            "param_diff": max_diff(model, ref, sliced, "param"),
            "loss_diff": max(abs(a.loss - b.loss) for a, b in zip(results, ref_results)),
            "grad_norm_diff": max(abs(a.grad_norm - b.grad_norm) for a, b in zip(results, ref_results)),
            "clipped": ref_results[0].grad_norm > 0.05,
            "bias_diff": max(biases),
            "bias_moved": any(
                float(m.router.expert_bias.abs().max()) > 0 for m in ref.modules() if isinstance(m, MoE)
            ),
        }
        del par, model, opt, args
        gc.collect()
    out["bf16"] = fsdp_bf16(env, cfg, ocfg, ref_results[0].loss)
    out["ep_layer"] = ep_layer(env)
    out["unused_expert"] = unused_expert(env, cfg, ocfg)
    out["nan"] = nan_agreement(env, cfg, ocfg)
    out["accumulation"] = accumulation(env, cfg, ocfg)
    out["ragged"] = ragged(env, cfg, ocfg)


# the collectives FSDP2 calls, by name across torch versions: (output, input) for each
GATHERS, SCATTERS = (
    ("all_gather_into_tensor", "all_gather_single"),
    ("reduce_scatter_tensor", "reduce_scatter_single"),
)


def recording_collectives(seen: dict[str, set]):
    """Patch torch.distributed's gather / reduce-scatter functions to record their input dtypes in
    seen["gather"] / seen["reduce"]; returns a function that undoes it."""
    saved = {}
    for kind, names in (("gather", GATHERS), ("reduce", SCATTERS)):
        for name in names:
            if hasattr(dist, name):
                saved[name] = original = getattr(dist, name)

                def wrapper(*args, _original=original, _kind=kind, **kwargs):
                    tensor = kwargs.get(
                        "input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
                    )
                    seen[_kind].add(str(tensor.dtype))
                    return _original(*args, **kwargs)

                setattr(dist, name, wrapper)
    return lambda: [setattr(dist, name, fn) for name, fn in saved.items()]


def fsdp_bf16(env, cfg, ocfg, ref_loss: float) -> dict:
    """FSDP2 mixed precision (bf16 compute, fp32 reduction and optimizer step) runs and stays close;
    C8: the parameters are all-gathered in bf16 and the gradients reduce-scattered in fp32."""
    torch.manual_seed(0)
    model = build_model(cfg)
    plan = make_plan(ParallelConfig(data="fsdp", param_dtype="bfloat16"), env.world_size)
    par = parallelize(model, plan, env, torch.device("cpu"))
    opt = make_optimizer(model, ocfg)
    args = step_args(par.model, opt, par.comm)
    args[2] = [rank_part(global_batch(env.world_size, 0), env.rank)]
    seen: dict[str, set] = {"gather": set(), "reduce": set()}
    undo = recording_collectives(seen)
    try:
        r = train_step(*args)
    finally:
        undo()
    fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    del par, model, opt, args
    return {"loss_diff": abs(r.loss - ref_loss), "finite": math.isfinite(r.grad_norm), "fp32_params": fp32,
            "collective_dtypes": {kind: sorted(dtypes) for kind, dtypes in seen.items()}}  # fmt: skip


def ep_layer(env) -> dict:
    """ExpertParallelDispatch vs the full MoE on this rank's tokens. Rank 0 routes everything to its own
    experts (sends 0 rows to rank 1); expert 3 gets no token at all."""
    rank, world = env.rank, env.world_size
    cfg = moe_model_cfg(n_experts=4, top_k=2)
    torch.manual_seed(0)
    ref = MoE(cfg, 0).train()
    with torch.no_grad():
        ref.router.expert_bias.copy_(torch.tensor([1e4, 1e4, -1e4, -1e4] if rank == 0 else [0, 0, 0, -1e4]))
    ep = copy.deepcopy(ref)
    apply_expert_parallel(ep, rank, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 6 + 3 * rank, cfg.d_model, generator=g)
    dy = torch.randn(x.shape, generator=g)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ye = ref(xr), ep(xe)
    (yr * dy).sum().backward()
    (ye * dy).sum().backward()
    worst = 0.0
    for name, p in ref.experts.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed)
        n = summed.shape[0] // world
        mine = dict(ep.experts.named_parameters())[name].grad
        worst = max(worst, float((mine - summed[rank * n : (rank + 1) * n]).abs().max()))
    expert3 = dict(ep.experts.named_parameters())["up_proj"].grad[1] if rank == 1 else torch.zeros(1)
    # evaluation under bf16 autocast without gradients, every token routed to rank 1's experts: rank 0
    # multiplies no row and rank 1 more than DECODE_MAX_ROWS, yet both send back rows of one dtype
    with torch.no_grad():
        for m in (ref, ep):
            m.router.expert_bias.copy_(torch.tensor([-1e4, -1e4, 1e4, 1e4]))
    xb = torch.randn(1, 40, cfg.d_model, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        yb_ref, yb_ep = ref.eval()(xb), ep.eval()(xb)
    # a capacity limit: each rank keeps what a single process would of its tokens, first choices first
    torch.manual_seed(1)
    capped = MoE(moe_model_cfg(n_experts=4, top_k=2, capacity_factor=0.6), 0).train()
    capped_ep = copy.deepcopy(capped)
    apply_expert_parallel(capped_ep, rank, world)
    xc = torch.randn(1, 24, cfg.d_model, generator=g)
    yc_ref, yc_ep = capped(xc), capped_ep(xc)
    return {
        "capacity_out_equal": bool(torch.equal(yc_ref, yc_ep)),
        "capacity_dropped": [int(m.last_stats["dropped"]) for m in (capped, capped_ep)],
        "eval_bf16_diff": float((yb_ref.float() - yb_ep.float()).abs().max()),
        "eval_bf16_scale": float(yb_ref.float().abs().max()),
        "out_equal": bool(torch.equal(yr, ye)),
        "out_diff": float((yr - ye).abs().max()),
        "dx_diff": float((xr.grad - xe.grad).abs().max()),
        "expert_grad_diff": worst,
        "empty_expert_grad_zero": bool((expert3 == 0).all()),
    }


def identical_across_ranks(model) -> bool:
    """Every replicated or sharded parameter is the same on all ranks (checksums of whole tensors)."""
    sums = torch.tensor([float(full(p.detach(), False).double().sum()) for p in model.parameters()])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return all(torch.equal(gathered[0], s) for s in gathered)


def unused_expert(env, cfg, ocfg) -> dict:
    """Expert 3 gets no token on rank 1 (its router bias there, set after wrapping: DDP broadcasts rank 0's
    buffers when it is built): DDP and FSDP2 steps neither crash nor hang, and the replicated weights
    stay identical across ranks. Building DDP leaves each rank's own token counters alone. The logged
    dead experts come from the counts summed over the ranks: none is dead."""
    result = {}
    for data in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = build_model(cfg)
        routers = [m.router for m in model.modules() if isinstance(m, MoE)]
        for router in routers:
            router.window_tokens.fill_(env.rank + 1)  # rank-local counts, as after a resume
        par = parallelize(
            model, make_plan(ParallelConfig(data=data), env.world_size), env, torch.device("cpu")
        )
        counters_kept = all(bool((r.window_tokens == env.rank + 1).all()) for r in routers)
        with torch.no_grad():
            for router in routers:
                router.window_tokens.zero_()
                if env.rank == 1:
                    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -1e4]))
        opt = make_optimizer(model, ocfg)
        args = step_args(par.model, opt, par.comm)
        args[2] = [rank_part(global_batch(env.world_size, 0), env.rank)]
        r = train_step(*args)
        result[data] = {
            "finite": math.isfinite(r.loss) and not r.skipped,
            "same": identical_across_ranks(model),
            "expert3_tokens": sum(int(router.window_tokens[3]) for router in routers),
            "counters_kept": counters_kept,
            # E4: dead over all ranks' tokens, not this rank's (rank 0 routed tokens to expert 3)
            "dead_experts": [v["dead_experts"] for v in global_routing_stats(model, env).values()],
        }
        del par, model, opt, args
    return result


def halves(batch: Batch) -> list[Batch]:
    return [Batch(batch.ids[i : i + 1], batch.targets[i : i + 1]) for i in range(B)]


def counting_allreduce(seen: list[int], bucket):
    """A DDP comm hook: DDP's default all-reduce, noting each bucket it reduces."""
    seen.append(bucket.index())
    return allreduce_hook(None, bucket)


def one_process(cfg, ocfg, batches: list[Batch], count=None) -> tuple:
    """The reference: a model of cfg (seed 0) trained by one process, one step per batch of `batches`
    (the union of what the ranks get); (the model, the steps' results). count: train_step's count of
    targets (default: every target)."""
    torch.manual_seed(0)
    ref = build_model(cfg)
    args = step_args(ref, make_optimizer(ref, ocfg))
    if count is not None:
        args[3] = count
    results = []
    for batch in batches:
        args[2] = [batch]
        results.append(train_step(*args))
    return ref, results


def accumulation(env, cfg, ocfg) -> dict:
    """Gradient accumulation: three steps of 1, 2 and 1 micro-batches per rank vs one process on the
    union of the ranks' batches; DDP all-reduces its buckets once per step however many micro-batches
    (a comm hook counts the reductions), FSDP2 reduce-scatters after each (only parity checked)."""
    world, plans = env.world_size, [1, 2, 1]
    ref, want = one_process(cfg, ocfg, [global_batch(world, step) for step in range(len(plans))])
    result = {}
    for data in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = build_model(cfg)
        par = parallelize(model, make_plan(ParallelConfig(data=data), world), env, torch.device("cpu"))
        reductions: list[int] = []
        if data == "ddp":
            par.model.register_comm_hook(reductions, counting_allreduce)
        args = step_args(par.model, make_optimizer(model, ocfg), par.comm)
        per_step, got = [], []
        for step, n in enumerate(plans):
            own = rank_part(global_batch(world, step), env.rank)
            args[2] = halves(own) if n == 2 else [own]
            before = len(reductions)
            got.append(train_step(*args))
            per_step.append(len(reductions) - before)
        result[data] = {
            "reductions_per_step": per_step,
            "loss_diff": max(abs(a.loss - b.loss) for a, b in zip(got, want)),
            "param_diff": max_diff(model, ref, set(), "param"),
        }
        del par, model, args
    return result


def ragged(env, cfg, ocfg) -> dict:
    """Ranks with batches of different shapes (D8, a ragged last batch): rank 0 two rows, rank 1 one row
    of another length; two DDP / FSDP2 steps vs one process on the three rows, and no hang (the launch's
    timeout stands guard). The reference pads the short row with ignored targets; no bias update, which
    would count the padding's routing."""
    world, cfg = env.world_size, moe_model_cfg(bias_update_rate=0.0)
    count = lambda b: int((b.targets != -100).sum())  # noqa: E731  (the reference's padding not counted)

    def rows(step: int, rank: int | None = None) -> Batch:
        g = global_batch(world, step)
        short = Batch(g.ids[2:3, : T - 3], g.targets[2:3, : T - 3])  # rank 1's row, 3 tokens shorter
        if rank is not None:
            return Batch(g.ids[:2], g.targets[:2]) if rank == 0 else short
        padded = torch.nn.functional.pad(short.targets, (0, 3), value=-100)  # ignored: as one process
        ids = torch.cat([g.ids[:2], torch.nn.functional.pad(short.ids, (0, 3))])
        return Batch(ids, torch.cat([g.targets[:2], padded]))

    ref, want = one_process(cfg, ocfg, [rows(step) for step in range(2)], count)
    result = {}
    for data in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = build_model(cfg)
        par = parallelize(model, make_plan(ParallelConfig(data=data), world), env, torch.device("cpu"))
        args = step_args(par.model, make_optimizer(model, ocfg), par.comm)
        args[3] = count
        got = []
        for step in range(2):
            args[2] = [rows(step, env.rank)]
            got.append(train_step(*args))
        result[data] = {
            "shape": list(rows(0, env.rank).ids.shape),
            "loss_diff": max(abs(a.loss - b.loss) for a, b in zip(got, want)),
            "param_diff": max_diff(model, ref, set(), "param"),
        }
        del par, model, args
    return result


def nan_agreement(env, cfg, ocfg) -> dict:
    """A NaN loss on rank 1 only: every rank skips the step; weights unchanged and identical."""
    torch.manual_seed(0)
    model = build_model(cfg)
    par = parallelize(model, make_plan(ParallelConfig(data="ddp"), env.world_size), env, torch.device("cpu"))
    opt = make_optimizer(model, ocfg)
    before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(m, batch):
        loss, n = lm_loss_sum(m, batch)
        return (loss * float("nan") if env.rank == 1 else loss), n

    args = step_args(par.model, opt, par.comm)
    args[1], args[2] = loss_fn, [rank_part(global_batch(env.world_size, 0), env.rank)]
    r = train_step(*args)
    stats = global_routing_stats(model, env)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    flags = torch.tensor([int(r.skipped)])
    dist.all_reduce(flags)
    window = next(iter(stats.values()))["window_tokens"]
    del par, model, opt, args
    return {"skipped_everywhere": int(flags) == env.world_size, "unchanged": unchanged,
            "global_window_tokens": window, "nonfinite_ranks": list(r.nonfinite_ranks)}  # fmt: skip


def main() -> int:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    env = init_distributed(ParallelConfig(timeout_s=60), "cpu")  # one process group per launch
    out: dict = {}
    scenarios = {
        "parity": parity,
        "tensor": tensor,
        "tensor2d": tensor2d,
        "resume1": resume1,
        "resume2": resume2,
        "resume3": resume3,
    }
    scenarios[scenario](env, out_dir, out)
    env.barrier()
    env.shutdown()
    (out_dir / f"{scenario}.rank{env.rank}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
