"""Cross-attention maps of a translation: how much each output token attended to each source token.

`record_cross_attention(model)` wraps the kernel of every decoder cross-attention layer for the length of
a `with` block. The kernel still computes the layer's output, so the model's numbers do not change; beside
it the wrapper keeps softmax(q k^T / sqrt(E) + mask) in fp32 (`attention_weights`, the eager kernel's own
formula), one (B, H, T, S) tensor per layer call, in call order. `cross_attention_map` runs one teacher-
forced forward of a translation's tokens and returns the weights per layer and head with the tokens as
text; `plot_cross_attention` draws them (one panel per layer, heads averaged), the picture the encoder-
decoder papers show, e.g. Bahdanau et al. (2015), fig. 3.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tformer.data.tokenizer import Tokenizer
from tformer.generate.beam import Hypothesis
from tformer.model.attention import CrossAttention, attention_weights, repeat_kv
from tformer.model.ensemble import Ensemble
from tformer.model.masks import Mask

MAX_TOKENS_DRAWN = 128  # a longer side is drawn without its token labels (they would overlap)


class _Recording(nn.Module):
    """A cross-attention kernel that also keeps its attention weights (detached, fp32) in `sink`."""

    def __init__(self, kernel: nn.Module, sink: list[Tensor]) -> None:
        super().__init__()
        self.kernel, self.sink = kernel, sink

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        n_rep = q.shape[1] // k.shape[1]  # q k^T in fp32 too (a bf16 model's products would round it)
        self.sink.append(attention_weights(q.detach().float(), repeat_kv(k.detach().float(), n_rep), mask))
        return self.kernel(q, k, v, mask)


@contextlib.contextmanager
def record_cross_attention(model: nn.Module) -> Iterator[list[Tensor]]:
    """Within the block, every call of a cross-attention layer of `model` appends its weights, (B, H, T, S)
    in fp32, to the list this yields (for one forward: one tensor per decoder layer, first layer first).
    The layers' kernels are restored on leaving, also after an error. Under tensor parallelism a rank
    records its own heads only; a training forward under activation checkpointing records the recomputed
    calls again."""
    layers = [m for m in model.modules() if isinstance(m, CrossAttention)]
    if not layers:
        raise ValueError(
            f"a {type(model).__name__} has no cross-attention to record: an encoder-decoder (arch "
            "'encoder_decoder', the translation task's model) has one per decoder layer"
        )
    sink: list[Tensor] = []
    kernels = [m.kernel for m in layers]
    try:
        for m in layers:
            m.kernel = _Recording(m.kernel, sink)
        yield sink
    finally:
        for m, kernel in zip(layers, kernels):
            m.kernel = kernel


@dataclass(frozen=True)
class AttentionMap:
    """The cross-attention of one translation: `weights[l, h, t, s]` is how much output row t attended to
    source token s in head h of decoder layer l; each row sums to 1. Row t is the step that chose
    `target[t]` (the output's tokens, then its EOS if it ended); `source` ends with the source's EOS."""

    source: list[str]
    target: list[str]
    weights: Tensor  # (layers, heads, len(target), len(source)), fp32, on the CPU

    def mean_over_heads(self) -> Tensor:
        """(layers, len(target), len(source))"""
        return self.weights.mean(dim=1)


def token_pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id as the text it stands for, a leading space shown as "▁" (so word starts stay visible), a
    special token by its name, a byte that is part of a longer character as U+FFFD."""
    pieces = []
    for i in ids:
        text = tokenizer.decode([i], skip_special=True)
        if not text:  # a special token (BOS, EOS, pad) decodes to nothing: its name
            text = tokenizer.id_to_token(i) or f"<{i}>"
        pieces.append("▁" + text[1:] if text.startswith(" ") else text)
    return pieces


def cross_attention_map(
    model: nn.Module,
    source: Sequence[int],
    hypothesis: Hypothesis,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
) -> AttentionMap:
    """The cross-attention of `hypothesis` (a search's output for the source ids `source`, EOS last), from
    one forward of the model over the source and [BOS] + the output's tokens, in eval mode."""
    if isinstance(model, Ensemble):
        raise ValueError("a cross-attention map draws one model's attention; an ensemble has one per member")
    source = list(source)
    rows = list(hypothesis.tokens) + [tgt_tok.eos_id] * hypothesis.finished  # the tokens each row chose
    if not source or not rows:
        raise ValueError("a cross-attention map needs a source and an output of at least one token each")
    device = next(model.parameters()).device
    src = torch.tensor([source], device=device)
    tgt = torch.tensor([([tgt_tok.bos_id] + rows)[: len(rows)]], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), record_cross_attention(model) as sink:
            model(src, tgt)
    finally:
        model.train(was_training)
    layers = sum(isinstance(m, CrossAttention) for m in model.modules())
    if len(sink) != layers:  # a layer that bypassed its kernel, or called it twice
        raise RuntimeError(
            f"the forward recorded {len(sink)} cross-attention calls for {layers} layers: this model's "
            "cross-attention does not run through its kernels once per layer (no map can be drawn)"
        )
    weights = torch.stack([w[0] for w in sink]).cpu()  # (layers, H, T, S)
    return AttentionMap(token_pieces(src_tok, source), token_pieces(tgt_tok, rows), weights)


def plot_cross_attention(amap: AttentionMap, path: str | Path, title: str = "") -> Path:
    """Write the map as a PNG: one panel per decoder layer, the heads' mean, source tokens across and output
    tokens down, darker where more attention went."""
    from matplotlib.figure import Figure  # (not pyplot: the caller's backend and figures are left alone)

    from tformer.eval.classification import MAX_INCHES, _drawable_chars, _tick_label

    means = amap.mean_over_heads().numpy()
    n_layers, rows, cols = means.shape
    chars = _drawable_chars()
    panel_w = min(1.0 + 0.22 * cols, MAX_INCHES / n_layers)
    height = min(1.6 + 0.22 * rows, MAX_INCHES)
    fig = Figure(figsize=(panel_w * n_layers + 1.2, height), layout="constrained")
    axes = fig.subplots(1, n_layers, squeeze=False)[0]
    x_labels = cols <= MAX_TOKENS_DRAWN and 0.15 * cols <= panel_w  # else they would overlap
    for layer, ax in enumerate(axes):
        image = ax.imshow(means[layer], cmap="Greys", vmin=0.0, vmax=1.0, aspect="auto")
        if x_labels:
            ax.set_xticks(range(cols), [_tick_label(s, chars) for s in amap.source], rotation=90)
        if rows <= MAX_TOKENS_DRAWN:
            ax.set_yticks(range(rows), [_tick_label(t, chars) for t in amap.target] if layer == 0 else [])
        ax.set_title(f"layer {layer + 1}", fontsize=9)
        ax.set_xlabel("source")
    axes[0].set_ylabel("output")
    heads = amap.weights.shape[1]
    fig.suptitle(title or f"cross-attention, mean of {heads} head{'s' if heads != 1 else ''}", fontsize=10)
    fig.colorbar(image, ax=axes.tolist(), fraction=0.03, pad=0.01)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # tokens are escaped where glyphs are missing: nothing left to say
            warnings.filterwarnings("ignore", message="Glyph .* missing from font", category=UserWarning)
            fig.savefig(path, dpi=110, format="png")
    except OSError as err:
        why = err.strerror or str(err)
        if blocking := next((p for p in path.parents if p.exists() and not p.is_dir()), None):
            why = f"{blocking} is a file, not a folder"  # (mkdir under a file says only "File exists")
        raise OSError(f"the attention plot could not be written to {path}: {why}") from err
    return path
