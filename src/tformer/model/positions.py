"""Position information: added to the input (sinusoidal, learned) or rotated into Q and K (RoPE).

Shapes: x (B, T, D) token embeddings; q/k (B, H, T, E) per-head features; positions (B, T) or (T,)
absolute integer positions. `make_positions(cfg)` returns the pair (input hook, rotary hook); the
hook a scheme does not use is a null object (`NoPositions`, `NoRotary`), so the spine calls both.
Rotary hooks rotate one tensor (`rotary(x, positions)`) or queries and keys together
(`rotary.pair(q, k, positions)`, one table lookup for both). `HalfRotaryEmbedding` is the fast twin of
`RotaryEmbedding` for the common case (half layout, whole heads rotated); `make_positions` picks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from tformer.config import ModelConfig, RopeConfig
from tformer.model.buffers import Float32Buffers
from tformer.model.linear import records_graph


# --------------------------------------------------------------------------- input positions
def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)) (Vaswani et al., 2017)."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (ceil(D/2),)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, ceil(D/2))
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


class NoPositions(nn.Module):
    """Null object: the input carries no position information (RoPE or position-free models)."""

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x


class SinusoidalPositions(Float32Buffers):
    """x + PE[positions], a fixed table (not a parameter, not saved; float32 whatever the model's dtype)."""

    FLOAT32_BUFFERS = ("table",)

    def __init__(self, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        self.max_seq_len, self.d_model = max_seq_len, d_model
        for name, table in self.computed_buffers().items():
            self.register_buffer(name, table, persistent=False)

    def computed_buffers(self) -> dict[str, Tensor]:
        return {"table": sinusoidal_table(self.max_seq_len, self.d_model)}

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.table[positions].to(x.dtype)


class LearnedPositions(nn.Module):
    """x + P[positions], a learned table (BERT, GPT-2)."""

    def __init__(self, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        self.pos_embed = nn.Embedding(max_seq_len, d_model)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.pos_embed(positions)


# --------------------------------------------------------------------------- rotary
def rope_inv_freq(rot_dim: int, rope: RopeConfig, max_seq_len: int) -> tuple[Tensor, float]:
    """Per-pair angular frequencies theta_i (rot_dim/2,) after scaling, and the attention scale.

    none:   theta_i = base^(-2i/d)
    linear: theta_i / s                       (position interpolation: p -> p / s)
    ntk:    base' = base * s^(d / (d - 2))    (NTK-aware: high frequencies kept, low ones stretched)
    yarn:   theta_i blended between theta_i / s and theta_i by the ramp gamma(r_i) of the number of
            rotations r_i = L / wavelength_i in the trained context L, with a softmax temperature
            that scales q and k by 0.1 ln(s) + 1 (Peng et al., 2023). yarn_ramp "dims": gamma linear in
            the pair index i between the (floored / ceiled) indices where r_i = beta_fast and beta_slow.
    """
    i2 = torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim  # (d/2,) = 2i/d
    s = rope.factor
    if rope.scaling == "ntk":
        base = rope.theta * s ** (rot_dim / (rot_dim - 2)) if rot_dim > 2 else rope.theta * s
        return base**-i2, 1.0
    inv_freq = rope.theta**-i2
    if rope.scaling == "linear":
        return inv_freq / s, 1.0
    if rope.scaling == "yarn":
        original = rope.original_max_seq_len or max(1, int(max_seq_len / s))
        rotations = original * inv_freq / (2 * math.pi)  # r_i = L / lambda_i
        lo, hi = rope.yarn_beta_slow, rope.yarn_beta_fast
        if rope.yarn_ramp == "rotations":
            gamma = ((rotations - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: interpolate, 1: keep
        else:  # r_i = L theta^(-2i/d) / 2 pi  <=>  i = d ln(L / (2 pi r)) / (2 ln theta)

            def index(r: float) -> float:
                return rot_dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(rope.theta))

            first = max(math.floor(index(hi)), 0)  # pairs up to here keep their frequency
            last = min(math.ceil(index(lo)), rot_dim - 1)  # pairs from here are interpolated
            last = last + 0.001 if last == first else last
            pairs = torch.arange(rot_dim // 2, dtype=torch.float64)
            gamma = 1 - ((pairs - first) / (last - first)).clamp(0.0, 1.0)
        inv_freq = (1 - gamma) * inv_freq / s + gamma * inv_freq
        return inv_freq, 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    return inv_freq, 1.0


def rotate_half_layout(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pairs (j, j + r/2) of the first r features: Llama / Hugging Face layout."""
    r = cos.shape[-1] * 2
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rotate_interleaved_layout(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pairs (2j, 2j + 1) of the first r features: the RoFormer paper's layout."""
    r = cos.shape[-1] * 2
    x1, x2, rest = x[..., 0:r:2], x[..., 1:r:2], x[..., r:]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)  # (..., r)
    return torch.cat((rotated, rest), dim=-1)


ROPE_LAYOUTS = {"half": rotate_half_layout, "interleaved": rotate_interleaved_layout}


class NoRotary(nn.Module):
    """Null object: attention features are not rotated."""

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def pair(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


class RotaryEmbedding(Float32Buffers):
    """Rotate each pair of features of x (B, H, T, E) by angle p * theta_i (Su et al., 2021)."""

    FLOAT32_BUFFERS = ("cos", "sin")

    def __init__(self, head_dim: int, max_seq_len: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.rope = head_dim, max_seq_len, rope
        for name, table in self.computed_buffers().items():
            self.register_buffer(name, table, persistent=False)
        self.rotate = ROPE_LAYOUTS[rope.layout]

    def computed_buffers(self) -> dict[str, Tensor]:
        rot_dim = int(self.head_dim * self.rope.fraction)
        inv_freq, scale = rope_inv_freq(rot_dim, self.rope, self.max_seq_len)
        angle = torch.arange(self.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (P, r/2)
        return {"cos": (angle.cos() * scale).float(), "sin": (angle.sin() * scale).float()}

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        cos = self.cos[positions].to(x.dtype)  # (B, T, r/2) or (T, r/2)
        sin = self.sin[positions].to(x.dtype)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, r/2)
        return self.rotate(x, cos, sin)

    def pair(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self(q, positions), self(k, positions)


class HalfRotaryEmbedding(RotaryEmbedding):
    """Fast twin of RotaryEmbedding for the half layout with every feature rotated (Llama):
    x * [cos, cos] + [x2, x1] * [-sin, sin], with both full-width tables precomputed for every position,
    one lookup per (q, k) pair, no torch.cat of halves (in a decoding step q and k are concatenated and
    rotated as one tensor). Bit-identical to the reference (a - b == a + (-b)) without a graph; training
    (a graph, more than JOINT_MAX_T queries in `pair`) goes through `RotateHalves`, equal to one rounding."""

    FLOAT32_BUFFERS = ("cos", "sin", "cos_sin")

    def computed_buffers(self) -> dict[str, Tensor]:
        tables = super().computed_buffers()
        cos, sin = tables["cos"], tables["sin"]  # (P, E/2)
        tables["cos_sin"] = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)))  # (2, P, E)
        return tables

    def table(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        e = self.cos_sin.shape[-1]
        cos_sin = self.cos_sin.index_select(1, positions.flatten()).view(2, *positions.shape, e)
        cos_sin = cos_sin.to(dtype)  # (2, T, E) or (2, B, T, E)
        if positions.dim() == 2:
            cos_sin = cos_sin[:, :, None]  # (2, B, 1, T, E)
        return cos_sin[0], cos_sin[1]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.rotate_one(x, *self.table(positions, x.dtype))

    def pair(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.table(positions, q.dtype)
        if q.shape[-2] > JOINT_MAX_T:
            return self.rotate_one(q, cos, sin), self.rotate_one(k, cos, sin)
        # a decoding step: a few elements, where the number of ops is the cost: q and k as one tensor
        qk = rotate_whole_half_layout(torch.cat((q, k), dim=1), cos, sin)  # (B, H + Hkv, T, E)
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]

    @staticmethod
    def rotate_one(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if rotate_halves_applies(x):  # training: fewer passes, and the rotated x laid out (B, H, T, E)
            e = x.shape[-1] // 2
            return RotateHalves.apply(x, cos[..., :e], sin[..., e:])
        return rotate_whole_half_layout(x, cos, sin)


JOINT_MAX_T = 1  # query lengths up to which q and k rotate as one tensor (5x fewer us per step here)
FUSED_ROTARY = True  # False: training rotates through rotate_whole_half_layout's ops (the slow twin)


def rotate_halves_applies(x: Tensor) -> bool:
    """Where `RotateHalves` computes the rotation: x records a graph outside torch.compile (which fuses
    the reference's ops itself), plain CPU tensor of an even head width. (`pair` rotates a query length
    up to JOINT_MAX_T with the reference's joint ops before asking.)"""
    return (
        FUSED_ROTARY
        and records_graph(x)
        and type(x) is Tensor
        and x.device.type == "cpu"
        and x.shape[-1] % 2 == 0
        and not torch.compiler.is_compiling()
    )


def rotate_halves_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """out = [x1 cos - x2 sin, x2 cos + x1 sin] over the halves x1, x2 of x's last dimension (half-width
    cos and sin), written into out's halves: two products and two fused multiply-adds of half width."""
    e = x.shape[-1] // 2
    x1, x2, y1, y2 = x[..., :e], x[..., e:], out[..., :e], out[..., e:]
    torch.mul(x1, cos, out=y1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=y2).addcmul_(x1, sin)
    return out


class RotateHalves(torch.autograd.Function):
    """Training twin of `rotate_whole_half_layout`: y = x * [cos, cos] + [x2, x1] * [-sin, sin] as
    `rotate_halves_into`, and the backward as the rotation by minus the angle (dx = g * [cos, cos] -
    [g2, g1] * [-sin, sin], since rolling [-sin, sin] by half is its negative). Per tensor it runs 4
    half-width ops forward and 4 backward where autograd ran 4 + 4 full-width ones (a roll being a cat),
    and writes y contiguous in x's (B, H, T, E) shape, so attention reshapes it without a copy; the
    gradient comes back in x's own layout (the projection's (B, T, H, E)). Equal to the reference to
    rounding (a fused multiply-add rounds once). Measured on the LM training step (benchmarks/bench_lm.py
    shapes, 10 interleaved rounds, Intel Xeon, 2026-12-02): bf16 1.277x vs 1.248x HF paired with and
    without it (both with the RMSNorm of this day)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(cos, sin)
        ctx.layout = torch.empty_like(x, device="meta").stride()  # x's strides where x is dense
        return rotate_halves_into(torch.empty(x.shape, dtype=x.dtype, device=x.device), x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        cos, sin = ctx.saved_tensors
        dx = torch.empty_strided(g.shape, ctx.layout, dtype=g.dtype, device=g.device)
        return rotate_halves_into(dx, g, cos, -sin), None, None


def rotate_whole_half_layout(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., E) rotated with full-width tables cos = [cos, cos], sin = [-sin, sin] (..., E)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # roll by E/2: [x2, x1]


def make_rotary(head_dim: int, max_seq_len: int, rope: RopeConfig) -> RotaryEmbedding:
    """The fast twin where it applies (half layout, whole heads rotated), the reference otherwise."""
    whole = int(head_dim * rope.fraction) == head_dim
    fast = rope.layout == "half" and whole
    return (HalfRotaryEmbedding if fast else RotaryEmbedding)(head_dim, max_seq_len, rope)


POSITIONS: dict[str, Callable[[ModelConfig], tuple[nn.Module, nn.Module]]] = {
    "sinusoidal": lambda cfg: (SinusoidalPositions(cfg.max_seq_len, cfg.d_model), NoRotary()),
    "learned": lambda cfg: (LearnedPositions(cfg.max_seq_len, cfg.d_model), NoRotary()),
    "rope": lambda cfg: (NoPositions(), make_rotary(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope)),
    "none": lambda cfg: (NoPositions(), NoRotary()),
}


def make_positions(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """(input-position hook, rotary hook) for `cfg.positions`; the unused one is a null object."""
    return POSITIONS[cfg.positions](cfg)
