"""The GPU path: the same models, kernels, decoding and training on CUDA as on the CPU.

Marked `cuda` and left out of the default run and CI (no GPU there): `pytest -m cuda` on a machine with
one. What each test compares against: the CPU (fp32 logits, decoded tokens), Hugging Face's classes on
the GPU (Llama, DeepSeek-V3's MoE block), tformer's slow twins (the split expert kernel, uncached
decoding), an uninterrupted run (exact resume) and eager mode (torch.compile).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.model.helpers import run, tiny_llama_pair
from tests.train.helpers import losses, small_config
from tformer import MoEConfig, build_model
from tformer.generate.beam import beam_search, sample_search
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.model import grouped_linear as kernels
from tformer.model import moe as moe_module
from tformer.presets import tiny
from tformer.tasks import make_task
from tformer.train.loop import Trainer

pytestmark = pytest.mark.cuda

DEEPSEEK = MoEConfig(n_experts=8, top_k=3, d_expert=32, n_shared=1, score_func="sigmoid", aux_loss_coef=0.0)
CONFIGS = {
    "paper (Post-Norm, sinusoidal, ReLU)": tiny().replace(
        norm_placement="post", positions="sinusoidal", ffn="relu", norm="layernorm", bias=True
    ),
    "Pre-Norm RoPE SwiGLU": tiny(),
    "DeepSeekMoE": tiny().replace(moe=DEEPSEEK),
    "encoder-decoder, MoE": tiny("encoder_decoder").replace(moe=MoEConfig(n_experts=4, top_k=2)),
    "encoder classifier": tiny("encoder").replace(n_classes=5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_fp32_logits_on_the_gpu_equal_the_cpus(name: str, device: torch.device) -> None:
    torch.manual_seed(0)
    cpu = build_model(CONFIGS[name]).eval()
    gpu = copy.deepcopy(cpu).to(device)
    tokens = torch.randint(0, cpu.cfg.vocab_size, (3, 19))
    expected = run(cpu, tokens)
    got = run(gpu, tokens.to(device))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_decoder_equals_hf_llama_on_the_gpu(device: torch.device) -> None:
    ours, hf = tiny_llama_pair(rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    ours, hf = ours.to(device), hf.to(device)
    tokens = torch.randint(0, 96, (2, 17), device=device)
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_moe_block_equals_hf_deepseek_v3_on_the_gpu(device: torch.device) -> None:
    """fp32 against HF's eager experts (1e-5); in bf16 (weights and input) against HF's grouped_mm experts
    in bf16, and both within bf16 rounding of the fp32 output."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from tests.model.helpers import moe_cfg
    from tests.model.test_moe import copy_from_hf
    from tformer.model.moe import MoE

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    moe = MoEConfig(n_experts=8, top_k=3, n_shared=2, score_func="sigmoid", n_group=4, topk_group=2,
                    group_score="top2", routed_scaling=2.5, aux_loss_coef=0.0)  # fmt: skip
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MoE(moe_cfg(d_model=64, d_ff=32, **moe.to_dict()), 0).eval()
    copy_from_hf(ours, hf)
    hf, ours = hf.to(device), ours.to(device)
    x = torch.randn(2, 24, 64, device=device)
    with torch.no_grad():
        hf.config._experts_implementation = "eager"
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
        hf.config._experts_implementation = "grouped_mm"
        hf_bf16, ours_bf16 = copy.deepcopy(hf).bfloat16(), copy.deepcopy(ours).bfloat16()
        ref, theirs, got = hf(x), hf_bf16(x.bfloat16()).float(), ours_bf16(x.bfloat16()).float()
        scale = ref.abs().max().item()
        torch.testing.assert_close(got, theirs, rtol=0.0, atol=0.01 * scale)
        for out in (got, theirs):
            torch.testing.assert_close(out, ref, rtol=0.0, atol=0.015 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_mm_kernel_equals_the_split_kernel_with_gradients(dtype, device: torch.device) -> None:
    """The grouped_mm kernel tformer picks on CUDA (SM80+), an expert with no rows included, against the
    per-expert F.linear twin: outputs and the gradients of x, W and b."""
    torch.manual_seed(0)
    counts = [5, 0, 17, 1, 9, 32]
    x = torch.randn(sum(counts), 64, device=device, dtype=dtype)
    w = torch.randn(len(counts), 48, 64, device=device, dtype=dtype) / 8
    b = torch.randn(len(counts), 48, device=device, dtype=dtype)
    if device.type == "cuda":
        assert kernels.pick_grouped_kernel(x, w) == "grouped_mm"
    results = []
    for kernel in ("grouped_mm", "split"):  # (F.grouped_mm runs on the CPU too)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = kernels.GROUPED_LINEAR_KERNELS[kernel](*leaves, counts)
        y.float().square().sum().backward()
        results.append([y.float(), *(t.grad.float() for t in leaves)])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


BALANCED = DEEPSEEK.replace(aux_loss_coef=0.01, seq_aux_loss_coef=0.001, z_loss_coef=0.001, device_loss_coef=0.01,
                           n_devices=2)  # fmt: skip


@pytest.mark.parametrize("moe_config", [DEEPSEEK, BALANCED], ids=["aux-loss-free", "balance-losses"])
def test_moe_layer_on_the_gpu_waits_for_it_nowhere_with_the_counts_on_the_device(
    moe_config: MoEConfig, device: torch.device, monkeypatch
) -> None:
    """A DeepSeekMoE layer's training forward and backward under bf16 autocast (grouped_mm) count and
    dispatch their rows on the device, and its balance losses count there too: torch's sync debug mode
    raises at no operation with the rows per expert kept there (`DEVICE_COUNTS`), and does raise with
    them read on the host, so it sees such a wait. The counts equal torch.bincount's on the CPU, an empty
    index included."""
    from tests.model.helpers import moe_cfg
    from tformer.model.moe import MoE
    from tformer.model.router import count_per_expert

    idx = torch.randint(0, 8, (50, 3))
    for ids in (idx, idx[:0]):
        expected = torch.bincount(ids.flatten(), minlength=8)
        torch.testing.assert_close(count_per_expert(ids.to(device), 8).cpu(), expected)
    torch.manual_seed(0)
    moe = MoE(moe_cfg(d_model=64, d_ff=32, **moe_config.to_dict()), 0).to(device).train()
    x = torch.randn(2, 24, 64, device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = moe(x)
        (y.float().square().sum() + moe.last_aux).backward()

    step()  # the first calls initialise cuBLAS and load kernels, which may wait
    assert (moe.last_aux.item() > 0) == (moe_config is BALANCED)  # the balance losses ran where set
    if device.type != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        monkeypatch.setattr(moe_module, "DEVICE_COUNTS", False)
        with pytest.raises(RuntimeError, match="synchroniz"):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_moe_model_trains_under_bf16_autocast_with_grouped_mm(device: torch.device, monkeypatch) -> None:
    """A DeepSeekMoE LM's loss and gradients under bf16 autocast with the kernel tformer picks (grouped_mm
    on CUDA, counted) equal those with every expert product as the split twin, to bf16 precision."""
    torch.manual_seed(0)
    model = build_model(tiny().replace(moe=DEEPSEEK, vocab_size=128)).to(device)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (4, 33), device=device)
    grouped_calls = []
    real = kernels.GROUPED_LINEAR_KERNELS["grouped_mm"]
    monkeypatch.setitem(
        kernels.GROUPED_LINEAR_KERNELS, "grouped_mm", lambda *a: grouped_calls.append(1) or real(*a)
    )

    def loss_and_grads(m: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = m(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.float() for p in m.parameters()]

    loss, grads = loss_and_grads(model)
    if device.type == "cuda":
        assert grouped_calls, "grouped_mm was not used for bf16 on CUDA"
    monkeypatch.setattr(kernels, "pick_grouped_kernel", lambda x, w: "split")
    twin_loss, twin_grads = loss_and_grads(twin)
    torch.testing.assert_close(loss, twin_loss, rtol=1e-2, atol=1e-2)
    for g, t in zip(grads, twin_grads):
        torch.testing.assert_close(g, t, rtol=5e-2, atol=5e-2 * t.abs().max().item() + 1e-6)


@pytest.mark.parametrize("moe", [None, DEEPSEEK], ids=["dense", "deepseek_moe"])
def test_cached_greedy_decoding_equals_uncached_and_the_cpu(moe, device: torch.device) -> None:
    """The KV-cached greedy tokens on the GPU equal a full forward over the growing sequence at every step,
    and the CPU's tokens."""
    torch.manual_seed(0)
    cpu = build_model(tiny().replace(moe=moe)).eval()
    with torch.no_grad():  # sharper next-token distributions: no near-ties between the devices
        for p in cpu.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    gpu = copy.deepcopy(cpu).to(device)
    prompts = [[5, 17, 33, 2, 9], [60, 3]]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    got = generate(gpu, prompts, cfg)
    assert got == generate(cpu, prompts, cfg)
    with torch.no_grad():
        for prompt, new in zip(prompts, got):
            seq = list(prompt)
            for token in new:
                logits = gpu(torch.tensor([seq], device=device))[0, -1]
                assert int(logits.argmax()) == token
                seq.append(token)


@pytest.mark.parametrize("moe", [None, DEEPSEEK], ids=["dense", "deepseek_moe"])
def test_compiled_decoding_on_the_gpu_equals_eager(moe, device: torch.device) -> None:
    """generate(compile=True): each step after the prompt as the compiled decoding program (Triton on
    CUDA), without a fallback warning, gives the eager greedy tokens."""
    import warnings

    torch.manual_seed(0)
    model = build_model(tiny().replace(moe=moe)).eval().to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    prompts = [[5, 17, 33, 2, 9], [60, 3]]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=16)
    with warnings.catch_warnings():
        # a model the compiled step refuses, or a compile that fails, decodes eagerly with this warning
        warnings.filterwarnings("error", message=".*decoding without it")
        compiled = generate(model, prompts, cfg, compile=True)
    assert compiled == generate(model, prompts, cfg)


def test_beam_search_on_the_gpu_equals_the_cpu_and_uncached(device: torch.device) -> None:
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder").replace(vocab_size=24, max_seq_len=32)
    cpu = build_model(cfg).eval()
    gpu = copy.deepcopy(cpu).to(device)
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, 24, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    src = src.masked_fill(~mask, 0)
    common = dict(bos_id=1, eos_id=2, max_len=12, beam_size=4, alpha=0.6, banned=(0, 1))
    on_gpu = beam_search(gpu, src.to(device), mask.to(device), **common)
    uncached = beam_search(gpu, src.to(device), mask.to(device), cached=False, **common)
    on_cpu = beam_search(cpu, src, mask, **common)
    assert [h.tokens for h in on_gpu] == [h.tokens for h in uncached] == [h.tokens for h in on_cpu]
    for g, c in zip(on_gpu, on_cpu):
        assert g.score == pytest.approx(c.score, abs=1e-4)
    greedy = sample_search(
        gpu, src.to(device), mask.to(device), bos_id=1, eos_id=2, max_len=12, banned=(0, 1)
    )
    assert [h.tokens for h in greedy] == [h.tokens for h in sample_search(cpu, src, mask, bos_id=1, eos_id=2,
                                                                       max_len=12, banned=(0, 1))]  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "float32", "moe": DEEPSEEK, "deterministic": True},
        {"dtype": "bfloat16", "moe": DEEPSEEK, "deterministic": True},
    ],
    ids=["fp32", "bf16", "fp32_deepseek_moe", "bf16_deepseek_moe"],
)
def test_exact_resume_on_the_gpu_with_dropout(
    changes: dict, corpus_dir: Path, tmp_path: Path, device
) -> None:
    """A run stopped at step 4 and resumed gives the losses and gradient norms, bit for bit, of one that ran
    through (dropout on: the CUDA generator's state is saved and restored). The DeepSeekMoE runs take
    deterministic=true: without it two identical fp32 runs on an H200 differed in a gradient norm's last
    bit at step 2 (2026-12-04), before any resume; the bf16 run's scatter-add of top-3 expert outputs is
    in fp32 too (it passed twice without, which proves nothing)."""
    changes = dict(changes)
    moe = changes.pop("moe", None)
    base = small_config(corpus_dir, device=str(device), **changes)
    cfg = base.replace(model=base.model.replace(moe=moe)) if moe else base
    Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False).fit()
    Trainer(cfg, tmp_path / "b", make_task("lm"), progress=False).fit(until=4)
    Trainer(cfg, tmp_path / "b", make_task("lm"), resume=True, progress=False).fit()
    assert len(losses(tmp_path / "a")) == cfg.steps
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.parametrize("moe", [None, DEEPSEEK], ids=["dense", "deepseek_moe"])
def test_compiled_training_on_the_gpu_follows_eager(
    moe, corpus_dir: Path, tmp_path: Path, device, monkeypatch
) -> None:
    """compile=true trains under torch.compile (Triton kernels on CUDA; dynamo captures graphs): its
    losses follow eager's (fp32, 1e-4); the MoE's experts take the loop kernel under the compiler (which
    lowers grouped_mm in bf16 only) and grouped_mm eagerly on CUDA."""
    from torch._dynamo.utils import counters

    picked: list[tuple[bool, str]] = []
    real = kernels.pick_grouped_kernel

    def spy(x, w):
        kernel = real(x, w)
        picked.append((torch.compiler.is_compiling(), kernel))
        return kernel

    monkeypatch.setattr(kernels, "pick_grouped_kernel", spy)
    cfg = small_config(corpus_dir, device=str(device), steps=4, eval_every=4, save_every=4)
    cfg = cfg.replace(model=cfg.model.replace(dropout=0.0, moe=moe))
    Trainer(cfg, tmp_path / "eager", make_task("lm"), progress=False).fit()
    eager = set(picked)
    picked.clear()
    torch._dynamo.reset()
    counters.clear()
    Trainer(cfg.replace(compile=True), tmp_path / "compiled", make_task("lm"), progress=False).fit()
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, not an eager fallback
    if moe is not None:
        assert {kernel for compiling, kernel in picked if compiling} == {kernels.CPU_KERNEL}
        if device.type == "cuda":
            assert eager == {(False, "grouped_mm")}

    def values(run: Path) -> list[float]:
        return [float.fromhex(x.split()[0]) for x in losses(run)]

    assert values(tmp_path / "compiled") == pytest.approx(values(tmp_path / "eager"), rel=1e-4)


def test_train_generate_and_eval_commands_on_the_gpu(
    tmp_path: Path, corpus_dir: Path, device, capsys
) -> None:
    """`tformer train` with device=cuda and dtype=auto (bf16 on a GPU that has it) end to end; the saved run
    generates and evaluates on the CPU (the commands' default) and with --device on the GPU: the same
    greedy tokens."""
    import json

    from tformer.cli.main import main

    out = tmp_path / "run"
    sets = [f"data.corpus=text:{corpus_dir}", "data.vocab_size=300", "data.seq_len=32", "model.max_seq_len=32",
            "steps=6", "batch_size=4", "eval_every=3", "eval_batches=1", "save_every=3",
            f"device={device}", "dtype=auto"]  # fmt: skip
    argv = ["train", "--preset", "tiny-lm", "--out", str(out), "--no-progress"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    config = json.loads((out / "config.json").read_text())
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        assert config["dtype"] == "bfloat16"
    peak = json.loads((out / "report.json").read_text())["peak_memory_mib"]
    if device.type == "cuda":  # torch's peak allocation on the GPU, this process's since it began
        assert 0 < peak <= torch.cuda.max_memory_allocated(device) / 2**20 + 0.1
    capsys.readouterr()
    argv = ["generate", "--run", str(out), "--prompt", "the king", "--max-new-tokens", "8", "--greedy"]
    assert main([*argv, "--no-stream"]) == 0
    on_cpu = capsys.readouterr().out
    assert main([*argv, "--no-stream", "--device", str(device)]) == 0
    assert capsys.readouterr().out == on_cpu
    for where in ("cpu", str(device)):
        assert main(["eval", "--run", str(out), "--split", "val", "--device", where]) == 0
        assert "perplexity" in capsys.readouterr().out
