"""The MoE router and the balance losses computed from its decisions.

Shapes: x (N, D) tokens (N = B * T); logits, scores, probs (N, E) over the E = n_experts experts;
idx, weights (N, K) with K = top_k. The router works in fp32 whatever the autocast dtype, because
top-K selection is a discontinuous function of its logits (Switch Transformer, ST-MoE).

Router (Shazeer et al., 2017; Switch; GShard; DeepSeekMoE):
    logits_e = x . c_e                      c_e: expert e's centroid, a row of `weight` (no bias)
    scores   = softmax(logits) | sigmoid(logits)
    idx      = topK(limit_groups(scores + expert_bias))     the bias steers selection only
    weights  = scale * renorm(scores[idx])                   never sees the bias
The balance losses equal 1 at uniform routing, except the z-loss, (ln E)^2 when every logit is 0 (see
`MoEConfig` for their coefficients).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import MoEConfig
from tformer.model.buffers import Float32Buffers


class Routing(NamedTuple):
    """One forward's routing decisions (all fp32 except idx)."""

    logits: Tensor  # (N, E)
    scores: Tensor  # (N, E) softmax or sigmoid of the logits
    idx: Tensor  # (N, K) chosen experts, best first
    weights: Tensor  # (N, K) combination weights


COUNT_CHUNK = 2**24  # comparisons (entries x experts) per pass of `count_by_comparison`: 16 MB of bools


def count_per_expert(idx: Tensor, n_experts: int) -> Tensor:
    """(E,) int64: how many entries of idx (any shape, values in [0, E)) name each expert. torch.bincount,
    except on CUDA, where bincount reads idx's largest and smallest values on the host (a wait for the
    GPU at every MoE layer); there `count_by_comparison`."""
    flat = idx.flatten()
    if not flat.is_cuda:
        return torch.bincount(flat, minlength=n_experts)
    return count_by_comparison(flat, n_experts)


def count_by_comparison(flat: Tensor, n_experts: int, chunk: int = COUNT_CHUNK) -> Tensor:
    """bincount of flat (S,) as a comparison of each entry with each expert id, summed: no value read on
    the host, the same sums in the same order at every call; in passes of at most `chunk` comparisons."""
    ids = torch.arange(n_experts, device=flat.device)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device)
    for part in flat.split(max(1, chunk // max(n_experts, 1))):
        counts += (part.unsqueeze(1) == ids).sum(0)
    return counts


SCORE_FUNCS: dict[str, Callable[[Tensor], Tensor]] = {
    "softmax": partial(torch.softmax, dim=-1),
    "sigmoid": torch.sigmoid,
}


class Jitter(nn.Module):
    """x * U(1 - eps, 1 + eps) in training (Switch Transformer's router input noise); x in eval."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        return x * torch.empty_like(x).uniform_(1.0 - self.eps, 1.0 + self.eps)


class GroupLimit(nn.Module):
    """Group-limited routing (DeepSeek-V2/V3): only experts in the best `topk_group` of `n_group` groups
    stay eligible. A group's score is its best expert's ("max", V2) or its best two summed ("top2", V3)."""

    def __init__(self, moe: MoEConfig) -> None:
        super().__init__()
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.per_group_k = 2 if moe.group_score == "top2" else 1

    def forward(self, s: Tensor) -> Tensor:
        return limit_groups(s, self.n_group, self.topk_group, self.per_group_k)


def limit_groups(s: Tensor, n_group: int, topk_group: int, per_group_k: int) -> Tensor:
    """Scores s (N, E) with the experts outside the best `topk_group` groups set to -inf."""
    n, e = s.shape
    groups = s.view(n, n_group, e // n_group)  # (N, G, E/G)
    group_score = groups.topk(per_group_k, dim=-1).values.sum(-1)  # (N, G)
    best = group_score.topk(topk_group, dim=-1).indices  # (N, topk_group)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
    return groups.masked_fill(~keep[..., None], float("-inf")).view(n, e)  # (N, E)


def renormalize(w: Tensor) -> Tensor:
    return w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


def keep_weights(w: Tensor) -> Tensor:
    return w


class TopKRouter(Float32Buffers):
    """Token-to-expert affinities and the top-K choice.

    Parameters and buffers (checkpoint keys): `weight` (E, D) the expert centroids; `expert_bias` (E,)
    the auxiliary-loss-free balancing bias; `tokens_per_expert` (E,) assignments seen by training
    forwards since the last bias update; `window_tokens` (E,) the same since the last statistics read.
    The two counters are each process's own (summed over processes when they are read;
    `tformer.distributed.plans.RANK_LOCAL`). `expert_bias` stays float32 when the model is cast.
    """

    FLOAT32_BUFFERS = ("expert_bias",)

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.routed_scaling = moe.routed_scaling
        self.bias_update_rate = moe.bias_update_rate
        self.weight = nn.Parameter(torch.empty(moe.n_experts, d_model))
        nn.init.uniform_(self.weight, -(d_model**-0.5), d_model**-0.5)
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(moe.n_experts, dtype=torch.long))
        self.register_buffer("window_tokens", torch.zeros(moe.n_experts, dtype=torch.long))
        self.jitter = Jitter(moe.jitter) if moe.jitter > 0 else nn.Identity()
        self.score_func = moe.score_func  # its name (the compiled decoding step reads it)
        self.score = SCORE_FUNCS[moe.score_func]
        self.limit_groups = GroupLimit(moe) if moe.n_group > 1 else nn.Identity()
        self.normalize = renormalize if moe.norm_topk and moe.top_k > 1 else keep_weights

    @property
    def centroids(self) -> Tensor:
        """(E, D): expert e's affinity with token x is x . centroids[e]."""
        return self.weight

    def forward(self, x: Tensor) -> Routing:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(
                self.jitter(x.float()), self.weight.float()
            )  # (N, E); fp32 noise on bf16 inputs too
            scores = self.score(logits)
            choice = self.limit_groups(scores + self.expert_bias.float())
            idx = choice.topk(self.top_k, dim=-1).indices  # (N, K)
            weights = self.normalize(scores.gather(-1, idx)) * self.routed_scaling  # (N, K)
        return Routing(logits, scores, idx, weights)

    def count(self, idx: Tensor, add: bool = True) -> Tensor:
        """One training forward's assignments per expert, (E,), added to the counters where `add`."""
        counts = count_per_expert(idx, self.weight.shape[0])  # (E,)
        if add:
            self.tokens_per_expert += counts
            self.window_tokens += counts
        return counts

    @torch.no_grad()
    def update_bias(self, all_reduce: Callable[[Tensor], object]) -> None:
        """expert_bias_i += u * sign(mean load - load_i) (DeepSeek-V3), then restart the count."""
        load = self.tokens_per_expert.float()
        all_reduce(load)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


# ----------------------------------------------------------------------------- balance losses
def probabilities(scores: Tensor) -> Tensor:
    """Scores normalised to sum 1 over experts (softmax scores already do; sigmoid ones do not). A token
    whose sigmoid scores all underflow to 0 gets probabilities 0 (no share of the balance loss, entropy 0),
    not 0 / 0 = NaN, which would have made the trainer skip the step."""
    return scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


class Segments(NamedTuple):
    """Which sequence each of N tokens comes from, when the sequences hold different numbers of them
    (padding left out): `ids` (N,) in [0, count)."""

    ids: Tensor
    count: int


def _balance(probs: Tensor, idx: Tensor, groups: Segments) -> Tensor:
    """E * sum_i f_i P_i within each group of tokens, averaged over the groups that hold a token.
    probs (N, E), idx (N, K); f_i: the group's share of assignments to i, P_i: its mean probability."""
    (seg, g), e, k = groups, probs.shape[-1], idx.shape[-1]
    tokens = count_per_expert(seg, g).to(probs.dtype)  # (G,) tokens per group (ids counted as experts' are)
    ones = torch.ones(idx.numel(), dtype=probs.dtype, device=probs.device)
    counts = torch.zeros(g * e, dtype=probs.dtype, device=probs.device)
    counts.index_add_(0, (seg[:, None] * e + idx).flatten(), ones)  # (G * E,) assignments per group, expert
    p_sum = torch.zeros(g, e, dtype=probs.dtype, device=probs.device).index_add_(0, seg, probs)
    # the groups that hold a token, by weight rather than by indexing (which would read them on the host)
    present = (tokens > 0).to(probs.dtype)  # (G,)
    held = tokens.clamp_min(1)[:, None]  # an empty group's sums are 0: any divisor leaves them 0
    f = counts.view(g, e) / (held * k)  # (G, E) share of the group's assignments
    p = p_sum / held  # (G, E) mean router probability
    return e * ((f * p).sum(-1) * present).sum() / present.sum()


def load_balance_loss(probs: Tensor, idx: Tensor) -> Tensor:
    """Switch/GShard auxiliary loss = DeepSeekMoE expert-level balance loss, over one layer's N tokens.

    E * sum_i f_i P_i with f_i = (assignments to i) / (N K) and P_i = mean_t probs[t, i]. This is
    Switch's N * sum f_i P_i with f counted per assignment, so it is 1 at uniform routing and E / K
    when every token goes to the same K experts; DeepSeekMoE's f'_i = E f_i gives the same value.
    """
    return _balance(probs, idx, Segments(torch.zeros(len(probs), dtype=torch.long, device=probs.device), 1))


def seq_balance_loss(probs: Tensor, idx: Tensor, groups: int | Segments) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss: `load_balance_loss` within each sequence, averaged over
    the sequences (groups: B sequences of N / B tokens each, in order, or `Segments`; a sequence with
    no token is left out)."""
    if isinstance(groups, int):
        n = len(probs)
        groups = Segments(torch.arange(n, device=probs.device) // (n // groups), groups)
    return _balance(probs, idx, groups)


def device_balance_loss(probs: Tensor, idx: Tensor, n_devices: int) -> Tensor:
    """DeepSeekMoE's device-level balance loss: sum_d f'_d P'_d over n_devices equal groups of experts,
    f'_d = mean of f_i = E * share_i over the group, P'_d = sum of P_i over the group."""
    e = probs.shape[-1]
    counts = count_per_expert(idx, e).to(probs.dtype)  # (E,)
    f = counts * e / idx.numel()  # (E,) 1 for every expert at uniform load
    p = probs.mean(0)  # (E,)
    return (f.view(n_devices, -1).mean(-1) * p.view(n_devices, -1).sum(-1)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE: mean over tokens of logsumexp(logits)^2; keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# BalanceLoss's terms, each of (routing, probabilities, groups)
def _load_term(route: Routing, probs: Tensor, groups: int | Segments) -> Tensor:
    return load_balance_loss(probs, route.idx)


def _device_term(n_devices: int, route: Routing, probs: Tensor, groups: int | Segments) -> Tensor:
    return device_balance_loss(probs, route.idx, n_devices)


def _seq_term(route: Routing, probs: Tensor, groups: int | Segments) -> Tensor:
    return seq_balance_loss(probs, route.idx, groups)


def _z_term(route: Routing, probs: Tensor, groups: int | Segments) -> Tensor:
    return router_z_loss(route.logits)


class BalanceLoss(nn.Module):
    """The weighted sum of the balance terms whose coefficient is > 0 (chosen at build time); a
    constant 0 without autograd graph when there are none."""

    def __init__(self, moe: MoEConfig) -> None:
        super().__init__()
        terms = {  # module-level functions, not lambdas: the model pickles (torch.save of the module)
            "aux_loss_coef": _load_term,
            "device_loss_coef": partial(_device_term, moe.n_devices),
            "seq_aux_loss_coef": _seq_term,
            "z_loss_coef": _z_term,
        }
        self.terms = [(getattr(moe, name), fn) for name, fn in terms.items() if getattr(moe, name) > 0]

    def forward(self, route: Routing, groups: int | Segments) -> Tensor:
        """groups: the sequences the tokens come from (for the sequence-wise term), see seq_balance_loss."""
        probs = probabilities(route.scores)
        zero = torch.zeros((), device=route.logits.device)
        return sum((coef * fn(route, probs, groups) for coef, fn in self.terms), zero)
