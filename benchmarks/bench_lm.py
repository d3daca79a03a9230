"""Training speed of tformer's decoder LMs vs Hugging Face, side by side in one process.

Sections (each a round-robin of its variants, see harness.py for the method):
  dense  tformer `llama_like(vocab 8192, d_model 512, 8 layers, 8 heads, d_ff 1376)` vs HF
         `LlamaForCausalLM` and x-transformers' `Decoder` (rotary on the whole head, RMSNorm, SwiGLU:
         benchmarks/peers.py) at the same config, batch 8 x 256, fp32, plus the fp32 matmul peak on the
         model's own GEMM shapes (for MFU). `--no-x-transformers` leaves the second peer out.
  bf16   the same under `torch.autocast("cpu", torch.bfloat16)`, plus the bf16 matmul peak. On a CPU
         without bf16 instructions (no AVX512-BF16 / AMX) a full-size step takes minutes, so this
         section then runs at batch 1 x 256 and says so.
  moe    a DeepSeekMoE LM (first layer dense, then 64 routed experts of width 344, top-6, 2 shared,
         sigmoid scores, top-k renormalised) vs HF `DeepseekV3ForCausalLM` with the same widths and
         expert counts, fp32. HF's attention is MLA (low-rank K/V, rope on part of each head), ours is
         plain MHA: we pick kv_lora_rank so the attention parameters match within a few percent, and
         count each side's own FLOPs.
  moe-bf16  the same under bf16 autocast (batch 1 on a CPU without bf16 instructions, as bf16), then HF
         with its eager experts in a pass of its own (torch's autocast has no rule for grouped_mm, so
         HF's default experts stay fp32 under autocast; the eager ones run in bf16). The ratio to quote
         is against the faster of the two (`hf_eager_experts`).
  compile (only with --compile) tformer under torch.compile vs tformer eager, fp32.

A step is what both sides do: forward, the same cross-entropy on fp32 logits (computed outside both
models, as tformer's trainer does by default), backward, one fused AdamW step, zero_grad(set_to_none).
HF runs with use_cache=False. `--loss-ab` adds to the dense sections a row of tformer with its fused
head and loss (`fused_loss: true`, tformer.model.loss: no tokens x vocabulary logits; it saves memory).

Every model takes 3 untimed steps first (5 in the MoE bf16 section), then 8 timed rounds in a rotating
order (harness.round_robin).

    python benchmarks/bench_lm.py            # ~10 minutes on a 2-core CPU, writes results/lm.json
    python benchmarks/bench_lm.py --quick    # < 1 minute smoke check (tiny shapes)
    python benchmarks/bench_lm.py --device cuda --no-x-transformers --batch 32 --seq 1024  # on a GPU

`--device cuda` puts every model, batch and matmul-peak operand on the GPU (autocast on CUDA, fp32
without TF32, a synchronize around each timed product of the peak; every step ends in loss.item(),
which waits for the GPU)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    WARMUP_CALLS,
    LoadMeter,
    MatmulPeak,
    MatmulShape,
    cpu_info,
    linear_train_shapes,
    paired_median,
    print_table,
    round_robin,
    setup,
    summarize,
    use_device,
    write_json,
)
from peers import (  # noqa: E402
    hf_llama,
    hf_llama_state_for_tformer,
    tformer_llama,
    tformer_state_for_x_transformers,
    x_transformers_decoder,
)

from tformer import MoEConfig, build_model  # noqa: E402
from tformer.presets import llama_like  # noqa: E402

FULL = dict(vocab=8192, d_model=512, layers=8, heads=8, d_ff=1376, batch=8, seq=256, rounds=8)
QUICK = dict(vocab=1024, d_model=128, layers=2, heads=4, d_ff=344, batch=2, seq=64, rounds=2)
DEVICE = torch.device("cpu")  # main() sets --device: every model and batch moves there in make_step
MOE = dict(n_experts=64, top_k=6, d_expert=344, n_shared=2, first_dense=1)
MOE_QUICK = dict(n_experts=8, top_k=2, d_expert=96, n_shared=1, first_dense=1)
COLUMNS = [
    ("name", "variant", "s"),
    ("best_s", "best s", ".3f"),
    ("median_s", "median s", ".3f"),
    ("tok_s", "tok/s", ".0f"),
    ("vs_hf_best", "x HF (best)", ".2f"),
    ("vs_hf_paired", "x HF (paired med)", ".2f"),
    ("mfu", "MFU", ".0%"),
]


# ----------------------------------------------------------------------------- models
def tformer_dense(s: dict) -> nn.Module:
    return tformer_llama(s, max(512, s["seq"]))


def tformer_moe(s: dict, m: dict) -> nn.Module:
    moe = MoEConfig(
        n_experts=m["n_experts"],
        top_k=m["top_k"],
        d_expert=m["d_expert"],
        n_shared=m["n_shared"],
        first_dense=m["first_dense"],
        score_func="sigmoid",
        norm_topk=True,
        routed_scaling=1.0,
        aux_loss_coef=0.0,  # DeepSeek-V3 is auxiliary-loss free; HF computes no balance loss either
    )
    cfg = llama_like(s["vocab"], s["d_model"], s["layers"], s["heads"], None, s["d_ff"], max(512, s["seq"]))
    return build_model(cfg.replace(moe=moe))


def hf_deepseek_v3(s: dict, m: dict, experts: str = "grouped_mm") -> nn.Module:
    """experts: HF's experts implementation, "grouped_mm" (what a PreTrainedModel picks in transformers 5)
    or "eager" (a loop over the experts)."""
    head_dim = s["d_model"] // s["heads"]
    kv_lora_rank = kv_rank_matching_mha(s["d_model"], s["heads"], head_dim)
    cfg = transformers.DeepseekV3Config(
        vocab_size=s["vocab"],
        hidden_size=s["d_model"],
        intermediate_size=s["d_ff"],
        moe_intermediate_size=m["d_expert"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        n_shared_experts=m["n_shared"],
        n_routed_experts=m["n_experts"],
        num_experts_per_tok=m["top_k"],
        first_k_dense_replace=m["first_dense"],
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        rope_interleave=False,
        max_position_embeddings=max(512, s["seq"]),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_cache=False,
        num_mtp_layers=0,
    )
    model = transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    model.config._experts_implementation = (
        experts  # read at every forward (as benchmarks/bench_moe.py sets it)
    )
    return model


def kv_rank_matching_mha(d: int, heads: int, head_dim: int) -> int:
    """MLA's kv_lora_rank r whose K/V parameters D (r + E/2) + r H (E/2 + E) match MHA's 2 D H E."""
    r = (2 * d * heads * head_dim - d * head_dim // 2) / (d + heads * (head_dim // 2 + head_dim))
    return max(8, int(round(r / 8)) * 8)


def active_matmul_params(model: nn.Module, top_k: int = 0) -> float:
    """Weights one token multiplies: every 2-D weight but the input embedding (the output head and the
    routers included) and, of stacked (E, out, in) expert weights, top_k / E of them."""
    total = 0.0
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if id(p) in lookups or p.dim() < 2:
            continue
        total += p.numel() * (top_k / p.shape[0] if p.dim() == 3 else 1.0)
    return total


def train_flops(model: nn.Module, s: dict, top_k: int = 0, d_attn: int | None = None) -> float:
    """Model FLOPs of one training step: 6 x active matmul params per token + attention
    3 x 2 x T x (d_qk + d_v) per layer per token, full T x T (docs/performance.md, Method)."""
    d_attn = d_attn or s["d_model"]
    per_token = 6 * active_matmul_params(model, top_k) + 3 * 2 * s["seq"] * 2 * d_attn * s["layers"]
    return per_token * s["batch"] * s["seq"]


def dense_gemm_shapes(s: dict, tokens: int) -> list[MatmulShape]:
    d, f, n = s["d_model"], s["d_ff"], s["layers"]
    return (
        linear_train_shapes(tokens, d, d, 4 * n)
        + linear_train_shapes(tokens, d, f, 2 * n)
        + linear_train_shapes(tokens, f, d, n)
        + linear_train_shapes(tokens, d, s["vocab"], 1)
    )


# ----------------------------------------------------------------------------- one training step
def make_step(model: nn.Module, call: Callable, tokens: torch.Tensor, autocast) -> Callable[[], float]:
    """Closure doing forward and loss (`call(model, inputs, targets)`), backward and one fused AdamW step;
    returns the loss."""
    model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = tokens.to(DEVICE)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model.train()

    def step() -> float:
        with autocast():
            loss = call(model, inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def call_tformer(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits_loss(model(inputs), targets)


def call_tformer_fused(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`fused_loss: true`: the model's fused head and cross-entropy (summed; here the mean)."""
    return model(inputs, targets=targets) / targets.numel()


def call_plain(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A model whose forward returns the logits (x-transformers' TransformerWrapper)."""
    return logits_loss(model(inputs), targets)


def call_hf(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits_loss(model(input_ids=inputs, use_cache=False).logits, targets)


def bf16_autocast():
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- sections
def run_section(
    title: str,
    steps: dict[str, Callable],
    flops: dict[str, float],
    peaks: dict[str, MatmulPeak],
    s: dict,
    rounds: int,
    notes: list[str],
    warmup: int = WARMUP_CALLS,
) -> dict:
    """warmup: untimed steps of each model first (the first one's loss is recorded)."""
    variants = {**steps, **{f"matmul peak ({k})": p for k, p in peaks.items()}}
    first_losses = {name: fn() for name, fn in steps.items()}  # also the warm-up
    for _ in range(warmup - 1):
        for fn in steps.values():
            fn()
    with LoadMeter() as load:
        times = round_robin(variants, rounds, warmup=0)
    tokens = s["batch"] * s["seq"]
    ref = next(n for n in steps if n.startswith("HF"))
    rows = summarize({n: times[n] for n in steps}, ref, tokens)
    peak_gflops = {k: p.gflops_best() for k, p in peaks.items()}
    table = []
    for name, row in rows.items():
        mfu = {k: flops[name] / row.best_s / 1e9 / g for k, g in peak_gflops.items()}
        row.extra = {
            "tokens_per_s": round(tokens / row.best_s, 1),
            "model_gflop_per_step": round(flops[name] / 1e9, 2),
            "gflops_per_s": round(flops[name] / row.best_s / 1e9, 2),
            **{f"mfu_vs_{k}_peak": round(v, 3) for k, v in mfu.items()},
            "first_step_loss": round(first_losses[name], 5),
        }
        table.append(
            {
                "name": name,
                "best_s": row.best_s,
                "median_s": row.median_s,
                "tok_s": tokens / row.best_s,
                "vs_hf_best": row.speedup_best,
                "vs_hf_paired": row.speedup_paired,
                "mfu": next(iter(mfu.values())),
            }
        )
    peak_line = ", ".join(f"{k} {g:.1f} GFLOP/s" for k, g in peak_gflops.items())
    text = print_table(f"\n{title}", table, COLUMNS)
    for line in [
        f"matmul peak on the model's GEMM shapes: {peak_line} (MFU above is against the first)",
        load.line(),
        *notes,
    ]:
        print("  " + line)
    return {
        "title": title,
        "shape": {k: s[k] for k in ("batch", "seq")},
        "rounds": rounds,
        "rows": {n: r.as_dict() for n, r in rows.items()},
        "times_s": {n: [round(t, 5) for t in times[n]] for n in steps},
        "matmul_peak_gflops": {k: round(g, 2) for k, g in peak_gflops.items()},
        "load": load.result,
        "notes": notes,
        "table": text,
    }


FUSED = "tformer, fused head and loss"
HF_MOE, HF_MOE_EAGER = "HF DeepseekV3ForCausalLM", "HF DeepseekV3ForCausalLM, eager experts"
OURS_MOE = "tformer DecoderLM (MoE)"
OURS = "tformer DecoderLM"
XT = "x-transformers Decoder"


def dense_pair(s: dict) -> tuple[nn.Module, nn.Module]:
    """HF Llama and tformer's dense LM with the same weights (the same first loss)."""
    hf = hf_llama(s, max(512, s["seq"]), use_cache=False)
    ours = tformer_dense(s)
    ours.load_state_dict(hf_llama_state_for_tformer(hf), strict=True)
    return hf, ours


def dense_peaks(s: dict, dtype: str) -> dict[str, MatmulPeak]:
    """The matmul peak on the dense model's GEMM shapes: fp32, and bf16 first for a bf16 section."""
    shapes = dense_gemm_shapes(s, s["batch"] * s["seq"])
    peaks = {"fp32": MatmulPeak(shapes, torch.float32, DEVICE)}
    return {"bf16": MatmulPeak(shapes, torch.bfloat16, DEVICE), **peaks} if dtype == "bf16" else peaks


def autocast_for(dtype: str) -> Callable:
    return bf16_autocast if dtype == "bf16" else contextlib.nullcontext


def dense_section(s: dict, rounds: int, dtype: str, loss_ab: bool = False, xt_peer: bool = True) -> dict:
    torch.manual_seed(0)
    hf, ours = dense_pair(s)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    autocast = autocast_for(dtype)
    models = {"HF LlamaForCausalLM": hf, OURS: ours}
    steps = {
        "HF LlamaForCausalLM": make_step(hf, call_hf, tokens, autocast),
        OURS: make_step(ours, call_tformer, tokens, autocast),
    }
    if xt_peer:  # tformer's (HF's) weights in x-transformers' Decoder: the same function to its norm epsilon
        xt = x_transformers_decoder(s["vocab"], s["d_model"], s["layers"], s["heads"], s["d_ff"], s["seq"])
        xt.load_state_dict({**xt.state_dict(), **tformer_state_for_x_transformers(ours)}, strict=True)
        models[XT] = xt
        steps[XT] = make_step(xt, call_plain, tokens, autocast)
    if loss_ab:  # the same weights again, stepped by their own optimizer
        twin = copy.deepcopy(ours)
        models[FUSED] = twin
        steps[FUSED] = make_step(twin, call_tformer_fused, tokens, autocast)
    flops = {name: train_flops(m, s) for name, m in models.items()}
    peaks = dense_peaks(s, dtype)
    notes = ["same weights on every side; the first-step losses are printed in the JSON (first_step_loss)"]
    title = f"dense LM training step, {dtype}{' autocast' if dtype == 'bf16' else ''}, batch {s['batch']} x {s['seq']}"
    result = run_section(title, steps, flops, peaks, s, rounds, notes)
    if xt_peer:  # the second peer: tformer's speed-up over it, as over HF
        times = result["times_s"]
        ratio = {
            "paired_median": round(paired_median(times, XT, OURS), 3),
            "best": round(min(times[XT]) / min(times[OURS]), 3),
        }
        result["tformer_vs_x_transformers"] = ratio
        line = f"tformer vs {XT}: {ratio['paired_median']:.2f}x paired median, {ratio['best']:.2f}x best"
        result["notes"].append(line)
        print("  " + line)
    return result


EAGER_ROUNDS = 3  # HF's eager experts take ~6x HF's grouped_mm step here: 3 steps tell which is faster


def moe_section(s: dict, m: dict, rounds: int, dtype: str = "fp32", eager_peer: bool = True) -> dict:
    torch.manual_seed(0)
    autocast = autocast_for(dtype)
    hf = hf_deepseek_v3(s, m)
    ours = tformer_moe(s, m)
    for p in hf.parameters():  # HF leaves the router at zero until from_pretrained; give it a random init
        if p.dim() >= 2:
            nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    steps = {
        HF_MOE: make_step(hf, call_hf, tokens, autocast),
        OURS_MOE: make_step(ours, call_tformer, tokens, autocast),
    }
    models = {HF_MOE: hf, OURS_MOE: ours}
    # HF q/k heads are nope + rope = head_dim features, v heads head_dim: the same d_qk = d_v as ours
    d_attn_hf = s["heads"] * (s["d_model"] // s["heads"])
    flops = {
        name: train_flops(model, s, m["top_k"], d_attn_hf if name.startswith("HF") else None)
        for name, model in models.items()
    }
    tokens_n = s["batch"] * s["seq"]
    d, layers_moe = s["d_model"], s["layers"] - m["first_dense"]
    width = m["d_expert"] * (m["top_k"] + m["n_shared"])
    shapes = (
        linear_train_shapes(tokens_n, d, d, 4 * s["layers"])
        + linear_train_shapes(tokens_n, d, s["d_ff"], 2 * m["first_dense"])
        + linear_train_shapes(tokens_n, s["d_ff"], d, m["first_dense"])
        + linear_train_shapes(tokens_n, d, width, 2 * layers_moe)  # active experts as one dense FFN
        + linear_train_shapes(tokens_n, width, d, layers_moe)
        + linear_train_shapes(tokens_n, d, s["vocab"], 1)
    )
    params = {n: sum(p.numel() for p in mm.parameters()) for n, mm in (("HF", hf), ("tformer", ours))}
    attn = {
        "HF": sum(p.numel() for n, p in hf.named_parameters() if "self_attn" in n),
        "tformer": sum(p.numel() for n, p in ours.named_parameters() if ".attn." in n),
    }
    impl = getattr(hf.config, "_experts_implementation", None)
    notes = [
        f"attention differs: HF MLA (q_lora_rank none, kv_lora_rank {hf.config.kv_lora_rank}, rope on "
        f"{hf.config.qk_rope_head_dim} of {hf.config.qk_head_dim} q/k features per head) vs tformer MHA; "
        f"attention params HF {attn['HF']:,} vs tformer {attn['tformer']:,}",
        f"total params HF {params['HF']:,} vs tformer {params['tformer']:,}; HF experts implementation: {impl}",
        "each side initialised on its own (MLA and MHA hold different weights), from the same distributions: "
        "routing at the first steps differs between the sides",
        "MFU counts each side's own FLOPs (active experts + shared + router); the peak runs the active "
        "experts as one dense FFN of the same width",
    ]
    warmup = WARMUP_CALLS
    if dtype == "bf16":  # oneDNN compiles a kernel per new GEMM shape, and expert row counts vary
        warmup = 5
        notes.append(
            "5 untimed steps of each model first (on the CPU, oneDNN compiles a bf16 kernel per new GEMM shape)"
        )
    title = (
        f"DeepSeekMoE LM training step, {dtype}{' autocast' if dtype == 'bf16' else ''}, batch {s['batch']} "
        f"x {s['seq']}, {m['n_experts']} experts x {m['d_expert']} top-{m['top_k']} + {m['n_shared']} shared"
    )
    peaks = {"fp32": MatmulPeak(shapes, torch.float32, DEVICE)}
    if dtype == "bf16":
        peaks = {"bf16": MatmulPeak(shapes, torch.bfloat16, DEVICE), **peaks}
    result = run_section(title, steps, flops, peaks, s, rounds, notes, warmup)
    if dtype == "bf16" and eager_peer:
        # free tformer's model and both optimizers' states first: with a third 263M-parameter model and its
        # own AdamW beside them the process reached 23.6 GB and was killed on a 24 GB machine (2026-12-04)
        del steps, models, ours
        gc.collect()
        result["hf_eager_experts"] = eager_experts_pass(hf, s, m, tokens, autocast, result)
    return result


def eager_experts_pass(hf: nn.Module, s: dict, m: dict, tokens, autocast, result: dict) -> dict:
    """HF's other experts implementation in bf16: torch's autocast has no rule for grouped_mm, so HF's
    default experts stay fp32 under autocast, while its eager ones (a loop of linear layers) run in bf16.
    Timed in a pass of its own after the interleaved rounds: interleaved, its products of a new row count
    per expert and step flood oneDNN's kernel cache and evict the other models' bf16 kernels (tformer's
    step went from 1.6 to 2.6 s in such a run, 2026-12-03). The ratio to quote is against the faster HF."""
    eager = hf_deepseek_v3(s, m, experts="eager")
    eager.load_state_dict(hf.state_dict())
    step = make_step(eager, call_hf, tokens, autocast)
    for _ in range(2):
        step()
    times = []
    for _ in range(EAGER_ROUNDS):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    grouped, ours = min(result["times_s"][HF_MOE]), min(result["times_s"][OURS_MOE])
    fastest = HF_MOE if grouped <= min(times) else HF_MOE_EAGER
    ratio = round(min(grouped, min(times)) / ours, 3)
    line = (
        f"{HF_MOE_EAGER}, its own pass ({EAGER_ROUNDS} steps after 2 untimed): best {min(times):.3f} s, "
        f"median {statistics.median(times):.3f} s; tformer vs the faster HF ({fastest}): {ratio:.2f}x best"
    )
    result["notes"].append(line)
    print("  " + line)
    return {
        "times_s": [round(t, 5) for t in times],
        "fastest_hf": fastest,
        "tformer_vs_fastest_hf_best": ratio,
    }


def compile_section(s: dict, rounds: int, dtype: str) -> dict:
    """Both sides eager and under torch.compile (inductor, default mode) of the model forward."""
    torch.manual_seed(0)
    hf, ours = dense_pair(s)
    hf_c, ours_c = copy.deepcopy(hf), copy.deepcopy(ours)  # the compiled twins, with the same weights
    hf_fwd, ours_fwd = torch.compile(hf_c), torch.compile(ours_c)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1))
    autocast = autocast_for(dtype)
    steps = {
        "HF LlamaForCausalLM": make_step(hf, call_hf, tokens, autocast),
        "HF torch.compile": make_step(hf_c, lambda m, x, t: call_hf(hf_fwd, x, t), tokens, autocast),
        "tformer eager": make_step(ours, call_tformer, tokens, autocast),
        "tformer torch.compile": make_step(
            ours_c, lambda m, x, t: call_tformer(ours_fwd, x, t), tokens, autocast
        ),
    }
    flops = {n: train_flops(ours, s) for n in steps}
    peaks = dense_peaks(s, dtype)
    for name, step in steps.items():  # compile here, untimed (run_section's warm-up is one more call)
        t = time.perf_counter()
        step()
        print(f"  {name}: first call {time.perf_counter() - t:.1f} s", file=sys.stderr)
    notes = [
        "torch.compile (inductor) of each model's forward; the first calls (compile) are untimed; "
        "x HF is against HF eager: compiled vs compiled is the ratio of the two compiled rows"
    ]
    title = f"dense LM, eager and torch.compile, {dtype}{' autocast' if dtype == 'bf16' else ''}, batch {s['batch']} x {s['seq']}"
    out = run_section(title, steps, flops, peaks, s, rounds, notes)
    ratio = paired_median(out["times_s"], "HF torch.compile", "tformer torch.compile")
    out["compiled_vs_compiled_paired"] = round(ratio, 3)
    print(f"  tformer torch.compile vs HF torch.compile, paired median: {ratio:.3f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke check in < 1 minute")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["dense", "bf16", "moe", "moe-bf16", "compile", "compile-bf16"],
        default=["dense", "bf16", "moe", "moe-bf16"],
    )
    ap.add_argument("--compile", action="store_true", help="add the torch.compile section")
    ap.add_argument(
        "--loss-ab",
        action="store_true",
        help=f"dense sections: add a row '{FUSED}' (fused_loss: true)",
    )
    ap.add_argument(
        "--no-x-transformers", action="store_true", help="dense sections: HF Llama as the only peer"
    )
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: every model on the GPU (default cpu)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --quick 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file name under benchmarks/results/")
    args = ap.parse_args()
    setup(args.threads)
    global DEVICE
    DEVICE = use_device(args.device)
    s = dict(QUICK if args.quick else FULL)
    s.update({k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None})
    rounds = s["rounds"] = args.rounds or s["rounds"]  # (the JSON's config says the rounds run)
    sections = list(args.only) + (["compile"] if args.compile and "compile" not in args.only else [])
    results = {}
    for name in sections:
        if name == "dense":
            results["dense_fp32"] = dense_section(s, rounds, "fp32", args.loss_ab, not args.no_x_transformers)
        elif name == "bf16":
            sb = dict(s)
            if DEVICE.type == "cpu" and not cpu_info()["native_bf16_matmul"] and not args.quick:
                sb["batch"] = 1  # a bf16 GEMM without bf16 instructions runs ~15-20x below fp32 here
            results["dense_bf16"] = dense_section(
                sb, rounds, "bf16", args.loss_ab, not args.no_x_transformers
            )
            if sb["batch"] != s["batch"]:
                note = (
                    "this CPU has no bf16 matmul instructions (no AVX512-BF16/AMX): torch's bf16 GEMM is "
                    "emulated, so the section runs at batch 1"
                )
                results["dense_bf16"]["notes"].append(note)
                print("  " + note)
        elif name == "moe":
            results["moe_fp32"] = moe_section(s, MOE_QUICK if args.quick else MOE, rounds)
        elif name == "moe-bf16":
            sb = dict(s)
            if DEVICE.type == "cpu" and not cpu_info()["native_bf16_matmul"] and not args.quick:
                sb["batch"] = 1  # as the dense bf16 section
            results["moe_bf16"] = moe_section(sb, MOE_QUICK if args.quick else MOE, rounds, "bf16")
        elif name == "compile":
            results["compile_fp32"] = compile_section(s, rounds, "fp32")
        elif name == "compile-bf16":
            results["compile_bf16"] = compile_section(s, rounds, "bf16")
    out = args.out or ("lm_quick.json" if args.quick else "lm.json")
    write_json(out, {"config": s, "moe": MOE_QUICK if args.quick else MOE, "sections": results})


if __name__ == "__main__":
    main()
