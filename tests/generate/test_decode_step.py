"""The flat decoding step (`tformer.model.decode_step.DecodeStep`) against its slow twin, the model's
own forward over the KV cache: same logits, same cache, same tokens from `generate`."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
from torch import nn

from tests.model.helpers import distinct_norms
from tformer import MoEConfig, build_model
from tformer.config import RopeConfig
from tformer.generate.beam import SearchConfig, beam_search, sample_search, search, select_memory
from tformer.generate.engine import _left_pad, generate
from tformer.generate.sampling import SamplingConfig
from tformer.model import decode_step as decode_step_module
from tformer.model import linear as linear_module
from tformer.model.decode_step import DecodeStep, Seq2SeqDecodeStep, unsupported
from tformer.model.linear import row_blocked_linears
from tformer.model.norms import rms_norms_as_layer_norm
from tformer.model.transformer import DecoderLM
from tformer.presets import llama_like, tiny

BASE = llama_like(97, 32, 2, 4, 2, 64, 64)  # GQA: 4 query heads over 2 K/V heads
CONFIGS = {
    "llama_gqa_bias_tied": BASE.replace(bias=True, tie_embeddings=True),
    "llama_mha": BASE.replace(n_kv_heads=None),
    "post_layernorm_sinusoidal_relu": tiny().replace(
        norm_placement="post", norm="layernorm", positions="sinusoidal", ffn="relu", embed_scale=True
    ),
    "pre_layernorm_nobias_learned_gelu": tiny().replace(
        norm="layernorm_nobias", positions="learned", ffn="gelu"
    ),
    "no_positions": tiny().replace(positions="none"),
    "rope_embed_scale": BASE.replace(embed_scale=True),  # the embedding scaled, RoPE in attention
    "no_positions_embed_scale": tiny().replace(positions="none", embed_scale=True),
    "deepseek_moe": BASE.replace(
        moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared=1, dispatch="grouped")
    ),
}


@pytest.fixture(autouse=True)
def block_every_layer(monkeypatch) -> None:
    """The test models are tiny; let the decoding context block their layers too."""
    monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 0)


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(CONFIGS[name]).eval()


def decoding_contexts(model: nn.Module, on: bool) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if on:
        stack.enter_context(row_blocked_linears(model))
        stack.enter_context(rms_norms_as_layer_norm(model))
    return stack


PROMPTS = {
    "one": [[5, 6, 7, 8, 9]],
    "two": [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]],
    "padded": [[5, 6, 7, 8, 9], [10, 11]],
}


@pytest.mark.parametrize(
    "products",
    ["blocked", "partly_blocked", "plain"],  # every layer row-blocked; q, o, FFN but not k/v (GQA); none
)
@pytest.mark.parametrize("prompts", sorted(PROMPTS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_step_equals_the_model_forward(name: str, prompts: str, products: str, monkeypatch) -> None:
    """Feed the same tokens to the model (cache a) and to the step (cache b) for 6 steps: logits and
    both caches are bit-identical (the step runs the model's ops on the model's weights)."""
    if products == "partly_blocked":
        monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 1000)  # q: 32 x 32, k/v: 16 x 32
    model = make(name)
    contexts, prompts = products != "plain", PROMPTS[prompts]
    tokens, real = _left_pad(prompts, 0, torch.device("cpu"))
    padded = not bool(real.all())
    b, length = tokens.shape
    with torch.inference_mode(), decoding_contexts(model, contexts):
        caches = model.new_cache(length + 8), model.new_cache(length + 8)
        positions = (real.cumsum(-1) - 1).clamp_min(0) if padded else None
        key_padding = real if padded else None
        for cache in caches:
            logits = model(tokens, positions=positions, key_padding_mask=key_padding, cache=cache)[:, -1]
        step = DecodeStep.build(model, b)
        assert step is not None
        next_pos = real.sum(-1, keepdim=True)
        for _ in range(6):
            nxt = logits.argmax(-1)
            if padded:
                key_padding = torch.cat([key_padding, torch.ones(b, 1, dtype=torch.bool)], dim=1)
                positions, next_pos = next_pos, next_pos + 1
            logits = model(nxt[:, None], positions=positions, key_padding_mask=key_padding, cache=caches[0])[
                :, -1
            ]
            got = step(nxt, positions, key_padding, caches[1])
            assert torch.equal(got, logits)
    a, c = caches
    assert a.lengths == c.lengths == [length + 6] * len(a.lengths)
    n = length + 6
    for ka, kc, va, vc in zip(a.k, c.k, a.v, c.v):
        assert torch.equal(kc[:, :, :n], ka[:, :, :n]) and torch.equal(vc[:, :, :n], va[:, :, :n])


@pytest.mark.parametrize("n_prompts", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generate_with_the_step_equals_the_slow_twin(name: str, n_prompts: int, count_calls) -> None:
    model = make(name)
    calls = count_calls(decode_step_module._Block, "__call__")
    forwards = count_calls(DecoderLM, "forward")
    prompts = [[5, 6, 7, 8], [9, 10]][:n_prompts]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20)
    slow = generate(model, prompts, cfg, fast_decode=False)
    assert len(forwards) == 20 and not calls  # the prompt, then a forward per token but the last
    fast = generate(model, prompts, cfg)
    assert fast == slow and all(len(row) == 20 for row in fast)
    assert len(forwards) == 21  # the fast run's prompt only: its 19 steps ran in the flat step
    assert len(calls) == 19 * model.cfg.n_layers


def test_seeded_sampling_with_the_step_equals_the_slow_twin() -> None:
    model = make("llama_gqa_bias_tied")
    cfg = SamplingConfig(
        temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3, max_new_tokens=16, seed=3
    )
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    assert generate(model, prompts, cfg) == generate(model, prompts, cfg, fast_decode=False)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(rope=RopeConfig(layout="interleaved")), "rotary embedding"),
        (dict(rope=RopeConfig(fraction=0.5)), "rotary embedding"),
        (dict(attn_kernel="eager"), "attention kernel"),
    ],
)
def test_models_it_does_not_know_decode_through_the_model(change: dict, reason: str) -> None:
    torch.manual_seed(0)
    model = build_model(BASE.replace(**change)).eval()
    with torch.inference_mode():
        assert reason in unsupported(model)
        assert DecodeStep.build(model, 1) is None
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    assert generate(model, [[5, 6, 7]], cfg) == generate(model, [[5, 6, 7]], cfg, fast_decode=False)


def test_no_step_in_training_mode_or_under_autocast() -> None:
    model = make("llama_mha").train()
    with torch.inference_mode():
        assert "training" in unsupported(model)
        model.eval()
        model.blocks[1].attn.kernel.train()  # dropout left on in one module (e.g. MC dropout)
        assert "training" in unsupported(model)
        model.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert "autocast" in unsupported(model)
        assert unsupported(model) is None


def test_step_refuses_a_full_cache_and_another_batch_size() -> None:
    model = make("llama_mha")
    with torch.inference_mode():
        cache = model.new_cache(4)
        model(torch.tensor([[5, 6, 7, 8]]), cache=cache)
        step = DecodeStep.build(model, 1)
        with pytest.raises(ValueError, match="holds 4 positions"):
            step(torch.tensor([3]), None, None, cache)
        with pytest.raises(ValueError, match="built for 1 rows, got 2"):
            step(torch.tensor([3, 4]), None, None, cache)


def test_half_precision_model_step_equals_the_model_forward() -> None:
    model = make("llama_gqa_bias_tied").to(torch.bfloat16)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    prompts = [[5, 6, 7, 8], [9, 10]]
    with torch.inference_mode():
        assert DecodeStep.build(model, 2) is not None
    assert generate(model, prompts, cfg) == generate(model, prompts, cfg, fast_decode=False)


class Tripled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 3


def _hooked(model: nn.Module) -> str:
    model.blocks[1].ffn.register_forward_hook(lambda module, args, out: out * 2)
    return "forward hooks"


def _pre_hooked(model: nn.Module) -> str:
    model.blocks[1].attn.register_forward_pre_hook(lambda module, args: (args[0] * 2, *args[1:]))
    return "forward hooks"


def _replaced_forward(model: nn.Module) -> str:
    block = model.blocks[0]
    block.forward = lambda *args: type(block).forward(block, *args) * 0.5
    return "replaced forward"


def _subclassed_linear(model: nn.Module) -> str:
    attn = model.blocks[0].attn
    tripled = Tripled(attn.v_proj.in_features, attn.v_proj.out_features, bias=attn.v_proj.bias is not None)
    tripled.load_state_dict(attn.v_proj.state_dict())
    attn.v_proj = tripled
    return "linear layer Tripled"


def _quantized(model: nn.Module) -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("change", [_hooked, _pre_hooked, _replaced_forward, _subclassed_linear])
def test_models_changed_by_the_user_decode_through_their_modules(change) -> None:
    """Hooks, a forward set on an instance, a subclass of nn.Linear: the step would skip them."""
    model = make("llama_mha")
    reason = change(model)
    model.eval()  # the new layers come in training mode
    with torch.inference_mode():
        assert reason in unsupported(model)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8)
    assert generate(model, [[5, 6, 7]], cfg) == generate(model, [[5, 6, 7]], cfg, fast_decode=False)


@pytest.mark.filterwarnings("ignore:.*quantiz")  # torch deprecates eager quantization for torchao
def test_global_hooks_and_quantized_models_decode_through_their_modules() -> None:
    model = make("llama_mha")
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with torch.inference_mode():
            assert "global" in unsupported(model)
    finally:
        handle.remove()
    quantized = _quantized(make("llama_mha")).eval()
    with torch.inference_mode():
        assert "linear layer" in unsupported(quantized)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6)
    assert generate(quantized, [[5, 6, 7]], cfg) == generate(quantized, [[5, 6, 7]], cfg, fast_decode=False)


def test_no_step_for_other_spines_or_with_gradients() -> None:
    torch.manual_seed(0)
    classifier = build_model(tiny("encoder").replace(n_classes=3)).eval()
    with torch.inference_mode():
        assert "neither a DecoderLM nor an EncoderDecoder" in unsupported(classifier)
        assert DecodeStep.build(seq2seq("paper_like"), 1) is None  # each step takes its own spine
        assert Seq2SeqDecodeStep.build(make("llama_mha")) is None
    assert "gradients" in unsupported(make("llama_mha"))


# ----------------------------------------------------------------------------- encoder-decoder
BOS, EOS, PAD = 1, 2, 0
SEQ2SEQ = {
    "paper_like": dict(norm="layernorm", positions="sinusoidal", ffn="relu", embed_scale=True),
    "post_norm": dict(norm_placement="post", norm="layernorm", positions="sinusoidal", ffn="relu"),
    "rope_self_only": dict(positions="rope"),
    "rope_cross_too": dict(positions="rope", rope=RopeConfig(cross_attention=True)),
    "gqa_swiglu_bias": dict(n_kv_heads=2, bias=True),
    "moe_decoder": dict(moe=MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared=1, dispatch="grouped")),
}


def seq2seq(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(tiny("encoder_decoder").replace(vocab_size=40, max_seq_len=32, **SEQ2SEQ[name])).eval()


def sources(padded: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, 40, (3, 7), generator=gen)
    if not padded:
        return src, None  # the memory mask is all True: SDPA runs without one
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False  # one padded sentence
    return src.masked_fill(~mask, PAD), mask


@pytest.mark.parametrize("padded", [True, False], ids=["padded_source", "full_source"])
@pytest.mark.parametrize("products", ["blocked", "plain"])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_seq2seq_step_equals_model_decode(name: str, products: str, padded: bool) -> None:
    """The decoder fed the same tokens through `model.decode` (cache a) and the step (cache b), with
    the rows reordered and cut halfway as beam search does: logits and self-attention caches
    bit-identical."""
    model = seq2seq(name)
    src, src_mask = sources(padded)
    with torch.inference_mode(), decoding_contexts(model, products == "blocked"):
        memory = model.encode(src, src_mask)
        caches = model.new_cache(12), model.new_cache(12)
        step = Seq2SeqDecodeStep.build(model)
        assert step is not None
        nxt = torch.full((3,), BOS)
        for cache in caches:  # the first step allocates the cache and projects the memory's K/V
            logits = model.decode(nxt[:, None], memory, cache=cache)[:, -1]
        for t in range(6):
            if t == 3:  # rows follow beams: reorder and drop one, memory rows with them
                index = torch.tensor([2, 0])
                memory, logits = select_memory(memory, index), logits.index_select(0, index)
                for cache in caches:
                    cache.reorder(index, memory.states)
            nxt = logits.argmax(-1)
            logits = model.decode(nxt[:, None], memory, cache=caches[0])[:, -1]
            assert torch.equal(step(nxt, memory, caches[1]), logits)
    a, c = caches
    assert a.lengths == c.lengths == [7] * len(a.lengths)
    for ka, kc, va, vc in zip(a.k, c.k, a.v, c.v):
        assert torch.equal(kc[:, :, :7], ka[:, :, :7]) and torch.equal(vc[:, :, :7], va[:, :, :7])


@pytest.mark.parametrize("products", ["blocked", "plain"])
@pytest.mark.parametrize("method", ["beam", "greedy", "sample"])
@pytest.mark.parametrize("name", sorted(SEQ2SEQ))
def test_search_with_the_step_equals_search_through_model_decode(
    name: str, method: str, products: str, count_calls
) -> None:
    """Beam, greedy and sampled search with the flat steps after the first: the same hypotheses, scores
    and log-probabilities, bit for bit, as with `model.decode` every step (sentences finish and leave,
    beams reorder the rows)."""
    model = seq2seq(name)
    src, src_mask = sources()
    steps = count_calls(decode_step_module._CrossBlock, "__call__")
    # EOS banned: random weights may end every sentence at the first step, which runs through
    # model.decode on both sides; the sentences still leave at their own max lengths
    common = dict(bos_id=BOS, eos_id=EOS, max_len=torch.tensor([9, 6, 11]), banned=(PAD, BOS, EOS))
    if method == "beam":
        run = partial(beam_search, model, src, src_mask, beam_size=3, alpha=0.6, **common)
    else:
        run = partial(
            sample_search,
            model,
            src,
            src_mask,
            temperature=0.8 * (method == "sample"),
            top_k=10,
            seed=5,
            **common,
        )
    with decoding_contexts(model, products == "blocked"):
        slow = run(flat=False)
        assert not steps
        fast = run()
    assert [len(h.tokens) for h in fast] == [9, 6, 11]
    assert len(steps) >= 10 * model.cfg.n_layers  # the steps after the first ran flat
    assert [(h.tokens, h.score, h.log_prob, h.finished) for h in fast] == [
        (h.tokens, h.score, h.log_prob, h.finished) for h in slow
    ]


def test_search_default_uses_the_flat_step_and_fast_decode_false_does_not(count_calls) -> None:
    model = seq2seq("paper_like")
    src, src_mask = sources()
    steps = count_calls(decode_step_module._CrossBlock, "__call__")
    cfg, common = SearchConfig(beam_size=2, max_len=6), dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    slow = search(model, src, src_mask, cfg, fast_decode=False, **common)
    assert not steps
    fast = search(model, src, src_mask, cfg, **common)
    assert steps and [h.tokens for h in fast] == [h.tokens for h in slow]


def test_seq2seq_step_needs_a_started_cache() -> None:
    model = seq2seq("paper_like")
    src, src_mask = sources()
    with torch.inference_mode():
        step = Seq2SeqDecodeStep.build(model)
        with pytest.raises(ValueError, match="first decoding step runs through model.decode"):
            step(torch.full((3,), BOS), model.encode(src, src_mask), model.new_cache(8))


def test_seq2seq_step_refuses_the_memory_of_another_source() -> None:
    """Stale cross-attention K/V would decode the new source against the old one's keys."""
    model = seq2seq("paper_like")
    src, src_mask = sources()
    other = torch.flip(src, dims=[1])
    with torch.inference_mode():
        cache = model.new_cache(8)
        model.decode(torch.full((3, 1), BOS), model.encode(src, src_mask), cache=cache)
        step = Seq2SeqDecodeStep.build(model)
        with pytest.raises(
            ValueError, match="holds the cross-attention keys/values of another encoder memory"
        ):
            step(torch.full((3,), BOS), model.encode(other, src_mask), cache)


# ----------------------------------------------------------------------------- found by a mutation audit
@pytest.mark.parametrize("name", ["post_norm", "rope_self_only"])  # Post-Norm LayerNorm; Pre-Norm RMSNorm
@torch.no_grad()
def test_seq2seq_step_equals_model_decode_with_distinct_norms(name: str) -> None:
    """As test_seq2seq_step_equals_model_decode, with every norm's weight (and bias) made distinct: at
    their initial values all norms of a block are the same function, so the step could use one norm's
    parameters in another's slot unseen."""

    model = distinct_norms(seq2seq(name))
    src, src_mask = sources(True)
    memory = model.encode(src, src_mask)
    caches = model.new_cache(12), model.new_cache(12)
    step = Seq2SeqDecodeStep.build(model)
    assert step is not None
    nxt = torch.full((3,), BOS)
    for cache in caches:
        logits = model.decode(nxt[:, None], memory, cache=cache)[:, -1]
    for _ in range(4):
        nxt = logits.argmax(-1)
        logits = model.decode(nxt[:, None], memory, cache=caches[0])[:, -1]
        torch.testing.assert_close(step(nxt, memory, caches[1]), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["post_layernorm_sinusoidal_relu", "pre_layernorm_nobias_learned_gelu"])
@torch.no_grad()
def test_lm_step_equals_the_model_forward_with_distinct_norms(name: str) -> None:
    """DecodeStep against model(...) with every norm's parameters made distinct (see above)."""

    model = distinct_norms(make(name))
    prompt = torch.randint(3, 60, (2, 5))
    caches = model.new_cache(12), model.new_cache(12)
    for cache in caches:
        logits = model(prompt, cache=cache)[:, -1]
    step = DecodeStep.build(model, 2)
    assert step is not None
    for _ in range(4):
        nxt = logits.argmax(-1)
        logits = model(nxt[:, None], cache=caches[0])[:, -1]
        torch.testing.assert_close(step(nxt, None, None, caches[1]), logits, rtol=1e-5, atol=1e-5)
