"""One optimizer step: micro-batches -> loss -> backward -> guard -> clip -> step.

The loss of a step is the sum of token losses over all its micro-batches divided by the step's total
target count (known before any backward), so gradient accumulation gives exactly the gradient of the
whole batch. MoE balance losses come in through `tformer.model.moe.moe_aux_loss`, the one channel.

Everything a step agrees on with other processes goes through one `Collectives` object: target and
loss sums, the gradient norm, the skip decision, the MoE load counts. `LOCAL` (one process) is the
null object; `tformer.distributed` supplies the process-group one, so a step means the same thing
at every world size: the gradient of the summed loss of all ranks' targets over their count.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tformer.model.moe import discard_expert_counts, moe_aux_loss, update_expert_biases


class LossFn(Protocol):
    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]:
        """(sum of per-target losses, number of targets) of one micro-batch."""


@dataclass
class StepResult:
    loss: float  # task loss per target (nats), averaged over the step's targets
    aux_loss: float  # MoE balance losses added to the objective
    grad_norm: float  # before clipping
    targets: int
    skipped: bool
    lr: float = 0.0  # the learning rate this step ran at (of the first parameter group)
    nonfinite_ranks: tuple[int, ...] = ()  # ranks whose own loss was not finite (skipped steps)


class Collectives(Protocol):
    loss_scale: float  # the task loss is multiplied by this (the world size where gradients are averaged)

    def sum(self, value: float) -> float:
        """The value summed over processes."""

    def ranks_where(self, flag: bool) -> tuple[int, ...]:
        """The ranks on which `flag` is true, the same tuple on every process."""

    def all_reduce(self, t: Tensor) -> None:
        """Sum `t` in place over processes."""

    def grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        """Global gradient norm before clipping; clips to max_norm when it is > 0."""

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Wraps one micro-batch's forward and backward; gradient reduction may wait for the last one."""


def local_grad_norm(params: list[Tensor], max_norm: float) -> float:
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0


class LocalCollectives:
    """One process: every collective is the identity."""

    loss_scale = 1.0

    def sum(self, value: float) -> float:
        return value

    def ranks_where(self, flag: bool) -> tuple[int, ...]:
        return (0,) if flag else ()

    def all_reduce(self, t: Tensor) -> None:
        pass

    def grad_norm(self, params: list[Tensor], max_norm: float) -> float:
        return local_grad_norm(params, max_norm)

    def micro_batch(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


LOCAL = LocalCollectives()


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


def cpu_has_native_bf16() -> bool | None:
    """Whether this x86 Linux CPU has bf16 matmul instructions (AVX512-BF16 or AMX); None if unknown."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """TrainConfig.dtype as the run computes: "auto" is "bfloat16" where the device multiplies bf16
    natively (CUDA with bf16 support; a CPU with AVX512-BF16 or AMX), else "float32"."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        native = device.type == "cpu" and bool(cpu_has_native_bf16())
    return "bfloat16" if native else "float32"


@contextlib.contextmanager
def deterministic_kernels(on: bool):
    """TrainConfig.deterministic: torch's deterministic algorithms inside the block, the process's own
    setting put back after it (also after an error). cuBLAS needs CUBLAS_WORKSPACE_CONFIG for it: set
    inside the block where the environment has none."""
    if not on:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    ours = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if ours:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if ours:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def autocast_context(device: torch.device, dtype: str):
    if dtype == "bfloat16":
        if device.type == "cpu" and cpu_has_native_bf16() is False:
            warnings.warn(
                "dtype=bfloat16 on a CPU without bf16 instructions (no AVX512-BF16 / AMX): bf16 matmuls "
                "are emulated and typically 10-20x slower than float32 here; set dtype=float32",
                RuntimeWarning,
                stacklevel=2,
            )
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    loss_fn: LossFn,
    micro_batches: list[Any],
    count_targets,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    autocast,
    comm: Collectives = LOCAL,
) -> StepResult:
    optimizer.zero_grad(set_to_none=True)  # gradients an interrupted step may have left
    total = max(1, int(comm.sum(sum(count_targets(b) for b in micro_batches))))
    loss_sum, aux_sum = 0.0, 0.0
    for i, batch in enumerate(micro_batches):
        with comm.micro_batch(model, last=i == len(micro_batches) - 1):
            with autocast:
                task_loss, _ = loss_fn(model, batch)
                aux = moe_aux_loss(model) / len(micro_batches)
                loss = task_loss * comm.loss_scale / total + aux
            loss.backward()
        loss_sum += task_loss.item()
        aux_sum += float(aux.detach())
    # the guard runs before optimizer.step(): clip_grad_norm_ of an inf gradient returns inf and turns
    # the gradients into NaN, which must never reach the weights. The decision is the same on every rank
    # (a rank's own loss tells where a non-finite value came from; the global norm catches the rest).
    bad_ranks = comm.ranks_where(not (math.isfinite(loss_sum) and math.isfinite(aux_sum)))
    loss_sum, aux_sum = comm.sum(loss_sum), comm.sum(aux_sum) / comm.loss_scale  # aux: mean over ranks
    grad_norm = comm.grad_norm([p for p in model.parameters() if p.grad is not None], grad_clip)
    skipped = bool(bad_ranks) or not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
        update_expert_biases(model, all_reduce=comm.all_reduce)
    else:
        discard_expert_counts(model)
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    with warnings.catch_warnings():  # a skipped first step: the schedule still counts it, on purpose
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
    return StepResult(loss_sum / total, aux_sum, grad_norm, total, skipped, lr, bad_ranks)
