"""Mixture-of-Experts at constant compute: dense vs Switch vs GShard vs DeepSeekMoE, with ablations.

Arms (Pre-Norm RMSNorm + RoPE + SwiGLU decoder; every layer's FFN slot differs only), all with the same
active FFN width d_ff per token, so equal active parameters and FLOPs per token (up to the router):

    dense                 one SwiGLU FFN of width d_ff
    switch                n_experts experts of width d_ff, top-1 (Fedus et al.)
    gshard                2 n_experts experts of width d_ff / 2, top-2: Switch's total parameters
    deepseekmoe           fine_grained(gshard, m, n_shared=1): 2 m n_experts - 1 routed experts of width
                          d_ff / (2m), top 2m - 1, plus one shared expert: GShard's total and active size
    deepseekmoe-noshared  fine_grained(gshard, m, n_shared=0) (ablation)
    deepseekmoe-lossfree  deepseekmoe balanced by expert biases (bias_update_rate > 0, aux_loss_coef 0)

Measured besides the losses: total / active parameters and FLOPs per token (model/stats.py); per-step
MaxVio and expert loads in training (runner); after training, on held-out batches: the load per expert
(MaxVio_global), the tokens each expert prefers, the loss when each token's top routed experts are
disabled (DeepSeekMoE's redundancy test), and the loss with the shared expert removed and one more
routed expert instead (DeepSeekMoE's shared-expert test).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tformer.config import ModelConfig, MoEConfig
from tformer.data.datasets import collate_lm
from tformer.distributed.env import resolve_device
from tformer.experiments.runner import Arm, Setting, StudyData, run_arms
from tformer.experiments.study_dir import begin_study
from tformer.model import build_model
from tformer.model.moe import moe_layers
from tformer.model.router import Routing
from tformer.model.stats import count_params, fine_grained, flops_per_token
from tformer.tasks.lm import lm_loss_sum

ARMS = ("dense", "switch", "gshard", "deepseekmoe", "deepseekmoe-noshared", "deepseekmoe-lossfree")


@dataclass(frozen=True)
class MoESetting(Setting):
    d_ff: int = 512  # the dense FFN width = every arm's active FFN width
    n_experts: int = 8  # Switch's experts; GShard has twice as many, half as wide
    granularity: int = 4  # DeepSeekMoE's m: each GShard expert split into m
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    analysis_batches: int = 8  # held-out batches for the routing analyses
    disable_ratios: tuple[float, ...] = (0.0625, 0.125, 0.25)  # of each token's ranked routed experts
    top_tokens: int = 6
    min_token_count: int = 20


FULL = MoESetting(
    vocab_size=2048,
    seq_len=128,
    d_model=128,
    n_heads=4,
    n_layers=4,
    d_ff=512,
    batch_size=16,
    steps=250,
    lr=2e-3,
    warmup_steps=30,
    grad_clip=1.0,
    eval_every=50,
    eval_batches=8,
    seeds=2,
    n_experts=8,
    granularity=4,
)
QUICK = FULL.replace(
    max_train_docs=2,
    vocab_size=512,
    seq_len=32,
    d_model=32,
    n_layers=2,
    d_ff=64,
    batch_size=8,
    steps=12,
    warmup_steps=3,
    eval_every=6,
    eval_batches=2,
    seeds=1,
    n_experts=4,
    granularity=2,
    analysis_batches=2,
    min_token_count=5,
)


def base_config(s: MoESetting) -> ModelConfig:
    return ModelConfig(
        arch="decoder",
        vocab_size=s.vocab_size,
        d_model=s.d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        d_ff=s.d_ff,
        max_seq_len=s.seq_len,
        dropout=0.0,
        norm="rmsnorm",
        norm_placement="pre",
        positions="rope",
        ffn="swiglu",
        bias=False,
        embed_scale=False,
        tie_embeddings=True,
        init="scaled",
    )


def arm_configs(s: MoESetting, resolve=lambda cfg: cfg) -> dict[str, ModelConfig]:
    dense = resolve(base_config(s))
    if s.d_ff % (2 * s.granularity):
        raise ValueError(f"d_ff={s.d_ff} must be divisible by 2 x granularity = {2 * s.granularity}")
    aux = s.aux_loss_coef
    gshard = dense.replace(
        moe=MoEConfig(n_experts=2 * s.n_experts, top_k=2, d_expert=s.d_ff // 2, aux_loss_coef=aux)
    )
    deepseek = fine_grained(gshard, s.granularity, 1)
    return {
        "dense": dense,
        "switch": dense.replace(
            moe=MoEConfig(n_experts=s.n_experts, top_k=1, d_expert=s.d_ff, aux_loss_coef=aux)
        ),
        "gshard": gshard,
        "deepseekmoe": deepseek,
        "deepseekmoe-noshared": fine_grained(gshard, s.granularity, 0),
        "deepseekmoe-lossfree": deepseek.replace(
            moe=deepseek.moe.replace(aux_loss_coef=0.0, bias_update_rate=s.bias_update_rate)
        ),
    }


def make_arms(s: MoESetting, resolve=lambda cfg: cfg) -> list[Arm]:
    cfgs = arm_configs(s, resolve)
    return [
        Arm(f"{name}-s{seed}", cfgs[name], s.optim(), seed, {"ffn": name})
        for seed in range(s.seeds)
        for name in ARMS
    ]


# ----------------------------------------------------------------------------- held-out analyses
def analysis_batches(data: StudyData, s: MoESetting) -> list:
    """Validation windows spread evenly over the held-out works."""
    val = data.task.val_ds
    take = min(len(val), s.analysis_batches * s.batch_size)
    index = torch.linspace(0, len(val) - 1, take).round().long().unique().tolist()
    return [
        collate_lm([val[j] for j in index[i : i + s.batch_size]]) for i in range(0, len(index), s.batch_size)
    ]


@torch.no_grad()
def mean_loss(model: nn.Module, batches: list, device: torch.device) -> float:
    total, count = 0.0, 0
    for b in batches:
        loss, n = lm_loss_sum(model, b.to(device))
        total, count = total + float(loss), count + n
    return total / max(1, count)


def capture_routing(model: nn.Module) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Forward hooks keeping each MoE layer's chosen experts (N, K) per forward."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, layer in moe_layers(model):
        seen[name] = []
        handles.append(
            layer.router.register_forward_hook(
                lambda mod, args, out, name=name: seen[name].append(out.idx.cpu())
            )
        )
    return seen, handles


@torch.no_grad()
def routing_eval(model: nn.Module, batches: list, tokenizer, s: MoESetting, device) -> dict:
    """Per MoE layer on held-out batches: load per expert, MaxVio_global, each expert's preferred tokens
    (tokens seen >= min_token_count times, ranked by the share of their occurrences routed to the expert)."""
    seen, handles = capture_routing(model)
    try:
        for b in batches:
            model(b.ids.to(device))
    finally:
        for h in handles:
            h.remove()
    tokens = torch.cat([b.ids.flatten() for b in batches])  # (N,) in the router's token order
    vocab = model.cfg.vocab_size
    layers, modules = {}, dict(moe_layers(model))
    for name, idx_list in seen.items():
        idx = torch.cat(idx_list)  # (N, K)
        n_experts = modules[name].experts.n_experts
        pair = tokens[:, None] * n_experts + idx  # (N, K)
        counts = torch.bincount(pair.flatten(), minlength=vocab * n_experts).view(vocab, n_experts).double()
        load = counts.sum(0) / counts.sum()
        occurrences = torch.bincount(tokens, minlength=vocab).double()  # (V,)
        share = counts / occurrences.clamp_min(1)[:, None]  # (V, E) share of a token's occurrences
        share[occurrences < s.min_token_count] = -1.0
        top = share.topk(min(s.top_tokens, vocab), dim=0)  # (k, E)
        prefers = [
            [
                [tokenizer.decode([t]), round(float(v), 4), int(occurrences[t])]
                for v, t in zip(top.values[:, e].tolist(), top.indices[:, e].tolist())
                if v >= 0
            ]
            for e in range(n_experts)
        ]
        layers[name] = {
            "load": load.tolist(),
            "max_vio": float(load.max() / load.mean() - 1.0),
            "prefers": prefers,
        }
    return {"kind": "routing_eval", "tokens": int(tokens.numel()), "layers": layers}


def disabled_count(model: nn.Module, ratio: float) -> tuple[int, int]:
    """(experts each token loses at `ratio`, routed experts per layer): round(ratio x E), at most E - top_k
    (0 at a ratio too small for E: that ratio measures nothing for this model)."""
    _, layer = moe_layers(model)[0]
    n = layer.experts.n_experts
    return min(round(ratio * n), n - layer.router.top_k), n


def disable_top_experts(model: nn.Module, ratio: float) -> list:
    """Route every token past its best round(ratio x E) experts to the next top_k (DeepSeekMoE's test)."""
    handles = []
    for _, layer in moe_layers(model):
        router = layer.router
        n_off = min(round(ratio * layer.experts.n_experts), layer.experts.n_experts - router.top_k)

        def hook(mod, args, out: Routing, n_off=n_off) -> Routing:
            choice = mod.limit_groups(out.scores + mod.expert_bias.float())
            best = choice.topk(n_off, dim=-1).indices  # (N, n_off)
            idx = choice.scatter(-1, best, float("-inf")).topk(mod.top_k, dim=-1).indices  # (N, K)
            weights = mod.normalize(out.scores.gather(-1, idx)) * mod.routed_scaling
            return Routing(out.logits, out.scores, idx, weights)

        if n_off > 0:
            handles.append(router.register_forward_hook(hook))
    return handles


def without_shared(model: nn.Module, cfg: ModelConfig, device) -> nn.Module:
    """The trained model with its shared experts removed and one more routed expert per token."""
    moe = cfg.moe.replace(n_shared=0, top_k=cfg.moe.top_k + 1)
    ablated = build_model(cfg.replace(moe=moe)).to(device)
    result = ablated.load_state_dict(model.state_dict(), strict=False)
    if result.missing_keys or any(".shared." not in k for k in result.unexpected_keys):
        raise RuntimeError(f"shared-expert ablation: unexpected state dict mismatch {result}")
    return ablated.eval()


def analyses(arm: Arm, model: nn.Module, data: StudyData, batches: list, s: MoESetting) -> list[dict]:
    device = resolve_device(s.device)
    size = count_params(arm.model)
    out = [{"kind": "size", **size, "flops_per_token": flops_per_token(arm.model, s.seq_len, causal=True)}]
    if arm.model.moe is None:
        return out
    base = mean_loss(model, batches, device)
    out.append(routing_eval(model, batches, data.task.tokenizer, s, device))
    for ratio in s.disable_ratios:
        n_disabled, n_experts = disabled_count(model, ratio)
        handles = disable_top_experts(model, ratio)
        try:
            out.append(
                {
                    "kind": "disable_top",
                    "ratio": ratio,
                    "n_disabled": n_disabled,  # 0: the ratio is too small for this model's experts
                    "n_experts": n_experts,
                    "base_loss": base,
                    "loss": mean_loss(model, batches, device),
                }
            )
        finally:
            for h in handles:
                h.remove()
    if arm.model.moe.n_shared:
        out.append(
            {
                "kind": "no_shared",
                "base_loss": base,
                "loss": mean_loss(without_shared(model, arm.model, device), batches, device),
            }
        )
    return out


def run(setting: MoESetting, run_dir: str | Path) -> None:
    run_dir = begin_study(run_dir, "moe", setting, QUICK)
    data = StudyData.prepare(setting, run_dir)
    batches = analysis_batches(data, setting)
    run_arms(
        make_arms(setting, data.resolve),
        data,
        setting,
        run_dir,
        after=lambda arm, model: analyses(arm, model, data, batches, setting),
    )


def report(run_dir: Path):
    from tformer.experiments.moe_report import report as build

    return build(run_dir)
