"""The CPU training fast paths against their slow twins: `score_attention` (vs the written-out
`EagerAttention` and SDPA), `RMSNormFunction` (vs nn.RMSNorm) and `RotateHalves` (vs the rotary
reference's ops), forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import tformer.model.norms as norms_module
import tformer.model.positions as positions_module
import tformer.model.score_attention as score_module
from tformer import build_model
from tformer.config import RopeConfig
from tformer.model.attention import EagerAttention, GqaSdpaAttention, SdpaAttention
from tformer.model.masks import Mask, causal_mask, padding_mask
from tformer.model.norms import RMSNorm, RMSNormFunction, is_rms_norm, make_norm
from tformer.model.positions import HalfRotaryEmbedding, RotateHalves, rotate_whole_half_layout
from tformer.presets import llama_like, tiny

CPU = torch.device("cpu")


def masks(b: int, t_q: int, t_k: int) -> dict[str, Mask]:
    pad = torch.ones(b, t_k, dtype=torch.bool)
    pad[0, -3:] = False  # padded keys
    pad[-1, :] = False  # a fully padded sample: its rows are opened to every key (masks.py)
    out = {"full": padding_mask(t_q, None, t_k, CPU), "padded": padding_mask(t_q, pad, t_k, CPU)}
    if t_q == t_k:
        out["causal"] = causal_mask(0, t_q, None, CPU)
        out["causal padded"] = causal_mask(0, t_q, pad, CPU)  # not the causal hint: the bias path
    return out


def attention_and_grads(kernel: nn.Module, q, k, v, mask: Mask, d_out) -> list[torch.Tensor]:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = kernel(q, k, v, mask)
    out.backward(d_out)
    return [out, q.grad, k.grad, v.grad]


# ----------------------------------------------------------------------------- score attention
@pytest.mark.parametrize(
    ("t_q", "t_k", "n_rep"),
    [(9, 9, 1), (9, 9, 2), (5, 11, 1), (256, 256, 1), (259, 259, 4), (130, 130, 2)],
)
def test_score_attention_equals_the_written_out_reference_fp32(
    monkeypatch, t_q, t_k, n_rep, count_calls
) -> None:
    """Output and the gradients of q, k, v, for every mask kind, grouped K/V heads, query blocks that do
    not divide the length (259 = 4 blocks of 64-65 rows) and one block (130 queries). The kernel is
    entered for bf16 only; in fp32 (let in here) it must equal the reference to rounding."""
    torch.manual_seed(0)
    monkeypatch.setattr(score_module, "DTYPES", (torch.float32, torch.bfloat16))
    calls = count_calls(score_module.ScoreAttention, "forward")
    b = 3
    q, d_out = torch.randn(b, 4, t_q, 8), torch.randn(b, 4, t_q, 8)
    k, v = torch.randn(b, 4 // n_rep, t_k, 8), torch.randn(b, 4 // n_rep, t_k, 8)
    for name, mask in masks(b, t_q, t_k).items():
        before = len(calls)
        got = attention_and_grads(GqaSdpaAttention(0.0, n_rep), q, k, v, mask, d_out)
        assert len(calls) == before + 1, name
        ref = attention_and_grads(EagerAttention(0.0, n_rep), q, k, v, mask, d_out)
        for g, r, what in zip(got, ref, ("out", "dq", "dk", "dv")):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"{name} {what}")


@pytest.mark.parametrize("t", [128, 256])
def test_score_attention_bf16_is_as_close_to_fp32_as_sdpa(monkeypatch, t: int) -> None:
    """In bf16 the kernel keeps bf16 scores and probabilities (as an eager bf16 attention does) where
    SDPA's flash kernel keeps fp32 ones: its error against the fp32 result stays within 2x SDPA's."""
    torch.manual_seed(0)
    q, k, v, d_out = (torch.randn(2, 4, t, 16) for _ in range(4))
    mask = causal_mask(0, t, None, CPU)
    exact = attention_and_grads(EagerAttention(0.0), q, k, v, mask, d_out)
    bf16 = [x.bfloat16() for x in (q, k, v, d_out)]
    ours = attention_and_grads(SdpaAttention(0.0), *bf16[:3], mask, bf16[3])
    monkeypatch.setattr(score_module, "ENABLED", False)
    sdpa = attention_and_grads(SdpaAttention(0.0), *bf16[:3], mask, bf16[3])
    for o, s, e, what in zip(ours, sdpa, exact, ("out", "dq", "dk", "dv")):
        assert o.dtype == torch.bfloat16
        err_ours = (o.float() - e).norm() / e.norm()
        err_sdpa = (s.float() - e).norm() / e.norm()
        assert err_ours < max(2 * err_sdpa, 1e-3), (what, err_ours, err_sdpa)


def test_causal_blocks_stop_at_the_diagonal() -> None:
    """From CAUSAL_SPLIT_FROM queries the causal path multiplies 4 row blocks, each with the keys up to
    its last row only (so the products cover 5/8 of the score matrix); below it, one block."""
    q = torch.randn(1, 1, 256, 4, requires_grad=True)
    products = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.baddbmm:
                products.append(tuple(args[0].shape))  # the causal bias of the block: (rows, keys)
            return func(*args, **(kwargs or {}))

    with Spy():
        score_module.score_attention(q, q, q, causal_mask(0, 256, None, CPU))
    assert products == [(64, 64), (64, 128), (64, 192), (64, 256)]
    products.clear()
    short = torch.randn(1, 1, 255, 4, requires_grad=True)
    with Spy():
        score_module.score_attention(short, short, short, causal_mask(0, 255, None, CPU))
    assert products == [(255, 255)]


def test_score_attention_only_where_it_applies(monkeypatch, count_calls) -> None:
    """bf16 only; not without a graph (inference), with attention dropout, above MAX_KEYS keys or
    MAX_PROBS_BYTES of probabilities, or when switched off; a key-only gradient is enough to enter."""
    calls = count_calls(score_module.ScoreAttention, "forward")
    mask = causal_mask(0, 8, None, CPU)
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    probs_bytes = 1 * 2 * 8 * 8 * 2  # B * H * Tq * Tk bf16 elements
    kernel = SdpaAttention(0.0)
    with torch.no_grad():
        kernel(q, k, k, mask)
    kernel(q.detach(), k, k, mask)  # nothing records a graph
    kernel.train().p = 0.1
    kernel(q, k, k, mask)
    kernel.p = 0.0
    for dtype in (torch.float32, torch.float16):
        kernel(q.detach().to(dtype).requires_grad_(), k.to(dtype), k.to(dtype), mask)
    monkeypatch.setattr(score_module, "MAX_KEYS", 7)
    kernel(q, k, k, mask)
    monkeypatch.setattr(score_module, "MAX_KEYS", 8)
    monkeypatch.setattr(score_module, "MAX_PROBS_BYTES", probs_bytes - 1)
    kernel(q, k, k, mask)
    monkeypatch.setattr(score_module, "MAX_PROBS_BYTES", probs_bytes)
    monkeypatch.setattr(score_module, "ENABLED", False)
    kernel(q, k, k, mask)
    assert len(calls) == 0
    monkeypatch.setattr(score_module, "ENABLED", True)
    kernel(q, k, k, mask)  # exactly MAX_KEYS keys and MAX_PROBS_BYTES
    kernel(q.detach(), k.requires_grad_(), k, mask)
    assert len(calls) == 2


def test_score_attention_gradients_only_for_the_inputs_that_need_them() -> None:
    q = torch.randn(1, 2, 6, 4)
    k = torch.randn(1, 2, 6, 4, requires_grad=True)
    v = torch.randn(1, 2, 6, 4)
    score_module.score_attention(q, k, v, causal_mask(0, 6, None, CPU)).sum().backward()
    assert k.grad is not None and q.grad is None and v.grad is None


def test_a_training_step_through_either_attention_gives_the_same_gradients(monkeypatch, count_calls) -> None:
    """A whole decoder LM (GQA, causal) and an encoder-decoder (padded source, cross-attention):
    forward with the fast paths on and off, loss and every parameter's gradient equal (in fp32, let
    into the attention kernel for this comparison)."""
    torch.manual_seed(0)
    monkeypatch.setattr(score_module, "DTYPES", (torch.float32, torch.bfloat16))
    attention_calls = count_calls(score_module.ScoreAttention, "forward")
    norm_calls = count_calls(RMSNormFunction, "forward")
    lm = build_model(
        llama_like(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)
    )
    seq2seq = build_model(
        tiny("encoder_decoder").replace(norm_placement="post", norm="layernorm", positions="sinusoidal")
    )
    tokens = torch.randint(0, 64, (2, 20))
    src_pad = torch.ones(2, 20, dtype=torch.bool)
    src_pad[1, 15:] = False
    rotary_calls = count_calls(RotateHalves, "forward")
    runs = {
        "lm": (lm, lambda m: m(tokens)),
        "seq2seq": (seq2seq, lambda m: m(tokens, tokens[:, :12], src_key_padding_mask=src_pad)),
    }
    for name, (model, call) in runs.items():
        grads = []
        for fast in (True, False):
            monkeypatch.setattr(score_module, "ENABLED", fast)
            monkeypatch.setattr(norms_module, "FUSED_RMS_NORM", fast)
            monkeypatch.setattr(positions_module, "FUSED_ROTARY", fast)
            model.zero_grad(set_to_none=True)
            logits = call(model)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, : logits.shape[1]].flatten())
            loss.backward()
            grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        for g, r in zip(*grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)
    assert len(attention_calls) == 2 + 6  # the LM's 2 layers; the encoder-decoder's 2 + 2 self, 2 cross
    assert len(norm_calls) == 5  # the LM's 2 x 2 + its final norm (the encoder-decoder's are LayerNorms)
    assert len(rotary_calls) == 4  # the LM's q and k in 2 layers (the encoder-decoder's are sinusoidal)


# ----------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("eps", [1e-6, 0.5, None])
def test_rms_norm_function_equals_torch(eps) -> None:
    """Output, input gradient and weight gradient equal nn.RMSNorm's (eps None: the dtype's eps), on a
    3-D input with small rows (where eps matters) and large ones: to fp32's rounding at each tensor's
    largest entry (the input gradient of the 1e-4 rows reaches ~7,700, where both fp32 computations sit
    up to ~2.5e-4 from the float64 one), and no further from nn.RMSNorm in float64 than torch's own fp32
    nn.RMSNorm is (its CPU kernels sum in another order on some CPUs)."""
    torch.manual_seed(0)
    ref = nn.RMSNorm(16, eps=eps)
    ours = RMSNorm(16, eps=eps)
    exact = nn.RMSNorm(16, eps=torch.finfo(torch.float32).eps if eps is None else eps).double()
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16))
        ours.weight.copy_(ref.weight)
        exact.weight.copy_(ref.weight)
    x = torch.randn(3, 5, 16) * torch.tensor([1e-4, 1.0, 30.0])[:, None, None]
    dy = torch.randn(3, 5, 16)
    results = []
    for norm, dtype in ((ours, torch.float32), (ref, torch.float32), (exact, torch.float64)):
        xi = x.to(dtype, copy=True).requires_grad_()
        y = norm(xi)
        y.backward(dy.to(dtype))
        results.append((y, xi.grad, norm.weight.grad))
    for g, r, e, what in zip(*results, ("y", "dx", "dw")):
        scale = r.abs().max().item()
        torch.testing.assert_close(g, r, rtol=1e-5, atol=2e-7 * scale, msg=what)
        ours_error, torch_error = ((t.double() - e).abs().max().item() for t in (g, r))
        assert ours_error <= 2 * torch_error + 1e-7 * scale, (what, ours_error, torch_error)


def test_rms_norm_function_on_one_vector() -> None:
    """A 1-D input (one row) has its weight gradient too."""
    ours, ref = RMSNorm(8), nn.RMSNorm(8)
    x = torch.randn(8)
    for norm in (ours, ref):
        norm(x.clone().requires_grad_()).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_training_kernels_refuse_a_second_derivative() -> None:
    """Their backwards are written out once: asking for a gradient of a gradient is an error, not a
    silently wrong number."""
    x = torch.randn(2, 8, requires_grad=True)
    (g,) = torch.autograd.grad(RMSNorm(8)(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()
    q = torch.randn(1, 2, 6, 4, dtype=torch.bfloat16, requires_grad=True)
    (g,) = torch.autograd.grad(score_module.score_attention(q, q, q, causal_mask(0, 6, None, CPU)).sum(), q,
                               create_graph=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.float().sum().backward()


def test_rms_norm_function_casts_a_low_precision_gradient_back() -> None:
    """Under autocast the next layer hands back a bf16 gradient: dx and dw are fp32, as torch's."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    RMSNormFunction.apply(x, w, 1e-6).backward(torch.ones(4, 8, dtype=torch.bfloat16))
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_fast_path_only_where_it_applies(monkeypatch, count_calls) -> None:
    calls = count_calls(RMSNormFunction, "forward")
    norm = RMSNorm(8)
    x = torch.randn(2, 8, requires_grad=True)
    with torch.no_grad():
        norm(x)
    norm(x.detach().bfloat16().requires_grad_())  # low-precision input: torch's
    RMSNorm((2, 4))(x.view(2, 2, 4))  # a 2-D normalized shape
    monkeypatch.setattr(norms_module, "FUSED_RMS_NORM", False)
    norm(x)
    assert len(calls) == 0
    monkeypatch.setattr(norms_module, "FUSED_RMS_NORM", True)
    norm(x)
    norm.weight.requires_grad_(True)
    norm(x.detach())  # only the weight learns: still a graph
    assert len(calls) == 2


def test_make_norm_builds_the_fast_rms_norm_that_decoding_still_recognises() -> None:
    cfg = llama_like(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_seq_len=16)
    norm = make_norm(cfg)
    assert type(norm) is RMSNorm and is_rms_norm(norm) and is_rms_norm(nn.RMSNorm(4))
    assert not is_rms_norm(nn.LayerNorm(4))

    class Changed(nn.RMSNorm):
        pass

    assert not is_rms_norm(Changed(4))  # a user's subclass may compute something else


# ----------------------------------------------------------------------------- audit additions
class Sub(torch.Tensor):
    """A tensor subclass (as a DTensor or a tensor-parallel wrapper is one)."""


def test_score_attention_stays_out_of_other_devices_and_tensor_subclasses(count_calls) -> None:
    """Not on a device other than the CPU (meta stands in for an accelerator) and not where q or k is
    a tensor subclass: SDPA computes those; the same call with plain CPU tensors enters."""
    calls = count_calls(score_module.ScoreAttention, "forward")
    kernel = SdpaAttention(0.0)
    meta = torch.device("meta")
    on_meta = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, device=meta, requires_grad=True)
    kernel(on_meta, on_meta, on_meta, causal_mask(0, 8, None, meta))
    mask = causal_mask(0, 8, None, CPU)
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    sub = q.detach().as_subclass(Sub).requires_grad_()
    kernel(sub, q, q, mask)
    kernel(q, sub, sub, mask)
    assert len(calls) == 0
    kernel(q, q, q, mask)
    assert len(calls) == 1


def test_score_attention_probability_budget_counts_queries_times_keys(monkeypatch, count_calls) -> None:
    """MAX_PROBS_BYTES bounds B * H * Tq * Tk elements: with fewer queries than keys (cross-attention)
    the keys count, not the queries twice."""
    calls = count_calls(score_module.ScoreAttention, "forward")
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    mask = padding_mask(4, None, 16, CPU)
    probs_bytes = 1 * 2 * 4 * 16 * 2
    monkeypatch.setattr(score_module, "MAX_PROBS_BYTES", probs_bytes - 1)
    SdpaAttention(0.0)(q, k, k, mask)
    assert len(calls) == 0
    monkeypatch.setattr(score_module, "MAX_PROBS_BYTES", probs_bytes)
    SdpaAttention(0.0)(q, k, k, mask)
    assert len(calls) == 1


def test_score_attention_default_limits_are_the_documented_ones() -> None:
    """At most 512 keys and 256 MiB of bf16 probabilities per call (shapes only: expanded views)."""
    grad = torch.zeros((), dtype=torch.bfloat16, requires_grad=True)
    q = grad.expand(1, 1, 1, 4)
    assert score_module.applies(q, grad.expand(1, 1, 512, 4), 0.0)
    assert not score_module.applies(q, grad.expand(1, 1, 513, 4), 0.0)
    k = grad.expand(1, 1, 512, 4)
    assert score_module.applies(grad.expand(64, 8, 512, 4), k, 0.0)  # 2**27 elements, 2 bytes each
    assert not score_module.applies(grad.expand(64, 8, 513, 4), k, 0.0)


def test_score_attention_leaves_keys_of_another_dtype_to_sdpa(count_calls) -> None:
    """Under bf16 autocast a bf16 query over fp32 keys and values (a memory kept in fp32) is SDPA's,
    which autocast casts; it trains, with fp32 key gradients."""
    calls = count_calls(score_module.ScoreAttention, "forward")
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 8, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = SdpaAttention(0.0)(q, k, k, causal_mask(0, 8, None, CPU))
    out.float().sum().backward()
    assert len(calls) == 0 and k.grad.dtype == torch.float32


def test_score_attention_in_eval_mode_despite_a_configured_dropout(count_calls) -> None:
    """Attention dropout is off in eval mode, so a graph recorded there (gradients of the inputs of a
    model in eval mode) goes through the kernel even when the module has a dropout rate."""
    calls = count_calls(score_module.ScoreAttention, "forward")
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    SdpaAttention(0.1).eval()(q, q, q, causal_mask(0, 8, None, CPU))
    assert len(calls) == 1


def test_causal_bias_is_cached_in_eager_mode_and_traced_when_compiled(monkeypatch, trace_graph) -> None:
    """Eager calls reuse one bias per block shape; under torch.compile the bias is traced as ops, the
    lru_cache is never entered (dynamo would trace through it and warn)."""
    score_module.cached_causal_bias.cache_clear()
    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = causal_mask(0, 6, None, CPU)
    expected = score_module.score_attention(q, k, v, mask)
    score_module.score_attention(q, k, v, mask)
    assert score_module.cached_causal_bias.cache_info().hits == 1

    def cache(*args):
        raise AssertionError("the eager cache entered under torch.compile")

    monkeypatch.setattr(score_module, "cached_causal_bias", cache)
    compiled, _ = trace_graph(score_module.score_attention)
    torch.testing.assert_close(compiled(q, k, v, mask), expected, rtol=0, atol=0)


@pytest.mark.parametrize("learns", ["input", "weight"])
def test_rms_norm_function_when_only_one_of_input_and_weight_learns(learns: str, count_calls) -> None:
    """A frozen weight (only x learns) or a fixed input (only the weight learns) trains through the
    fused path, with the learning one's gradient equal to nn.RMSNorm's and none for the other."""
    calls = count_calls(RMSNormFunction, "forward")
    torch.manual_seed(0)
    ours, ref = RMSNorm(8), nn.RMSNorm(8)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(8))
        ours.weight.copy_(ref.weight)
    x, dy = torch.randn(3, 8), torch.randn(3, 8)
    grads = []
    for norm in (ours, ref):
        norm.weight.requires_grad_(learns == "weight")
        xi = x.clone().requires_grad_(learns == "input")
        norm(xi).backward(dy)
        grads.append((xi.grad, norm.weight.grad))
    assert len(calls) == 1
    (dx, dw), (ref_dx, ref_dw) = grads
    if learns == "input":
        assert dw is None
        torch.testing.assert_close(dx, ref_dx)
    else:
        assert dx is None
        torch.testing.assert_close(dw, ref_dw)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_fast_path_stays_out_of_other_devices_subclasses_and_weights(count_calls) -> None:
    """torch's forward on another device (meta), for a tensor subclass input, without a weight
    (elementwise_affine=False) and with a low-precision weight; the plain case enters."""
    calls = count_calls(RMSNormFunction, "forward")
    x = torch.randn(2, 8, requires_grad=True)
    RMSNorm(8, device="meta")(torch.randn(2, 8, device="meta", requires_grad=True))
    RMSNorm(8)(x.detach().as_subclass(Sub).requires_grad_())
    torch.testing.assert_close(
        RMSNorm(8, elementwise_affine=False)(x), nn.RMSNorm(8, elementwise_affine=False)(x)
    )
    RMSNorm(8, dtype=torch.bfloat16)(x)
    assert len(calls) == 0
    RMSNorm(8)(x)
    assert len(calls) == 1


def test_rms_norm_under_torch_compile_is_torchs(trace_graph) -> None:
    """Compiled, RMSNorm traces as torch's rms_norm (which inductor fuses), not as RMSNormFunction."""
    compiled, graphs = trace_graph(RMSNorm(8))
    compiled(torch.randn(2, 8, requires_grad=True))
    (graph,) = graphs
    assert "autograd_function_apply" not in graph and "rms_norm" in graph


# ----------------------------------------------------------------------------- RoPE
def rotary_and_grads(rotary, x_flat: torch.Tensor, heads: int, positions: torch.Tensor, dy: torch.Tensor):
    """x as attention sees it: the projection's (B, T, H*E) output split into (B, H, T, E) heads.
    Returns y, the projection's gradient and (the heads' gradient's strides, the heads' strides)."""
    leaf = x_flat.detach().requires_grad_()
    b, t, _ = leaf.shape
    x = leaf.view(b, t, heads, -1).transpose(1, 2)
    strides = []
    x.register_hook(lambda g: strides.append((g.stride(), x.stride())))
    y = rotary(x, positions)
    y.backward(dy)
    return y, leaf.grad, strides[0]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("heads", [4, 1])
def test_rotate_halves_equals_the_reference(monkeypatch, per_row: bool, heads: int, count_calls) -> None:
    """Output and input gradient equal the reference ops' to rounding, with one position table for the
    batch or one per row (left-padded batches); the output is laid out (B, H, T, E) for attention and
    the gradient comes back in the projection's layout."""
    torch.manual_seed(0)
    calls = count_calls(RotateHalves, "forward")
    rotary = HalfRotaryEmbedding(8, 32, RopeConfig())
    b, t = 3, 7
    positions = torch.arange(t) + 2 * torch.arange(b)[:, None] if per_row else torch.arange(t)
    x, dy = torch.randn(b, t, heads * 8), torch.randn(b, heads, t, 8)
    results = []
    for fast in (True, False):
        monkeypatch.setattr(positions_module, "FUSED_ROTARY", fast)
        results.append(rotary_and_grads(rotary, x, heads, positions, dy))
    (y, dx, (grad_strides, head_strides)), (y_ref, dx_ref, _) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    assert y.is_contiguous() and grad_strides == head_strides and len(calls) == 1


def test_rotate_halves_bf16_is_as_close_to_fp64_as_the_reference(monkeypatch) -> None:
    """In bf16 each output rounds once (a fused multiply-add) where the reference rounds after every
    op: its error against fp64 is at most the reference's, to within one bf16 rounding."""
    torch.manual_seed(0)
    rotary = HalfRotaryEmbedding(64, 256, RopeConfig())
    x, dy = torch.randn(2, 256, 4 * 64), torch.randn(2, 4, 256, 64)
    positions = torch.arange(256)
    exact = rotary_and_grads(rotary.double(), x.double(), 4, positions, dy.double())
    errors = {}
    for fast in (True, False):
        monkeypatch.setattr(positions_module, "FUSED_ROTARY", fast)
        got = rotary_and_grads(rotary.bfloat16(), x.bfloat16(), 4, positions, dy.bfloat16())
        errors[fast] = [(g.double() - e).abs().max().item() for g, e in zip(got[:2], exact[:2])]
    for fast_error, ref_error in zip(errors[True], errors[False]):
        assert fast_error <= ref_error + 2**-8 * 4  # one bf16 rounding of values up to ~4


def test_rotate_halves_only_where_it_applies(monkeypatch, count_calls) -> None:
    """Inference (no graph) and the slow twin run the reference's ops, bit for bit; a graph enters."""
    calls = count_calls(RotateHalves, "forward")
    rotary = HalfRotaryEmbedding(8, 16, RopeConfig())
    q, k, positions = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.arange(5)
    cos, sin = rotary.table(positions, q.dtype)
    with torch.no_grad():
        q_rot, k_rot = rotary.pair(q.requires_grad_(), k, positions)
    assert torch.equal(q_rot, rotate_whole_half_layout(q, cos, sin))
    assert torch.equal(k_rot, rotate_whole_half_layout(k, cos, sin))
    monkeypatch.setattr(positions_module, "FUSED_ROTARY", False)
    rotary(q, positions)
    assert len(calls) == 0
    monkeypatch.setattr(positions_module, "FUSED_ROTARY", True)
    rotary.pair(q, k, positions)  # only q learns: q through the function, k through the ops
    assert len(calls) == 1


def test_rotate_halves_stays_out_of_tensor_subclasses_and_torch_compile(count_calls, trace_graph) -> None:
    calls = count_calls(RotateHalves, "forward")
    rotary = HalfRotaryEmbedding(8, 16, RopeConfig())
    rotary(torch.randn(1, 2, 5, 8).as_subclass(Sub).requires_grad_(), torch.arange(5))
    assert len(calls) == 0
    compiled, graphs = trace_graph(rotary)
    compiled(torch.randn(1, 2, 5, 8, requires_grad=True), torch.arange(5))
    (graph,) = graphs
    assert "autograd_function_apply" not in graph and "roll" in graph


def test_rotate_halves_refuses_a_second_derivative() -> None:
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    y = HalfRotaryEmbedding(8, 16, RopeConfig())(x, torch.arange(5))
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()


def test_rotate_halves_stays_out_of_other_devices(count_calls) -> None:
    """On a device other than the CPU (meta stands in for an accelerator) the reference's ops rotate x
    on its own device, forward and backward; the same call with CPU tensors enters RotateHalves."""
    calls = count_calls(RotateHalves, "forward")
    meta = torch.device("meta")
    x = torch.randn(1, 2, 5, 8, device=meta, requires_grad=True)
    y = HalfRotaryEmbedding(8, 16, RopeConfig()).to(meta)(x, torch.arange(5, device=meta))
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert y.device == meta and dx.device == meta and dx.shape == x.shape
    assert len(calls) == 0
    HalfRotaryEmbedding(8, 16, RopeConfig())(torch.randn(1, 2, 5, 8, requires_grad=True), torch.arange(5))
    assert len(calls) == 1


def test_rotate_halves_gradient_of_a_column_slice_is_dense(monkeypatch, count_calls) -> None:
    """q as a column slice of a wider projection output (one stacked q/k/v GEMM, FUSE_UNDER_AUTOGRAD):
    x has gaps between rows. Its gradient equals the reference's and comes back dense in the
    projection's (B, T, H, E) order, not with x's gaps (a buffer of the whole stacked width)."""
    torch.manual_seed(0)
    calls = count_calls(RotateHalves, "forward")
    rotary = HalfRotaryEmbedding(8, 32, RopeConfig())
    b, t, h = 2, 7, 3
    qkv, dy = torch.randn(b, t, 3 * h * 8), torch.randn(b, h, t, 8)
    results = []
    for fast in (True, False):
        monkeypatch.setattr(positions_module, "FUSED_ROTARY", fast)
        leaf = qkv.clone().requires_grad_()
        x = leaf[..., : h * 8].view(b, t, h, 8).transpose(1, 2)  # (B, H, T, E), not dense
        head_grads = []
        x.register_hook(head_grads.append)
        rotary(x, torch.arange(t)).backward(dy)
        results.append((head_grads[0], leaf.grad))
    (head_grad, dx), (_, dx_ref) = results
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    assert len(calls) == 1 and head_grad.transpose(1, 2).is_contiguous()
