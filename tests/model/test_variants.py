"""The variant matrix, generated from the registries: every arch x placement x norm x position x FFN
builds, runs forward and backward with the right shapes and finite loss and gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tformer.model.blocks import BLOCKS
from tformer.model.ffn import FFNS
from tformer.model.norms import NORMS
from tformer.model.positions import POSITIONS
from tformer.model.transformer import ARCHITECTURES
from tformer.presets import tiny

from .helpers import make

MATRIX = list(itertools.product(ARCHITECTURES, BLOCKS, NORMS, POSITIONS, FFNS))


def test_matrix_covers_every_registered_choice() -> None:
    assert len(MATRIX) == 3 * 2 * 3 * 4 * 3


@pytest.mark.parametrize(("arch", "placement", "norm", "positions", "ffn"), MATRIX)
def test_variant_trains(arch: str, placement: str, norm: str, positions: str, ffn: str) -> None:
    cfg = tiny(arch).replace(
        norm_placement=placement,
        norm=norm,
        positions=positions,
        ffn=ffn,
        d_model=32,
        d_ff=48,
        n_heads=4,
        n_kv_heads=2,
        dropout=0.1,
        **({"n_classes": 3} if arch == "encoder" else {}),
    )
    model = make(cfg).train()
    b, t = 3, 9
    tokens = torch.randint(1, cfg.vocab_size, (b, t))
    pad = torch.ones(b, t, dtype=torch.bool)
    pad[0, -3:] = False
    if arch == "decoder":
        logits = model(tokens, key_padding_mask=pad)
        assert logits.shape == (b, t, cfg.vocab_size)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
    elif arch == "encoder":
        logits = model(tokens, key_padding_mask=pad)
        assert logits.shape == (b, cfg.n_classes)
        loss = F.cross_entropy(logits, torch.tensor([0, 1, 2]))
    else:
        tgt = tokens[:, :5]
        logits = model(tokens, tgt, src_key_padding_mask=pad)
        assert logits.shape == (b, 5, cfg.vocab_size)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt.reshape(-1))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
