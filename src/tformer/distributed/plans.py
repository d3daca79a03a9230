"""Parallel plans: data that says how a model is spread over ranks, applied from outside the model.

The model code stays single-device. A plan names module paths and buffers; `parallelize` reads it:
  data          "none" (one process), "ddp" or "fsdp"
  fsdp_units    regexes over module names (`model.named_modules()`): each match becomes one FSDP2
                unit (`fully_shard`), the root takes what is left (embeddings, final norm, head)
  expert_parallel  split every MoE layer's experts over the data-parallel ranks (all ranks without
                tensor parallelism; tformer.distributed.expert_parallel)
  param_dtype   FSDP2 mixed precision: the dtype units compute in (None: the parameters' own)
  tensor        tensor-parallel degree T; tp_styles: module-name regex -> "colwise" / "rowwise" /
                "rowwise_reduced" (output all-reduced, also under sequence parallelism) / "vocab"
                (Megatron: q/k/v and the FFN's input layers split by output features, o and the FFN's
                output layer by input features, so a block needs one all-reduce after attention and one
                after the FFN; the LM head split by vocabulary: its logits all-gathered, except for a training
                step's loss, which reads them split, tformer.distributed.vocab)
  sequence      sequence parallelism inside each tensor-parallel group: the residual stream, norms and
                dropout between those layers split over the sequence (tformer.distributed.sequence)
Rank-local state (never averaged, never broadcast, saved per rank): buffers named by RANK_LOCAL.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

import torch

from tformer.schema import ConfigError
from tformer.train.config import ParallelConfig

# every transformer block (decoder, encoder, encoder-decoder stacks) is one FSDP2 unit
FSDP_UNITS: tuple[str, ...] = (r"(^|\.)blocks\.\d+$",)

# MoE token counters: each rank counts its own tokens; update_expert_biases / moe_routing_stats sum them
RANK_LOCAL: tuple[str, ...] = ("router.tokens_per_expert", "router.window_tokens")

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}

# tensor parallelism: which linear layers are split, and how (self- and cross-attention, dense FFNs, the
# LM head: "vocab" splits the vocabulary, tformer.distributed.vocab; a head tied to the embedding stays
# whole)
TP_STYLES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(attn|cross_attn)\.(q_proj|k_proj|v_proj)$", "colwise"),
    (r"(^|\.)(attn|cross_attn)\.o_proj$", "rowwise"),
    (r"(^|\.)ffn\.(gate_proj|up_proj)$", "colwise"),
    (r"(^|\.)ffn\.down_proj$", "rowwise"),
    # the shared experts of an MoE layer whose routed experts stay whole (biases, an indivisible width):
    # split like a dense FFN, their output all-reduced inside the layer (layers split by width
    # split theirs in tformer.distributed.expert_width and reduce them with the routed experts')
    (r"(^|\.)ffn\.shared\.(gate_proj|up_proj)$", "colwise"),
    (r"(^|\.)ffn\.shared\.down_proj$", "rowwise_reduced"),
    (r"^lm_head$", "vocab"),
)


@dataclass(frozen=True)
class ParallelPlan:
    data: str = "none"
    expert_parallel: bool = False
    fsdp_units: tuple[str, ...] = FSDP_UNITS
    param_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    tensor: int = 1
    sequence: bool = False
    tp_styles: tuple[tuple[str, str], ...] = TP_STYLES

    def is_fsdp_unit(self, module_name: str) -> bool:
        return any(re.search(pattern, module_name) for pattern in self.fsdp_units)

    def tp_style(self, module_name: str) -> str | None:
        return next((style for pattern, style in self.tp_styles if re.search(pattern, module_name)), None)


def make_plan(cfg: ParallelConfig, world_size: int) -> ParallelPlan:
    """The plan for a ParallelConfig at a world size (nothing to do for one process)."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size == 1:
        return ParallelPlan()
    if world_size % cfg.tensor:
        raise ConfigError(f"parallel.tensor={cfg.tensor} must divide the world size {world_size}")
    data = cfg.data
    if cfg.tensor > 1:
        if world_size // cfg.tensor == 1 and cfg.experts == "shard":
            raise ConfigError(
                f"parallel.experts=shard with parallel.tensor={cfg.tensor} on {world_size} processes: the experts "
                "are split over the data-parallel ranks, and one tensor-parallel group spanning every process "
                "leaves one (use more processes, or experts=replicate)"
            )
        if world_size // cfg.tensor == 1:
            if cfg.param_dtype != "float32":
                raise ConfigError(
                    f"parallel.param_dtype={cfg.param_dtype} is FSDP2 mixed precision over the data dimension, "
                    f"which parallel.tensor={cfg.tensor} on {world_size} processes leaves empty; use bf16 "
                    "autocast (dtype=bfloat16) instead"
                )
            data = "none"  # every rank is in the one tensor-parallel group: no data parallelism
        elif data != "fsdp":
            raise ConfigError(
                f"parallel.tensor={cfg.tensor} with {world_size // cfg.tensor} data-parallel groups needs "
                "parallel.data='fsdp' (FSDP2 over the data dimension of the mesh; DDP does not take "
                "tensor-parallel parameters)"
            )
    return ParallelPlan(
        data=data,
        expert_parallel=cfg.experts == "shard",
        param_dtype=DTYPES[cfg.param_dtype],
        reshard_after_forward=cfg.reshard_after_forward,
        tensor=cfg.tensor,
        sequence=cfg.sequence,
    )


def is_rank_local(state_key: str) -> bool:
    return state_key.endswith(RANK_LOCAL)
