"""Cross-attention maps (tformer.eval.attention): the recorded weights are the ones the model used (checked
against torch's fused attention and against q k^T written out from the layer's own inputs), recording
changes nothing, padding gets no weight, the map's rows and labels, the plot, and `translate
--plot-attention`."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F

from tests.generate.helpers import tiny_translator_and_classifier
from tformer import build_model
from tformer.cli.main import main
from tformer.eval.attention import (
    MAX_TOKENS_DRAWN,
    AttentionMap,
    cross_attention_map,
    plot_cross_attention,
    record_cross_attention,
)
from tformer.generate.beam import Hypothesis, SearchConfig
from tformer.model.attention import CrossAttention
from tformer.presets import paper_base, tiny

PAD = 0


def batch(vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sources, the second padded after 5 tokens, and two targets of 6 tokens."""
    src = torch.randint(3, vocab, (2, 9), generator=gen)
    src[1, 5:] = PAD
    return src, src != PAD, torch.randint(3, vocab, (2, 6), generator=gen)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # multi-head, grouped, multi-query
@pytest.mark.parametrize("rotate", [False, True])  # RoPE on the cross-attention's q and k, or not
def test_recorded_weights_times_v_give_the_fused_kernels_output(n_kv_heads: int, rotate: bool) -> None:
    """Each layer's recorded weights, applied to its V, give what torch's fused attention (the model's
    kernel) returned for that layer, with grouped K/V heads and with RoPE in the cross-attention."""
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder")
    model = build_model(
        cfg.replace(n_kv_heads=n_kv_heads, rope=cfg.rope.replace(cross_attention=rotate))
    ).eval()
    rotary = [m.rotary for m in model.modules() if isinstance(m, CrossAttention)]
    assert all(type(r).__name__ != "NoRotary" for r in rotary) == rotate  # the premise
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (v, output) of each kernel call

    def keep(module, inputs, output) -> None:
        calls.append((inputs[2], output))

    layers = [m for m in model.modules() if isinstance(m, CrossAttention)]
    hooks = [m.kernel.register_forward_hook(keep) for m in layers]
    src, mask, tgt = batch(128, torch.Generator().manual_seed(1))
    with torch.no_grad(), record_cross_attention(model) as weights:
        model(src, tgt, mask)
    for hook in hooks:
        hook.remove()
    assert len(weights) == len(calls) == len(layers) == 2
    for w, (v, out) in zip(weights, calls):
        assert w.shape == (2, 4, 6, 9) and w.dtype == torch.float32
        v = v.repeat_interleave(4 // n_kv_heads, dim=1)  # query head h reads K/V head h // (4 / n_kv_heads)
        torch.testing.assert_close(w @ v, out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
        assert (w[1, :, :, 5:] == 0).all()  # the padding gets none


def test_recorded_weights_equal_q_k_written_out_from_the_layers_inputs() -> None:
    """The paper's model (sinusoidal positions, biases, Post-Norm): softmax(q k^T / sqrt(E)) computed here
    from each cross-attention layer's input and the encoder output, per head, equals the record."""
    torch.manual_seed(0)
    cfg = paper_base().replace(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_layers=2, n_encoder_layers=2)
    model = build_model(cfg).eval()
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, memory states) of each layer

    def keep(module, args) -> None:
        inputs.append((args[0], args[2].states))

    layers = [m for m in model.modules() if isinstance(m, CrossAttention)]
    hooks = [m.register_forward_pre_hook(keep) for m in layers]
    src, mask, tgt = batch(50, torch.Generator().manual_seed(2))
    with torch.no_grad(), record_cross_attention(model) as weights:
        model(src, tgt, mask)
    for hook in hooks:
        hook.remove()
    for layer, w, (x, memory) in zip(layers, weights, inputs):
        q = F.linear(x, layer.q_proj.weight, layer.q_proj.bias).view(2, 6, 4, 8)
        k = F.linear(memory, layer.k_proj.weight, layer.k_proj.bias).view(2, 9, 4, 8)
        scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(8)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        torch.testing.assert_close(w, scores.softmax(-1), atol=1e-6, rtol=1e-5)


def test_recording_changes_no_output_and_the_kernels_come_back() -> None:
    torch.manual_seed(0)
    model = build_model(tiny("encoder_decoder")).eval()
    src, mask, tgt = batch(128, torch.Generator().manual_seed(3))
    kernels = [m.kernel for m in model.modules() if isinstance(m, CrossAttention)]
    with torch.no_grad():
        plain = model(src, tgt, mask)
        with record_cross_attention(model):
            recorded = model(src, tgt, mask)
        with pytest.raises(RuntimeError, match="stop"), record_cross_attention(model):
            raise RuntimeError("stop")
    assert torch.equal(plain, recorded)
    assert [m.kernel for m in model.modules() if isinstance(m, CrossAttention)] == kernels
    decoder = build_model(tiny("decoder"))
    with (
        pytest.raises(ValueError, match="has no cross-attention to record: an encoder-decoder"),
        record_cross_attention(decoder),
    ):
        pass


def test_a_translations_map_has_a_row_per_chosen_token_and_the_source_as_text() -> None:
    translator, _ = tiny_translator_and_classifier()
    model = translator.model
    text = "the dog barked"
    cfg = SearchConfig(method="greedy", max_len=5)
    amap = translator.attention(text, cfg)
    source = translator.encode([text])[0][0]
    hypothesis = translator.hypotheses([source], cfg)[0]
    rows = len(hypothesis.tokens) + hypothesis.finished  # the EOS is chosen by a row of its own
    assert amap.weights.shape == (model.cfg.n_layers, model.cfg.n_heads, rows, len(source))
    torch.testing.assert_close(amap.weights.sum(-1), torch.ones(amap.weights.shape[:-1]))
    assert "".join(amap.source[:-1]).replace("▁", " ") == text and amap.source[-1] == "<eos>"
    assert "".join(amap.target[: len(hypothesis.tokens)]).replace("▁", " ") == translator.text(hypothesis)
    assert model.training  # the caller's mode is kept (the map ran in eval mode)
    ended = Hypothesis([5, 6], 0.0, 0.0, finished=True)
    cut = Hypothesis([5, 6], 0.0, 0.0, finished=False)
    tok = translator.tgt_tok
    assert cross_attention_map(model, source, ended, tok, tok).target[-1] == "<eos>"
    assert cross_attention_map(model, source, ended, tok, tok).weights.shape[2] == 3
    assert cross_attention_map(model, source, cut, tok, tok).weights.shape[2] == 2
    with pytest.raises(ValueError, match="at least one token each"):
        cross_attention_map(model, source, Hypothesis([], 0.0, 0.0, finished=False), tok, tok)
    with pytest.raises(TypeError, match="text must be one str"):
        translator.attention(["the dog"], cfg)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_each_row_is_the_attention_of_the_search_step_that_chose_its_token(method: str) -> None:
    """Row t of the map (one forward over [BOS] + the output) equals the attention of the newest position
    at search step t (recorded during the search itself, with the KV cache): the rows are not shifted."""
    translator, _ = tiny_translator_and_classifier()
    translator.model.eval()
    source = translator.encode(["the market rose and the dog barked"])[0][0]
    cfg = SearchConfig(method=method, beam_size=1, max_len=6, length_penalty=0.0)
    with record_cross_attention(translator.model) as steps:
        hypothesis = translator.hypotheses([source], cfg)[0]
    layers = translator.model.cfg.n_layers
    tok = translator.tgt_tok
    amap = cross_attention_map(translator.model, source, hypothesis, translator.src_tok, tok)
    rows = amap.weights.shape[2]
    assert rows == len(hypothesis.tokens) + hypothesis.finished and len(steps) >= rows * layers
    for t in range(rows):  # step t: one call per layer, the newest position's row last
        for layer in range(layers):
            torch.testing.assert_close(
                amap.weights[layer, :, t], steps[t * layers + layer][0, :, -1], atol=1e-6, rtol=1e-5
            )


def test_the_plot_is_written_and_a_long_map_stays_a_readable_size(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    small = AttentionMap(["Der", "▁Hund", "."], ["The", "▁dog", "体"], torch.rand(2, 4, 3, 3, generator=gen))
    path = plot_cross_attention(small, tmp_path / "sub" / "small.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n = MAX_TOKENS_DRAWN + 50  # beyond the labels' limit: drawn without them
    long = AttentionMap(["x"] * n, ["y"] * n, torch.rand(6, 2, n, n, generator=gen).softmax(-1))
    height, width, _ = matplotlib.image.imread(plot_cross_attention(long, tmp_path / "long.png")).shape
    assert height < 45 * 110 and width < 45 * 110  # MAX_INCHES 40 a side, plus the margins


def test_translate_plots_the_attention_of_one_sentence(
    dictionary_file: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    run = tmp_path / "run"
    argv = ["train", "--preset", "tiny-translation", "--set", f"data.path={dictionary_file}"]
    assert main([*argv, "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    png = tmp_path / "attention.png"
    argv = ["translate", "--run", str(run), "--text", "Der Hund.", "--max-len", "6"]
    assert main([*argv, "--plot-attention", str(png)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"heads averaged): {png}\n" in captured.err
    drawn = []  # the hypotheses the maps are made of
    import tformer.eval.attention as attention

    make_map = attention.cross_attention_map
    monkeypatch.setattr(attention, "cross_attention_map", lambda *a: drawn.append(a[2]) or make_map(*a))
    assert (
        main([*argv, "--beam", "3", "--nbest", "3", "--plot-attention", str(png)]) == 0
    )  # the best of the list
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert (
        len(lines) == 3 and len(drawn) == 1 and drawn[0].score == pytest.approx(float(lines[0][2]), abs=1e-4)
    )
    assert drawn[0].score > float(lines[1][2])  # the first of the list, not another
    path = tmp_path / "in.txt"
    path.write_text("Der Hund.\n", encoding="utf-8")
    assert main(["translate", "--run", str(run), "--file", str(path), "--plot-attention", str(png)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "tformer translate: error: --plot-attention draws the attention of one sentence: give it with --text\n"
    )
    assert captured.out == ""
    (tmp_path / "a_file").write_text("")
    assert main([*argv, "--plot-attention", str(tmp_path / "a_file" / "x.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # the translation is printed before the plot fails
    assert captured.err.splitlines()[-1] == (
        f"tformer translate: error: the attention plot could not be written to {tmp_path}/a_file/x.png: "
        f"{tmp_path}/a_file is a file, not a folder"
    )
