"""The tensor-parallel scenarios of worker.py: `tensor` (2 ranks, one group: plain and sequence parallel,
decoder LM, encoder-decoder, dropout, MoE, a DCP round trip) and `tensor2d` (4 ranks, FSDP2 x TP)."""

from __future__ import annotations

import contextlib
import gc
import warnings
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from worker_common import Batch, T, full, global_batch, max_diff, rank_part, step_args

from tformer.config import MoEConfig
from tformer.distributed.parallelize import parallelize
from tformer.distributed.plans import make_plan
from tformer.model import build_model
from tformer.presets import tiny
from tformer.tasks.lm import lm_loss_sum
from tformer.train.config import OptimConfig, ParallelConfig
from tformer.train.optim import make_optimizer
from tformer.train.step import train_step


# ------------------------------------------------------------------------------------- tensor parallel
def twins(cfg) -> list:
    """Two models from the same seed: the one-process reference and the one to parallelize."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(cfg))
    return models


def expert_pieces(par, model) -> dict[str, tuple | None]:
    """The expert-parallel slices by name -> (dim, tensor group) of their width split, or None (whole)."""
    from tformer.distributed.checkpoint import expert_slices

    dims = expert_slices(model)
    return {
        name: None if dims[name] is None else (dims[name], par.mesh["tensor"].get_group())
        for name in par.rank_local
    }


def compare_steps(ref, model, par, ref_batch, own_batch, own_scale: float) -> dict:
    """Gradients on batch 0, then three clipped AdamW steps (the last of two micro-batches on the
    parallel side), parallel vs reference. ref_batch(step): the
    whole batch; own_batch(step): this rank's part, whose summed loss times own_scale is the gradient
    of the whole batch's mean loss."""
    ocfg = OptimConfig(lr=1e-2, fused=False, warmup_steps=0)
    ref_args = step_args(ref, make_optimizer(ref, ocfg))
    args = step_args(par.model, par.adapt_optimizer(make_optimizer(model, ocfg)), par.comm)
    ref_args[1] = args[1] = partial(lm_loss_sum, label_smoothing=0.1)  # the steps train with smoothing
    # expert-parallel slices, split over the data dimension's ranks (and by width over the tensor one)
    sliced, group = expert_pieces(par, model), par.mesh["data"].get_group() if par.rank_local else None
    diff = partial(max_diff, model, ref, sliced, group=group)
    loss, n = lm_loss_sum(ref, ref_batch(0), label_smoothing=0.1)
    (loss / n).backward()
    grad_diff, placed = [], True  # from the gathered logits (a forward outside the trainer), then split
    for context in (contextlib.nullcontext(), par.comm.micro_batch(par.model, last=True)):
        with context:
            loss, _ = lm_loss_sum(par.model, own_batch(0), label_smoothing=0.1)
        (loss * own_scale).backward()
        grad_diff.append(diff("grad"))
        # a DTensor gradient placed like its parameter (a Partial one would read whole in max_diff, but
        # clip and step as this rank's partial sum)
        placed &= all(p.grad.placements == p.placements for p in model.parameters() if isinstance(p, DTensor))
        model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    results, logits = [], set()  # the logits the loss read inside the steps: split by vocabulary
    hook = model.lm_head.register_forward_hook(lambda m, args, out: logits.add(type(out).__name__))
    for step in range(3):  # the third step accumulates two micro-batches (this rank's rows in halves)
        own = own_batch(step)
        halves = [Batch(own.ids[rows], own.targets[rows]) for rows in (slice(0, 1), slice(1, None))]
        ref_args[2], args[2] = [ref_batch(step)], halves if step == 2 else [own]
        results.append((train_step(*ref_args), train_step(*args)))
    hook.remove()
    return {
        "step_logits": sorted(logits),
        "grad_diff": grad_diff,
        "grads_placed": placed,
        "param_diff": diff("param"),
        "bias_diff": max(
            [
                float((a.router.expert_bias - b.router.expert_bias).abs().max())
                for a, b in moe_pairs(model, ref)
            ]
            + [0.0]
        ),  # fmt: skip
        "loss_diff": max(abs(a.loss - b.loss) for a, b in results),
        "grad_norm_diff": max(abs(a.grad_norm - b.grad_norm) for a, b in results),
        "clipped": results[0][0].grad_norm > 0.05,
        "targets": [b.targets for _, b in results],
    }


def moe_pairs(model, ref) -> list:
    from tformer.model.moe import MoE

    return list(zip(*([m for m in x.modules() if isinstance(m, MoE)] for x in (model, ref))))


TP_CFG = dict(d_model=32, d_ff=64, n_heads=4, n_kv_heads=2, vocab_size=64, tie_embeddings=False)  # head split


def saved_bytes(model, batch, context=contextlib.nullcontext) -> int:
    """Bytes one forward and its loss keep alive for backward on this rank (within `context`): the
    storages of the saved tensors (a DTensor's local piece), each counted once."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        lm_loss_sum(model, batch)
    return sum(seen.values())


def sublayer_rows(block) -> list[int]:
    """The sequence lengths the block's FFN hands back to the residual stream, one per forward."""
    rows = []
    block.ffn.register_forward_hook(lambda m, args, out: rows.append(out.shape[1]))
    return rows


def tensor(env, out_dir: Path, out: dict) -> None:
    """Tensor parallelism over all ranks (data size 1: every rank sees the whole batch) vs one process,
    without and with sequence parallelism: a decoder LM (with the trainer's step: clipping, AdamW; with
    sequence parallelism also a length the group does not divide) and an encoder-decoder (gradients).
    Every stacked q/k/v and gate/up GEMM is asked for (FUSE_MIN_ROWS 0, also under autograd): the
    sharded layers must refuse it."""
    from tformer.distributed.env import ProcessGroup
    from tformer.generate import SamplingConfig
    from tformer.generate.engine import generate
    from tformer.model import linear

    linear.FUSE_MIN_ROWS = 0
    linear.FUSE_UNDER_AUTOGRAD = True
    tp_env = ProcessGroup(owns_group=False, tensor=env.world_size)
    whole = partial(global_batch, 1)
    for sequence in (False, True):
        key = "sequence_" if sequence else ""
        plan = make_plan(ParallelConfig(tensor=env.world_size, sequence=sequence), env.world_size)
        lengths = {"decoder": T, "decoder_odd": T - 1} if sequence else {"decoder": T}
        for name, t in lengths.items():
            ref, model = twins(tiny().replace(bias=True, **TP_CFG))
            par = parallelize(model, plan, tp_env, torch.device("cpu"))
            # greedy tokens (left-padded prompts, prefill lengths 4 and 5, 1-token steps), fast decoding paths
            prompts, greedy = [[5, 6, 7, 8], [9, 10, 11]], SamplingConfig(temperature=0.0, max_new_tokens=4)
            generated = [
                generate(m, p, greedy) for m in (ref, par.model) for p in (prompts, [[5, 6, 7, 8, 9]])
            ]
            rows = sublayer_rows(model.blocks[0])
            batch = lambda step, t=t: Batch(whole(step).ids[:, :t], whole(step).targets[:, :t])  # noqa: E731
            d = compare_steps(ref, model, par, batch, batch, 1 / batch(0).targets.numel())
            d["generated_same"] = generated[:2] == generated[2:]
            q = model.blocks[0].attn.q_proj.weight
            d["sharded"] = isinstance(q, DTensor) and tuple(q.to_local().shape) == (32 // env.world_size, 32)
            head = model.lm_head.weight  # untied: split by vocabulary
            d["head_split"] = isinstance(head, DTensor) and tuple(head.to_local().shape) == (
                64 // env.world_size,
                32,
            )
            d["rows"] = sorted(set(rows))
            d["saved_bytes"] = saved_bytes(model, batch(0))
            # a training micro-batch: the loss reads the logits split, each rank keeps its softmax part
            d["saved_bytes_step"] = saved_bytes(model, batch(0), partial(par.comm.micro_batch, model, True))
            if sequence and name == "decoder":  # norms as replicated DTensors, the head split by vocabulary
                d["norm_grads"] = norm_grad_reduces(par.model, batch(0))
                d["checkpoint"] = tensor_checkpoint(env, tp_env, plan, par, model, out_dir)
                d["saved_bytes_kept"] = kept_gathered_bytes(plan, tp_env, batch(0))
                # two gathered inputs per block (attention's, the FFN's), (B, T, D) fp32, each kept as a half
                gathered = batch(0).ids.numel() * model.cfg.d_model * 4
                d["regathered_saving"] = (
                    model.cfg.n_layers * 2 * gathered * (env.world_size - 1) // env.world_size
                )
            out[key + name] = d
            del par, model, ref
        out[key + "encoder_decoder"] = tensor_encoder_decoder(plan, tp_env)
        out[key + "encoder_decoder_untied"] = tensor_encoder_decoder(plan, tp_env, tie_embeddings=False)
        out[key + "dropout"] = tensor_dropout(plan, tp_env)
        out[key + "autocast"] = tensor_autocast(plan, tp_env)
        out[key + "moe"] = tensor_moe(plan, tp_env)
        out[key + "moe_bias"] = tensor_moe(plan, tp_env, bias=True)
    out["vocab_loss"] = vocab_loss(env)
    linear.FUSE_MIN_ROWS = 1024
    gc.collect()


def vocab_loss(env) -> dict:
    """The vocabulary-parallel cross-entropy vs F.cross_entropy (summed) on the whole logits: 63 entries
    (pieces of 32 and 31 on 2 ranks), targets in both pieces and ignored ones, with and without label
    smoothing, fp32 and bf16 logits: the loss and the gradient of the logits; and every target ignored."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tformer.data.datasets import IGNORE_INDEX
    from tformer.distributed.vocab import vocab_parallel_cross_entropy

    mesh = init_device_mesh("cpu", (env.world_size,))
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(2, 9, 63, generator=g) * 3  # the same on every rank
    targets = torch.randint(0, 63, (2, 9), generator=g)
    targets[0, :3] = IGNORE_INDEX
    out = {"loss_diff": 0.0, "grad_diff": 0.0}
    for dtype in (torch.float32, torch.bfloat16):
        for eps in (0.0, 0.1):
            ref = whole.to(dtype).clone().requires_grad_()
            want = F.cross_entropy(ref.float().flatten(0, 1), targets.flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX, label_smoothing=eps)  # fmt: skip
            want.backward()
            split = distribute_tensor(whole.to(dtype), mesh, [Shard(-1)]).requires_grad_()
            got = vocab_parallel_cross_entropy(split, targets, eps, IGNORE_INDEX)
            got.backward()
            out["loss_diff"] = max(out["loss_diff"], abs(float(got) - float(want)) / float(want))
            grad = split.grad.full_tensor().float() - ref.grad.float()
            out["grad_diff"] = max(out["grad_diff"], float(grad.abs().max()))
    split = distribute_tensor(whole, mesh, [Shard(-1)]).requires_grad_()
    nothing = vocab_parallel_cross_entropy(split, torch.full_like(targets, IGNORE_INDEX), 0.1, IGNORE_INDEX)
    nothing.backward()
    out["all_ignored"] = [float(nothing), float(split.grad.full_tensor().abs().max())]
    out["pieces"] = [split.to_local().shape[-1]]
    # -inf logits (the first of each piece, never a target): finite as F.cross_entropy without smoothing;
    # and one entry over 2 ranks (one rank holds none)
    masked = whole.clone()
    masked[..., [0, 32]] = -torch.inf
    cases = {"masked": (masked, targets.masked_fill(targets == 0, 1).masked_fill(targets == 32, 33)), "one_entry": (whole[..., :1], targets.clamp(max=0))}  # fmt: skip
    for name, (logits, tgt) in cases.items():
        ref = logits.clone().requires_grad_()
        want = F.cross_entropy(ref.flatten(0, 1), tgt.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
        want.backward()
        split = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        got = vocab_parallel_cross_entropy(split, tgt, 0.0, IGNORE_INDEX)
        got.backward()
        grad = float((split.grad.full_tensor() - ref.grad).abs().max())
        out[name] = [float(got), float(want), grad, split.to_local().shape[-1]]
    return out


def kept_gathered_bytes(plan, tp_env, batch, context=contextlib.nullcontext, cfg=None) -> int:
    """saved_bytes of the sequence-parallel decoder whose sublayers keep their gathered inputs whole
    (the slow twin of gathering them again in backward)."""
    from tformer.distributed import sequence

    sequence.KEEP_GATHERED = True
    try:
        _, model = twins(tiny().replace(**(cfg or dict(bias=True, **TP_CFG))))
        parallelize(model, plan, tp_env, torch.device("cpu"))
    finally:
        sequence.KEEP_GATHERED = False
    return saved_bytes(model, batch, context)


def tensor_checkpoint(env, tp_env, plan, par, model, out_dir: Path, name: str = "tp_sp_head") -> dict:
    """The trained model through tformer's DCP checkpointer: loaded into a fresh parallel twin (weights equal
    to the saved ones), and its whole weights dumped for the one-process load on the pytest side."""
    from safetensors.torch import save_file

    from tformer.distributed.checkpoint import DCPCheckpointer

    run_dir = out_dir / name
    group = par.mesh["data"].get_group() if par.rank_local else None  # expert slices: over the data ranks
    pieces = expert_pieces(par, model)
    whole = {
        n: partial(full, sliced=n in pieces, group=group, width=pieces.get(n))
        for n, _ in model.named_parameters()
    }

    def optimizer_and_schedule(m):
        opt = torch.optim.AdamW(m.parameters())
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    path = DCPCheckpointer(tp_env, 0).save(
        run_dir, 2, par.model, *optimizer_and_schedule(model), {}, {}, None
    )
    _, fresh = twins(model.cfg)
    fresh_par = parallelize(fresh, plan, tp_env, torch.device("cpu"))
    DCPCheckpointer(tp_env, 0).load(path, fresh_par.model, *optimizer_and_schedule(fresh))
    saved = {n: whole[n](p.detach()) for n, p in model.named_parameters()}
    loaded = dict(fresh.named_parameters())
    equal = all(torch.equal(whole[n](loaded[n].detach()), w) for n, w in saved.items())
    if env.rank == 0:
        save_file({k: v.contiguous() for k, v in saved.items()}, out_dir / f"{name}.safetensors")
    env.barrier()
    return {"path": str(path), "reloaded_equal": equal}


def tensor_moe(plan, tp_env, bias: bool = False) -> dict:
    """A decoder with MoE layers (first layer dense, a shared expert, balance losses on): attention and the
    dense FFN split, in the MoE layers every rank routes the whole sequence and computes its slice of
    every expert's width (with biases: the experts whole on every rank, with a warning). Loss with the
    balance loss, gradients (router included), and the routing statistics (counted once, not once per
    rank of the group) vs one process."""
    from tformer.distributed.parallelize import global_routing_stats
    from tformer.model.moe import moe_aux_loss, moe_routing_stats

    moe = MoEConfig(
        n_experts=4, top_k=2, n_shared=1, first_dense=1, aux_loss_coef=0.01, seq_aux_loss_coef=0.01
    )
    ref, model = twins(tiny().replace(n_layers=2, moe=moe, bias=bias, **TP_CFG))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = parallelize(model, plan, tp_env, torch.device("cpu"))
    rows = sublayer_rows(model.blocks[1])
    batch = global_batch(1, 0)
    losses = []
    for m in (ref, par.model):
        loss, n = lm_loss_sum(m, batch)
        total = loss / n + moe_aux_loss(m)
        total.backward()
        losses.append(total.item())
    want = moe_routing_stats(ref)
    got = global_routing_stats(model, tp_env)  # the trainer's env: it knows the tensor-parallel degree
    result = {
        "loss_diff": abs(losses[0] - losses[1]),
        "grad_diff": max_diff(model, ref, set(), "grad"),
        "stats_equal": all(
            got[k]["load"] == want[k]["load"] and got[k]["assignments"] == want[k]["assignments"]
            for k in want
        ),  # fmt: skip
        "rows": sorted(set(rows)),
        "warned_whole": any("keep their experts whole" in str(w.message) for w in caught),
        "shared_split": isinstance(model.blocks[1].ffn.shared.up_proj.weight, DTensor),
        # each rank's slice of every expert's width: (E, F / P, D) of (E, F, D)
        "experts_split": [
            [list(p.to_local().shape), list(p.shape)] if isinstance(p, DTensor) else None
            for p in (model.blocks[1].ffn.experts.up_proj, model.blocks[1].ffn.experts.down_proj)
        ],
    }
    result["collectives"] = moe_collectives(model.blocks[1].ffn, plan, batch.ids.shape)  # after the grads
    return result


def norm_grad_reduces(model, batch) -> dict:
    """The norm weights' partial gradients of a sequence-parallel backward: summed in one all-reduce at its
    end (`NormGrads`) vs one per parameter (the slow twin): the all-reduces each backward runs (DTensor's
    and torch.distributed's), and the gradients, which must be equal."""
    from torch.distributed.tensor.debug import CommDebugMode

    from tformer.distributed.sequence import NormGrads

    norms = [p for n, p in model.named_parameters() if "_norm." in n and "final_norm" not in n]
    out = {"norm_params": len(norms)}
    grads = {}
    try:
        for bucketed in (False, True):
            NormGrads.BUCKETED = bucketed
            model.zero_grad(set_to_none=True)
            loss, _ = lm_loss_sum(model, batch)
            with CommDebugMode() as comm:
                loss.backward()
            counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            out["bucketed" if bucketed else "each"] = counts.get("allreduce_", 0) + counts.get(
                "all_reduce", 0
            )
            grads[bucketed] = [p.grad.full_tensor() for p in norms]
    finally:
        NormGrads.BUCKETED = True
        model.zero_grad(set_to_none=True)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    out["placed"] = all(p.grad is None or p.grad.placements == p.placements for p in norms)
    return out


def moe_collectives(layer, plan, shape) -> dict:
    """The collectives of one MoE layer's forward and backward, by kind (CommDebugMode), on the hidden
    states a block hands it: the rank's positions under sequence parallelism, the whole sequence without."""
    from torch.distributed.tensor.debug import CommDebugMode

    b, t = shape
    x = torch.randn(b, t // (plan.tensor if plan.sequence else 1), layer.router.weight.shape[1])
    x.requires_grad_(True)
    stack = getattr(getattr(layer, "width_split", None), "sequence", None)
    if stack is not None:
        stack.active = True  # as the stack's first block sets it when the group divides the length
    counts = {}
    with CommDebugMode() as comm:
        y = layer(x)
    counts["forward"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    with CommDebugMode() as comm:
        y.sum().backward()
    counts["backward"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    return counts


def tensor_autocast(plan, tp_env) -> dict:
    """Under bf16 autocast (with sequence parallelism each sublayer's input is cast for its gather), the
    loss from split logits inside the trainer's micro-batch context: loss and gradients vs one process
    under autocast, relative to the largest gradient; with sequence parallelism, the bytes kept for
    backward vs the twin that keeps the gathered inputs whole."""
    ref, model = twins(tiny().replace(**TP_CFG))
    par = parallelize(model, plan, tp_env, torch.device("cpu"))
    batch, losses = global_batch(1, 0), []
    for m, step in ((ref, contextlib.nullcontext()), (par.model, par.comm.micro_batch(par.model, True))):
        with torch.autocast("cpu", torch.bfloat16), step:
            loss, n = lm_loss_sum(m, batch)
        (loss / n).backward()
        losses.append(float(loss / n))
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    out = {"loss_diff": abs(losses[0] - losses[1]), "grad_diff": max_diff(model, ref, set(), "grad") / scale}
    if plan.sequence:
        bf16 = partial(torch.autocast, "cpu", torch.bfloat16)
        out["saved_bytes"] = saved_bytes(model, batch, bf16)
        out["saved_bytes_kept"] = kept_gathered_bytes(plan, tp_env, batch, bf16, TP_CFG)
        gathered = batch.ids.numel() * model.cfg.d_model * 2  # (B, T, D) in bf16, half of it kept
        out["regathered_saving"] = model.cfg.n_layers * 2 * gathered // 2
    return out


def tensor_dropout(plan, tp_env) -> dict:
    """Residual and attention dropout 0.1: losses and gradients vs one process (its fused attention
    kernel) drawing from the same seed, at a length the group divides (a split sequence draws the whole
    mask, applies its part; each rank's heads draw every head's mask, apply theirs) and at one it does
    not."""
    ref, model = twins(tiny().replace(dropout=0.1, attn_dropout=0.1, **TP_CFG))
    par = parallelize(model, plan, tp_env, torch.device("cpu"))
    rows = sublayer_rows(model.blocks[0])
    out = {}
    for t in (T, T - 1):
        batch = global_batch(1, 0)
        batch = Batch(batch.ids[:, :t], batch.targets[:, :t])
        losses = []
        for m in (ref, par.model):
            torch.manual_seed(11)
            loss, n = lm_loss_sum(m, batch)
            (loss / n).backward()
            losses.append((loss / n).item())
        out[f"length_{t}"] = {
            "loss_diff": abs(losses[0] - losses[1]),
            "grad_diff": max_diff(model, ref, set(), "grad"),
        }
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    ref.eval()  # the dropout is on: without it the loss differs
    with torch.no_grad():
        loss, n = lm_loss_sum(ref, batch)
    out["dropped"] = abs(float(loss / n) - losses[0]) > 1e-4
    out["rows"] = sorted(set(rows))
    return out


def tensor_encoder_decoder(plan, tp_env, tie_embeddings: bool = True) -> dict:
    """An encoder-decoder's gradients (source 10 tokens, one row padded; target 6) vs one process; untied,
    its head split by vocabulary and the loss computed from the split logits, with label smoothing."""
    from tformer.data.datasets import Seq2SeqBatch
    from tformer.tasks.translation import seq2seq_loss_sum

    cfg = tiny("encoder_decoder").replace(d_model=32, d_ff=64, n_heads=2, vocab_size=64)
    ref, model = twins(cfg.replace(tie_embeddings=tie_embeddings))
    par = parallelize(model, plan, tp_env, torch.device("cpu"))
    rows = {
        "encoder": sublayer_rows(model.encoder.blocks[0]),
        "decoder": sublayer_rows(model.decoder.blocks[0]),
    }
    g = torch.Generator().manual_seed(7)
    src, tgt = torch.randint(3, 64, (4, 10), generator=g), torch.randint(3, 64, (4, 7), generator=g)
    src_mask = torch.ones_like(src, dtype=torch.bool)
    src_mask[1, 6:] = False
    batch = Seq2SeqBatch(
        src, src_mask, tgt[:, :-1], tgt[:, 1:], torch.ones_like(tgt[:, 1:], dtype=torch.bool)
    )
    for m, context in ((ref, contextlib.nullcontext()), (par.model, par.comm.micro_batch(par.model, True))):
        with context:
            loss, n = seq2seq_loss_sum(m, batch, label_smoothing=0.1)
        (loss / n).backward()
    return {
        "head_split": isinstance(model.lm_head.weight, DTensor),
        "sharded": isinstance(model.decoder.blocks[0].cross_attn.k_proj.weight, DTensor),
        "head_tied": model.lm_head.weight is model.tok_embed.weight
        and type(model.lm_head.weight) is nn.Parameter,
        "grad_diff": max_diff(model, ref, set(), "grad"),
        "grads_placed": all(
            p.grad.placements == p.placements for p in model.parameters() if isinstance(p, DTensor)
        ),
        "rows": {name: sorted(set(r)) for name, r in rows.items()},
    }


def tensor2d(env, out_dir: Path, out: dict) -> None:
    """4 ranks as a (2 data x 2 tensor) mesh, FSDP2 over the data dimension: each data rank takes its
    part of the batch; gradients, three clipped AdamW steps and the weights vs one process on the union."""
    from tformer.distributed.env import ProcessGroup, train_loader

    tp_env = ProcessGroup(owns_group=False, tensor=2)
    for sequence in (False, True):
        plan = make_plan(ParallelConfig(tensor=2, data="fsdp", sequence=sequence), env.world_size)
        ref, model = twins(tiny().replace(**TP_CFG))
        par = parallelize(model, plan, tp_env, torch.device("cpu"))
        rows = sublayer_rows(model.blocks[0])
        dp = tp_env.data_world_size
        whole = partial(global_batch, dp)
        d = compare_steps(
            ref,
            model,
            par,
            whole,
            lambda step, whole=whole: rank_part(whole(step), tp_env.data_rank),
            dp / whole(0).targets.numel(),
        )
        q = model.blocks[0].attn.q_proj.weight
        d |= {"mesh": list(q.device_mesh.shape) if isinstance(q, DTensor) else None,
              "data_rank": tp_env.data_rank, "rows": sorted(set(rows)),
              # split by vocabulary on the tensor dimension too (FSDP2 alone shards it on the data one)
              "head_split": isinstance(model.lm_head.weight, DTensor) and model.lm_head.weight.device_mesh.ndim == 2}  # fmt: skip
        out["fsdp_tp_sp" if sequence else "fsdp_tp"] = d
        del par, model, ref
        gc.collect()
        out["ep_tp_sp" if sequence else "ep_tp"] = tensor2d_experts(env, tp_env, sequence, out_dir)
        out["moe_tp_sp" if sequence else "moe_tp"] = tensor2d_experts(
            env, tp_env, sequence, out_dir, "replicate"
        )
        if not sequence:  # experts with biases stay whole in each pair: each rank computes its share whole
            out["ep_tp_whole"] = tensor2d_experts(env, tp_env, sequence, out_dir, bias=True)

    class SplitBy:  # a task whose loader is the part of the batches it was asked for
        def train_loader(self, cfg, rank: int = 0, world_size: int = 1) -> list[int]:
            return [rank, world_size]

    out["loader_part"] = train_loader(SplitBy(), None, tp_env)  # the trainer's loader on this rank


def tensor2d_experts(
    env, tp_env, sequence: bool, out_dir: Path, experts: str = "shard", bias: bool = False
) -> dict:
    """Expert parallelism over the data dimension with tensor parallelism in pairs (FSDP2 over the data
    dimension for the rest): an MoE decoder (bias updates, a shared expert; no balance loss, which each
    data rank computes on its own tokens) vs one process on the whole batch, as `tensor2d`; each rank
    holds half the experts, its pair partner the same half, each of the two half of their width
    (experts="replicate": every rank holds every expert's half width, FSDP2 sharding that over the data
    dimension). With sequence parallelism also a
    DCP round trip, and the weights dumped for opening the checkpoint in one process."""
    cfg = tiny().replace(moe=MoEConfig(n_experts=4, top_k=2, n_shared=1, aux_loss_coef=0.0, bias_update_rate=0.01), **TP_CFG)  # fmt: skip
    plan = make_plan(
        ParallelConfig(tensor=2, data="fsdp", experts=experts, sequence=sequence), env.world_size
    )
    ref, model = twins(cfg.replace(bias=bias))
    with warnings.catch_warnings(record=True) as caught:  # biased experts: kept whole, with a warning
        warnings.simplefilter("always")
        par = parallelize(model, plan, tp_env, torch.device("cpu"))
    dp = tp_env.data_world_size
    whole = partial(global_batch, dp)
    d = {"warned": [str(w.message) for w in caught if "keep their experts whole" in str(w.message)]}
    d |= compare_steps(ref, model, par, whole, lambda step: rank_part(whole(step), tp_env.data_rank),
                      dp / whole(0).targets.numel())  # fmt: skip
    up = model.blocks[0].ffn.experts.up_proj
    d["experts_held"] = [
        list(up.to_local().shape if isinstance(up, DTensor) else up.shape),
        type(up).__name__,
    ]
    d["bias_moved"] = any(float(m.router.expert_bias.abs().max()) > 0 for m, _ in moe_pairs(model, ref))
    if sequence:  # the experts saved as one tensor each (data-sharded, tensor-replicated / -sharded by width)
        name = "ep_tp_sp" if experts == "shard" else "moe_tp_sp"
        d["checkpoint"] = tensor_checkpoint(env, tp_env, plan, par, model, out_dir, name)
        d["window_tokens"] = [
            m.router.window_tokens.tolist() for m, _ in moe_pairs(model, ref)
        ]  # saved counts
    return d
