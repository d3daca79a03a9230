"""The encoder-decoder and its searches against Hugging Face `transformers`, which someone else wrote: a
tiny random `MarianMTModel` (Post-Norm, sinusoidal positions, ReLU) whose weights are copied into
tformer's Post-Norm encoder-decoder (`benchmarks.peers.marian_state_for_tformer`: the same network with
its model features in tformer's order). Its logits, and whole `generate` calls: greedy, and beam search
at beam 1 to 5 with HF's canonical rule (`length_penalty=0.0`, `early_stopping="never"`, which ranks by
log-probability, as tformer's alpha 0 does), best and n-best, with a minimum length and banned ids."""

from __future__ import annotations

import pytest
import torch

from benchmarks.peers import (
    hf_marian,
    hf_outputs,
    marian_hidden_order,
    marian_of_tformer,
    marian_state_for_tformer,
    tformer_marian_config,
)
from tformer import ModelConfig, build_model
from tformer.generate.beam import beam_search, beam_search_nbest, sample_search

PAD, BOS, EOS = 0, 1, 2
SHAPE = dict(vocab=12, d_model=32, layers=2, heads=4, d_ff=64)
MAX_NEW = 10


@torch.no_grad()
def marian_pair(tied: bool = False, random_norms: bool = False):
    """(HF model, tformer model) with the same weights, both in evaluation mode. random_norms: random
    LayerNorm weights and biases (a norm in the wrong slot shows). Untied, unscaled embeddings, HF's
    norms and this seed give a model whose searches end at several lengths, and some not before the
    limit: most random Post-Norm models repeat one token to the end."""
    torch.manual_seed(2)
    hf = hf_marian(SHAPE, 64, init_std=0.2, tie_word_embeddings=tied, scale_embedding=tied).eval()
    for name, p in hf.named_parameters():
        if random_norms and "layer_norm" in name:
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    ours = build_model(tformer_marian_config(hf.config)).eval()
    ours.load_state_dict(marian_state_for_tformer(hf, ours), strict=True)
    return hf, ours


def sources(n: int = 8, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 9) source ids and their mask, two of them right-padded."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS + 1, SHAPE["vocab"], (n, 9), generator=g)
    mask = torch.ones_like(src, dtype=torch.bool)
    mask[1, 5:] = False
    mask[4, 2:] = False
    return src.masked_fill(~mask, PAD), mask


def hf_generate(hf, src, mask, *, beams: int, min_len: int, banned: list[int], n: int = 1):
    """HF's outputs as (tokens before EOS, ended with EOS) per returned sequence, and their scores."""
    out = hf.generate(
        input_ids=src,
        attention_mask=mask.long(),
        num_beams=beams,
        num_return_sequences=n,
        do_sample=False,
        length_penalty=0.0,
        early_stopping="never",
        max_new_tokens=MAX_NEW,
        min_new_tokens=min_len,
        suppress_tokens=banned,
        output_scores=True,
        return_dict_in_generate=True,
    )
    scores = out.sequences_scores.tolist() if beams > 1 else None
    return hf_outputs(out.sequences, EOS), scores


@pytest.mark.parametrize("d", [32, 7])
def test_hidden_order_is_a_permutation_that_maps_the_sinusoids(d: int) -> None:
    """An odd width too: Marian's sin block is then one feature longer than its cos block."""
    from tformer.model.positions import sinusoidal_table

    order = marian_hidden_order(d)
    assert sorted(order.tolist()) == list(range(d))
    hf = hf_marian({**SHAPE, "d_model": d, "heads": 1}, 64)
    theirs = hf.model.encoder.embed_positions.weight[:20]
    torch.testing.assert_close(theirs[:, order], sinusoidal_table(20, d), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
@torch.no_grad()
def test_logits_equal_hf_marian(tied: bool) -> None:
    hf, ours = marian_pair(tied, random_norms=True)
    src, mask = sources()
    tgt = torch.randint(
        EOS + 1, SHAPE["vocab"], (src.shape[0], 7), generator=torch.Generator().manual_seed(5)
    )
    tgt[:, 0] = BOS
    expected = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits
    got = ours(src, tgt, mask)
    scale = expected.abs().max()
    assert scale > 1.0  # logits of some spread: a zero model would pass too easily
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(scale))
    print(f"max |diff| vs HF Marian (tied={tied}):", (got - expected).abs().max().item(), "of", scale.item())


@pytest.mark.parametrize(("tied", "d", "heads"), [(True, 32, 4), (False, 32, 4), (True, 7, 1)])
@torch.no_grad()
def test_a_tformer_model_as_marian_gives_its_logits(tied: bool, d: int, heads: int) -> None:
    """The other way (the benchmark's trained runs): tformer's Post-Norm model, 2 encoder and 3 decoder
    layers (and an odd width), written into a Marian that gives tformer's logits."""
    cfg = ModelConfig(
        arch="encoder_decoder",
        vocab_size=SHAPE["vocab"],
        d_model=d,
        n_layers=3,
        n_encoder_layers=2,
        n_heads=heads,
        d_ff=64,
        max_seq_len=40,
        norm_placement="post",
        share_embeddings=tied,
        tie_embeddings=tied,
        embed_scale=tied,
        init="normal",
        init_std=0.2,
    )
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    for name, p in ours.named_parameters():
        if "norm" in name:
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    hf = marian_of_tformer(ours, PAD, BOS, EOS)
    assert hf.config.encoder_layers == 2 and hf.config.decoder_layers == 3
    src, mask = sources()
    tgt = torch.randint(
        EOS + 1, SHAPE["vocab"], (src.shape[0], 7), generator=torch.Generator().manual_seed(5)
    )
    tgt[:, 0] = BOS
    expected = ours(src, tgt, mask)
    got = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits
    scale = float(expected.abs().max())
    assert scale > 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


def test_a_model_marian_cannot_express_is_refused_by_name() -> None:
    cfg = ModelConfig(
        arch="encoder_decoder", vocab_size=SHAPE["vocab"], d_model=32, n_layers=2, n_heads=4, d_ff=64
    )
    with pytest.raises(ValueError, match="norm_placement='pre'"):
        marian_of_tformer(build_model(cfg.replace(norm_placement="pre")), PAD, BOS, EOS)
    with pytest.raises(ValueError, match="ffn='gelu'"):
        marian_of_tformer(build_model(cfg.replace(ffn="gelu")), PAD, BOS, EOS)


@pytest.mark.parametrize("min_len", [0, 3])
@pytest.mark.parametrize("flat", [True, False])
def test_greedy_equals_hf_generate(min_len: int, flat: bool) -> None:
    hf, ours = marian_pair()
    src, mask = sources()
    banned = [PAD, BOS]
    expected, _ = hf_generate(hf, src, mask, beams=1, min_len=min_len, banned=banned)
    got = sample_search(
        ours, src, mask, bos_id=BOS, eos_id=EOS, max_len=MAX_NEW, banned=banned, min_len=min_len, flat=flat
    )
    assert [(h.tokens, h.finished) for h in got] == expected
    assert any(ended for _, ended in expected) and not all(ended for _, ended in expected)


@pytest.mark.parametrize("min_len", [1, 3])
def test_beam_search_equals_hf_generate(min_len: int) -> None:
    """alpha 0 against HF's canonical beam search at beam 1 to 5: the same best hypothesis per sentence
    (tokens, ended or cut at the limit) with the same log-probability."""
    hf, ours = marian_pair()
    src, mask = sources()
    banned = [PAD, BOS]
    seen = set()
    for beams in range(1, 6):
        expected, scores = hf_generate(hf, src, mask, beams=beams, min_len=min_len, banned=banned)
        got = beam_search(
            ours,
            src,
            mask,
            bos_id=BOS,
            eos_id=EOS,
            max_len=MAX_NEW,
            beam_size=beams,
            alpha=0.0,
            banned=banned,
            min_len=min_len,
        )
        assert [(h.tokens, h.finished) for h in got] == expected, f"beam {beams}"
        if scores is not None:
            ours_scores = torch.tensor([h.log_prob for h in got])
            torch.testing.assert_close(ours_scores, torch.tensor(scores), atol=1e-4, rtol=0)
        seen |= {(len(tokens), ended) for tokens, ended in expected}
    # ended at several lengths, and cut at the limit: the stopping rule and the limit are exercised
    assert len({n for n, ended in seen if ended}) >= 2 and (MAX_NEW, False) in seen, seen


@pytest.mark.parametrize("beams", [2, 4])
def test_nbest_equals_hf_generate(beams: int) -> None:
    """All K finished hypotheses of each sentence, in order, as HF returns them with
    num_return_sequences = K."""
    hf, ours = marian_pair()
    src, mask = sources()
    banned = [PAD, BOS]
    expected, scores = hf_generate(hf, src, mask, beams=beams, min_len=1, banned=banned, n=beams)
    got = beam_search_nbest(
        ours,
        src,
        mask,
        n_best=beams,
        bos_id=BOS,
        eos_id=EOS,
        max_len=MAX_NEW,
        beam_size=beams,
        alpha=0.0,
        banned=banned,
        min_len=1,
    )
    flat = [h for hyps in got for h in hyps]
    assert [(h.tokens, h.finished) for h in flat] == expected
    torch.testing.assert_close(
        torch.tensor([h.log_prob for h in flat]), torch.tensor(scores), atol=1e-4, rtol=0
    )
