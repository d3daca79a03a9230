"""MoE block speed on CPU: tformer's grouped MoE vs its loop reference, Hugging Face's Mixtral and
DeepSeek-V3 MoE blocks (experts implementation "grouped_mm", the default a PreTrainedModel picks in
transformers 5.x, and "eager"), and a dense SwiGLU of the same active width.

Training: forward + backward of one block on 2048 tokens (8 x 256), d_model 512, fp32 (`--bf16`: the
forward under bf16 autocast, after 5 warm-up calls instead of 2, since torch's bf16 CPU products compile a
kernel for every new shape). Decode: forward only on 8 tokens (8 sequences x 1). Every variant runs in the same process, interleaved round-robin
with a rotating order after warm-up; we report the best time and paired-median ratios (the median over
rounds of the same-round time ratio). Both sides do the same work: the weights are copied from the HF
block into ours so routing is identical, and our balance-loss coefficients are 0 (HF computes its
auxiliary loss outside the block); ours still counts tokens per expert in training, HF does not.

    PYTHONPATH=src python benchmarks/bench_moe.py            # ~3-5 minutes, writes results/moe.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from tformer import ModelConfig, MoEConfig, keep_freed_memory
from tformer.model import grouped_linear as kernels_module
from tformer.model.ffn import SwiGLU
from tformer.model.linear import decoding_layout
from tformer.model.moe import MoE

D, BATCH, SEQ, DECODE_BATCH = 512, 8, 256, 8
CONFIGS = {
    "mixtral (8 x 1376, top-2)": dict(E=8, F=1376, K=2, shared=0),
    "deepseekmoe (64 x 344, top-6, +2 shared)": dict(E=64, F=344, K=6, shared=2),
}


# ----------------------------------------------------------------------------- machine load
def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class LoadMeter:
    def __enter__(self):
        self.t, self.busy, self.own = time.perf_counter(), cpu_busy_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t
        foreign = (cpu_busy_seconds() - self.busy) - (own_cpu_seconds() - self.own)
        self.result = {
            "wall_s": round(wall, 1),
            "foreign_cpu_share": round(max(foreign, 0.0) / (wall * os.cpu_count()), 3),
            "loadavg": os.getloadavg(),
        }


# ----------------------------------------------------------------------------- the blocks
def hf_blocks(E: int, F: int, K: int, shared: int) -> dict[str, nn.Module]:
    if shared:
        cfg = transformers.DeepseekV3Config(
            hidden_size=D,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=shared,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
        )
        block = DeepseekV3MoE
    else:
        cfg = transformers.MixtralConfig(
            hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K
        )
        block = MixtralSparseMoeBlock
    torch.manual_seed(0)
    blocks = {}
    for impl in ("grouped_mm", "eager"):
        c = cfg.__class__.from_dict(cfg.to_dict())
        c._experts_implementation = impl  # what PreTrainedModel sets ("grouped_mm" unless asked otherwise)
        blocks[impl] = block(c)
    for p in blocks["grouped_mm"].parameters():
        nn.init.normal_(p, std=0.02)
    blocks["eager"].load_state_dict(blocks["grouped_mm"].state_dict())
    return blocks


def ours(E: int, F: int, K: int, shared: int, dispatch: str, hf: nn.Module) -> MoE:
    moe = MoEConfig(
        n_experts=E,
        top_k=K,
        n_shared=shared,
        score_func="sigmoid" if shared else "softmax",
        aux_loss_coef=0.0,
        dispatch=dispatch,
    )
    block = MoE(ModelConfig(d_model=D, d_ff=F, ffn="swiglu", bias=False, moe=moe), 0)
    with torch.no_grad():  # the same weights as the HF block
        block.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        block.experts.gate_proj.copy_(gate)
        block.experts.up_proj.copy_(up)
        block.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj") if shared else ():
            getattr(block.shared, name).weight.copy_(getattr(hf.shared_experts, name).weight)
    return block


class WithKernel(nn.Module):
    """Runs `block` with another CPU grouped-matmul kernel for every call (the defaults are `moe.CPU_KERNEL`,
    and `moe.CPU_DECODE_KERNEL` for a few rows without a graph or row-blocked products)."""

    def __init__(self, block: MoE, kernel: str) -> None:
        super().__init__()
        self.block, self.kernel = block, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        defaults = kernels_module.CPU_KERNEL, kernels_module.CPU_DECODE_KERNEL
        kernels_module.CPU_KERNEL = kernels_module.CPU_DECODE_KERNEL = self.kernel
        try:
            return self.block(x)
        finally:
            kernels_module.CPU_KERNEL, kernels_module.CPU_DECODE_KERNEL = defaults


def variants(spec: dict) -> dict[str, nn.Module]:
    hf = hf_blocks(**spec)
    grouped = ours(**spec, dispatch="grouped", hf=hf["grouped_mm"])
    out = {
        "tformer grouped": grouped,
        "  kernel split+unbind": WithKernel(grouped, "split"),
        "  kernel F.grouped_mm": WithKernel(grouped, "grouped_mm"),
        "tformer loop": ours(**spec, dispatch="loop", hf=hf["grouped_mm"]),
        "HF grouped_mm (default)": hf["grouped_mm"],
        "HF eager": hf["eager"],
        "dense SwiGLU": SwiGLU(D, spec["K"] * spec["F"] + spec["shared"] * spec["F"], bias=False),
    }
    x = torch.randn(2, 16, D)
    with torch.no_grad():
        ref = out["HF grouped_mm (default)"].eval()(x)
        for name in [n for n in out if n not in ("HF grouped_mm (default)", "dense SwiGLU")]:
            torch.testing.assert_close(out[name].eval()(x), ref, rtol=1e-4, atol=1e-5, msg=name)
    return out


def active_matmul_params(spec: dict) -> int:
    return spec["E"] * D + 3 * D * spec["F"] * (spec["K"] + spec["shared"])


# ----------------------------------------------------------------------------- timing
def train_step(block: nn.Module, x: torch.Tensor, g: torch.Tensor, autocast=contextlib.nullcontext) -> None:
    for p in block.parameters():
        p.grad = None
    x.grad = None
    with autocast():
        y = block(x)
    (y[0] if isinstance(y, tuple) else y).backward(g)


def decode_step(block: nn.Module, x: torch.Tensor, reps: int, autocast=contextlib.nullcontext) -> None:
    """HF's blocks as they are; tformer's in the decoding mode `generate` enters (`decoding_layout`: few-row
    products as row-blocked batched products where they pay on this machine, docs/performance.md)."""
    ours = not type(block).__module__.startswith("transformers")
    with torch.inference_mode(), autocast(), decoding_layout(block) if ours else contextlib.nullcontext():
        for _ in range(reps):
            block(x)


def measure(
    blocks: dict[str, nn.Module], step, rounds: int, per_call: int, peak, warmup: int = 2
) -> tuple[dict, float]:
    """Times per call of every block, round-robin with a rotating order, and the best matmul GFLOP/s
    of `peak` timed once per round under the same conditions."""
    names = list(blocks)
    for name in names:  # warm-up
        for _ in range(warmup):
            step(blocks[name])
    times, peaks = {n: [] for n in names}, []
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            step(blocks[name])
            times[name].append((time.perf_counter() - t) / per_call)
        peaks.append(peak())
    return times, max(peaks)


def matmul_peak(rows: int, d_in: int, d_out: int, dtype: torch.dtype = torch.float32, reps: int = 1):
    """A probe returning the GFLOP/s of a (rows x d_in) @ (d_in x d_out) matmul in `dtype`, timed over
    `reps` back-to-back products (a few-row product takes tens of microseconds: timed alone, the clock's
    and the call's overhead and its noise had given decode MFUs above 100%)."""
    a, b = torch.randn(rows, d_in, dtype=dtype), torch.randn(d_in, d_out, dtype=dtype)

    def probe() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        return 2 * rows * d_in * d_out * reps / (time.perf_counter() - t) / 1e9

    probe()
    return probe


def summarize(times: dict[str, list[float]], tokens: int, flops_per_call: float, peak: float) -> dict:
    ref, dense = times["tformer grouped"], times["dense SwiGLU"]
    rows = {}
    hf = [n for n in times if n.startswith("HF")]
    fastest = min(hf, key=lambda n: min(times[n])) if hf else None  # HF's faster experts implementation
    for name, ts in times.items():
        rows[name] = {
            "best_ms": round(min(ts) * 1e3, 2),
            "median_ms": round(statistics.median(ts) * 1e3, 2),
            "tokens_per_s": round(tokens / min(ts)),
            "tformer_speedup": round(statistics.median(t / o for t, o in zip(ts, ref)), 2),
            "share_of_dense": round(statistics.median(d / t for d, t in zip(dense, ts)), 2),
            "mfu": round(flops_per_call / min(ts) / 1e9 / peak, 3),
            "times_ms": [round(t * 1e3, 3) for t in ts],  # per round: the paired medians can be recomputed
        }
    if fastest is not None:  # the ratio to quote: tformer against the faster of HF's two implementations
        rows["tformer grouped"]["vs_fastest_hf"] = {
            "peer": fastest,
            "paired_median": round(statistics.median(t / o for t, o in zip(times[fastest], ref)), 2),
            "best": round(min(times[fastest]) / min(ref), 2),
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="8 x 32 tokens, 2 rounds: a smoke check, not a measurement"
    )
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (--quick: 2)")
    ap.add_argument("--decode-reps", type=int, default=None, help="default 30 (--quick: 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="forwards under bf16 autocast (peaks in bf16)")
    ap.add_argument(
        "--out",
        default=None,
        help="default results/moe.json (--bf16: moe_bf16.json; --quick: moe_quick.json, moe_quick_bf16.json)",
    )
    args = ap.parse_args()
    args.seq = 32 if args.quick else SEQ
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.decode_reps = args.decode_reps or (3 if args.quick else 30)
    results_dir = Path(__file__).parent / "results"
    default = ("moe_quick" if args.quick else "moe") + ("_bf16" if args.bf16 else "") + ".json"
    args.out = args.out or str(results_dir / default)
    keep_freed_memory()  # as the tformer command line does; TFORMER_MALLOC=default: glibc's default
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = {}
    with LoadMeter() as load:
        for cname, spec in CONFIGS.items():
            results.update(bench_config(cname, spec, args))
    report(results, load.result, args)


def bench_config(cname: str, spec: dict, args) -> dict:
    blocks = variants(spec)
    seq = args.seq
    dtype, autocast, warmup = torch.float32, contextlib.nullcontext, 2
    if args.bf16:
        dtype, autocast, warmup = torch.bfloat16, lambda: torch.autocast("cpu", dtype=torch.bfloat16), 5
    peak = matmul_peak(BATCH * seq, D, spec["F"] * (spec["K"] + spec["shared"]), dtype)
    x = torch.randn(BATCH, seq, D, requires_grad=True)
    g = torch.randn(BATCH, seq, D)
    for b in blocks.values():
        b.train()
    train, train_peak = measure(blocks, lambda b: train_step(b, x, g, autocast), args.rounds, 1, peak, warmup)
    flops = 6 * BATCH * seq * active_matmul_params(spec)
    xd = torch.randn(DECODE_BATCH, 1, D)
    for b in blocks.values():
        b.eval()
    reps = args.decode_reps
    # the decode MFU's peak: the active width as one product of the decoding step's few rows (a 2048-row
    # peak, as until 2026-12-01, made every decode MFU look tiny)
    decode_probe = matmul_peak(DECODE_BATCH, D, spec["F"] * (spec["K"] + spec["shared"]), dtype, reps=200)
    decode, decode_peak = measure(
        blocks, lambda b: decode_step(b, xd, reps, autocast), args.rounds, reps, decode_probe, warmup
    )
    dflops = 2 * DECODE_BATCH * active_matmul_params(spec)
    return {
        f"{cname} | train fwd+bwd": summarize(train, BATCH * seq, flops, train_peak),
        f"{cname} | decode fwd, 8 tokens": summarize(decode, DECODE_BATCH, dflops, decode_peak),
        f"{cname} | matmul peak GFLOP/s (train, decode rounds)": [
            round(train_peak, 1),
            round(decode_peak, 1),
        ],
    }


def report(results: dict, load: dict, args) -> None:
    header = f"{'variant':<26}{'best ms':>10}{'tok/s':>10}{'tformer x':>11}{'of dense':>10}{'MFU':>7}"
    for key, rows in results.items():
        if not isinstance(rows, dict):
            print(f"{key}: {rows}")
            continue
        print(f"\n{key}\n{header}")
        for name, r in rows.items():
            print(
                f"{name:<26}{r['best_ms']:>10.2f}{r['tokens_per_s']:>10}{r['tformer_speedup']:>11.2f}"
                f"{r['share_of_dense']:>10.2f}{r['mfu']:>7.2f}"
            )
        versus = rows.get("tformer grouped", {}).get("vs_fastest_hf")
        if versus:
            print(
                f"tformer grouped vs the faster HF ({versus['peer']}): {versus['paired_median']:.2f}x paired "
                f"median, {versus['best']:.2f}x best"
            )
    print(
        f"\nforeign CPU share {load['foreign_cpu_share']:.1%} over {load['wall_s']} s, loadavg {load['loadavg']}"
        + ("  (above 15%: numbers unreliable)" if load["foreign_cpu_share"] > 0.15 else "")
    )
    print(
        "tformer x: paired-median time ratio variant / tformer grouped (>1: tformer faster); "
        "of dense: paired-median dense time / variant time."
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "shapes": {
                    "d_model": D,
                    "train_tokens": [BATCH, args.seq],
                    "threads": args.threads,
                    "decode_tokens": [DECODE_BATCH, 1],
                    "dtype": "bfloat16 autocast" if args.bf16 else "float32",
                    "rounds": args.rounds,
                    "decode_reps": args.decode_reps,
                },
                "configs": CONFIGS,
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                },
                "machine": {
                    "cpu": _cpu_name(),
                    "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(),
                    "malloc": keep_freed_memory(),
                },
                "load": load,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
