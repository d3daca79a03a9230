"""Export a trained decoder LM as a Hugging Face `transformers` model directory.

`export_hf(run, out)` writes what `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` read: config.json, model.safetensors, generation_config.json and
the run's byte-level BPE as tokenizer.json (with tokenizer_config.json). The model family follows from
the run's architecture:

    dense FFN                                        -> LlamaForCausalLM
    MoE, softmax routing (Mixtral / DeepSeekMoE)     -> Qwen2MoeForCausalLM
    MoE, sigmoid routing (DeepSeek-V3 style)         -> Glm4MoeForCausalLM

Each is the same function as tformer's model, weight for weight: Pre-Norm RMSNorm blocks, RoPE in the
half layout over whole heads, gated SiLU FFNs. What the family cannot express is refused up front,
every such setting named (a Post-Norm or LayerNorm model, sinusoidal or no positions, a ReLU FFN, ...).
The rest is a renaming, plus three exact rewrites: an interleaved-RoPE model's q / k rows are reordered
per head into the half layout (the same q . k), an `embed_scale` model's sqrt(d_model) is folded into
its embedding (the head untied from it), and tformer's ungated shared experts become Qwen2-MoE's gated
one with a zero gate (sigmoid(0) = 1/2) over a doubled down projection. Before anything is written the
Hugging Face model, built in memory, must give the logits tformer's model gives on a sample of tokens
(fp32); the directory appears whole or not at all.

Needs `transformers` >= 5 (`pip install 'tformer[hf]'`); nothing else in tformer imports it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.train.interrupt import RaiseOnSignals

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_TOLERANCE = 1e-4  # max |difference| over the sample, relative to the logits' largest magnitude


class ExportError(ValueError):
    """A run that cannot be exported as asked (its settings are named), or an export that failed its check."""


@dataclass(frozen=True)
class Exported:
    path: Path
    architecture: str  # the Hugging Face class, e.g. "LlamaForCausalLM"
    max_logit_diff: float  # max |HF - tformer| over the check's sample, fp32
    parameters: int
    saved_logit_diff: float  # the same for the saved directory reloaded, in its dtype


# ----------------------------------------------------------------------------- what maps where


def hf_family(cfg: ModelConfig) -> str:
    """The family a decoder of `cfg` exports to; ExportError naming every setting none can express."""
    problems = []
    if cfg.arch != "decoder":
        problems.append(f"model.arch={cfg.arch!r} (only decoder LMs export as causal LMs)")
    for key, value, want in (
        ("norm_placement", cfg.norm_placement, "pre"),
        ("norm", cfg.norm, "rmsnorm"),
        ("positions", cfg.positions, "rope"),
        ("ffn", cfg.ffn, "swiglu"),
    ):
        if value != want:
            problems.append(f"model.{key}={value!r} (needs {want!r})")
    if cfg.positions == "rope":
        if cfg.rope.fraction != 1.0:
            problems.append(f"model.rope.fraction={cfg.rope.fraction} (needs 1.0: rotation over whole heads)")
        if cfg.rope.scaling not in ("none", "linear"):
            problems.append(f"model.rope.scaling={cfg.rope.scaling!r} (needs 'none' or 'linear')")
    moe = cfg.moe
    family = "llama"
    if moe is not None:
        family = "qwen2_moe" if moe.score_func == "softmax" else "glm4_moe"
        if cfg.bias:
            problems.append(
                "model.bias=true with MoE layers (their families have no output or expert biases)"
            )
        if moe.eval_capacity_factor is not None:
            problems.append(f"model.moe.eval_capacity_factor={moe.eval_capacity_factor} (Hugging Face's MoE "
                            "layers drop no tokens)")  # fmt: skip
        if family == "qwen2_moe":
            for key, value, want in (("n_group", moe.n_group, 1), ("routed_scaling", moe.routed_scaling, 1.0),
                                     ("bias_update_rate", moe.bias_update_rate, 0.0)):  # fmt: skip
                if value != want:
                    problems.append(f"model.moe.{key}={value} with softmax routing (needs {want})")
        else:
            if moe.every != 1:
                problems.append(f"model.moe.every={moe.every} with sigmoid routing (needs 1: MoE in every "
                                "layer after the first_dense ones)")  # fmt: skip
            if moe.n_group > 1 and moe.group_score != "top2":
                problems.append("model.moe.group_score='max' with n_group > 1 (needs 'top2')")
            if moe.n_shared and (moe.d_shared or moe.d_expert or cfg.d_ff) != (moe.d_expert or cfg.d_ff):
                problems.append(f"model.moe.d_shared={moe.d_shared} with sigmoid routing (needs the experts' "
                                f"width {moe.d_expert})")  # fmt: skip
            if moe.n_experts < 2:
                problems.append("model.moe.n_experts=1 with sigmoid routing (needs >= 2)")
    if problems:
        raise ExportError("this run cannot be exported as a Hugging Face model: " + "; ".join(problems))
    return family


def hf_config(cfg: ModelConfig, family: str, vocab_size: int, tied: bool, tokens: dict[str, int]) -> dict:
    """The keyword arguments of the family's `transformers` config class."""
    head = cfg.head_dim or cfg.d_model // cfg.n_heads
    rope = {"rope_type": "default", "rope_theta": cfg.rope.theta}
    if cfg.rope.scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": cfg.rope.theta, "factor": cfg.rope.factor}
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=head,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=tied,
        rope_parameters=rope,
        attention_dropout=0.0,
        **tokens,
    )
    moe = cfg.moe
    if family == "llama":
        return {**common, "attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    if family == "qwen2_moe":
        return {
            **common,
            "num_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.d_expert or cfg.d_ff,
            "shared_expert_intermediate_size": moe.n_shared * (moe.d_shared or moe.d_expert or cfg.d_ff),
            "norm_topk_prob": norm_topk(moe),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.n_layers) if not moe_layer(cfg, i)],
            "qkv_bias": False,
            "use_sliding_window": False,
            "output_router_logits": False,
        }
    return {
        **common,
        "attention_bias": False,
        "use_qk_norm": False,
        "rope_parameters": {**rope, "partial_rotary_factor": 1.0},
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.d_expert or cfg.d_ff,
        "n_shared_experts": moe.n_shared,
        "first_k_dense_replace": moe.first_dense,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": norm_topk(moe),
        "routed_scaling_factor": moe.routed_scaling,
    }


def norm_topk(moe) -> bool:
    """Whether the chosen experts' weights are renormalised: tformer leaves a top-1 choice's score as it
    is (Hugging Face would divide it by itself, giving 1)."""
    return moe.norm_topk and moe.top_k > 1


def moe_layer(cfg: ModelConfig, i: int) -> bool:
    return cfg.moe is not None and cfg.moe.is_moe_layer(i)


def hf_state(model: nn.Module, family: str) -> tuple[dict[str, Tensor], bool]:
    """tformer's weights under the family's names (fp32 copies where rewritten) and whether the head
    stays tied to the embedding. Every tformer parameter must land somewhere: one left over is an
    ExportError naming it."""
    cfg: ModelConfig = model.cfg
    state = dict(model.state_dict())
    head = cfg.head_dim or cfg.d_model // cfg.n_heads
    out: dict[str, Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> Tensor:
        used.add(name)
        return state[name]

    def rows(w: Tensor) -> Tensor:  # interleaved RoPE pairs (2i, 2i + 1) -> half pairs (i, i + d/2), per head
        if cfg.rope.layout != "interleaved":
            return w
        per_head = torch.cat([torch.arange(0, head, 2), torch.arange(1, head, 2)])
        order = (torch.arange(w.shape[0] // head)[:, None] * head + per_head).flatten()
        return w[order]

    emb = take("tok_embed.weight")
    lm_head = take("lm_head.weight")
    tied = emb.data_ptr() == lm_head.data_ptr()
    if cfg.embed_scale:  # x = E[t] * sqrt(D): folded into the lookup table; the head keeps E
        emb, tied = emb * math.sqrt(cfg.d_model), False
    out["model.embed_tokens.weight"] = emb
    out["lm_head.weight"] = lm_head
    out["model.norm.weight"] = take("final_norm.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = take(b + "attn_norm.weight")
        out[h + "post_attention_layernorm.weight"] = take(b + "ffn_norm.weight")
        for p in ("q", "k", "v", "o"):
            for kind in ("weight", "bias"):
                name = f"{b}attn.{p}_proj.{kind}"
                if name in state:
                    t = take(name)
                    out[f"{h}self_attn.{p}_proj.{kind}"] = rows(t) if p in "qk" else t
        if not moe_layer(cfg, i):
            for p in ("gate", "up", "down"):
                for kind in ("weight", "bias"):
                    if f"{b}ffn.{p}_proj.{kind}" in state:
                        out[f"{h}mlp.{p}_proj.{kind}"] = take(f"{b}ffn.{p}_proj.{kind}")
            continue
        out[h + "mlp.gate.weight"] = take(b + "ffn.router.weight")
        bias = take(b + "ffn.router.expert_bias")
        if family == "glm4_moe":
            out[h + "mlp.gate.e_score_correction_bias"] = bias.float()
        elif bias.any():
            raise ExportError(f"layer {i}'s router carries non-zero expert biases, which softmax routing in "
                              "Hugging Face cannot apply")  # fmt: skip
        used.update({b + "ffn.router.tokens_per_expert", b + "ffn.router.window_tokens"})  # training counters
        gate, up = take(b + "ffn.experts.gate_proj"), take(b + "ffn.experts.up_proj")
        out[h + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # (E, 2F, D): gate rows first
        out[h + "mlp.experts.down_proj"] = take(b + "ffn.experts.down_proj")
        shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
        for p in ("gate", "up", "down"):
            name = f"{b}ffn.shared.{p}_proj.weight"
            if name in state:
                t = take(name)
                # Qwen2-MoE scales its shared expert by sigmoid(gate . x): a zero gate halves it, exactly
                out[f"{h}mlp.{shared}.{p}_proj.weight"] = (
                    t * 2 if family == "qwen2_moe" and p == "down" else t
                )
            else:  # no shared expert: the family always has one, here of width 0
                shape = (cfg.d_model, 0) if p == "down" else (0, cfg.d_model)
                out[f"{h}mlp.{shared}.{p}_proj.weight"] = emb.new_zeros(shape)
        if family == "qwen2_moe":
            out[h + "mlp.shared_expert_gate.weight"] = emb.new_zeros(1, cfg.d_model)
    left = sorted(set(state) - used)
    if left:
        raise ExportError(f"tformer weights with no Hugging Face counterpart: {', '.join(left[:5])}")
    return out, tied


# ----------------------------------------------------------------------------- the export


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ExportError(
            "exporting to Hugging Face needs the transformers package: pip install 'tformer[hf]' "
            "(or pip install 'transformers>=5')"
        ) from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ExportError(
            f"exporting needs transformers >= 5 (installed: {transformers.__version__}): "
            "pip install -U 'transformers>=5'"
        )
    return transformers


def sample_ids(vocab_size: int, length: int, seed: int = 0) -> Tensor:
    """(2, length) token ids for the logit check: the same for every export of a vocabulary size."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (2, length), generator=g)


@torch.no_grad()
def export_hf(run, out: str | Path, dtype: str = "float32", check_tokens: int = 64) -> Exported:
    """Write the run (a `LoadedRun`, or a run or checkpoint directory) to the new directory `out` as a
    Hugging Face causal LM with its tokenizer; see the module docstring. `dtype`: the saved weights'
    type (the check runs in fp32 first). ExportError for a run the families cannot express, an `out`
    that exists, or logits that differ."""
    from tformer.runs import LoadedRun, load_run

    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(check_tokens, bool) or not isinstance(check_tokens, int) or check_tokens < 8:
        raise ExportError(
            f"check_tokens must be an int >= 8 (the logit check's sample length), got {check_tokens!r}"
        )
    out = check_out(out)
    transformers = _transformers()
    run = run if isinstance(run, LoadedRun) else load_run(run)
    model = run.model
    if next(model.parameters()).device.type != "cpu" or any(
        p.dtype != torch.float32 for p in model.parameters()
    ):
        model = copy.deepcopy(model).float().cpu()  # the check runs in fp32 on the CPU; the run's model stays
    training = model.training
    try:
        return _export(run, model.eval(), out, dtype, check_tokens, transformers)
    finally:
        model.train(training)


def _export(run, model: nn.Module, out: Path, dtype: str, check_tokens: int, transformers) -> Exported:
    cfg: ModelConfig = model.cfg
    family = hf_family(cfg)
    state, tied = hf_state(model, family)
    tok = run.tokenizer
    tokens = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    config_cls = getattr(transformers, FAMILIES[family].replace("ForCausalLM", "Config"))
    hf_cfg = config_cls(**hf_config(cfg, family, cfg.vocab_size, tied, tokens))
    experts = experts_implementation(cfg, DTYPES[dtype])
    with quiet(transformers):
        hf = getattr(transformers, FAMILIES[family])._from_config(
            hf_cfg, attn_implementation="sdpa", **({"experts_implementation": experts} if experts else {})
        )
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ExportError(f"the Hugging Face model does not take tformer's weights: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")  # fmt: skip
    if tied:
        hf.tie_weights()
    hf.eval()
    ids = sample_ids(cfg.vocab_size, min(check_tokens, cfg.max_seq_len))
    ours = model(ids).float()
    diff = check_logits(ours, hf, ids, "the Hugging Face model built from the run")
    if dtype != "float32":
        keep = tuple(getattr(hf, "_keep_in_fp32_modules_strict", None) or ())  # GLM-4-MoE's router weights
        tensors = [*hf.named_parameters(), *hf.named_buffers()]
        fp32 = {name: tensor.data.clone() for name, tensor in tensors if keep and name.endswith(keep)}
        hf = hf.to(DTYPES[dtype])
        hf.config.dtype = dtype
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if name in fp32:  # as trained, not rounded through the saved dtype
                tensor.data = fp32[name]
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:  # (a folder that takes no new directories: /proc, a read-only mount)
        raise ExportError(f"cannot write {out}: {e.strerror or e} in {out.parent}") from None
    try:
        with signals_interrupt(), quiet(transformers):
            hf.save_pretrained(tmp)
            hf.generation_config.save_pretrained(tmp)
            if experts:  # the library does not write it: read from config.json when the directory is loaded
                config = json.loads((tmp / "config.json").read_text())
                (tmp / "config.json").write_text(
                    json.dumps({**config, "experts_implementation": experts}, indent=2) + "\n"
                )
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_object=tok._backend,
                pad_token=tok.special_tokens[0],
                bos_token=tok.special_tokens[1],
                eos_token=tok.special_tokens[2],
                unk_token=tok.special_tokens[3],
                split_special_tokens=True,  # "<eos>" typed in text is text, as tformer encodes it
                add_bos_token=False,  # tformer LMs see no BOS: documents end in EOS, prompts start bare
                add_eos_token=False,
                model_max_length=cfg.max_seq_len,
            )
            fast.save_pretrained(tmp)
            # the directory as a user will load it, in the saved dtype: it must run, and say how close it is
            saved = transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()
            saved_diff = check_logits(ours, saved, ids, f"the saved {dtype} model", exact=dtype == "float32")
            (tmp / "tformer_export.json").write_text(json.dumps({
                "run_checkpoint": str(Path(run.checkpoint).resolve()), "step": run.step,
                "averaged_steps": list(run.averaged_steps), "architecture": FAMILIES[family], "dtype": dtype,
                "max_logit_diff_fp32": diff, "max_logit_diff_saved": saved_diff,
            }, indent=2) + "\n")  # fmt: skip
            umask = os.umask(0)
            os.umask(umask)
            for f in tmp.iterdir():  # mkdtemp's 0700 and the library's private files: as any new file
                f.chmod(0o666 & ~umask)
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            tmp.chmod(0o777 & ~umask)
            if os.path.lexists(out):  # made meanwhile: never replaced
                raise ExportError(f"{out} appeared while the export was written; nothing was replaced")
            os.rename(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot write {out}: {err.strerror or err}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, FAMILIES[family], diff, sum(p.numel() for p in hf.parameters()), saved_diff)


def experts_implementation(cfg: ModelConfig, dtype: torch.dtype) -> str | None:
    """ "eager" where the library's default experts kernel (`grouped_mm`) cannot take the experts' rows:
    torch's CPU grouped product needs the rows' bytes (d_model, the expert width) in multiples of 16, which
    the main job's width 172 in bf16 is not; None (the library's default) elsewhere."""
    if cfg.moe is None:
        return None
    size = torch.finfo(dtype).bits // 8  # and 4: the check runs in fp32 first
    widths = (cfg.d_model, cfg.moe.expert_width(cfg.d_ff))
    return None if all(w * s % 16 == 0 for w in widths for s in (4, size)) else "eager"


def signals_interrupt() -> RaiseOnSignals:
    """SIGTERM and a hang-up (SIGHUP) raise KeyboardInterrupt while the directory is written, as Ctrl-C
    does, so the temporary folder is removed (the exit status says which signal)."""
    return RaiseOnSignals("export stopped before its directory was complete; nothing was written")


def check_out(out: str | Path) -> Path:
    """`out` as a Path if it can be the new export directory; ExportError otherwise."""
    from tformer.train.run_dir import refuse_run_dir_in_checkpoints

    out = Path(out)
    if os.path.lexists(out):  # a link to nowhere too
        raise ExportError(
            f"{out} already exists: export writes a new directory (remove it or choose another)"
        )
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent} is not a directory")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: {out.parent} is not writable")
    try:
        refuse_run_dir_in_checkpoints(out)  # its files would mix with a checkpoint's
    except ValueError as err:
        raise ExportError(str(err).replace("the run directory", "the export directory")) from None
    return out


@contextmanager
def quiet(transformers):
    """The library's progress bars, info logs and init warnings (an empty shared expert's) kept off
    stderr: the export prints its own summary."""
    logging = transformers.utils.logging
    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def check_logits(ours: Tensor, hf: nn.Module, ids: Tensor, what: str, exact: bool = True) -> float:
    """Max |HF - tformer| logit over the sample `ids` (tformer's logits `ours`). `exact`: ExportError past
    LOGIT_TOLERANCE of the logits' scale (a float32 model); otherwise only non-finite logits are (weights
    rounded to bf16 / fp16 differ by their rounding; an fp16 overflow gives inf)."""
    try:
        theirs = hf(input_ids=ids, use_cache=False).logits.float()
    except RuntimeError as err:
        raise ExportError(
            f"{what} does not run: {' '.join(str(err).split())[:300]}; nothing was written"
        ) from None
    diff = (ours - theirs).abs().max().item()
    scale = max(1.0, ours.abs().max().item())
    if not math.isfinite(diff) or (exact and not diff <= LOGIT_TOLERANCE * scale):
        raise ExportError(f"{what} gives logits that differ from the run's by {diff:.3g} (scale {scale:.3g}); "
                          "nothing was written")  # fmt: skip
    return diff
