"""`tformer bench`: training and decoding speed of a preset, its MFU, compiled decoding, and what it
measures when asked for sizes the model does not hold."""

from __future__ import annotations

import json
import os

import pytest

from tformer.cli.main import main


def test_bench_reports_speed(capsys) -> None:
    assert (
        main(
            [
                "bench",
                "--preset",
                "tiny-lm",
                "--repeats",
                "1",
                "--new-tokens",
                "4",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["train_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["decode_dtype"] == "float32"  # what generate decodes in, whatever the training dtype
    assert result["params_total"] == result["params_active"] > 0
    assert (result["device"], result["dtype"], result["batch"]) == ("cpu", "float32", [2, 16])


def test_bench_mfu_is_three_forward_flops_per_token_over_the_measured_matmul_rate(
    capsys, monkeypatch
) -> None:
    """Every timed call made to take 0.5 s: the MFU is then fixed by the FLOP counts alone."""
    from tformer.cli import bench
    from tformer.model.stats import flops_per_token
    from tformer.train.presets import get_train_preset

    monkeypatch.setattr(bench, "_times", lambda fn, repeats, device, warmup=1: (fn(), (0.5, 0.5))[1])
    argv = ["bench", "--preset", "tiny-lm", "--repeats", "1", "--new-tokens", "2", "--batch-size", "2"]
    assert main([*argv, "--seq-len", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    m, k, n = result["matmul_shape"]
    peak = 20 * 2 * m * k * n / 0.5  # 20 products of (M, K) @ (K, N) in one timed call
    assert result["matmul_peak_gflops"] == pytest.approx(peak / 1e9)
    flops = 3 * flops_per_token(get_train_preset("tiny-lm").model, 16, causal=True) * 2 * 16  # fwd + bwd
    assert result["train_mfu"] == pytest.approx(flops / 0.5 / peak, rel=1e-9)
    assert result["train_tokens_per_s"] == pytest.approx(2 * 16 / 0.5)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # --threads sets torch's thread count for the measurement, and the report says it
        assert main([*argv, "--seq-len", "16", "--json", "--threads", "1"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["threads"] == 1 and "warning" not in err
        cores = len(os.sched_getaffinity(0))  # more threads than cores run, with a warning that says so
        assert main([*argv, "--seq-len", "16", "--json", "--threads", str(cores + 1)]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["threads"] == cores + 1
        assert f"--threads {cores + 1} is more than the {cores} core" in err
    finally:
        torch.set_num_threads(before)


def test_bench_times_compiled_decoding_when_asked(capsys, monkeypatch) -> None:
    """--compile-decoding times generate(compile=True) beside the eager decoding (its program run eagerly
    here, so the test does not compile; tests/generate/test_compiled_step.py compiles it)."""
    from tformer.model import compiled_step

    calls: list[int] = []
    eager = compiled_step.step_program
    monkeypatch.setattr(
        compiled_step, "compiled_step_program", lambda: lambda *a: calls.append(1) or eager(*a)
    )
    argv = ["bench", "--preset", "tiny-lm", "--repeats", "2", "--new-tokens", "4", "--seq-len", "16"]
    assert main([*argv, "--batch-size", "1", "--json", "--compile-decoding"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decode_compiled_tokens_per_s"] > 0 and result["decode_compiled_first_call_s"] > 0
    assert len(calls) == 3 * 3  # the first call, a warm-up, one timed call (repeats 2 // 2): 3 steps each
    assert main([*argv, "--batch-size", "1", "--json"]) == 0
    assert "decode_compiled_tokens_per_s" not in json.loads(capsys.readouterr().out)


def test_bench_measures_what_was_asked_or_says_why_not(capsys) -> None:
    """A --seq-len beyond model.max_seq_len is measured (training sizes the model to it, as here), not
    cut to the context; --new-tokens that do not fit are an error; parallel.* is named as unused."""
    argv = ["bench", "--preset", "tiny-lm", "--repeats", "1", "--batch-size", "1", "--json"]
    assert main([*argv, "--seq-len", "80", "--new-tokens", "4", "--set", "parallel.data=fsdp"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["batch"] == [1, 80]
    assert "warning: parallel.* is not used: bench measures one process" in err
    assert main([*argv, "--new-tokens", "1000"]) == 2
    assert "--new-tokens 1000 does not fit after the 8-token prompt in the context of 64 tokens" in (
        capsys.readouterr().err
    )
    short = ["--seq-len", "4", "--set", "model.max_seq_len=4", "--set", "data.seq_len=4"]
    assert main([*argv, *short]) == 2  # had said "--new-tokens 64 does not fit ... at most -4"
    assert "the context of 4 tokens (model.max_seq_len, or --seq-len if longer) leaves no room to decode" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--seq-len", "16"]) == 0  # the default: 64 tokens, or what fits (56 here)
    assert json.loads(capsys.readouterr().out)["decode_new_tokens"] == 56
    # the vocabulary training would build (data.vocab_size: its BPE), not ModelConfig's default of 32000
    assert (
        main([*argv, "--seq-len", "16", "--set", "data.vocab_size=300", "--set", "model.vocab_size=32000"])
        == 0
    )
    out, err = capsys.readouterr()
    small = json.loads(out)["params_total"]
    assert "model.vocab_size 32000 is replaced by data.vocab_size 300, as training sizes the model" in err
    assert main([*argv, "--seq-len", "16", "--set", "data.vocab_size=600"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["params_total"] - small == 300 * 64
    )  # the tied embedding / head


def test_bench_trains_as_the_run_would_compile_and_checkpoint_it(capsys, monkeypatch) -> None:
    """`compile` and `activation_checkpointing` had been ignored by bench's training step without a word:
    the timed steps now run through the compiled callable (torch.compile stubbed here with a wrapper that
    counts its calls) over blocks that recompute, which run as built again for the decoding after."""
    import torch

    from tformer.cli import bench
    from tformer.model.recompute import is_recomputed

    calls, seen = [], {}

    def fake_compile(model):
        seen["recomputed"] = is_recomputed(model.blocks[0])
        return lambda x: calls.append(1) or model(x)

    monkeypatch.setattr(torch, "compile", fake_compile)
    decoded = []
    monkeypatch.setattr(bench, "_decoding", lambda model, *a: decoded.append(model) or {})
    argv = ["bench", "--preset", "tiny-lm", "--repeats", "2", "--seq-len", "16"]
    assert main([*argv, "--json", "--set", "compile=true", "--set", "activation_checkpointing=true"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["train_compile"] is True and result["train_activation_checkpointing"] == "full"
    assert seen["recomputed"] and len(calls) == 4  # a warm-up step, the 2 timed ones, the activations count
    assert not is_recomputed(decoded[0].blocks[0])  # decoded as built
    monkeypatch.setattr(bench, "_print", lambda result, *a: print(bench._train_how(result)))
    assert main([*argv, "--set", "compile=true", "--set", "activation_checkpointing=true"]) == 0
    assert capsys.readouterr().out.strip() == ", compiled, activation checkpointing full"
    assert main([*argv, "--set", "activation_checkpointing=selective"]) == 0
    assert capsys.readouterr().out.strip() == ", activation checkpointing selective"
    assert main(argv) == 0  # neither: the model as built, not compiled
    assert capsys.readouterr().out.strip() == "" and len(calls) == 8  # the selective run not compiled
    assert main([*argv, "--json"]) == 0  # the activations kept for the backward: far more without it
    plain = json.loads(capsys.readouterr().out)["train_activation_mib"]
    assert main([*argv, "--json", "--set", "fused_loss=true"]) == 0  # the head's logits never whole
    fused = json.loads(capsys.readouterr().out)
    assert fused["train_fused_loss"] is True and fused["train_activation_mib"] < plain
    assert bench._train_how(fused) == ", fused head and loss"
    assert main([*argv, "--json", "--set", "activation_checkpointing=selective"]) == 0
    selective = json.loads(capsys.readouterr().out)["train_activation_mib"]
    assert plain > selective > 2 * result["train_activation_mib"] > 0, (plain, selective, result)


def test_bench_decides_dtype_auto_as_a_run_would(capsys, monkeypatch) -> None:
    from tformer.cli import bench
    from tformer.train import step

    monkeypatch.setattr(step, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(bench, "_decoding", lambda *a: {})
    argv = [
        "bench",
        "--preset",
        "tiny-lm",
        "--repeats",
        "1",
        "--seq-len",
        "16",
        "--json",
        "--set",
        "dtype=auto",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"


def test_bench_warms_an_moe_model_up_longer_in_reduced_precision_on_the_cpu(capsys, monkeypatch) -> None:
    """oneDNN compiles a kernel per new bf16 product shape and an MoE layer's expert row counts change
    from step to step: such a model gets MOE_REDUCED_PRECISION_WARMUP untimed steps; in fp32, or a dense
    model, one."""
    from tformer.cli import bench

    seen, original = [], bench._times

    def recording(fn, repeats, device, warmup=1):
        seen.append(warmup)
        return original(fn, repeats, device, warmup)

    monkeypatch.setattr(bench, "_times", recording)
    monkeypatch.setattr(bench, "_decoding", lambda *a: {})
    base = ["bench", "--repeats", "1", "--batch-size", "2", "--seq-len", "16", "--json"]
    cases = (("shakespeare", "bfloat16", bench.MOE_REDUCED_PRECISION_WARMUP), ("shakespeare", "float32", 1),
             ("tiny-lm", "bfloat16", 1))  # fmt: skip
    for preset, dtype, want in cases:
        seen.clear()
        assert main([*base, "--preset", preset, "--set", f"dtype={dtype}"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert seen == [1, want] and result["train_warmup_steps"] == want, (preset, dtype)
    assert bench.MOE_REDUCED_PRECISION_WARMUP > 1
    assert bench._after_warmup({"train_warmup_steps": 5}).startswith(" after 5 untimed")
    assert bench._after_warmup({"train_warmup_steps": 1}) == ""


def test_bench_refuses_a_setting_its_lm_run_would_ignore(capsys) -> None:
    """As `tformer train` does: a data setting of another task is an error, not a silent no-op."""
    argv = ["bench", "--preset", "tiny-lm", "--repeats", "1", "--json"]
    assert main([*argv, "--set", "data.dictionary_alternatives=true"]) == 2
    assert (
        "data.dictionary_alternatives is read by the translation task only: task 'lm' would ignore it"
        in capsys.readouterr().err
    )
