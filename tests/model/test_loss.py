"""The fused head and loss (tformer.model.loss) against its slow twin, F.linear + F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tformer import ModelConfig, build_model
from tformer.model import loss as loss_mod
from tformer.model.loss import (
    IGNORE_INDEX,
    block_rows,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)


def _inputs(n: int = 3, t: int = 70, d: int = 24, v: int = 300, seed: int = 0, ignored: int = 9):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, t, d, generator=g).requires_grad_()
    w = (0.2 * torch.randn(v, d, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n, t), generator=g)
    targets[0, :ignored] = IGNORE_INDEX  # padding at the start of one row
    targets[-1, -ignored:] = IGNORE_INDEX  # and at the end of another
    return h, w, targets


def _loss_and_grads(fn, h, w, targets, eps: float, scale: float = 0.37, autocast: bool = False):
    h.grad = w.grad = None
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = fn(h, w, targets, eps)
    (loss * scale).backward()  # an upstream gradient other than 1, as the trainer's 1 / targets
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 rows, so 210 rows make 13 full blocks and a ragged one of 2."""
    monkeypatch.setattr(loss_mod, "BLOCK_ROWS", 16)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_equals_twin_fp32(small_blocks, eps):
    h, w, targets = _inputs()
    assert block_rows(h.shape[0] * h.shape[1]) == 16
    fused = _loss_and_grads(linear_cross_entropy, h, w, targets, eps)
    twin = _loss_and_grads(linear_cross_entropy_reference, h, w, targets, eps)
    for a, b in zip(fused, twin):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused[1][0, :9].abs().max() == 0  # ignored positions get no gradient
    assert fused[1][0, 9:].abs().max() > 0


def test_fused_matches_float64_truth():
    """Against the whole computation in float64: the fused path is as exact as fp32 allows."""

    def float64_loss(h, w, targets, eps):
        logits = F.linear(h, w).flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), reduction="sum", label_smoothing=eps)

    h, w, targets = _inputs(seed=1)
    fused = _loss_and_grads(linear_cross_entropy, h, w, targets, 0.1)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    truth = _loss_and_grads(float64_loss, h64, w64, targets, 0.1)
    assert truth[0].dtype == torch.float64
    for a, b in zip(fused, truth):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_equals_twin_under_bf16_autocast(small_blocks, eps):
    """Both take the product in bf16 and the softmax in fp32: equal to bf16 rounding of the products."""
    h, w, targets = _inputs(seed=2)
    fused = _loss_and_grads(linear_cross_entropy, h, w, targets, eps, autocast=True)
    twin = _loss_and_grads(linear_cross_entropy_reference, h, w, targets, eps, autocast=True)
    fp32 = _loss_and_grads(linear_cross_entropy_reference, h, w, targets, eps)
    assert fused[0].dtype == twin[0].dtype == torch.float32
    assert fused[1].dtype == h.dtype and fused[2].dtype == w.dtype
    torch.testing.assert_close(fused[0], twin[0], rtol=1e-5, atol=1e-3)  # the same bf16 logits
    for a, b, exact in zip(fused[1:], twin[1:], fp32[1:]):
        scale = exact.abs().max()
        assert (a - b).abs().max() < 0.02 * scale  # bf16 rounding of the products
        assert (a - exact).abs().max() <= 2 * (b - exact).abs().max() + 1e-3 * scale  # no worse than the twin


class _CountProducts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func.overloadpacket in (
            torch.ops.aten.mm,
            torch.ops.aten.addmm,
            torch.ops.aten.addmm_,
        )
        return func(*args, **(kwargs or {}))


def test_without_gradients_only_the_loss_is_computed(small_blocks):
    """No grad mode, or no input that wants a gradient: one product per block (the logits), not three."""
    h, w, targets = _inputs(seed=3)  # 210 rows: 14 blocks of 16
    expected = linear_cross_entropy_reference(h, w, targets, 0.1).detach()
    with torch.no_grad(), _CountProducts() as counter:
        loss = linear_cross_entropy(h, w, targets, 0.1)
    assert not loss.requires_grad and counter.products == 14
    torch.testing.assert_close(loss, expected)
    with torch.inference_mode():  # (a dispatch mode sees no ops there)
        torch.testing.assert_close(linear_cross_entropy(h, w, targets, 0.1), expected)
    with _CountProducts() as counter:
        linear_cross_entropy(h.detach(), w.detach(), targets, 0.1)
    assert counter.products == 14
    with _CountProducts() as counter:
        linear_cross_entropy(h, w, targets, 0.1)
    assert counter.products == 3 * 14  # the logits, grad h and grad W of each block


def test_no_second_derivative():
    """The gradients are constants made in the forward: create_graph=True raises instead of a gradient
    penalty that would silently add nothing."""
    h, w, targets = _inputs(seed=6)
    with pytest.raises(
        RuntimeError, match=r"has no second derivative: for a gradient penalty or create_graph"
    ):
        torch.autograd.grad(linear_cross_entropy(h, w, targets), h, create_graph=True)
    (grad_h,) = torch.autograd.grad(linear_cross_entropy(h, w, targets), h)  # the first derivative works
    assert grad_h.shape == h.shape


@pytest.mark.slow
def test_a_compiled_model_does_not_recompile_per_token_count():
    """The fused loss runs eagerly between the compiled graphs: six sequence lengths compile the model
    twice (one static graph, then a dynamic one), as the logits path does; the loss equals the eager one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, dropout=0.0)
    torch._dynamo.reset()
    model = build_model(cfg)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    for t in (8, 12, 16, 20, 24, 28):
        x, y = torch.randint(0, 300, (2, t)), torch.randint(0, 300, (2, t))
        loss = compiled(x, targets=y)
        loss.backward()
        torch.testing.assert_close(loss, model(x, targets=y), rtol=1e-5, atol=1e-4)
    assert counter.frame_count == 2


def test_gradient_for_the_weight_alone_and_for_the_input_alone():
    h, w, targets = _inputs(seed=4)
    for frozen in (h, w):
        frozen.requires_grad_(False)
        loss = linear_cross_entropy(h, w, targets)
        loss.backward()
        twin_h, twin_w = h.detach().clone().requires_grad_(h.requires_grad), w.detach().clone()
        twin_w.requires_grad_(w.requires_grad)
        linear_cross_entropy_reference(twin_h, twin_w, targets).backward()
        live, twin = (w, twin_w) if frozen is h else (h, twin_h)
        torch.testing.assert_close(live.grad, twin.grad, rtol=1e-5, atol=1e-6)
        assert frozen.grad is None
        frozen.requires_grad_(True)
        h.grad = w.grad = None


def test_every_position_ignored_gives_zero():
    h, w, targets = _inputs(seed=5)
    loss = linear_cross_entropy(h, w, torch.full_like(targets, IGNORE_INDEX), 0.1)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_block_rows():
    assert block_rows(4096) == loss_mod.BLOCK_ROWS == 1024
    assert block_rows(100) == 100  # never more rows than there are
    assert block_rows(0) == 1


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_model_forward_with_targets_equals_logits_then_loss(small_blocks, arch, eps):
    """A model's fused loss and every parameter's gradient (the tied embedding too) equal the twin's."""
    cfg = ModelConfig(
        arch=arch, vocab_size=300, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=40, dropout=0.0
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, 300, (3, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[1, 20:] = IGNORE_INDEX
    args = (inputs, inputs) if arch == "encoder_decoder" else (inputs,)

    def grads(fused: bool):
        model.zero_grad(set_to_none=True)
        if fused:
            loss = model(*args, targets=targets, label_smoothing=eps)
        else:
            logits = model(*args)
            loss = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), reduction="sum", label_smoothing=eps
            )
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (fused_loss, fused_grads), (twin_loss, twin_grads) = grads(True), grads(False)
    torch.testing.assert_close(fused_loss, twin_loss, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == twin_grads.keys()
    for name in fused_grads:
        torch.testing.assert_close(fused_grads[name], twin_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_model_rejects_bad_targets():
    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16)
    model = build_model(cfg)
    tokens = torch.randint(0, 50, (2, 8))
    with pytest.raises(
        ValueError, match=r"targets must have the shape of the input tokens \(2, 8\).*got \(2, 7\)"
    ):
        model(tokens, targets=tokens[:, 1:])
    with pytest.raises(TypeError, match="targets must be a torch.Tensor of class ids, got list"):
        model(tokens, targets=tokens.tolist())
    with pytest.raises(ValueError, match="targets are on meta, the model on cpu: move one to the other"):
        model(tokens, targets=torch.empty(2, 8, dtype=torch.long, device="meta"))
    bad = tokens.clone()
    bad[1, 3] = 50
    with pytest.raises(ValueError, match=r"targets contains id 50 at \(batch 1, position 3\).*0\.\.49"):
        model(tokens, targets=bad)
    with pytest.raises(
        TypeError, match="targets must be a torch.long tensor of class ids, got dtype torch.int32"
    ):
        model(tokens, targets=tokens.int())
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.5"):
        model(tokens, targets=tokens, label_smoothing=1.5)
    for eps in ("0.1", None):  # had been Python's "'<=' not supported between instances of 'int' and 'str'"
        with pytest.raises(TypeError, match=rf"label_smoothing must be a number in \[0, 1\), got {eps!r}"):
            model(tokens, targets=tokens, label_smoothing=eps)


def test_a_head_split_by_vocabulary_is_refused() -> None:
    """Under tensor parallelism the head's weight is a DTensor split by vocabulary: targets= says to take
    the logits and the vocabulary-parallel loss (here a one-process gloo group holds the DTensor)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16)
    model = build_model(cfg.replace(tie_embeddings=False))
    tokens = torch.randint(0, 50, (2, 8))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model.lm_head.weight = torch.nn.Parameter(
            distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)])
        )
        with pytest.raises(ValueError, match="tensor parallelism splits it by vocabulary: take the logits"):
            model(tokens, targets=tokens)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_targets_are_refused_before_any_block_runs(arch: str, count_calls) -> None:
    """Bad targets= are refused before the first block (or the encoder) runs, so a refused call changes
    nothing; a loss with a KV cache is refused and the cache keeps its length (decoding takes logits)."""
    cfg = ModelConfig(arch=arch, vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, 50, (1, 4))
    blocks = model.encoder.blocks if arch == "encoder_decoder" else model.blocks
    calls = count_calls(blocks[0], "forward")
    args = (tokens, tokens) if arch == "encoder_decoder" else (tokens,)
    with pytest.raises(ValueError, match="targets contains id 50"):
        model(*args, targets=torch.full_like(tokens, 50))
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        model(*args, targets=tokens, label_smoothing=-0.1)
    assert not calls
    cache = model.new_cache()
    if arch == "decoder":
        model(tokens, cache=cache)
        call = lambda: model(tokens, cache=cache, targets=tokens)  # noqa: E731
    else:
        memory = model.encode(tokens)
        model.decode(tokens, memory, cache=cache)
        call = lambda: model.decode(tokens, memory, cache=cache, targets=tokens)  # noqa: E731
    assert cache.seq_len == 4
    with pytest.raises(ValueError, match="targets= returns a training loss and takes no KV cache"):
        call()
    assert cache.seq_len == 4
