"""Every fast path against its slow twin: the half-layout RoPE without torch.cat vs the reference
rotation, stacked q/k/v and gate/up GEMMs vs separate linear layers, SDPA with `enable_gqa` vs
repeat_kv + SDPA vs eager attention, the mask-free SDPA call for an all-True mask vs the explicit mask,
and, at sizes where the fast paths switch on, the whole model vs Hugging Face Llama and vs cached
decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tformer.model.linear as linear_module
from tformer import RopeConfig
from tformer.model.attention import (
    ATTENTION_KERNELS,
    SDPA_HAS_GQA,
    EagerAttention,
    GqaSdpaAttention,
    SdpaAttention,
)
from tformer.model.linear import FUSE_MIN_ROWS, stacked_linear
from tformer.model.masks import Mask, causal_mask, padding_mask
from tformer.model.positions import JOINT_MAX_T, HalfRotaryEmbedding, RotaryEmbedding, make_rotary
from tformer.presets import tiny

from .helpers import make, rand_tokens, tiny_llama_pair

ROPES = {
    "plain": RopeConfig(),
    "linear": RopeConfig(scaling="linear", factor=2.0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=16),
}


# ----------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("rope", list(ROPES.values()), ids=list(ROPES))
@pytest.mark.parametrize("batched_positions", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [JOINT_MAX_T + 9, JOINT_MAX_T], ids=["per-tensor", "joint"])  # joint: decoding
def test_half_rotary_equals_the_reference(rope: RopeConfig, batched_positions: bool, dtype, t: int) -> None:
    fast, ref = HalfRotaryEmbedding(16, 64, rope), RotaryEmbedding(16, 64, rope)
    q = torch.randn(3, 4, t, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(3, 2, t, 16, dtype=dtype, requires_grad=True)
    positions = torch.randint(0, 64, (3, t)) if batched_positions else torch.arange(5, 5 + t)
    with torch.no_grad():  # inference: the same ops as the reference, bit for bit
        for g, w in zip(fast.pair(q, k, positions), ref.pair(q, k, positions)):
            assert g.dtype == w.dtype and torch.equal(g, w)
        assert torch.equal(fast(q, positions), ref(q, positions))

    # training (a graph): RotateHalves from 2 queries on, whose fused multiply-adds round once where the
    # reference rounds both products and their sum: apart by at most two units in the last place of the
    # largest output (a bf16 unit is at most 2^-7 of the value)
    def atol(want: torch.Tensor) -> float:
        return 1e-6 if dtype == torch.float32 else 2**-6 * want.abs().max().item()

    got, want = fast.pair(q, k, positions), ref.pair(q, k, positions)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=atol(w))
    weight = torch.linspace(-1, 1, 16, dtype=dtype)
    grads = [torch.autograd.grad(sum((o * weight).sum() for o in out), (q, k)) for out in (got, want)]
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=0, atol=atol(w))


def test_half_rotary_on_strided_heads() -> None:
    """q/k arrive as transposed views of the projection output (B, T, H, E) -> (B, H, T, E)."""
    fast, ref = HalfRotaryEmbedding(8, 32, RopeConfig()), RotaryEmbedding(8, 32, RopeConfig())
    x = torch.randn(2, 7, 3, 8).transpose(1, 2)  # (B, H, T, E), not contiguous
    assert torch.equal(fast(x, torch.arange(7)), ref(x, torch.arange(7)))


def test_make_rotary_picks_the_fast_twin_only_where_it_applies() -> None:
    assert type(make_rotary(16, 32, RopeConfig())) is HalfRotaryEmbedding
    assert type(make_rotary(16, 32, RopeConfig(layout="interleaved"))) is RotaryEmbedding
    assert type(make_rotary(16, 32, RopeConfig(fraction=0.5))) is RotaryEmbedding


# ----------------------------------------------------------------------------- stacked GEMMs
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_stacked_linear_equals_separate_layers(bias: bool, autocast: bool, monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "FUSE_UNDER_AUTOGRAD", True)
    layers = [nn.Linear(16, n, bias=bias) for n in (16, 8, 8)]
    x = torch.randn(4, 6, 16, requires_grad=True)
    outs, grads = [], []
    for min_rows in (0, 10**9):  # stacked, separate
        for p in (x, *(p for layer in layers for p in layer.parameters())):
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = stacked_linear(x, layers, min_rows=min_rows)
        sum((t.float() * torch.arange(t.shape[-1])).sum() for t in y).backward()
        outs.append(y)
        grads.append([x.grad] + [p.grad for layer in layers for p in layer.parameters()])
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(*outs):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)


@torch.no_grad()
def test_stacked_linear_switches_on_at_fuse_min_rows() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    few = stacked_linear(torch.randn(FUSE_MIN_ROWS - 1, 4), layers)
    many = stacked_linear(torch.randn(FUSE_MIN_ROWS, 4), layers)
    assert few[0].is_contiguous() and not many[0].is_contiguous()  # views of one stacked output


def test_stacked_linear_under_autograd_only_when_asked(monkeypatch) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    x = torch.randn(FUSE_MIN_ROWS, 4)
    assert stacked_linear(x, layers)[0].is_contiguous()  # a training step: separate layers
    monkeypatch.setattr(linear_module, "FUSE_UNDER_AUTOGRAD", True)
    assert not stacked_linear(x, layers)[0].is_contiguous()


class CastCounter(TorchDispatchMode):
    """Records the shape of every tensor copied to another dtype (autocast's casts included)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_separate_layers_share_one_autocast_cast(monkeypatch) -> None:
    """Under autocast the separate layers read x cast once (`autocast_input`): one cast of x instead of
    one per layer, the same outputs and weight gradients as the per-layer casts (the slow twin), x's
    gradient summed in bf16 instead."""
    layers = [nn.Linear(16, n) for n in (16, 8, 8)]
    leaf = torch.randn(4, 6, 16, requires_grad=True)
    outs, grads, dxs, casts = [], [], [], []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(linear_module, "autocast_input", lambda t: t)
        for p in (leaf, *(p for layer in layers for p in layer.parameters())):
            p.grad = None
        x = leaf * 1.0  # an activation: autocast caches the casts of leaves (weights), not of these
        with torch.autocast("cpu", dtype=torch.bfloat16), CastCounter() as counter:
            y = stacked_linear(x, layers)
        sum((t.float() * torch.arange(t.shape[-1])).sum() for t in y).backward()
        outs.append(y)
        grads.append([p.grad for layer in layers for p in layer.parameters()])
        dxs.append(leaf.grad)
        casts.append(counter.shapes.count(tuple(x.shape)))
    assert casts == [1, 3]
    for a, b in zip(*outs):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert dxs[0].dtype == torch.float32
    torch.testing.assert_close(dxs[0], dxs[1], rtol=2e-2, atol=2e-2)


def test_autocast_input_casts_only_what_autocast_would() -> None:
    x = torch.randn(2, 3)
    assert linear_module.autocast_input(x) is x  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_module.autocast_input(x).dtype == torch.bfloat16
        doubles = x.double()
        assert linear_module.autocast_input(doubles) is doubles  # autocast leaves fp64 alone
    meta = torch.empty(2, 3, device="meta")  # a device autocast does not know: left as it is
    assert linear_module.autocast_input(meta) is meta


def test_decoder_casts_the_memory_once_under_autocast(monkeypatch) -> None:
    """Under autocast the decoder casts the encoder memory once for all its layers' K/V products (not
    once per layer and product): the same logits; `encode` still returns fp32 states."""
    import tformer.model.transformer as transformer_module

    cfg = tiny("encoder_decoder")
    model = make(cfg)
    src, tgt = rand_tokens(cfg, t=11), rand_tokens(cfg, t=9)
    memory_shape = (src.shape[0], src.shape[1], cfg.d_model)
    logits, casts = [], []
    for once in (True, False):
        if not once:
            monkeypatch.setattr(transformer_module, "autocast_input", lambda t: t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            memory = model.encode(src)
            assert memory.states.dtype == torch.float32
            with CastCounter() as counter:
                logits.append(model.decode(tgt, memory))
        casts.append(counter.shapes.count(memory_shape))
    assert casts == [1, 2 * cfg.n_layers]  # K and V of every layer
    assert torch.equal(*logits)


# ----------------------------------------------------------------------------- attention kernels
def _masks(t_q: int, t_k: int) -> dict[str, Mask]:
    pad = torch.ones(2, t_k, dtype=torch.bool)
    pad[1, :3] = False
    return {
        "causal": causal_mask(t_k - t_q, t_q, None, torch.device("cpu")),
        "padded": causal_mask(t_k - t_q, t_q, pad, torch.device("cpu")),
        "bidirectional": padding_mask(t_q, None, t_k, torch.device("cpu")),
    }


@pytest.mark.parametrize(("t_q", "t_k"), [(9, 9), (1, 9), (3, 9)])
@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_attention_kernels_agree(t_q: int, t_k: int, n_rep: int) -> None:
    q = torch.randn(2, 4, t_q, 8)
    k, v = torch.randn(2, 4 // n_rep, t_k, 8), torch.randn(2, 4 // n_rep, t_k, 8)
    kernels = [EagerAttention(0.0, n_rep), SdpaAttention(0.0, n_rep)]
    kernels += [GqaSdpaAttention(0.0, n_rep)] if SDPA_HAS_GQA else []
    for name, mask in _masks(t_q, t_k).items():
        ref = kernels[0](q, k, v, mask)
        for kernel in kernels[1:]:
            torch.testing.assert_close(kernel(q, k, v, mask), ref, rtol=1e-5, atol=1e-5, msg=name)


def test_registry_uses_enable_gqa_where_torch_has_it() -> None:
    assert ATTENTION_KERNELS["sdpa"] is (GqaSdpaAttention if SDPA_HAS_GQA else SdpaAttention)


def test_full_mask_flags() -> None:
    cpu = torch.device("cpu")
    one_new = causal_mask(7, 1, None, cpu)
    assert one_new.is_full and bool(one_new.allowed.all())
    assert not causal_mask(7, 2, None, cpu).is_full
    assert causal_mask(0, 5, None, cpu).is_causal and not causal_mask(0, 5, None, cpu).is_full
    assert not causal_mask(7, 1, torch.ones(1, 8, dtype=torch.bool), cpu).is_full  # padding: keep the mask
    assert padding_mask(3, None, 5, cpu).is_full
    assert not padding_mask(3, torch.ones(2, 5, dtype=torch.bool), 5, cpu).is_full


def test_sdpa_without_mask_equals_explicit_all_true_mask() -> None:
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)
    full = causal_mask(8, 1, None, torch.device("cpu"))
    explicit = Mask(full.allowed)
    torch.testing.assert_close(SdpaAttention(0.0)(q, k, v, full), SdpaAttention(0.0)(q, k, v, explicit))


# ----------------------------------------------------------------------------- whole models
@pytest.mark.parametrize("n_kv_heads", [4, 2])
@torch.no_grad()
def test_llama_parity_where_the_stacked_gemms_are_on(n_kv_heads: int) -> None:
    ours, hf = tiny_llama_pair(n_kv_heads, 512, rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    tokens = torch.randint(0, 96, (4, FUSE_MIN_ROWS // 4))  # B * T = FUSE_MIN_ROWS: stacked GEMMs
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_training_sized_forward_equals_separate_gemms_and_cached_decoding(monkeypatch) -> None:
    model = make(tiny(), n_kv_heads=2, max_seq_len=FUSE_MIN_ROWS)
    tokens = rand_tokens(model.cfg, b=2, t=FUSE_MIN_ROWS // 2)
    fast = model(tokens)
    t = tokens.shape[1]
    cache = model.new_cache(t)
    steps = [model(tokens[:, : t - 4], cache=cache)] + [
        model(tokens[:, i : i + 1], cache=cache) for i in range(t - 4, t)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), fast, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(linear_module, "FUSE_MIN_ROWS", 10**9)
    torch.testing.assert_close(model(tokens), fast, rtol=1e-5, atol=1e-5)


def test_training_sized_gradients_equal_separate_gemms(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "FUSE_UNDER_AUTOGRAD", True)
    model = make(tiny(), n_kv_heads=2, max_seq_len=FUSE_MIN_ROWS).train()
    tokens = rand_tokens(model.cfg, b=2, t=FUSE_MIN_ROWS // 2 + 1)  # inputs: 2 x FUSE_MIN_ROWS / 2 rows
    grads = []
    for min_rows in (FUSE_MIN_ROWS, 10**9):
        monkeypatch.setattr(linear_module, "FUSE_MIN_ROWS", min_rows)
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- generation engine
def _greedy_by_full_forward(model: nn.Module, prompt: list[int], n: int, eos_id: int | None) -> list[int]:
    """The slow twin of the cached engine: re-run the whole sequence for every new token."""
    seq, new = list(prompt), []
    for _ in range(n):
        tok = int(model(torch.tensor([seq]))[0, -1].argmax())
        if tok == eos_id:
            break
        seq.append(tok)
        new.append(tok)
    return new


@torch.no_grad()
def test_cached_greedy_generation_equals_full_recompute_with_padding_and_eos() -> None:
    from tformer.generate.engine import generate
    from tformer.generate.sampling import SamplingConfig

    model = make(tiny(), n_kv_heads=2)
    prompts = [[5, 17, 3, 9, 40, 2], [7, 1], [11, 12, 13]]
    eos_id = _greedy_by_full_forward(model, prompts[0], 3, None)[2]  # row 0 stops at its third token
    want = [_greedy_by_full_forward(model, p, 12, eos_id) for p in prompts]
    steps = []
    got = generate(model, prompts, SamplingConfig(temperature=0.0, max_new_tokens=12), eos_id=eos_id,
                   on_step=steps.append)  # fmt: skip
    assert got == want
    assert len(got[0]) <= 2
    for t, step in enumerate(steps):  # finished rows are reported as -1
        for i, row in enumerate(want):
            expected = row[t] if t < len(row) else (eos_id if t == len(row) else -1)
            assert int(step[i]) == expected


# ----------------------------------------------------------------------------- found by a mutation audit
def test_causal_mask_with_a_cache_marks_the_new_queries_real_tokens() -> None:
    """`tokens` names the queries (slots q_start..q_start+Tq-1) of a padded causal mask, not the first Tq
    key slots; and the allowed pattern is key slot <= query slot and key real, written out."""
    from tformer.model.masks import causal_mask

    pad = torch.tensor([[True, True, True, True, False, True], [False, False, True, True, True, True]])
    mask = causal_mask(3, 3, pad, torch.device("cpu"))
    assert torch.equal(mask.tokens, pad[:, 3:6])
    expected = torch.tensor(
        [[[j <= i and bool(pad[b, j]) for j in range(6)] for i in range(3, 6)] for b in range(2)]
    )[:, None]
    assert torch.equal(mask.allowed, expected)
    assert not mask.is_causal and not mask.is_full
    nopad = causal_mask(3, 3, None, torch.device("cpu"))
    assert not nopad.is_causal and not nopad.is_full  # Tq != Tk: SDPA's causal path would be top-left aligned
