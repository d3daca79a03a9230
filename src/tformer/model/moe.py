"""Mixture-of-Experts FFN slot: y = sum_{e in topK(x)} g_e(x) FFN_e(x) + Shared(x).

Shapes: x (B, T, D) -> (B, T, D); inside, N = B * T tokens, E = n_experts, K = top_k, F = d_expert,
S <= N * K token-expert assignments kept after the capacity limit. Expert weights are stacked like E
linear layers, W (E, out, in): `experts.gate_proj` (E, F, D), `experts.up_proj` (E, F, D),
`experts.down_proj` (E, D, F), biases `*_bias` (E, out) when cfg.bias.

Dispatch is chosen at build time: `LoopDispatch` is the readable reference (one expert at a time);
`GroupedDispatch` sorts the assignments by expert, gathers once, runs contiguous per-expert matmuls
(`tformer.model.grouped_linear`) and scatter-adds once. The trainer's one channel is `moe_aux_loss`,
`moe_routing_stats` and `update_expert_biases` at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import ModelConfig, MoEConfig
from tformer.model.ffn import make_dense_ffn
from tformer.model.grouped_linear import DeviceCounts, grouped_linear
from tformer.model.router import BalanceLoss, Routing, Segments, TopKRouter, count_per_expert, probabilities


# ----------------------------------------------------------------------------- experts
def _same(t: Tensor | None) -> Tensor | None:
    return t


class Experts(nn.Module):
    """E FFNs of one kind; `forward(x, p)` is the FFN written once over projections `p`, which
    `grouped(counts)` binds to all experts' rows at once and `per_expert()` to each expert alone.
    `local` maps a stacked weight to what the kernels multiply by: the weight itself, or (set by a
    tensor-parallel plan, tformer.distributed.expert_width) this rank's slice of it."""

    projections: tuple[str, ...] = ("up_proj", "down_proj")
    local = staticmethod(_same)

    def __init__(self, n_experts: int, d_model: int, d_expert: int, bias: bool) -> None:
        super().__init__()
        self.n_experts = n_experts
        for name in self.projections:
            d_out, d_in = (d_model, d_expert) if name == "down_proj" else (d_expert, d_model)
            bound = d_in**-0.5  # nn.Linear's default init, expert by expert
            w = nn.Parameter(torch.empty(n_experts, d_out, d_in).uniform_(-bound, bound))
            self.register_parameter(name, w)
            b = nn.Parameter(torch.empty(n_experts, d_out).uniform_(-bound, bound)) if bias else None
            self.register_parameter(f"{name}_bias", b)

    def grouped(self, counts: list[int] | DeviceCounts) -> SimpleNamespace:
        """Projections over rows sorted by expert, counts[e] rows for expert e (`grouped_linear`)."""
        return SimpleNamespace(
            **{
                n: partial(
                    grouped_linear,
                    w=self.local(getattr(self, n)),
                    b=self.local(getattr(self, f"{n}_bias")),
                    counts=counts,
                )  # fmt: skip
                for n in self.projections
            }
        )

    def per_expert(self) -> list[SimpleNamespace]:
        """Each expert's projections, as views from one `unbind` per stacked tensor."""
        views = {n: self._unbind(self.local(getattr(self, n))) for n in self.projections}
        biases = {n: self._unbind(self.local(getattr(self, f"{n}_bias"))) for n in self.projections}
        return [
            SimpleNamespace(**{n: partial(F.linear, weight=views[n][e], bias=biases[n][e]) for n in views})
            for e in range(self.n_experts)
        ]

    def _unbind(self, t: Tensor | None) -> tuple:
        return (None,) * self.n_experts if t is None else t.unbind(0)


class ReluExperts(Experts):
    """down(relu(up(x))) per expert."""

    activation = staticmethod(F.relu)

    def forward(self, x: Tensor, p: SimpleNamespace) -> Tensor:
        return p.down_proj(self.activation(p.up_proj(x)))


class GeluExperts(ReluExperts):
    """down(gelu(up(x))) per expert."""

    activation = staticmethod(F.gelu)


class SwiGLUExperts(Experts):
    """down(silu(gate(x)) * up(x)) per expert."""

    projections = ("gate_proj", "up_proj", "down_proj")

    def forward(self, x: Tensor, p: SimpleNamespace) -> Tensor:
        return p.down_proj(F.silu(p.gate_proj(x)) * p.up_proj(x))


EXPERTS: dict[str, type[Experts]] = {"relu": ReluExperts, "gelu": GeluExperts, "swiglu": SwiGLUExperts}


class NoShared(nn.Module):
    """No shared experts: contributes nothing."""

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(())


# ----------------------------------------------------------------------------- capacity
class Dropless(nn.Module):
    """Every assignment is kept."""

    def limit(self, n_tokens: int) -> int:
        return n_tokens

    def sort(self, idx: Tensor) -> Tensor:
        """The N*K assignments (indices into idx (N, K) flattened) by expert, token order within."""
        return idx.flatten().argsort(stable=True)

    def trim(self, order: Tensor, expert: Tensor, counts: Tensor, n_tokens: int):
        return order, counts, counts.new_zeros(())


class Capacity(nn.Module):
    """Each expert keeps ceil(cf * N * K / E) assignments (<= N): every token's first choice before any
    token's second, and so on, in token order within a choice (GShard's priority: a token's second choice
    never pushes out another token's first). The rest are dropped: those tokens get nothing from that
    expert (the residual and shared experts remain).
    cf is capacity_factor in training mode and eval_capacity_factor in eval mode; None: no limit
    (an expert holds each token at most once, so a limit of N drops nothing)."""

    def __init__(self, moe: MoEConfig) -> None:
        super().__init__()
        # each factor as the fraction its decimal names (1.1 is 11/10, not 1.1000000000000000888...) and the
        # limit in integers, so a whole number of slots is not rounded up to one more (1.1 x 100 / 11 is 10)
        self.factor, self.eval_factor = (None if f is None else Fraction(repr(f)).as_integer_ratio() for f in
                                         (moe.capacity_factor, moe.eval_capacity_factor))  # fmt: skip
        self.top_k, self.n_experts = moe.top_k, moe.n_experts

    def limit(self, n_tokens: int) -> int:
        factor = self.factor if self.training else self.eval_factor
        if factor is None:
            return n_tokens
        num, den = factor
        return min(-(-num * n_tokens * self.top_k // (den * self.n_experts)), n_tokens)  # ceil, exact

    def sort(self, idx: Tensor) -> Tensor:
        """The N*K assignments (indices into idx (N, K) flattened) by expert, then by choice rank, then
        token: the order in which an expert's slots are filled. One sort of a unique key."""
        n, k = idx.shape
        a = torch.arange(n * k, device=idx.device)  # token-major: a = token * K + rank
        return (idx.flatten() * (n * k) + (a % k) * n + a // k).argsort()

    def trim(self, order: Tensor, expert: Tensor, counts: Tensor, n_tokens: int):
        """order (S,) assignments in `sort`'s order; expert (S,) their experts; counts (E,)."""
        cap = self.limit(n_tokens)
        if cap >= n_tokens:  # no expert holds a token twice: nothing to drop (and no data-dependent shape)
            return order, counts, counts.new_zeros(())
        starts = counts.cumsum(0) - counts  # (E,) first sorted slot of each expert
        keep = torch.arange(order.numel(), device=order.device) - starts[expert] < cap  # (S,)
        return order[keep], counts.clamp(max=cap), (~keep).sum()


# ----------------------------------------------------------------------------- dispatch
class Dispatch(nn.Module):
    """(experts, x (N, D), routing) -> (sum of weighted expert outputs (N, D) in >= fp32, dropped count)."""

    def __init__(self, capacity: nn.Module) -> None:
        super().__init__()
        self.capacity = capacity

    def kept(self, idx: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        """(the kept assignments (S,) as indices into idx (N, K) flattened, by expert; rows per expert (E,);
        the dropped count) under the capacity's order and limit."""
        flat = idx.flatten()  # (N*K,) expert of each assignment
        order = self.capacity.sort(idx)  # (N*K,)
        counts = count_per_expert(flat, n_experts)  # (E,)
        return self.capacity.trim(order, flat[order], counts, idx.shape[0])


class LoopDispatch(Dispatch):
    """Reference: for each expert, gather its tokens, run it, add its weighted output back."""

    def forward(self, experts: Experts, x: Tensor, route: Routing) -> tuple[Tensor, Tensor]:
        n, d = x.shape
        cap, dropped = self.capacity.limit(n), 0
        out = torch.zeros(n, d, device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
        for e, proj in enumerate(experts.per_expert()):
            slot, token = torch.where(e == route.idx.T)  # first choices first, token order within
            dropped += max(token.numel() - cap, 0)
            token, slot = token[:cap], slot[:cap]
            y = experts(x[token], proj)  # (n_e, D)
            out = out.index_add(0, token, y * route.weights[token, slot].unsqueeze(1))
        return out, torch.tensor(dropped, device=x.device)


# Whether the rows per expert stay a tensor on the GPU for the grouped_mm kernel. Read as a list, they cost
# one wait for the GPU per MoE layer (`tolist`) and one more per projection (`torch.tensor(counts,
# device=...)` copies from the host and waits for the stream), where the CPU could have queued the
# layer's remaining kernels; made into offsets on the device, they cost none (torch's grouped_mm still
# reads them on the host where it has no grouped GEMM for the dtype and loops over the experts).
DEVICE_COUNTS = True


def host_or_device(counts: Tensor) -> list[int] | DeviceCounts:
    """counts (E,) as `Experts.grouped` should get them: `DeviceCounts` on CUDA (`DEVICE_COUNTS`), a list
    elsewhere."""
    return DeviceCounts(counts) if counts.is_cuda and DEVICE_COUNTS else counts.tolist()


class GroupedDispatch(Dispatch):
    """Fast path: sort the N*K assignments by expert, one gather, grouped matmuls, one scatter-add."""

    def forward(self, experts: Experts, x: Tensor, route: Routing) -> tuple[Tensor, Tensor]:
        n, d = x.shape
        k = route.idx.shape[1]
        order, counts, dropped = self.kept(route.idx, experts.n_experts)  # (S,), (E,)
        token = order // k  # (S,)
        y = experts(x.index_select(0, token), experts.grouped(host_or_device(counts)))  # (S, D)
        weighted = y * route.weights.flatten().index_select(0, order).unsqueeze(1)  # (S, D), >= fp32
        return torch.zeros(n, d, device=x.device, dtype=weighted.dtype).index_add(0, token, weighted), dropped


DISPATCH: dict[str, type[Dispatch]] = {"loop": LoopDispatch, "grouped": GroupedDispatch}


# ----------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """y = sum_{e in topK} g_e(x) Expert_e(x) + Shared(x), token by token (Shazeer et al., 2017;
    GShard; Switch; DeepSeekMoE). Slots: router, experts, shared. In a training forward with grad
    enabled it also keeps `last_aux` (this layer's weighted balance losses) and `last_stats`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        moe = cfg.moe
        self.layer_idx = layer_idx
        d_expert, d_shared = moe.expert_width(cfg.d_ff), moe.shared_width(cfg.d_ff)
        self.router = TopKRouter(cfg.d_model, moe)
        self.experts = EXPERTS[cfg.ffn](moe.n_experts, cfg.d_model, d_expert, cfg.bias)
        shared_width = moe.n_shared * d_shared  # n_shared experts fused into one FFN: the sum of them
        self.shared = (
            make_dense_ffn(cfg.ffn, cfg.d_model, shared_width, cfg.bias) if moe.n_shared else NoShared()
        )
        limited = moe.capacity_factor is not None or moe.eval_capacity_factor is not None
        self.dispatch = DISPATCH[moe.dispatch](Capacity(moe) if limited else Dropless())
        self.balance = BalanceLoss(moe)
        self.last_aux: Tensor = torch.zeros(())
        self.last_stats: dict[str, Tensor] = {}

    def __getstate__(self) -> dict:
        """The module's state with the last training forward's loss and statistics detached: a copy
        (copy.deepcopy, torch.optim.swa_utils.AveragedModel) of a model that has trained had failed on
        that loss, a tensor inside the step's graph."""
        state = dict(self.__dict__)
        state["last_aux"] = self.last_aux.detach()
        state["last_stats"] = {k: v.detach() for k, v in self.last_stats.items()}
        return state

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:
        """x (B, T, D); tokens (B, T) bool, True for real tokens (None: all are). Padding is left out of
        the layer: no expert, capacity slot, load count, balance loss or statistic sees it, and its
        output there is 0 (padding is masked out of attention, pooling and the loss)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # (N, D)
        if tokens is None:
            return self.mix(flat, b).view(b, t, d)
        keep = tokens.reshape(-1).nonzero().squeeze(1)  # (N',) the real tokens, row-major
        # (none at all still runs the layer, on 0 tokens: an expert-parallel dispatch's collectives must run
        # on every rank, and the layer's balance loss and statistics must be this forward's)
        out = self.mix(flat.index_select(0, keep), Segments(keep // t, b))
        return torch.zeros_like(flat).index_copy(0, keep, out).view(b, t, d)

    def mix(self, flat: Tensor, groups: int | Segments) -> Tensor:
        """Routed experts + shared experts of N tokens (N, D); groups: the sequences they come from (an
        int B: N / B tokens each, in order)."""
        route = self.router(flat)
        routed, dropped = self.dispatch(self.experts, flat, route)  # (N, D) fp32
        if self.training and torch.is_grad_enabled():
            self.observe(route, dropped, groups)
        return routed.to(flat.dtype) + self.shared(flat)

    def observe(self, route: Routing, dropped: Tensor, groups: int | Segments) -> None:
        """Training-forward bookkeeping: counters, this layer's balance losses, statistics. Activation
        checkpointing's recomputation computes the losses again (it must save the tensors the forward
        saved) but keeps the forward's counters, losses and statistics: the forward counted these tokens,
        and a loss kept from the recomputation would hold its graph (the block's activations) after the
        backward."""
        again = recomputing()
        counts = self.router.count(route.idx, add=not again)
        none = route.idx.shape[0] == 0  # no token (a forward of padding alone): nothing to balance
        # 0 without tokens, in the graph like the losses it stands for
        aux = route.logits.sum() * 0.0 if none else self.balance(route, groups)
        if again:
            return
        self.last_aux = aux
        with torch.no_grad():
            if none:
                entropy = torch.zeros((), device=route.logits.device)
            else:
                p = probabilities(route.scores)
                entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()
        self.last_stats = {"counts": counts, "dropped": dropped, "entropy": entropy}


def recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recomputation of a block
    (tformer.model.recompute), whose tokens the forward before it already counted. torch's FSDP2 tells
    its backward hooks from its forward ones the same way. A forward between two backward calls (each
    micro-batch of gradient accumulation) is not inside one; tformer runs no forward from a backward hook."""
    return torch._C._current_graph_task_id() != -1


# ----------------------------------------------------------------------------- the trainer's channel
def _no_reduce(t: Tensor) -> None:
    """Single process: nothing to all-reduce."""


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> Tensor:
    """The weighted balance + z losses of each MoE layer's last training forward, averaged over the MoE
    layers (each layer's loss is computed from its own f and P). Add it to the task loss. A constant 0
    without graph when every coefficient is 0 or the model has no MoE layer."""
    layers = moe_layers(model)
    device = next(model.parameters()).device
    if not layers:
        return torch.zeros((), device=device)
    return torch.stack([m.last_aux.to(device) for _, m in layers]).mean()


@torch.no_grad()
def moe_routing_stats(
    model: nn.Module, reset_window: bool = True, all_reduce: Callable[[Tensor], object] = _no_reduce
) -> dict[str, dict]:
    """Per MoE layer (by module name), from its last training forward: `load` (share of assignments per
    expert), `max_vio` (max load / mean load - 1), `dropped` and `assignments` counts, router
    `entropy` (nats, mean over tokens), `aux_loss`; over the window since the last call with
    reset_window: `dead_experts` (ids that got no token) and `window_tokens`. Plain JSON-ready values.
    `all_reduce` (e.g. torch.distributed.all_reduce) sums the window counts over processes."""
    out = {}
    for name, layer in moe_layers(model):
        if not layer.last_stats:
            continue  # no training forward yet
        s, window = layer.last_stats, layer.router.window_tokens.clone()
        all_reduce(window)
        counts = s["counts"].double()
        total = counts.sum().clamp_min(1.0)
        out[name] = {
            "load": (counts / total).tolist(),
            "max_vio": float(counts.max() / (total / counts.numel()) - 1.0),
            "dropped": int(s["dropped"]),
            "assignments": int(counts.sum()),
            "entropy": float(s["entropy"]),
            "aux_loss": float(layer.last_aux),
            "dead_experts": (window == 0).nonzero().flatten().tolist(),
            "window_tokens": int(window.sum()),
        }
        if reset_window:
            layer.router.window_tokens.zero_()
    return out


def update_expert_biases(model: nn.Module, all_reduce: Callable[[Tensor], object] = _no_reduce) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): call after each optimizer step. Each MoE layer's
    expert_bias_i += bias_update_rate * sign(mean load - load_i), from the assignments its training
    forwards made since the last call (summed over processes by `all_reduce`); then the count restarts."""
    for _, layer in moe_layers(model):
        layer.router.update_bias(all_reduce)


def discard_expert_counts(model: nn.Module) -> None:
    """Forget the assignments counted since the last bias update: a skipped (non-finite) step's routing
    must not steer the next update."""
    for _, layer in moe_layers(model):
        layer.router.tokens_per_expert.zero_()
