"""The compiled decoding step (`tformer.model.compiled_step`): its program run eagerly against the model's
own forward over the KV cache (1e-5), the compiled program against the eager one (slow: it compiles),
and what `generate(compile=True)` does with models it does not take or a compiler that fails."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from tformer import MoEConfig, build_model
from tformer.generate.engine import _left_pad, generate
from tformer.generate.sampling import SamplingConfig
from tformer.model import compiled_step as compiled_step_module
from tformer.model import linear as linear_module
from tformer.model.cache import KVCache
from tformer.model.compiled_step import CompiledDecodeStep, why_not_compiled
from tformer.presets import llama_like, tiny

from .test_decode_step import CONFIGS, PROMPTS

MOE_BASE = CONFIGS["deepseek_moe"]
MODELS = {
    **CONFIGS,
    # sigmoid scores, group-limited choice, unnormalised scaled weights, biases, ReLU experts, a dense
    # first layer, no shared expert
    "moe_sigmoid_groups_relu": tiny().replace(
        ffn="relu",
        bias=True,
        moe=MoEConfig(
            n_experts=8,
            top_k=3,
            d_expert=24,
            score_func="sigmoid",
            norm_topk=False,
            routed_scaling=2.5,
            n_group=4,
            topk_group=2,
            group_score="top2",
            first_dense=1,
            dispatch="loop",
        ),
    ),
    # GELU experts, top-1 with weights as scored, two shared experts
    "moe_gelu_top1": tiny().replace(ffn="gelu", moe=MoEConfig(n_experts=4, top_k=1, d_expert=16, n_shared=2)),
}
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(MODELS[name]).eval()
    with torch.no_grad():  # a trained router's balancing bias, which steers the choice only
        for module in model.modules():
            if hasattr(module, "expert_bias"):
                module.expert_bias.uniform_(-0.05, 0.05)
    return model


def compiled_generate(model, prompts, cfg: SamplingConfig) -> list[list[int]]:
    """generate(compile=True), failing where it fell back to the flat step (it warns when it does)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, prompts, cfg, compile=True)
    ours = [str(w.message) for w in caught if "compile" in str(w.message) and "decoding" in str(w.message)]
    assert not ours, ours
    return out


def run_steps(model, prompts, step: CompiledDecodeStep, steps: int = 6):
    """Feed the same tokens to the model (cache a) and to `step` (cache b): the logits of both per step
    and both caches."""
    tokens, real = _left_pad(prompts, 0, torch.device("cpu"))
    padded = not bool(real.all())
    b, length = tokens.shape
    pairs = []
    with torch.inference_mode():
        caches = model.new_cache(length + steps + 2), model.new_cache(length + steps + 2)
        positions = (real.cumsum(-1) - 1).clamp_min(0) if padded else None
        key_padding = real if padded else None
        for cache in caches:
            logits = model(tokens, positions=positions, key_padding_mask=key_padding, cache=cache)[:, -1]
        next_pos = real.sum(-1, keepdim=True)
        for _ in range(steps):
            nxt = logits.argmax(-1)
            if padded:
                key_padding = torch.cat([key_padding, torch.ones(b, 1, dtype=torch.bool)], dim=1)
                positions, next_pos = next_pos, next_pos + 1
            logits = model(nxt[:, None], positions=positions, key_padding_mask=key_padding, cache=caches[0])
            logits = logits[:, -1]
            pairs.append((step(nxt, positions, key_padding, caches[1]), logits))
    return pairs, caches, length + steps


def block_every_layer(monkeypatch, blocked: bool) -> None:
    """Where `blocked`: the products as row-blocked batched products, for the tiny test models too."""
    monkeypatch.setattr(linear_module, "DECODE_ROW_BLOCKED", blocked)
    if blocked:
        monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 0)


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("prompts", sorted(PROMPTS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_program_equals_the_model_forward(name: str, prompts: str, blocked: bool, monkeypatch) -> None:
    """The program, run eagerly: logits and caches equal the model's to 1e-5 (the products and the
    attention are written differently, so not bit for bit) for Pre/Post-Norm, LayerNorm/RMSNorm,
    RoPE/sinusoidal/learned/no positions, SwiGLU/ReLU/GELU, GQA, biases, a tied head, MoE layers
    (softmax / sigmoid routing, group limits, shared experts), padded rows; with its products as F.linear
    and as row-blocked batched products (as where `row_blocking_pays`)."""
    block_every_layer(monkeypatch, blocked)
    model = make(name)
    with torch.inference_mode():
        step = CompiledDecodeStep.build(model, len(PROMPTS[prompts]), compiled=False)
    assert step.program.row_blocks is blocked
    pairs, (a, c), n = run_steps(model, PROMPTS[prompts], step)
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert a.lengths == c.lengths == [n] * model.cfg.n_layers
    for ka, kc, va, vc in zip(a.k, c.k, a.v, c.v):
        torch.testing.assert_close(kc[:, :, :n], ka[:, :, :n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(vc[:, :, :n], va[:, :, :n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["llama_gqa_bias_tied", "deepseek_moe"])
def test_bf16_program_is_close_to_the_model_forward(name: str) -> None:
    """In bf16 the program's products and sums round differently from the model's: logits within 1e-2
    (the README says ~4e-3), the same greedy tokens."""
    model = make(name).to(torch.bfloat16)
    with torch.inference_mode():
        step = CompiledDecodeStep.build(model, 2, compiled=False)
    pairs, _, _ = run_steps(model, PROMPTS["padded"], step)
    for got, want in pairs:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def eager_step_after_a_prompt(capacity: int) -> tuple[CompiledDecodeStep, KVCache]:
    """The eager program of a one-row model, and a cache of `capacity` slots holding a 3-token prompt
    (call under inference_mode)."""
    model = make("llama_mha")
    step = CompiledDecodeStep.build(model, 1, compiled=False)
    cache = model.new_cache(capacity)
    model(torch.tensor([[5, 6, 7]]), cache=cache)
    return step, cache


def test_program_attends_over_the_filled_slots_only() -> None:
    """Slots past the new token hold garbage (NaN) in the cache: the logits do not see it."""
    with torch.inference_mode():
        step, cache = eager_step_after_a_prompt(16)
        for k, v in zip(cache.k, cache.v):
            k[:, :, 3:] = float("nan")
            v[:, :, 3:] = float("nan")
        logits = step(torch.tensor([8]), None, None, cache)
    assert bool(torch.isfinite(logits).all())
    assert cache.seq_len == 4


def test_models_it_does_not_take_decode_without_it_with_a_warning() -> None:
    torch.manual_seed(0)
    moe = MOE_BASE.moe.replace(eval_capacity_factor=1.0)
    model = build_model(MOE_BASE.replace(moe=moe)).eval()
    reason = "block 0's MoE drops tokens over eval_capacity_factor (compiled decoding is dropless)"
    with torch.inference_mode():
        assert why_not_compiled(model) == reason
    with pytest.warns(UserWarning, match=f"compiled decoding not used: {re.escape(reason)}"):
        fast = generate(model, [[5, 6, 7]], GREEDY, compile=True)
    assert fast == generate(model, [[5, 6, 7]], GREEDY)
    model.train()
    assert "training mode" in why_not_compiled(model)


def test_compile_with_the_slow_twin_is_refused() -> None:
    with pytest.raises(ValueError, match="compile=True is a fast path; fast_decode=False"):
        generate(make("llama_mha"), [[5, 6]], GREEDY, compile=True, fast_decode=False)


def test_a_compiler_that_fails_is_named_once_and_decoding_goes_on(monkeypatch, recwarn) -> None:
    """The first failure is said where the user called generate and remembered: a later call of the same
    model shape decodes with the flat step from the start (no second attempt to compile)."""
    calls: list[int] = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("Compiler: cc is not found\nmore detail")

    monkeypatch.setattr(compiled_step_module, "compiled_step_program", lambda: broken)
    monkeypatch.setattr(compiled_step_module, "_FAILED", {})
    model = make("llama_gqa_bias_tied")
    prompts = [[5, 6, 7, 8], [9, 10]]
    slow = generate(model, prompts, GREEDY, fast_decode=False)
    with pytest.warns(
        UserWarning, match=r"torch.compile failed \(RuntimeError: Compiler: cc is not found\)"
    ) as w:
        assert generate(model, prompts, GREEDY, compile=True) == slow
    assert w[0].filename == __file__ and len(calls) == 1
    with pytest.warns(UserWarning, match="torch.compile failed for this model earlier in this process"):
        assert generate(model, prompts, GREEDY, compile=True) == slow
    assert len(calls) == 1


def test_the_recompile_limit_is_named_as_such(monkeypatch) -> None:
    class FailOnRecompileLimitHit(RuntimeError):
        pass

    def limited(*args):
        raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    monkeypatch.setattr(compiled_step_module, "compiled_step_program", lambda: limited)
    monkeypatch.setattr(compiled_step_module, "_FAILED", {})
    with pytest.warns(
        UserWarning, match=r"recompile limit reached: .* \(torch._dynamo.config.recompile_limit\); raise it"
    ):
        generate(make("llama_mha"), [[5, 6]], GREEDY, compile=True)


def test_a_model_in_training_mode_is_compiled_in_eval_mode_and_put_back(monkeypatch, recwarn) -> None:
    """generate decodes in eval mode whatever the model's mode (a fresh build_model is in training
    mode): the compiled step is built, not refused for dropout, and the mode is put back."""
    calls: list[int] = []
    eager = compiled_step_module.step_program
    monkeypatch.setattr(
        compiled_step_module, "compiled_step_program", lambda: lambda *a: calls.append(1) or eager(*a)
    )
    model = make("llama_mha").train()
    out = generate(model, [[5, 6, 7]], GREEDY, compile=True)
    assert model.training and len(calls) == GREEDY.max_new_tokens - 1
    assert out == generate(model, [[5, 6, 7]], GREEDY)
    assert not [w for w in recwarn if "compile" in str(w.message)]


def test_blocks_with_other_attention_shapes_are_refused_by_name() -> None:
    model = make("llama_mha")
    model.blocks[1].attn.n_heads = 2  # as a pruned block would be
    with torch.inference_mode():
        assert why_not_compiled(model).startswith("the blocks' attention heads differ")


def test_the_step_refuses_another_batch_size_and_a_full_cache() -> None:
    with torch.inference_mode():
        step, cache = eager_step_after_a_prompt(3)
        with pytest.raises(ValueError, match="built for 1 rows, got 2"):
            step(torch.tensor([1, 2]), None, None, cache)
        with pytest.raises(ValueError, match="holds 3 positions; cannot add 1 after 3"):
            step(torch.tensor([1]), None, None, cache)


@pytest.mark.slow
@pytest.mark.parametrize("blocked", [False, True])
def test_compiled_generate_equals_the_eager_one_and_compiles_once(blocked: bool, monkeypatch) -> None:
    """torch.compile of the step (tens of seconds on 2 cores): the same greedy tokens as the flat step and logits
    equal to the eager program to 1e-5, for one row and two padded rows; another prompt length and
    another run of new tokens reuse the graph (the sizes that change per call and per step are symbolic).
    With the products as F.linear and as row-blocked batched products (the flat step then blocks too)."""
    block_every_layer(monkeypatch, blocked)
    torch._dynamo.reset()  # each variant counts its own graphs
    torch.manual_seed(0)
    model = build_model(llama_like(97, 64, 2, 4, 2, 128, 128)).eval()
    with torch.inference_mode():
        step = CompiledDecodeStep.build(model, 1)
        twin = CompiledDecodeStep.build(model, 1, compiled=False)
        for _ in range(2):  # cache a for the compiled step, b for the twin
            caches = model.new_cache(20), model.new_cache(20)
            for cache in caches:
                model(torch.tensor([[5, 6, 7, 8]]), cache=cache)
            for token in (9, 10, 11):
                got = step(torch.tensor([token]), None, None, caches[0])
                torch.testing.assert_close(
                    got, twin(torch.tensor([token]), None, None, caches[1]), atol=1e-5, rtol=1e-5
                )
    graphs = counters["stats"]["unique_graphs"]
    for prompts in ([[5, 6, 7, 8]], [[1, 2, 3, 4, 5, 6, 7]], [[5, 6, 7, 8], [9, 10]]):
        cfg = SamplingConfig(temperature=0.0, max_new_tokens=10 + len(prompts[0]))
        assert compiled_generate(model, prompts, cfg) == generate(model, prompts, cfg)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the batch of two rows only


@pytest.mark.slow
def test_compiled_moe_generate_equals_the_eager_one() -> None:
    """A DeepSeekMoE model (softmax routing with a balancing bias, a shared expert) and the ReLU MoE with
    group-limited sigmoid routing, compiled: the greedy tokens of the flat step, one padded batch each."""
    for name in ("deepseek_moe", "moe_sigmoid_groups_relu"):
        model = make(name)
        prompts = [[5, 6, 7, 8], [9, 10]]
        assert compiled_generate(model, prompts, GREEDY) == generate(model, prompts, GREEDY)
