"""Greedy decoding speed: tformer's `generate` vs Hugging Face `generate`, same weights, one process.

The model is the dense LM of bench_lm.py (`llama_like(vocab 8192, d_model 512, 8 layers, 8 heads,
d_ff 1376)`), built as HF `LlamaForCausalLM` (sdpa attention) and its weights copied into tformer, and
from tformer into x-transformers' `Decoder` (benchmarks/peers.py; its `AutoregressiveWrapper.generate`
with its KV cache, eager; `--no-x-transformers` leaves it out). Each call
decodes `--new` (256) tokens greedily after a `--prompt` (32) token prompt, at batch 1 and batch 8,
with no EOS on either side (HF: eos_token_id None, min_new_tokens = max_new_tokens) so both produce
exactly the same number of tokens; a call includes the prefill and its own KV cache. The generated
ids of both sides are compared and the result printed. Rounds are interleaved (see harness.py).

Both sides also decode compiled (leave out with --no-compile): tformer's `generate(compile=True)` (each
step after the prompt as `tformer.model.compiled_step`'s program under torch.compile) and HF's own
compiled decoding (a static cache and its forward under torch.compile), so the eager rows compare the
libraries as they run by default and the compiled rows compare compiled with compiled. The first call of
each is untimed; the time it took beyond a timed call (the compile) is printed.

For scale the script also measures this machine's memory read bandwidth in the same run: at batch 1
every decoded token reads all matmul weights once; that time is printed for scale (not a bound where the
weights fit the last-level cache: on the 300 MB L3 Xeon the compiled step ran below it).

    python benchmarks/bench_generate.py            # ~5-8 minutes on a 2-core CPU, writes results/generate.json
    python benchmarks/bench_generate.py --quick    # < 1 minute smoke check
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402
from harness import (  # noqa: E402
    WARMUP_CALLS,
    LoadMeter,
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

from tformer.generate.engine import generate  # noqa: E402
from tformer.generate.sampling import SamplingConfig  # noqa: E402

DEVICE = torch.device("cpu")  # main() sets --device
FULL = dict(vocab=8192, d_model=512, layers=8, heads=8, d_ff=1376, prompt=32, new=256, rounds=6)
QUICK = dict(vocab=1024, d_model=128, layers=2, heads=4, d_ff=344, prompt=8, new=16, rounds=2)
XT = "x-transformers generate"
COLUMNS = [
    ("name", "variant", "s"),
    ("best_s", "best s", ".2f"),
    ("ms_tok", "ms/step", ".2f"),
    ("tok_s", "tok/s", ".0f"),
    ("vs_hf_best", "x HF (best)", ".2f"),
    ("vs_hf_paired", "x HF (paired med)", ".2f"),
]


def build_pair(s: dict) -> tuple[nn.Module, nn.Module]:
    """tformer DecoderLM and HF LlamaForCausalLM holding the same weights (HF's, copied into ours)."""
    torch.manual_seed(0)
    hf = hf_llama(s, 512, bos_token_id=None, eos_token_id=None, pad_token_id=0).eval()
    ours = tformer_llama(s, 512).eval()
    ours.load_state_dict(hf_llama_state_for_tformer(hf), strict=True)
    return ours.to(DEVICE), hf.to(DEVICE)


def hf_generate(hf: nn.Module, prompts: torch.Tensor, new: int, compiled: bool = False) -> list[list[int]]:
    """HF `generate`, greedy, exactly `new` tokens. compiled: HF's own compiled decoding, a static cache
    and its forward under torch.compile (HF compiles automatically on GPUs only; `_compile_all_devices`
    asks for it on the CPU)."""
    options = {}
    if compiled:
        compile_config = transformers.CompileConfig()
        compile_config._compile_all_devices = True
        options = {"cache_implementation": "static", "compile_config": compile_config}
    out = hf.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **options,
    )
    return out[:, prompts.shape[1] :].tolist()


def x_transformers_peer(s: dict, ours: nn.Module) -> nn.Module:
    """x-transformers' decoder holding tformer's weights (benchmarks/peers.py), in its
    `AutoregressiveWrapper`, which decodes with its KV cache."""
    from x_transformers import AutoregressiveWrapper

    xt = x_transformers_decoder(s["vocab"], s["d_model"], s["layers"], s["heads"], s["d_ff"], 512)
    xt.load_state_dict({**xt.state_dict(), **tformer_state_for_x_transformers(ours)}, strict=True)
    return AutoregressiveWrapper(xt).eval().to(DEVICE)


@torch.no_grad()
def xt_generate(wrapper: nn.Module, prompts: torch.Tensor, new: int) -> list[list[int]]:
    """x-transformers' `generate`, greedy (temperature 0), with its KV cache, exactly `new` tokens."""
    return wrapper.generate(prompts, new, temperature=0.0, cache_kv=True).tolist()


def ours_generate(
    model: nn.Module, prompts: torch.Tensor, new: int, compile: bool = False
) -> list[list[int]]:
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=new)
    return generate(model, prompts.tolist(), cfg, compile=compile)


def timed(fn) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def first_difference(a: list[list[int]], b: list[list[int]], name: str = "tformer") -> str:
    for i, (ra, rb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                return f"row {i} token {j}: {name} {x} vs HF {y}"
        if len(ra) != len(rb):
            return f"row {i}: lengths {len(ra)} vs {len(rb)}"
    return "none"


def read_bandwidth_gbs(mb: int = 256, reps: int = 3) -> float:
    """GB/s of one pass summing a buffer much larger than the caches (best of `reps`; on a GPU the time
    includes the wait for the sum, a few microseconds)."""
    a = torch.ones(mb * 2**20 // 4, device=DEVICE)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.sum().item()  # (waits for a GPU)
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def speed_table(rows: dict, steps: int) -> list[dict]:
    """The printed table's rows (COLUMNS) from `summarize`'s, for calls of `steps` decoding steps."""
    return [
        {"name": n, "best_s": r.best_s, "ms_tok": r.best_s / steps * 1e3, "tok_s": r.rate_best,
         "vs_hf_best": r.speedup_best, "vs_hf_paired": r.speedup_paired}
        for n, r in rows.items()
    ]  # fmt: skip


def moe_models(quick: bool) -> dict[str, nn.Module]:
    """The MoE decoders compiled decoding is measured on: the main job's model (the shakespeare preset,
    random weights) and bench_lm.py's DeepSeekMoE LM."""
    from bench_lm import FULL as LM
    from bench_lm import MOE, MOE_QUICK, tformer_moe
    from bench_lm import QUICK as LM_QUICK

    from tformer import build_model
    from tformer.train.presets import get_train_preset

    torch.manual_seed(0)
    main_job = build_model(get_train_preset("shakespeare").model).eval()
    deepseek = tformer_moe(LM_QUICK if quick else LM, MOE_QUICK if quick else MOE).eval()
    return {"main job (shakespeare preset)": main_job.to(DEVICE), "bench_lm DeepSeekMoE": deepseek.to(DEVICE)}


def moe_sections(args, s: dict, rounds: int) -> dict:
    """tformer's compiled decoding against its own eager decoding (the flat step) on MoE decoders, batch
    1: HF has no peer holding the same weights (DeepseekV3 attends with MLA)."""
    sections = {}
    for title, model in moe_models(args.quick).items():
        prompts = torch.randint(1, model.cfg.vocab_size, (1, s["prompt"])).to(DEVICE)
        new = min(s["new"], model.cfg.max_seq_len - s["prompt"])  # the main job's context is 256
        variants = {
            "tformer generate": lambda m=model, p=prompts, n=new: ours_generate(m, p, n),
            "tformer generate, compiled": lambda m=model, p=prompts, n=new: ours_generate(m, p, n, True),
        }
        first = {name: timed(fn) for name, fn in variants.items()}
        with LoadMeter() as load:
            times = round_robin(variants, rounds, warmup=WARMUP_CALLS - 1)  # (after the first calls)
        rows = summarize(times, "tformer generate", new)
        table = speed_table(rows, new)
        columns = [(k, "x eager" + label[4:], f) if k.startswith("vs_hf") else (k, label, f)
                   for k, label, f in COLUMNS]  # fmt: skip
        text = print_table(
            f"\ngreedy decoding, {title}, batch 1, {s['prompt']} + {new} tokens", table, columns
        )
        same = first["tformer generate"][0] == first["tformer generate, compiled"][0]
        compile_s = first["tformer generate, compiled"][1] - rows["tformer generate, compiled"].best_s
        lines = [f"token ids identical: {same}; compile {compile_s:.1f} s", load.line()]
        for line in lines:
            print("  " + line)
        sections[title] = {"model": model.cfg.to_dict(), "prompt": s["prompt"], "new": new,
                           "rows": {n: r.as_dict() for n, r in rows.items()}, "times_s": times, "ids_identical": same,
                           "compile_s": round(compile_s, 1), "load": load.result, "table": text,
                           "notes": lines}  # fmt: skip
    return sections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 tokens: a smoke check in < 1 minute")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--layers", type=int, default=None, help="fewer layers if time is tight (same both sides)"
    )
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both models and the prompts on the GPU")
    ap.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="leave out both sides' compiled decoding (each compiles before its first call: 3-40 s)",
    )
    ap.add_argument(
        "--no-x-transformers", action="store_true", help="HF as the only peer (eager and compiled)"
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="instead: compiled vs eager tformer decoding of two MoE decoders (the main job's, bench_lm's "
        "DeepSeekMoE), batch 1",
    )
    ap.add_argument("--out", default=None, help="JSON file name under benchmarks/results/")
    args = ap.parse_args()
    setup(args.threads)
    global DEVICE
    DEVICE = use_device(args.device)
    s = dict(QUICK if args.quick else FULL)
    s["layers"] = args.layers or s["layers"]
    s["new"] = args.new or s["new"]
    rounds = s["rounds"] = args.rounds or s["rounds"]
    if args.moe:  # each section records its model's config
        sections = moe_sections(args, s, rounds)
        write_json(args.out or "generate_moe.json", {"rounds": rounds, "sections": sections})
        return
    ours, hf = build_pair(s)
    xt = None if args.no_x_transformers else x_transformers_peer(s, ours)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in ours.named_parameters() if "embed" not in n)
    sections = {}
    for batch in args.batch:
        torch.manual_seed(batch)
        prompts = torch.randint(1, s["vocab"], (batch, s["prompt"])).to(DEVICE)
        variants = {
            "HF generate": lambda p=prompts: hf_generate(hf, p, s["new"]),
            "tformer generate": lambda p=prompts: ours_generate(ours, p, s["new"]),
        }
        if xt is not None:
            variants[XT] = lambda p=prompts: xt_generate(xt, p, s["new"])
        if args.compile:
            variants["HF generate, compiled"] = lambda p=prompts: hf_generate(hf, p, s["new"], True)
            variants["tformer generate, compiled"] = lambda p=prompts: ours_generate(ours, p, s["new"], True)
        # the first calls: a warm-up, the ids to compare, and (compiled) the time it takes to compile
        first = {name: timed(fn) for name, fn in variants.items()}
        outputs = {name: out for name, (out, _) in first.items()}
        same = {name: out == outputs["HF generate"] for name, out in outputs.items() if name != "HF generate"}
        with LoadMeter() as load:
            bandwidth = read_bandwidth_gbs()
            times = round_robin(variants, rounds, warmup=WARMUP_CALLS - 1)  # (after the first calls)
        rows = summarize(times, "HF generate", batch * s["new"])
        table = speed_table(rows, s["new"])
        title = (
            f"\ngreedy decoding, batch {batch}, prompt {s['prompt']} + {s['new']} new tokens, fp32, "
            f"{s['layers']} layers"
        )
        text = print_table(title, table, COLUMNS)
        floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        compile_s = {
            name: first[name][1] - rows[name].best_s for name in variants if name.endswith("compiled")
        }
        lines = [
            f"generated token ids identical to HF generate's: {name} {ok}"
            + (
                ""
                if ok
                else f" (first difference: {first_difference(outputs[name], outputs['HF generate'], name)})"
            )
            for name, ok in same.items()
        ]
        if xt is not None:
            lines.append(
                f"tformer vs {XT}: {rows[XT].best_s / rows['tformer generate'].best_s:.2f}x (best), "
                f"{paired_median(times, XT, 'tformer generate'):.2f}x (paired median), both eager"
            )
        if args.compile:
            pair = ("HF generate, compiled", "tformer generate, compiled")
            lines.append(
                f"compiled vs compiled: tformer {rows[pair[0]].best_s / rows[pair[1]].best_s:.2f}x HF (best), "
                f"{paired_median(times, *pair):.2f}x (paired median); first call minus a later one (the "
                "compile): " + ", ".join(f"{name} {t:.1f} s" for name, t in compile_s.items())
            )
        lines += [
            f"memory read bandwidth {bandwidth:.1f} GB/s: reading the {weight_bytes / 1e6:.0f} MB of matmul weights "
            f"takes {floor_ms:.2f} ms per decoding step",
            load.line(),
        ]
        for line in lines:
            print("  " + line)
        sections[f"batch_{batch}"] = {
            "batch": batch,
            "rows": {n: r.as_dict() for n, r in rows.items()},
            "times_s": times,  # per round: the paired medians can be recomputed
            "ids_identical": same,
            "first_difference": {
                name: first_difference(outputs[name], outputs["HF generate"], name) for name in same
            },
            "compile_s": {name: round(t, 1) for name, t in compile_s.items()},
            "read_bandwidth_gbs": round(bandwidth, 2),
            "weights_mb": round(weight_bytes / 1e6, 1),
            "weight_read_ms_per_step": round(floor_ms, 2),
            "load": load.result,
            "table": text,
            "notes": lines,
        }
    out = args.out or ("generate_quick.json" if args.quick else "generate.json")
    write_json(out, {"config": s, "rounds": rounds, "sections": sections})


if __name__ == "__main__":
    main()
