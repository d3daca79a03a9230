"""The compiled decoding step (`tformer.model.compiled_step`): its program run eagerly against the model's
own forward over the KV cache (1e-5), the compiled program against the eager one (slow: it compiles),
and what `generate(compile=True)` does with models it does not take or a compiler that fails."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from tests.model.helpers import distinct_norms
from tformer import MoEConfig, build_model
from tformer.generate.engine import _left_pad, generate
from tformer.generate.sampling import SamplingConfig
from tformer.model import compiled_step as compiled_step_module
from tformer.model import linear as linear_module
from tformer.model.cache import KVCache
from tformer.model.compiled_step import CompiledDecodeStep, Program, why_not_compiled
from tformer.model.moe import SwiGLUExperts
from tformer.model.norms import is_rms_norm
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
    a, c, n = assert_program_equals_forward(model, PROMPTS[prompts], step)
    assert a.lengths == c.lengths == [n] * model.cfg.n_layers


@pytest.mark.parametrize(
    "name",
    [
        "llama_gqa_bias_tied",
        "deepseek_moe",
        "post_layernorm_sinusoidal_relu",
        "pre_layernorm_nobias_learned_gelu",
    ],
)
def test_bf16_program_is_close_to_the_model_forward(name: str) -> None:
    """In bf16 the program's products and sums round differently from the model's: logits within 1e-2
    (the README says ~4e-3), the same greedy tokens; also with input positions (a sinusoidal table kept
    in fp32, learned positions), which the program casts to the model's dtype."""
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


def assert_program_equals_forward(model, prompts, step: CompiledDecodeStep | None = None) -> tuple:
    """The eager program (built here unless given) against the model's own forward over the KV cache:
    logits to 1e-5, the filled cache slots to 1e-6. Returns the two caches and the filled length."""
    if step is None:
        with torch.inference_mode():
            step = CompiledDecodeStep.build(model, len(prompts), compiled=False)
    assert step is not None
    pairs, (a, c), n = run_steps(model, prompts, step)
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for ka, kc, va, vc in zip(a.k, c.k, a.v, c.v):
        torch.testing.assert_close(kc[:, :, :n], ka[:, :, :n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(vc[:, :, :n], va[:, :, :n], atol=1e-6, rtol=1e-6)
    return a, c, n


def trained_like(model):
    """Norm weights/biases and every bias away from their initial (1, 0) (a norm in another's slot, or
    a dropped bias, is invisible at init)."""
    with torch.no_grad():
        distinct_norms(model)
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # nn.Linear biases, the experts' *_bias, LayerNorm biases
                p.copy_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_program_equals_the_model_forward_with_trained_norms_and_biases(name: str) -> None:
    """Norms with their own weights and biases (each in its slot: the attention's, the FFN's, the
    final one) and non-zero biases of every product (dense FFN, experts, head): still the model's
    logits and caches."""
    assert_program_equals_forward(trained_like(make(name)), PROMPTS["padded"])


@pytest.mark.parametrize(
    "name", ["llama_mha", "post_layernorm_sinusoidal_relu", "pre_layernorm_nobias_learned_gelu"]
)
def test_program_uses_the_models_norm_eps(name: str) -> None:
    """A norm eps other than torch's default LayerNorm eps (1e-5) is the model's."""
    torch.manual_seed(0)
    model = build_model(MODELS[name].replace(norm_eps=0.1)).eval()
    assert_program_equals_forward(model, PROMPTS["padded"])


def test_rms_norms_without_eps_use_the_dtypes_eps() -> None:
    """nn.RMSNorm(eps=None) uses torch.finfo(dtype).eps, as the model's forward does."""
    model = make("llama_mha")
    rms = [m for m in model.modules() if is_rms_norm(m)]
    assert rms
    for m in rms:
        m.eps = None
    with torch.no_grad():  # small activations, where eps matters
        model.tok_embed.weight.mul_(1e-2)
    assert_program_equals_forward(model, PROMPTS["padded"])


def test_a_final_norm_of_another_kind_than_the_blocks_is_its_own() -> None:
    """A final norm (identity) unlike the blocks' RMSNorms is applied as itself."""
    model = make("llama_gqa_bias_tied")
    model.final_norm = nn.Identity().eval()
    with torch.inference_mode():
        assert why_not_compiled(model) is None
    assert_program_equals_forward(model, PROMPTS["padded"])


def test_moe_with_a_training_capacity_but_dropless_eval_is_taken() -> None:
    """capacity_factor drops tokens in training only (eval_capacity_factor None): the compiled step takes
    the model and computes its forward."""
    torch.manual_seed(0)
    model = build_model(MOE_BASE.replace(moe=MOE_BASE.moe.replace(capacity_factor=1.0))).eval()
    with torch.inference_mode():
        assert why_not_compiled(model) is None
    assert_program_equals_forward(model, PROMPTS["padded"])


def test_row_blocking_up_to_the_eager_steps_row_limit(monkeypatch) -> None:
    """The products are row-blocked for up to DECODE_MAX_ROWS rows, as the eager layout blocks them
    (`row_blocked_linears` takes F.linear above max_rows rows), and not above."""
    block_every_layer(monkeypatch, True)
    model = make("llama_mha")
    limit = linear_module.DECODE_MAX_ROWS
    with torch.inference_mode():
        assert CompiledDecodeStep.build(model, limit, compiled=False).program.row_blocks
        assert not CompiledDecodeStep.build(model, limit + 1, compiled=False).program.row_blocks


def test_the_plain_layout_makes_no_batched_products(monkeypatch) -> None:
    """Where row blocking does not pay, the step's products are F.linear: no torch.bmm call."""
    block_every_layer(monkeypatch, False)
    monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 0)  # row_blocks would accept every weight
    calls: list[int] = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or bmm(*a, **k))
    with torch.inference_mode():
        step, cache = eager_step_after_a_prompt(8)
        assert not step.program.row_blocks
        calls.clear()  # the prefill's
        step(torch.tensor([8]), None, None, cache)
    assert calls == []


class _OtherExperts(SwiGLUExperts):
    pass


def _encoder_decoder():
    return build_model(tiny("encoder_decoder")).eval()


def _with(name: str, change):
    model = make(name)
    change(model)
    return model.eval()  # the new modules too


def _layer_norm_2d(model) -> None:
    for block in model.blocks:
        block.attn_norm = nn.LayerNorm((1, model.cfg.d_model))


def _other_experts(model) -> None:
    model.blocks[0].ffn.experts.__class__ = _OtherExperts


REFUSED = {
    "encoder_decoder": (_encoder_decoder, "EncoderDecoder is not a DecoderLM"),
    "mixed_norm_kinds": (
        lambda: _with("llama_mha", lambda m: setattr(m.blocks[1], "attn_norm", nn.LayerNorm(m.cfg.d_model))),
        "the blocks' attn_norm are not all one LayerNorm, RMSNorm or identity",
    ),
    "a_later_blocks_norm": (
        lambda: _with(
            "llama_mha", lambda m: setattr(m.blocks[1], "ffn_norm", nn.GroupNorm(1, m.cfg.d_model))
        ),
        "the blocks' ffn_norm are not all one LayerNorm, RMSNorm or identity",
    ),
    "layer_norm_over_two_dims": (
        lambda: _with("pre_layernorm_nobias_learned_gelu", _layer_norm_2d),
        "the blocks' attn_norm are not all one LayerNorm, RMSNorm or identity",
    ),
    "final_norm": (
        lambda: _with("llama_mha", lambda m: setattr(m, "final_norm", nn.GroupNorm(1, m.cfg.d_model))),
        "final norm GroupNorm",
    ),
    "input_positions": (
        lambda: _with("no_positions", lambda m: setattr(m, "input_positions", nn.Identity())),
        "input positions Identity",
    ),
    "dense_ffn": (
        lambda: _with("llama_mha", lambda m: setattr(m.blocks[1], "ffn", nn.Identity())),
        "block 1 has a Identity FFN",
    ),
    "experts": (
        lambda: _with("deepseek_moe", _other_experts),
        "block 0's MoE experts _OtherExperts / SwiGLU",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_models_it_does_not_take_are_refused_by_name(case: str) -> None:
    build, reason = REFUSED[case]
    model = build()
    with torch.inference_mode():
        assert why_not_compiled(model) == reason
        with pytest.warns(UserWarning) as w:
            assert CompiledDecodeStep.build(model, 1) is None
    assert str(w[0].message) == f"compiled decoding not used: {reason}; decoding without it"


def test_a_remembered_failure_refuses_the_compiled_step_only(monkeypatch, recwarn) -> None:
    """After a failure to compile a program, a compiled build of it warns and gives none; the eager twin
    of the same program is still built (it does not compile)."""
    eager = compiled_step_module.step_program
    monkeypatch.setattr(compiled_step_module, "compiled_step_program", lambda: eager)
    model = make("llama_mha")
    with torch.inference_mode():
        twin = CompiledDecodeStep.build(model, 1, compiled=False)
        monkeypatch.setattr(compiled_step_module, "_FAILED", {twin.key: "why"})
        with pytest.warns(UserWarning) as w:
            assert CompiledDecodeStep.build(model, 1) is None
        assert str(w[0].message) == (
            "torch.compile failed for this model earlier in this process (why); decoding without it"
        )
        recwarn.clear()
        assert CompiledDecodeStep.build(model, 1, compiled=False) is not None
    assert not [w for w in recwarn if "compile" in str(w.message)]


@pytest.mark.parametrize(
    "message, said",
    [
        ("x" * 400 + "\nmore detail", "RuntimeError: " + "x" * 300),
        ("", "RuntimeError: "),
        ("  \n ", "RuntimeError: "),
    ],
    ids=["long", "empty", "blank"],
)
def test_a_compiler_failure_is_said_in_its_first_line_up_to_300_characters(
    message, said, monkeypatch
) -> None:
    """The warning names the error's type and the first 300 characters of its first line (none where the
    message is empty), and decoding goes on with the flat step."""

    def broken(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(compiled_step_module, "compiled_step_program", lambda: broken)
    monkeypatch.setattr(compiled_step_module, "_FAILED", {})
    model = make("llama_mha")
    with pytest.warns(UserWarning) as w:
        out = generate(model, [[5, 6, 7]], GREEDY, compile=True)
    ours = [str(x.message) for x in w if str(x.message).startswith("torch.compile failed (")]
    assert ours == [f"torch.compile failed ({said}); decoding without it"]
    assert out == generate(model, [[5, 6, 7]], GREEDY)


def test_only_the_first_compiled_call_falls_back(monkeypatch) -> None:
    """A compiled call after the first (which compiled) that raises is an error, not a silent switch to
    the flat step (the failed call may have written the cache)."""
    calls: list[int] = []
    eager = compiled_step_module.step_program

    def flaky(*args):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return eager(*args)

    monkeypatch.setattr(compiled_step_module, "compiled_step_program", lambda: flaky)
    monkeypatch.setattr(compiled_step_module, "_FAILED", {})
    model = make("llama_mha")
    with torch.inference_mode():
        step = CompiledDecodeStep.build(model, 1)
        cache = model.new_cache(16)
        model(torch.tensor([[5, 6, 7]]), cache=cache)
        step(torch.tensor([8]), None, None, cache)
        with pytest.raises(RuntimeError, match="boom"):
            step(torch.tensor([9]), None, None, cache)
    assert compiled_step_module._FAILED == {}


def test_the_eager_twin_raises_what_its_program_raises(monkeypatch) -> None:
    """compiled=False runs the program as is: an error in it is raised, not caught as a compiler's."""

    def broken(*args):
        raise RuntimeError("a bug in the program")

    monkeypatch.setattr(compiled_step_module, "step_program", broken)
    monkeypatch.setattr(compiled_step_module, "_FAILED", {})
    with torch.inference_mode():
        step, cache = eager_step_after_a_prompt(8)
        with pytest.raises(RuntimeError, match="a bug in the program"):
            step(torch.tensor([8]), None, None, cache)
    assert compiled_step_module._FAILED == {}


def test_the_step_refuses_fewer_rows_and_a_cache_without_a_prefill() -> None:
    with torch.inference_mode():
        model = make("llama_mha")
        step = CompiledDecodeStep.build(model, 2, compiled=False)
        with pytest.raises(ValueError, match="built for 2 rows, got 1"):
            step(torch.tensor([1]), None, None, model.new_cache(8))
        with pytest.raises(ValueError, match="decodes after a prefill"):
            step(torch.tensor([1, 2]), None, None, model.new_cache(8))


def test_the_sizes_that_change_per_step_are_marked_dynamic(monkeypatch) -> None:
    """The mask's length and the caches' capacity are marked dynamic (so one compiled graph serves every
    step; the slow test checks the graph count by compiling)."""
    marked: list[tuple[tuple[int, ...], int]] = []
    monkeypatch.setattr(
        torch._dynamo, "maybe_mark_dynamic", lambda t, dim: marked.append((tuple(t.shape), dim))
    )
    with torch.inference_mode():
        step, cache = eager_step_after_a_prompt(16)
        step(torch.tensor([8]), None, None, cache)
    k, n_layers = tuple(cache.k[0].shape), len(cache.k)
    assert marked == [((1, 4), 1), *[(k, 2)] * (2 * n_layers)]


def test_attention_scores_and_weights_are_fp32_in_bf16() -> None:
    """`_attention` of bf16 q/k/v with large scores (close to each other) equals softmax(q k^T / sqrt(E)) v computed in fp32 from
    the same bf16 values (to bf16 output rounding): scores rounded to bf16 would move the weights."""
    torch.manual_seed(0)
    b, h, hkv, e, s = 2, 4, 2, 8, 6
    p = Program(pre=True, heads=h, kv_heads=hkv, head_dim=e, ffns=(), attn_norm=None, ffn_norm=None,
                final_norm=None, embed_scale=1.0, rope=False)  # fmt: skip
    q = (2 * torch.randn(b, h, e)).bfloat16()
    # keys = a large common part (which the softmax cancels: scores ~200 apart from O(1) differences)
    # plus a small one per slot: bf16 scores (spacing 1 near 200) would lose the differences
    k = (100 * torch.randn(b, hkv, 1, e) + torch.randn(b, hkv, s, e)).bfloat16()
    v = torch.randn(b, hkv, s, e).bfloat16()
    mask = torch.tensor([[True] * s, [False, False] + [True] * (s - 2)])
    got = compiled_step_module._attention(p, q, k, v, mask)
    kr, vr = k.float().repeat_interleave(h // hkv, 1), v.float().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("bhe,bhse->bhs", q.float(), kr) / e**0.5
    weights = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    want = torch.einsum("bhs,bhse->bhe", weights, vr).reshape(b, h * e)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_bf16_router_scores_in_fp32() -> None:
    """The MoE slot of the eager program on bf16 rows equals the model's MoE module (which routes in fp32)
    where the router's logits are large and close (bf16 would round away their differences)."""
    model = make("deepseek_moe")
    with torch.no_grad():
        for block in model.blocks:  # a large logit common to every expert (the softmax cancels it)
            block.ffn.router.weight.add_(50 * torch.randn(model.cfg.d_model))
    model = model.to(torch.bfloat16)
    x = torch.randn(8, model.cfg.d_model).bfloat16()
    with torch.inference_mode():
        step = CompiledDecodeStep.build(model, 8, compiled=False)
        got = compiled_step_module._ffn(step.program, step.program.ffns[0], step.layers[0]["ffn"], x)
        want = model.blocks[0].ffn(x[:, None])[:, 0]
    scale = want.float().abs().max().item()  # the tiny model's MoE outputs are ~1e-3
    assert scale > 0
    torch.testing.assert_close(got.float(), want.float(), atol=0.05 * scale, rtol=0)  # bf16 rounding: ~1%


def test_a_head_with_a_bias() -> None:
    """build_model's heads have no bias; a head replaced by an nn.Linear with one (which the step takes) is
    applied with its bias."""
    model = make("llama_mha")
    head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size).eval()
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_()
    model.lm_head = head
    assert_program_equals_forward(model, PROMPTS["padded"])
