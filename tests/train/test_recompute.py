"""Activation checkpointing (`activation_checkpointing: full` or `selective`): each block recomputed in
the backward, all of it or all but its products and attention, gives the losses, gradients and MoE
counters of the model as built (its slow twin) bit for bit, with dropout on, keeps fewer activations for
the backward ("full" far fewer), and a run may switch it on resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.train.helpers import losses, small_config
from tformer import build_model
from tformer.config import ConfigError, MoEConfig
from tformer.model.blocks import Block
from tformer.model.moe import MoE, moe_aux_loss
from tformer.model.recompute import checkpoint_blocks, recompute_mode
from tformer.model.stats import activation_bytes
from tformer.presets import tiny
from tformer.tasks import make_task
from tformer.train.loop import Trainer

CONFIGS = {
    "decoder, Pre-Norm RoPE": tiny().replace(dropout=0.1, attn_dropout=0.1),
    "DeepSeekMoE decoder": tiny().replace(
        dropout=0.1, moe=MoEConfig(n_experts=8, top_k=3, n_shared=1, first_dense=1, bias_update_rate=1e-3)
    ),
    "encoder-decoder, Post-Norm": tiny().replace(
        arch="encoder_decoder", norm_placement="post", positions="sinusoidal", dropout=0.1
    ),
    "encoder classifier": tiny().replace(arch="encoder", n_classes=3, dropout=0.1),
}


def one_step(
    model: torch.nn.Module, cfg, count: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], int | None]:
    """Loss, gradients, buffers after one backward, and the bytes of activations kept for that backward
    (None without `count`: the counting hooks would keep torch.compile out, and the model run eagerly)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (3, 24), generator=gen)
    losses = []

    def loss() -> torch.Tensor:
        out = model(x, x) if cfg.arch == "encoder_decoder" else model(x)
        losses.append(out.float().logsumexp(-1).mean() + moe_aux_loss(model))
        return losses[-1]

    torch.manual_seed(1)  # the dropout masks
    saved = activation_bytes(model, loss) if count else loss().backward()  # the backward runs inside
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return losses[0].detach(), grads, [b.clone() for b in model.buffers()], saved


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", CONFIGS)
def test_recomputed_blocks_give_the_same_step_and_keep_fewer_activations(name: str, mode: str) -> None:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    built = build_model(cfg)
    recomputed = copy.deepcopy(built)
    blocks = checkpoint_blocks(recomputed, mode)
    assert {recompute_mode(m) for m in recomputed.modules() if isinstance(m, Block)} == {mode}
    assert blocks == cfg.n_layers + (cfg.resolved_n_encoder_layers if cfg.arch == "encoder_decoder" else 0)
    loss, grads, buffers, saved = one_step(built, cfg)
    layers = [m for m in recomputed.modules() if isinstance(m, MoE)]
    counted = []  # Router.count's `add` of each call: the recomputation reaches the MoE layers, and does not add
    for layer in layers:
        real = layer.router.count
        layer.router.count = lambda idx, add=True, real=real: counted.append(add) or real(idx, add)
    aux = {}

    def keep_first_aux(m: MoE, args, out) -> None:
        aux.setdefault(id(m), m.last_aux)

    for layer in layers:  # the forward's balance losses, which the recomputation must not replace
        layer.register_forward_hook(keep_first_aux)
    loss2, grads2, buffers2, saved2 = one_step(recomputed, cfg)
    assert loss.item() == loss2.item()
    assert len(grads) == len(grads2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # the MoE token counters: the recomputation does not count the step's tokens twice
    assert all(torch.equal(a, b) for a, b in zip(buffers, buffers2))
    if cfg.moe is not None:
        assert any(b.sum() > 0 for n, b in built.named_buffers() if n.endswith("tokens_per_expert"))
        assert counted == [True] * len(layers) + [False] * len(layers), counted
        # kept from the forward: a loss made in the recomputation held its graph (the block's activations)
        assert all(layer.last_aux is aux[id(layer)] for layer in layers)
    if mode == "full":
        assert saved2 < saved / 4, (saved2, saved)  # each block keeps its input alone
    else:  # the products' and attention's outputs kept (more than "full"), the rest recomputed
        assert 130_000 < saved2 < 0.7 * saved, (saved2, saved)
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in recomputed.named_parameters()]


def test_outside_a_training_graph_the_blocks_run_as_built() -> None:
    """Evaluation, decoding and a KV cache call the plain forward: the flat decoding step still takes the
    model (its tokens those of the model as built), and a training forward that fills a cache writes each
    slot once (a recomputation would write them again in the backward)."""
    from tformer.generate.engine import generate
    from tformer.generate.sampling import SamplingConfig
    from tformer.model.decode_step import unsupported

    torch.manual_seed(0)
    built = build_model(CONFIGS["DeepSeekMoE decoder"]).eval()
    recomputed = copy.deepcopy(built)
    checkpoint_blocks(recomputed)
    with torch.no_grad():
        assert unsupported(recomputed) is None
    copied = copy.deepcopy(recomputed)  # the copy's blocks recompute their own forward, not the original's
    assert copied.blocks[0].forward.args[0].__self__ is copied.blocks[0]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    assert generate(built, [[5, 9, 2, 7]], greedy) == generate(recomputed, [[5, 9, 2, 7]], greedy)
    prompt = torch.tensor([[5, 9, 2, 7]])
    recomputed.train()
    cache = recomputed.new_cache()
    recomputed(prompt, cache=cache).sum().backward()
    assert cache.seq_len == prompt.shape[1]


def test_blocks_are_checkpointed_once_in_a_known_mode() -> None:
    model = build_model(tiny())
    with pytest.raises(ValueError, match="mode must be one of full, selective, got 'some'"):
        checkpoint_blocks(model, "some")
    checkpoint_blocks(model)
    with pytest.raises(ValueError, match="already has a forward of its own"):
        checkpoint_blocks(model, "selective")


def test_the_config_takes_a_mode_and_the_booleans_of_earlier_runs(corpus_dir: Path) -> None:
    cfg = small_config(corpus_dir)
    assert cfg.activation_checkpointing == "none"
    for given, read in ((True, "full"), (False, "none"), ("selective", "selective")):
        assert cfg.replace(activation_checkpointing=given).activation_checkpointing == read
        assert (
            type(cfg)
            .from_dict({**cfg.to_dict(), "activation_checkpointing": given})
            .to_dict()["activation_checkpointing"]
            == read
        )
    with pytest.raises(
        ConfigError,
        match="activation_checkpointing must be one of 'none', 'full', 'selective', got 'partial'",
    ):
        cfg.replace(activation_checkpointing="partial")


def test_a_run_with_activation_checkpointing_trains_and_resumes_as_one_without(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """The same losses and gradient norms bit for bit, with dropout on; the mode may change on resume
    (parameter names and checkpoints are the same in every mode)."""
    cfg = small_config(corpus_dir)
    Trainer(cfg, tmp_path / "plain", make_task("lm"), progress=False).fit()
    full, selective = (cfg.replace(activation_checkpointing=m) for m in ("full", "selective"))
    for first, then in ((full, cfg), (cfg, selective), (selective, full)):  # switched at the resume
        run = tmp_path / f"ac_first_{first.activation_checkpointing}"
        trainer = Trainer(first, run, make_task("lm"), progress=False)
        assert recompute_mode(trainer.model.blocks[0]) == first.activation_checkpointing
        trainer.fit(until=4)
        resumed = Trainer(then, run, make_task("lm"), resume=True, progress=False)
        assert recompute_mode(resumed.model.blocks[0]) == then.activation_checkpointing
        resumed.fit()
        assert losses(tmp_path / "plain") == losses(run)
        assert len(losses(run)) == cfg.steps


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_blocks_under_torch_compile(mode: str) -> None:
    """The checkpointed blocks compile (torch's hook-based checkpoint API had recomputed other graphs than
    the forward's and failed) and give the model's loss and gradients, its MoE counters counted once.
    (Whether inductor keeps the recomputation is its choice; this checks the result, and that the step
    ran compiled graphs: under the activation counter's hooks torch.compile had let it run eagerly.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = CONFIGS["DeepSeekMoE decoder"].replace(dropout=0.0)  # compiled dropout draws other masks
    torch.manual_seed(0)
    built = build_model(cfg)
    recomputed = copy.deepcopy(built)
    checkpoint_blocks(recomputed, mode)
    loss, grads, buffers, _ = one_step(built, cfg)
    compiler = CompileCounterWithBackend("inductor")
    compiled = torch.compile(recomputed, backend=compiler)
    loss2, _, buffers2, _ = one_step(compiled, cfg, count=False)
    assert compiler.frame_count >= 1
    grads2 = [p.grad for p in recomputed.parameters() if p.grad is not None]
    assert abs(loss.item() - loss2.item()) < 1e-5
    assert len(grads) == len(grads2) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grads2))
    assert all(torch.equal(a, b) for a, b in zip(buffers, buffers2))


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder", "decoder"])
def test_selective_under_bf16_autocast_gives_the_same_step(arch: str) -> None:
    """Under bf16 autocast the CPU trains attention with `score_attention` (batched products, one of them
    scaled in place): selective checkpointing recomputes that attention whole, and the loss and gradients
    are those of the model as built."""
    cfg = tiny().replace(arch=arch, dropout=0.1, **({"n_classes": 3} if arch == "encoder" else {}))
    torch.manual_seed(0)
    built = build_model(cfg)
    selective = copy.deepcopy(built)
    checkpoint_blocks(selective, "selective")
    results = []
    for model in (built, selective):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(one_step(model, cfg, count=False))
    (loss, grads, _, _), (loss2, grads2, _, _) = results
    assert loss.item() == loss2.item()
    assert len(grads) == len(grads2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_selective_keeps_attention_kernels_only_without_dropout() -> None:
    """A fused attention kernel that draws dropout is recomputed: kept, it would skip its random draws in
    the recomputation and shift every later random op's masks (the dropout argument found by name). The
    linear layers' products are kept, oneDNN's (tformer.model.linear.OneDnnLinear) as MKL's."""
    from torch.utils.checkpoint import CheckpointPolicy

    from tformer.model.recompute import _keep_products_and_attention as policy

    aten = torch.ops.aten
    q = torch.zeros(1, 1, 2, 4)
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert policy(None, flash, q, q, q) == CheckpointPolicy.MUST_SAVE
    assert policy(None, flash, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
    assert policy(None, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, flash, q, q, q, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    efficient = aten._scaled_dot_product_efficient_attention.default  # dropout_p is its 6th argument
    assert policy(None, efficient, q, q, q, None, False, 0.2) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, efficient, q, q, q, None, False) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE
    onednn = torch.ops.mkldnn._linear_pointwise.default  # fp32 training products on AVX512 CPUs
    assert policy(None, onednn, q, q, None, "none", [], "") == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.bmm.default, q, q) == CheckpointPolicy.PREFER_RECOMPUTE  # attention's scores
    assert policy(None, aten.mul.Tensor, q, q) == CheckpointPolicy.PREFER_RECOMPUTE
