"""`tformer export` / `export_hf`: a decoder LM written as a Hugging Face model directory loads with
`AutoModelForCausalLM` / `AutoTokenizer` and gives tformer's logits (1e-5), greedy tokens and token ids;
what no family can express is refused by name, and a failed export leaves no directory."""

from __future__ import annotations

import errno
import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tformer import build_model
from tformer.cli.main import main
from tformer.config import MoEConfig, RopeConfig
from tformer.data.tokenizer import Tokenizer
from tformer.export import ExportError, export_hf, hf_family
from tformer.generate import SamplingConfig
from tformer.generate.engine import generate
from tformer.presets import llama_like, tiny
from tformer.runs import LoadedRun, load_run
from tformer.train.config import TrainConfig
from tformer.train.presets import shakespeare, shakespeare_model

VOCAB = 300
TEXTS = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
         "The slings and arrows of outrageous fortune", "Or to take arms against a sea of troubles,"] * 20  # fmt: skip


def main_job_model(**moe):
    """The main job's Pre-Norm + RoPE + DeepSeekMoE decoder (softmax routing, one shared expert, first
    layer dense), narrowed for a test."""
    base = shakespeare().model.moe.replace(**{"d_expert": 32, **moe})
    return shakespeare_model(base).replace(vocab_size=VOCAB, d_model=64, n_heads=4, d_ff=128, max_seq_len=64)


CASES = {
    "llama-gqa": (llama_like(VOCAB, 64, 2, 4, 2, 128, 64), "LlamaForCausalLM"),
    "llama-bias-tied-scaled-interleaved-linear": (
        llama_like(VOCAB, 64, 2, 4, None, 128, 64).replace(
            bias=True,
            tie_embeddings=True,
            embed_scale=True,
            rope=RopeConfig(theta=500.0, layout="interleaved", scaling="linear", factor=2.0),
        ),
        "LlamaForCausalLM",
    ),  # fmt: skip
    "main-job-deepseekmoe": (main_job_model(), "Qwen2MoeForCausalLM"),
    "softmax-moe-no-shared-every-2": (
        main_job_model(n_shared=0, first_dense=0, every=2, norm_topk=False),
        "Qwen2MoeForCausalLM",
    ),
    "switch-top1": (main_job_model(n_shared=0, top_k=1), "Qwen2MoeForCausalLM"),  # the score kept, not 1
    "sigmoid-top1-no-shared": (
        llama_like(VOCAB, 64, 2, 4, None, 128, 64).replace(
            moe=MoEConfig(n_experts=4, top_k=1, d_expert=32, score_func="sigmoid", aux_loss_coef=0.0)
        ),
        "Glm4MoeForCausalLM",
    ),
    "deepseek-v3-style-sigmoid": (
        llama_like(VOCAB, 64, 3, 4, 2, 128, 64).replace(
            moe=MoEConfig(
                n_experts=8,
                top_k=3,
                d_expert=32,
                n_shared=2,
                first_dense=1,
                score_func="sigmoid",
                n_group=2,
                topk_group=1,
                group_score="top2",
                routed_scaling=2.5,
                bias_update_rate=0.01,
                aux_loss_coef=0.0,
            ),
        ),
        "Glm4MoeForCausalLM",
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_bpe(TEXTS, VOCAB)


def loaded(cfg, tokenizer: Tokenizer) -> LoadedRun:
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():  # trained expert biases steer the choice: set some
            if name.endswith("expert_bias") and cfg.moe.bias_update_rate:
                buf.uniform_(-0.05, 0.05)
    return LoadedRun(model, tokenizer, TrainConfig(), Path("checkpoints/step_000007"), 7)


def from_pretrained(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_gives_the_runs_logits_and_greedy_tokens(case, tokenizer, tmp_path) -> None:
    cfg, architecture = CASES[case]
    run = loaded(cfg, tokenizer)
    done = export_hf(run, tmp_path / "hf")
    assert done.architecture == architecture and done.max_logit_diff < 1e-5
    hf = from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, run.model(ids), rtol=0, atol=1e-5)
        prompt = ids[:1, :6]
        # EOS held back on both sides (random weights may pick it first): 16 tokens each
        theirs = hf.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 6:].tolist()
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16, min_new_tokens=16)
    assert generate(run.model, prompt.tolist(), greedy, eos_id=2)[0] == theirs


def test_tokenizer_encodes_and_decodes_as_the_runs(tokenizer, tmp_path) -> None:
    export_hf(loaded(tiny().replace(vocab_size=VOCAB), tokenizer), tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (1, 2, 0)
    assert hf_tok("To be").input_ids == tokenizer.encode("To be")  # no BOS added by default either
    for text in [
        "To be, or not to be",
        "a literal <eos> stays text",
        "naïve café — ünïcode ✓",
        "  spaces\tand\nlines ",
    ]:
        ids = tokenizer.encode(text)
        assert hf_tok(text, add_special_tokens=False).input_ids == ids
        assert hf_tok.decode(ids) == tokenizer.decode(ids) == text


def test_saved_dtype_and_config(tokenizer, tmp_path) -> None:
    run = loaded(CASES["llama-gqa"][0], tokenizer)
    run.model.train()
    export_hf(run, tmp_path / "hf", dtype="bfloat16")
    assert run.model.training and next(run.model.parameters()).dtype == torch.float32  # the run's, as it was
    hf = from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16
    config = hf.config
    assert (config.num_key_value_heads, config.eos_token_id, config.max_position_embeddings) == (2, 2, 64)
    # GLM-4-MoE keeps its router in fp32: the expert biases are saved as trained, not rounded to bf16
    run = loaded(CASES["deepseek-v3-style-sigmoid"][0], tokenizer)
    export_hf(run, tmp_path / "glm", dtype="bfloat16")
    saved = load_file(tmp_path / "glm" / "model.safetensors")
    bias = saved["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, run.model.blocks[1].ffn.router.expert_bias)
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert saved["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(norm_placement="post"), "model.norm_placement='post'"),
        (dict(norm="layernorm"), "model.norm='layernorm'"),
        (dict(positions="sinusoidal"), "model.positions='sinusoidal'"),
        (dict(ffn="relu"), "model.ffn='relu'"),
        (dict(rope=RopeConfig(fraction=0.5)), "model.rope.fraction=0.5"),
        (dict(rope=RopeConfig(scaling="yarn", factor=2.0)), "model.rope.scaling='yarn'"),
        (dict(moe=MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01)), "model.moe.bias_update_rate=0.01"),
        (dict(moe=MoEConfig(n_experts=4, top_k=2, score_func="sigmoid", every=2)), "model.moe.every=2"),
        (dict(moe=MoEConfig(n_experts=4, top_k=2), bias=True), "model.bias=true"),
    ],
)
def test_what_no_family_expresses_is_named(change, named) -> None:
    with pytest.raises(ExportError, match="cannot be exported") as e:
        hf_family(tiny().replace(**change))
    assert named in str(e.value)


def test_every_problem_is_named_at_once_and_other_tasks_refused() -> None:
    with pytest.raises(ExportError) as e:
        hf_family(tiny("encoder_decoder").replace(norm_placement="post", positions="sinusoidal"))
    assert all(s in str(e.value) for s in ("model.arch='encoder_decoder'", "norm_placement", "positions"))


def test_failed_check_or_taken_directory_writes_nothing(tokenizer, tmp_path, monkeypatch) -> None:
    import tformer.export

    run = loaded(tiny().replace(vocab_size=VOCAB), tokenizer)
    monkeypatch.setattr(tformer.export, "LOGIT_TOLERANCE", -1.0)  # any difference, even 0, fails the check
    with pytest.raises(ExportError, match="logits that differ"):
        export_hf(run, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="already exists"):
        export_hf(run, tmp_path / "taken")
    with pytest.raises(ExportError, match="dtype"):
        export_hf(run, tmp_path / "hf", dtype="int8")
    with pytest.raises(ExportError, match="check_tokens must be an int >= 8"):
        export_hf(run, tmp_path / "hf", check_tokens=0)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # a link to nowhere is taken too
    with pytest.raises(ExportError, match="link already exists"):
        export_hf(run, tmp_path / "link")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # named as a step a run would save
    with pytest.raises(ExportError, match="the export directory .* is named as a checkpoint"):
        export_hf(run, tmp_path / "run" / "checkpoints" / "step_000099")

    def refused(*args, **kwargs):  # a folder that takes no new directory (/proc, a read-only mount)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.undo()  # the logits check passes again
    monkeypatch.setattr(tformer.export.tempfile, "mkdtemp", refused)
    with pytest.raises(ExportError) as e:  # it had named the temporary folder it could not make
        export_hf(run, tmp_path / "hf")
    assert str(e.value) == f"cannot write {tmp_path / 'hf'}: Read-only file system in {tmp_path}"


def test_a_signal_while_writing_leaves_no_temporary_folder(tokenizer, tmp_path, monkeypatch) -> None:
    run = loaded(tiny().replace(vocab_size=VOCAB), tokenizer)
    real = transformers.PreTrainedTokenizerFast.save_pretrained

    def killed(self, *args, **kwargs):  # SIGTERM halfway through the directory
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt) as e:
        export_hf(run, tmp_path / "hf")
    assert e.value.signum == signal.SIGTERM and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back


@pytest.mark.parametrize("width, dtype", [(30, "float32"), (172, "bfloat16")])  # the main job's in bf16
def test_expert_widths_the_grouped_kernel_cannot_take_export_to_the_eager_kernel(
    width, dtype, tokenizer, tmp_path
) -> None:
    run = loaded(main_job_model(d_expert=width), tokenizer)
    done = export_hf(run, tmp_path / "hf", dtype=dtype)  # torch's grouped product needs 16-byte rows
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["experts_implementation"] == "eager"
    hf = from_pretrained(tmp_path / "hf")  # loads with the defaults and runs
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = hf(ids).logits.float()
        assert torch.isfinite(logits).all()
        assert (logits - run.model(ids)).abs().max().item() == pytest.approx(done.saved_logit_diff, abs=0.5)


def test_cli_exports_a_trained_run(trained_run, tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    assert main(["export", "--run", str(trained_run), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "as LlamaForCausalLM" in printed.out and "logits equal the run's" in printed.out
    assert printed.err == ""
    run = load_run(trained_run)
    ids = torch.tensor([run.tokenizer.encode("to be or not to be")])
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(out)(ids).logits, run.model(ids), rtol=0, atol=1e-5)
    assert main(["export", "--run", str(trained_run), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
