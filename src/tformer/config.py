"""Model configuration: the schema every switch of tformer lives in (no torch import).

`ModelConfig` picks the architecture and every component; `RopeConfig` and `MoEConfig` are nested.
All are frozen dataclasses validated at construction (see `tformer.schema`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from tformer.schema import Config, ConfigError

__all__ = ["ConfigError", "MoEConfig", "ModelConfig", "RopeConfig"]

ARCHS = ("decoder", "encoder", "encoder_decoder")
# the largest BPE vocabulary tformer trains (1,048,576: above those in use; the tokenizers library aborts
# the process trying to allocate for a huge one)
MAX_BPE_VOCAB = 1 << 20
MAX_SIZE = 2**31 - 1  # the largest width, vocabulary or context a config takes


@dataclass(frozen=True)
class RopeConfig(Config):
    """Rotary position embedding (Su et al., 2021) and its long-context scalings.

    theta: base of the frequencies theta_i = theta^(-2i/d).
    layout: "half" pairs feature i with i + d/2 (Llama / Hugging Face); "interleaved" pairs 2i with
        2i + 1 (the RoFormer paper). The two are permutations of each other.
    fraction: share of each head's features that is rotated (partial rotary, as in GPT-NeoX).
    scaling: "linear" position interpolation (Chen et al., 2023), "ntk" NTK-aware base change,
        "yarn" (Peng et al., 2023); `factor` stretches the trained context. `original_max_seq_len`
        (the trained context; default max_seq_len / factor), the yarn_beta_* and yarn_ramp are read by
        "yarn" only. yarn_ramp "rotations" blends each frequency by the paper's ramp of its rotations in
        the trained context; "dims" by a ramp over the dimension index between the dimensions where those
        rotation counts fall (the YaRN authors' code and Hugging Face's, so YaRN weights trained there
        keep their frequencies).
    cross_attention: rotate queries and keys in encoder-decoder cross-attention too (default no:
        source and target positions are different sequences, so their difference has no meaning).

    Read only when ModelConfig.positions is "rope" (so switching positions keeps one config whole).
    """

    theta: float = 10000.0
    layout: Literal["half", "interleaved"] = "half"
    fraction: float = 1.0
    scaling: Literal["none", "linear", "ntk", "yarn"] = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ramp: Literal["rotations", "dims"] = "rotations"
    cross_attention: bool = False

    def check(self) -> None:
        self._require(self.theta > 1.0, "theta", "must be > 1")
        self._require(0.0 < self.fraction <= 1.0, "fraction", "must be in (0, 1]")
        self._require(self.factor >= 1.0, "factor", "must be >= 1")
        if self.scaling == "none":
            self._require(self.factor == 1.0, "factor", "must be 1.0 when scaling is 'none'")
        if self.original_max_seq_len is not None:
            self._require(self.original_max_seq_len > 0, "original_max_seq_len", "must be > 0")
        self._require(
            self.yarn_beta_fast > self.yarn_beta_slow > 0, "yarn_beta_fast", "must be > yarn_beta_slow > 0"
        )


@dataclass(frozen=True)
class MoEConfig(Config):
    """Mixture-of-Experts in the FFN slot; Switch, GShard/Mixtral and DeepSeekMoE are settings of it.

    Layers: the first `first_dense` layers stay dense, then every `every`-th layer is MoE.
    Experts: n_experts routed FFNs of the model's kind (cfg.ffn) and width d_expert (default: the dense
        d_ff), top_k of them per token, plus n_shared shared experts of width d_shared (default
        d_expert) that see every token (DeepSeekMoE), run as one dense FFN of width n_shared * d_shared
        (d_shared is kept, unread, when n_shared is 0: the no-shared ablations drop only n_shared).
    Router: logits = x . centroid_e (fp32); scores = score_func(logits); the top_k experts by score
        (+ expert_bias, selection only); weights = the chosen scores, renormalised to sum 1 if
        norm_topk and top_k > 1 (with top_k = 1 that would make every weight 1 and cut the router off
        from the task gradient), times routed_scaling. Group-limited routing (DeepSeek-V2/V3): experts
        form n_group groups scored by their best expert ("max", V2) or their best two ("top2", V3);
        only the best topk_group groups are eligible. jitter: multiplicative U(1-j, 1+j) noise on the
        router input in training (Switch).
    Dispatch: "grouped" (sorted, one gather, per-expert matmuls, one scatter-add) or "loop" (the readable
        reference). capacity_factor: null = dropless; else each expert takes at most
        ceil(capacity_factor * tokens * top_k / n_experts) (<= tokens) assignments of a training forward,
        every token's first choice before any second choice (GShard's priority), token order within a
        choice. eval_capacity_factor: the same in eval mode (evaluation, generation,
        search); null (default) = dropless there, so a sequence's output never depends on the other
        sequences of its batch and cached decoding equals the full forward.
    Balance (each term's coefficient; 0 turns it off; all are averaged over MoE layers):
        aux_loss_coef     Switch/GShard = DeepSeekMoE expert-level: E * sum_i f_i P_i per layer
                          (f_i: share of the layer's assignments, P_i: mean router probability); 1 when
                          uniform, E / top_k when collapsed.
        device_loss_coef  DeepSeekMoE device-level: experts in n_devices equal groups (n_devices must
                          divide n_experts, and only this term reads it; expert parallelism takes its
                          layout from torchrun).
        seq_aux_loss_coef DeepSeek-V3 sequence-wise: the expert-level loss per sequence, averaged.
        z_loss_coef       ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 ((ln E)^2
                          when every logit is 0; the only term that is not 1 at uniform routing).
        bias_update_rate  DeepSeek-V3 auxiliary-loss-free balancing: after each optimizer step
                          expert_bias_i += rate * sign(mean load - load_i).
    """

    n_experts: int = 8
    top_k: int = 2
    d_expert: int | None = None
    n_shared: int = 0
    d_shared: int | None = None
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk: bool = True
    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["max", "top2"] = "max"
    jitter: float = 0.0
    first_dense: int = 0
    every: int = 1
    capacity_factor: float | None = None
    eval_capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    device_loss_coef: float = 0.0
    n_devices: int = 1
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    dispatch: Literal["grouped", "loop"] = "grouped"

    def check(self) -> None:
        self._require(self.n_experts >= 1, "n_experts", "must be >= 1")
        self._require(
            1 <= self.top_k <= self.n_experts, "top_k", f"must be in [1, n_experts={self.n_experts}]"
        )
        for name in ("d_expert", "d_shared"):  # widths: bounded as ModelConfig's are
            value = getattr(self, name)
            if value is not None:
                self._require(0 < value <= MAX_SIZE, name, f"must be from 1 to {MAX_SIZE:,} (or null)")
        self._require(self.n_shared >= 0, "n_shared", "must be >= 0")
        self._require(self.routed_scaling > 0, "routed_scaling", "must be > 0")
        self._require(
            self.n_group >= 1 and self.n_experts % self.n_group == 0,
            "n_group",
            f"must be >= 1 and divide n_experts={self.n_experts}",
        )
        self._require(
            1 <= self.topk_group <= self.n_group, "topk_group", f"must be in [1, n_group={self.n_group}]"
        )
        if self.n_group > 1:
            per_group = self.n_experts // self.n_group
            self._require(
                self.topk_group * per_group >= self.top_k,
                "topk_group",
                f"must leave at least top_k={self.top_k} experts selectable",
            )
            if self.group_score == "top2":
                self._require(
                    per_group >= 2,
                    "group_score",
                    f"'top2' needs >= 2 experts per group (n_experts / n_group = {per_group})",
                )
        self._require(
            0 <= self.jitter < 1, "jitter", "must be in [0, 1) (the noise is U(1 - jitter, 1 + jitter))"
        )
        self._require(self.first_dense >= 0, "first_dense", "must be >= 0")
        self._require(self.every >= 1, "every", "must be >= 1")
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if value is not None:
                self._require(
                    math.isfinite(value) and value > 0,
                    name,
                    "must be a finite number > 0 (or null for dropless)",
                )
        for name in (
            "aux_loss_coef",
            "device_loss_coef",
            "seq_aux_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
        ):
            self._require(getattr(self, name) >= 0, name, "must be >= 0")
        self._require(
            self.n_devices >= 1 and self.n_experts % self.n_devices == 0,
            "n_devices",
            f"must be >= 1 and divide n_experts={self.n_experts}",
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_dense and (layer_idx - self.first_dense) % self.every == 0

    def expert_width(self, d_ff: int) -> int:
        """d_expert, or the dense d_ff when unset."""
        return self.d_expert if self.d_expert is not None else d_ff

    def shared_width(self, d_ff: int) -> int:
        """Width of one shared expert: d_shared, or d_expert when unset."""
        return self.d_shared if self.d_shared is not None else self.expert_width(d_ff)


SEQ2SEQ_ONLY = ("n_encoder_layers", "src_vocab_size")  # ModelConfig fields only arch encoder_decoder reads


@dataclass(frozen=True)
class ModelConfig(Config):
    """Everything that decides what a tformer model computes.

    arch: "decoder" (causal LM), "encoder" (bidirectional, classification head), "encoder_decoder"
        (seq2seq, cross-attention over the encoder memory).
    norm_placement: "post" is the original norm(x + f(x)); "pre" is x + f(norm(x)) with a final norm.
    positions: "sinusoidal" (the paper), "learned" absolute, "rope" (rotary, in attention), "none".
    ffn: "relu" (the paper), "gelu", "swiglu"; `moe` (if set) replaces the FFN in the MoE layers.
    init: "xavier" (uniform Glorot, as torch.nn.Transformer), "normal" (N(0, init_std)), "scaled"
        (N(0, init_std) with output projections divided by sqrt(2 n_layers), GPT-2 / Megatron).
    """

    arch: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    vocab_size: int = 32000
    src_vocab_size: int | None = None
    share_embeddings: bool = True
    tie_embeddings: bool = True
    d_model: int = 512
    n_layers: int = 6
    n_encoder_layers: int | None = None
    n_heads: int = 8
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 2048
    max_seq_len: int = 512
    dropout: float = 0.1
    attn_dropout: float = 0.0
    norm: Literal["layernorm", "layernorm_nobias", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: Literal["post", "pre"] = "post"
    positions: Literal["sinusoidal", "learned", "rope", "none"] = "sinusoidal"
    rope: RopeConfig = field(default_factory=RopeConfig)
    ffn: Literal["relu", "gelu", "swiglu"] = "relu"
    bias: bool = True
    attn_kernel: Literal["sdpa", "eager"] = "sdpa"
    embed_scale: bool = True
    n_classes: int = 2
    pooling: Literal["cls", "mean"] = "cls"
    init: Literal["xavier", "normal", "scaled"] = "xavier"
    init_std: float = 0.02
    moe: MoEConfig | None = None

    def check(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in (
            "vocab_size",
            "src_vocab_size",
            "d_model",
            "d_ff",
            "max_seq_len",
            "n_classes",
            "head_dim",
        ):
            value = getattr(self, name)  # beyond int32 torch overflows (or the allocation cannot exist)
            self._require(value is None or value <= MAX_SIZE, name, f"must be at most {MAX_SIZE:,}")
        for name in SEQ2SEQ_ONLY:  # an encoder's own depth and vocabulary are n_layers and vocab_size:
            if self.arch != "encoder_decoder":  # a setting it would ignore
                self._require(
                    getattr(self, name) is None,
                    name,
                    f"is for arch 'encoder_decoder' only (arch {self.arch!r} uses "
                    f"{'vocab_size' if name == 'src_vocab_size' else 'n_layers'}); leave it null",
                )
        if self.src_vocab_size is not None:
            self._require(
                self.src_vocab_size >= 1, "src_vocab_size", "must be >= 1 (or null: same as vocab_size)"
            )
            if self.share_embeddings and self.arch == "encoder_decoder":
                self._require(
                    self.src_vocab_size == self.vocab_size,
                    "src_vocab_size",
                    f"must equal vocab_size={self.vocab_size} when share_embeddings is true",
                )
        if self.n_encoder_layers is not None:
            self._require(
                self.n_encoder_layers >= 1, "n_encoder_layers", "must be >= 1 (or null: same as n_layers)"
            )
        if self.head_dim is None:
            self._require(
                self.d_model % self.n_heads == 0,
                "n_heads",
                f"must divide d_model={self.d_model} (or set head_dim)",
            )
        else:
            self._require(self.head_dim >= 1, "head_dim", "must be >= 1")
        if self.n_kv_heads is not None:
            self._require(
                self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
                "n_kv_heads",
                f"must be >= 1 and divide n_heads={self.n_heads}",
            )
        self._require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        self._require(0.0 <= self.attn_dropout < 1.0, "attn_dropout", "must be in [0, 1)")
        self._require(self.norm_eps > 0, "norm_eps", "must be > 0")
        self._require(self.n_classes >= 1, "n_classes", "must be >= 1")
        self._require(self.init_std > 0, "init_std", "must be > 0")
        if self.positions == "rope":
            rot = int(self.resolved_head_dim * self.rope.fraction)
            if rot < 2 or rot % 2:
                source = (
                    f"ModelConfig.head_dim={self.head_dim}"
                    if self.head_dim is not None
                    else f"head_dim={self.resolved_head_dim} (d_model={self.d_model} / n_heads={self.n_heads})"
                )
                raise ConfigError(
                    f"ModelConfig.rope.fraction={self.rope.fraction} gives {rot} rotated features of "
                    f"{source}; must be an even number >= 2"
                )
        if self.moe is not None:
            depth = max(
                self.n_layers, self.resolved_n_encoder_layers if self.arch == "encoder_decoder" else 0
            )
            if not any(self.moe.is_moe_layer(i) for i in range(depth)):
                raise ConfigError(
                    f"ModelConfig.moe: first_dense={self.moe.first_dense} and every={self.moe.every} leave no "
                    f"MoE layer among the model's {depth} layers; lower first_dense, or set moe to null for a "
                    "dense model"
                )

    @classmethod
    def from_dict(cls, data: dict[str, Any], _path: str | None = None) -> ModelConfig:
        """As Config.from_dict; a file, override or saved run that sets n_encoder_layers or src_vocab_size
        for an arch without a separate encoder (which never read them) has them dropped with a warning,
        so such runs still load (the constructor refuses them)."""
        if isinstance(data, dict) and data.get("arch", "decoder") != "encoder_decoder":
            unused = [k for k in SEQ2SEQ_ONLY if data.get(k) is not None]
            if unused:
                warnings.warn(
                    f"{_path or 'ModelConfig'}: {', '.join(f'{k}={data[k]}' for k in unused)} dropped: "
                    f"arch {data.get('arch', 'decoder')!r} has no separate encoder (it uses n_layers and "
                    "vocab_size)",
                    stacklevel=2,
                )
                data = {k: v for k, v in data.items() if k not in unused}
        return super().from_dict(data, _path=_path)

    # ----------------------------------------------------------------- resolved values
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def resolved_n_encoder_layers(self) -> int:
        return self.n_encoder_layers if self.n_encoder_layers is not None else self.n_layers

    @property
    def resolved_src_vocab_size(self) -> int:
        return self.src_vocab_size if self.src_vocab_size is not None else self.vocab_size
