"""`tformer bench`: how fast a model config trains and decodes on this machine.

Measures, in one process: a matmul peak on the model's own shapes, training tokens/s (forward,
loss, backward, AdamW step) with model FLOPs utilisation against that peak, and KV-cached greedy
decoding tokens/s. For comparisons against other libraries see benchmarks/ in the repository.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tformer.cli.options import refuse_torchrun, warn_oversubscribed

PROMPT = 8  # tokens of the decoding prompt
# untimed training steps before the timed ones for an MoE model in bf16 / fp16 on the CPU: oneDNN compiles a
# kernel for every new product shape there, and the experts' row counts change from step to step; the
# loop kernel bounds those shapes (tformer.model.grouped_linear.row_pieces), and bench_lm.py's DeepSeekMoE LM compiled
# none after its fourth step. Other models take one.
MOE_REDUCED_PRECISION_WARMUP = 5
DEFAULT_NEW = 64  # tokens to decode unless --new-tokens says otherwise (fewer where the context is shorter)


def _times(fn, repeats: int, device: torch.device, warmup: int = 1) -> tuple[float, float]:
    """(best, median) seconds of `repeats` timed calls after `warmup` untimed ones."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def run(args: argparse.Namespace) -> int:
    refuse_torchrun("bench", "it measures this machine's speed for one process; ranks would share its cores")
    warn_oversubscribed("bench", args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, mcfg, device, (b, t), n_new = _setting(args)
    from tformer import build_model

    torch.manual_seed(0)
    model = build_model(mcfg).to(device)
    result = {
        **_model_line(model, cfg, device, b, t, args.repeats),
        **_training(model, cfg, mcfg, device, b, t, args.repeats),
        **_decoding(model, mcfg, device, n_new, args),
    }
    if args.json:
        print(json.dumps(result))
    else:
        _print(result, cfg.dtype, args.repeats)
    return 0


def _setting(args: argparse.Namespace):
    """The config, the model config as training sizes it, the device, (batch, length) and the decoded
    token count, each checked before anything is built."""
    from tformer.cli.options import resolve_train_config, warn
    from tformer.distributed.env import resolve_device
    from tformer.schema import ConfigError
    from tformer.train.config import ParallelConfig, refuse_ignored_settings
    from tformer.train.presets import LM_PRESETS, TRAIN_PRESETS
    from tformer.train.step import resolve_dtype

    if args.preset is not None and args.preset not in TRAIN_PRESETS:  # the presets bench takes, not all
        raise ConfigError(
            f"unknown training preset {args.preset!r}; tformer bench measures decoder LMs: "
            f"{', '.join(LM_PRESETS)} (or --config FILE.yaml)"
        )
    cfg = resolve_train_config(args, default_preset="shakespeare")
    if cfg.model.arch != "decoder":
        raise ValueError(
            f"tformer bench measures decoder LMs ({', '.join(LM_PRESETS)}); this config's model.arch is "
            f"{cfg.model.arch!r}"
        )
    refuse_ignored_settings(cfg)  # as `tformer train` would (a data setting of another task, say)
    if cfg.parallel != ParallelConfig():
        warn(
            "bench",
            "parallel.* is not used: bench measures one process (scale-out: torchrun -m tformer train)",
        )
    device = resolve_device(cfg.device)
    cfg = cfg.replace(dtype=resolve_dtype(cfg.dtype, device))  # auto: what a run would compute in here
    b, t = args.batch_size or cfg.batch_size, args.seq_len or cfg.data.seq_len
    # as training sizes it: the vocabulary is the BPE one it trains (data.vocab_size), the context fits T
    if cfg.model.vocab_size != cfg.data.vocab_size:
        warn(
            "bench",
            f"model.vocab_size {cfg.model.vocab_size} is replaced by data.vocab_size {cfg.data.vocab_size}, as "
            "training sizes the model by its tokenizer: set data.vocab_size to measure another vocabulary",
        )
    mcfg = cfg.model.replace(vocab_size=cfg.data.vocab_size, max_seq_len=max(cfg.model.max_seq_len, t))
    room = mcfg.max_seq_len - PROMPT
    # the default shrinks to what fits (if anything does); a count the user asked for is never changed
    n_new = args.new_tokens or (min(DEFAULT_NEW, room) if room > 0 else DEFAULT_NEW)
    if room < 1:  # not even one decoded token fits: the context is what to change, whatever --new-tokens is
        raise ValueError(
            f"the context of {mcfg.max_seq_len} tokens (model.max_seq_len, or --seq-len if longer) leaves no "
            f"room to decode after the {PROMPT}-token prompt: give a context of at least {PROMPT + 1}"
        )
    if n_new > room:
        raise ValueError(
            f"--new-tokens {n_new} does not fit after the {PROMPT}-token prompt in the context of "
            f"{mcfg.max_seq_len} tokens (model.max_seq_len, or --seq-len if longer): at most {room}"
        )
    return cfg, mcfg, device, (b, t), n_new


def _model_line(model, cfg, device, b: int, t: int, repeats: int) -> dict:
    from tformer.model.stats import count_params

    params = count_params(model)
    return {
        "params_total": params["total"],
        "params_active": params["active"],
        "batch": [b, t],
        "device": str(device),
        "dtype": cfg.dtype,
        "threads": torch.get_num_threads(),
        "repeats": repeats,  # timed training steps (best reported; the median beside it)
    }


def _training(model, cfg, mcfg, device, b: int, t: int, repeats: int) -> dict:
    """Training tokens/s (forward, loss, backward, AdamW) and its MFU against a matmul rate of the
    model's widths measured now; the step as the run's `compile`, `activation_checkpointing` and
    `fused_loss` make it
    (the blocks run as built again for the decoding after it). The MFU counts the model's FLOPs, not a
    recomputation's."""
    from tformer.model.grouped_linear import reduced_cpu
    from tformer.model.recompute import checkpoint_blocks, plain_blocks
    from tformer.model.stats import activation_bytes, flops_per_token
    from tformer.train.optim import make_optimizer
    from tformer.train.step import autocast_context

    if cfg.activation_checkpointing != "none":
        checkpoint_blocks(model, cfg.activation_checkpointing)
    forward = torch.compile(model) if cfg.compile else model
    opt = make_optimizer(model, cfg.optim)
    autocast = autocast_context(device, cfg.dtype)
    x = torch.randint(0, mcfg.vocab_size, (b, t), device=device)

    def step_loss() -> torch.Tensor:  # under autocast
        if cfg.fused_loss:  # the model's fused head and loss (tformer.model.loss), as the trainer takes it
            return forward(x, targets=x) / x.numel()
        return F.cross_entropy(forward(x).flatten(0, 1).float(), x.flatten())

    def train_step() -> None:
        with autocast:
            loss = step_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    a = torch.randn(b * t, mcfg.d_model, device=device, dtype=dtype)
    w = torch.randn(max(mcfg.d_ff, mcfg.d_model), mcfg.d_model, device=device, dtype=dtype)

    def matmuls() -> None:
        for _ in range(20):
            a @ w.t()

    peak = 20 * 2 * a.shape[0] * a.shape[1] * w.shape[0] / _times(matmuls, repeats, device)[0]
    warmup = MOE_REDUCED_PRECISION_WARMUP if mcfg.moe is not None and reduced_cpu(a) else 1
    train_s, train_median = _times(train_step, repeats, device, warmup)

    def loss() -> torch.Tensor:
        with autocast:
            return step_loss()

    # one more forward and backward, untimed; eager even with `compile` (under the counter's dispatch mode
    # and hooks torch.compile runs the model's own forward, not its graphs)
    kept = activation_bytes(model, loss)
    opt.zero_grad(set_to_none=True)
    train_flops = 3 * flops_per_token(mcfg, t, causal=True) * b * t
    plain_blocks(model)
    model.eval()
    return {
        "matmul_shape": [a.shape[0], a.shape[1], w.shape[0]],  # (M, K) @ (K, N): the MFU's denominator
        "matmul_peak_gflops": peak / 1e9,
        "train_tokens_per_s": b * t / train_s,
        "train_tokens_per_s_median": b * t / train_median,
        "train_mfu": train_flops / train_s / peak,
        "train_compile": cfg.compile,  # the first (warm-up) step compiled, untimed
        "train_warmup_steps": warmup,
        "train_activation_checkpointing": cfg.activation_checkpointing,
        "train_fused_loss": cfg.fused_loss,
        "train_activation_mib": kept / 2**20,  # the eager backward's (tformer.model.stats.activation_bytes)
    }


def _after_warmup(result: dict) -> str:
    n = result["train_warmup_steps"]
    return f" after {n} untimed (an MoE model in reduced precision on the CPU)" if n > 1 else ""


def _train_how(result: dict) -> str:
    recompute = result["train_activation_checkpointing"]
    how = (["compiled"] if result["train_compile"] else []) + (
        [] if recompute == "none" else [f"activation checkpointing {recompute}"]
    )
    how += ["fused head and loss"] if result.get("train_fused_loss") else []
    return "".join(f", {w}" for w in how)


def _decoding(model, mcfg, device, n_new: int, args: argparse.Namespace) -> dict:
    """Greedy KV-cached decoding at batch 1, and with --compile-decoding the compiled step too."""
    from tformer.generate.engine import generate
    from tformer.generate.sampling import SamplingConfig

    prompt = [
        torch.randint(0, mcfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    ]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=n_new)
    calls = max(1, args.repeats // 2)
    decode_s, decode_median = _times(lambda: generate(model, prompt, sampling), calls, device)
    out = {
        "decode_calls": calls,
        "decode_dtype": str(next(model.parameters()).dtype).removeprefix(
            "torch."
        ),  # no autocast: as generate
        "decode_prompt_tokens": PROMPT,
        "decode_tokens_per_s": n_new / decode_s,
        "decode_tokens_per_s_median": n_new / decode_median,
        "decode_ms_per_token": 1000 * decode_s / n_new,
        "decode_new_tokens": n_new,
    }
    if args.compile_decoding:  # the first call compiles: timed on its own, then the calls as above
        t0 = time.perf_counter()
        generate(model, prompt, sampling, compile=True)
        first = time.perf_counter() - t0
        best, median = _times(lambda: generate(model, prompt, sampling, compile=True), calls, device)
        out |= {
            "decode_compiled_first_call_s": first,
            "decode_compiled_tokens_per_s": n_new / best,
            "decode_compiled_tokens_per_s_median": n_new / median,
            "decode_compiled_ms_per_token": 1000 * best / n_new,
        }
    return out


def _print(result: dict, dtype: str, repeats: int) -> None:
    threads, (b, t), n_new, calls = (
        result["threads"],
        result["batch"],
        result["decode_new_tokens"],
        result["decode_calls"],
    )
    print(
        f"model: {result['params_total']:,} parameters ({result['params_active']:,} active per token), batch "
        f"{b} x {t}, {result['device']}, {dtype}, {threads} thread{'s' if threads != 1 else ''}"
    )
    m, k, n = result["matmul_shape"]
    print(
        f"matmul rate ({dtype}, ({m} x {k}) @ ({k} x {n}), best of {repeats}): "
        f"{result['matmul_peak_gflops']:.1f} GFLOP/s (the MFU's denominator, measured now; not the hardware peak)"
    )
    print(
        f"training{_train_how(result)}, best of {repeats} steps{_after_warmup(result)} (median in brackets): "
        f"{result['train_tokens_per_s']:,.0f} tokens/s ({result['train_tokens_per_s_median']:,.0f}), MFU "
        f"{100 * result['train_mfu']:.1f}%, {result['train_activation_mib']:,.1f} MiB of activations kept for "
        "the backward"
    )
    print(
        f"greedy decoding ({result['decode_dtype']} weights without autocast, as tformer generate runs; batch 1, "
        f"KV cache, {PROMPT}-token prompt + {n_new} tokens, best of {calls} "
        f"call{'s' if calls != 1 else ''}): {result['decode_tokens_per_s']:,.1f} tokens/s "
        f"({result['decode_ms_per_token']:.2f} ms/token; median {result['decode_tokens_per_s_median']:,.1f} tokens/s)"
    )
    if "decode_compiled_tokens_per_s" in result:
        print(
            f"greedy decoding compiled (generate(compile=True), same prompt; first call "
            f"{result['decode_compiled_first_call_s']:.1f} s, the compile included): "
            f"{result['decode_compiled_tokens_per_s']:,.1f} tokens/s ({result['decode_compiled_ms_per_token']:.2f} "
            f"ms/token; median {result['decode_compiled_tokens_per_s_median']:,.1f} tokens/s)"
        )
    print(
        "times on a shared machine move by tens of percent between runs: compare two settings in one "
        "process, by ratio (benchmarks/ does)"
    )
