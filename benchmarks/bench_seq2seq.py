"""Encoder-decoder training speed: tformer's EncoderDecoder vs `torch.nn.Transformer`, and beam search.

Sections (each a round-robin of its variants, see harness.py for the method):
  fp32   d_model 512, 6 + 6 layers, 8 heads, ReLU FFN 2048, vocab 8192, batch 16 x 128 source and
         128 target tokens; Post-Norm and Pre-Norm on both sides; plus the fp32 matmul peak on the
         model's own GEMM shapes (for MFU).
  bf16   the same under `torch.autocast("cpu", torch.bfloat16)`, plus the bf16 matmul peak. On a CPU
         without bf16 instructions (no AVX512-BF16 / AMX) bf16 matmuls run ~100x below fp32 and a
         full-size step takes many minutes, so this section then runs at batch 1 x 32 and says so.
  beam   translation sentences/s of beam search (beam 4, GNMT length penalty 0.6) with the KV cache
         vs the uncached slow twin, on the fp32 Pre-Norm model: 32 sources of 24 tokens, EOS banned so
         every hypothesis runs to its max length of 32 (random weights would stop at random points).
         With --run DIR, also on that trained translation run's test sentences (real EOS behaviour).
  search tformer's beam search (beam 4) and greedy search vs Hugging Face `MarianMTModel.generate`
         (sdpa, its KV cache) at the same shape and the same weights: a random HF Marian (Post-Norm,
         sinusoidal positions, ReLU, tied embeddings scaled by sqrt(d_model)) copied into tformer's
         Post-Norm model (benchmarks/peers.py, checked by tests/generate/test_hf_seq2seq_reference.py),
         the same 32 sources, EOS held back for 32 tokens on both sides (HF: `min_new_tokens`), then one
         more token (EOS or not) ends every output.
         Both return the same tokens (checked, in the JSON): the same work. With --run DIR of a
         Post-Norm translation run (`--set model.norm_placement=post`), also on its first 200 test
         sentences in batches of 32 by source length, its model written into a Marian: real EOS,
         canonical beam search (alpha 0) on both sides, outputs compared sentence by sentence. There
         the work differs by design: tformer drops a sentence from its batch when its search is over,
         HF computes a finished sentence's rows until the whole batch is done.

Post-Norm has a third side, Hugging Face's `MarianMTModel` (sdpa) holding tformer's weights
(`peers.marian_of_tformer`, tested to give tformer's logits): its ratio is printed and recorded as
`tformer_post_vs_hf_marian`.

Both sides do the same work per step: shared source/target embedding scaled by sqrt(d_model) plus
sinusoidal positions, dropout 0 (torch's attention-weight and FFN-inner dropout have no exact twin in
tformer, so both are off), an output projection tied to the embedding, the same cross-entropy on fp32
logits (outside both models), backward, one fused AdamW step (same settings, plain parameter list on
both sides), zero_grad(set_to_none). No padding: the peer gets a causal target mask (tgt_is_causal).
The two models hold the same weights (the peer's copied into tformer, as tests/model/test_parity.py
does; both read tformer's sinusoid table), so their first losses agree (in the JSON). torch.nn.Transformer
ends both stacks with a LayerNorm, Post-Norm included; the paper's Post-Norm (and tformer's) has none, so
the peer's Post-Norm stacks end in an identity here (until 2026-12-01 they kept those two LayerNorms and
the weights were not copied).
FLOPs for MFU: 6 x matmul parameters (embedding lookup excluded, output projection included) per
token of each side, plus attention 12 x d_model x keys per query per layer (encoder self over S,
decoder self over the full T, not halved for causality, and cross over S).

    python benchmarks/bench_seq2seq.py                 # ~7-12 minutes on 2 cores, writes results/seq2seq.json
    python benchmarks/bench_seq2seq.py --quick         # < 1 minute smoke check (tiny shapes)
    python benchmarks/bench_seq2seq.py --run runs/translation   # adds beam speed on a trained run
    python benchmarks/bench_seq2seq.py --only search   # one section (fp32, bf16, beam, search)

On a busy machine two threads can run several times slower than one (each op waits for a core the
other processes hold): the JSON records the foreign CPU share; `--threads 1` measures the one-core case.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    LoadMeter,
    MatmulPeak,
    cpu_info,
    linear_train_shapes,
    paired_median,
    print_table,
    round_robin,
    setup,
    summarize,
    use_device,
    write_json,
)

from tformer import ModelConfig, build_model  # noqa: E402
from tformer.generate.beam import SearchConfig, beam_search, search  # noqa: E402
from tformer.model.positions import sinusoidal_table  # noqa: E402

DEVICE = torch.device("cpu")  # main() sets --device
FULL = dict(vocab=8192, d_model=512, layers=6, heads=8, d_ff=2048, batch=16, src=128, tgt=128, rounds=6)
QUICK = dict(vocab=512, d_model=64, layers=2, heads=4, d_ff=128, batch=4, src=16, tgt=16, rounds=2)
SLOW_BF16 = dict(batch=1, src=32, tgt=32, rounds=2)
SECTIONS = ("fp32", "bf16", "beam", "search")
BEAM = dict(sentences=32, src=24, max_len=32, beam=4, alpha=0.6, rounds=3)
COLUMNS = [
    ("name", "variant", "s"),
    ("best_s", "best s/step", ".3f"),
    ("median_s", "median", ".3f"),
    ("rate_best", "target tok/s", ",.0f"),
    ("speedup_paired_median", "x torch (paired)", ".3f"),
    ("speedup_best", "x torch (best)", ".3f"),
    ("mfu", "MFU", ".1%"),
    ("first_loss", "first loss", ".5f"),
]


# ----------------------------------------------------------------------------- the two models
def tformer_model(s: dict, placement: str) -> nn.Module:
    cfg = ModelConfig(
        arch="encoder_decoder",
        vocab_size=s["vocab"],
        d_model=s["d_model"],
        n_layers=s["layers"],
        n_heads=s["heads"],
        d_ff=s["d_ff"],
        max_seq_len=max(s["src"], s["tgt"], BEAM["max_len"]),
        dropout=0.0,
        norm="layernorm",
        norm_placement=placement,
        positions="sinusoidal",
        ffn="relu",
        embed_scale=True,
        share_embeddings=True,
        tie_embeddings=True,
    )
    return build_model(cfg)


@torch.no_grad()
def copy_peer_weights(peer: TorchSeq2Seq, ours: nn.Module) -> None:
    """The peer's weights into tformer's model (tests/model/test_parity.py maps them the same way)."""

    def attention(mine, mha: nn.MultiheadAttention) -> None:
        for proj, w, b in zip((mine.q_proj, mine.k_proj, mine.v_proj), mha.in_proj_weight.chunk(3),
                              mha.in_proj_bias.chunk(3)):  # fmt: skip
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        mine.o_proj.load_state_dict(mha.out_proj.state_dict())

    def ffn_norms(block, layer, norms: tuple[str, ...]) -> None:
        block.ffn.up_proj.load_state_dict(layer.linear1.state_dict())
        block.ffn.down_proj.load_state_dict(layer.linear2.state_dict())
        for mine, theirs in zip(norms, ("norm1", "norm2", "norm3")):
            getattr(block, mine).load_state_dict(getattr(layer, theirs).state_dict())

    ours.tok_embed.weight.copy_(peer.embed.weight)  # shared source / target embedding, tied head
    for block, layer in zip(ours.encoder.blocks, peer.core.encoder.layers):
        attention(block.attn, layer.self_attn)
        ffn_norms(block, layer, ("attn_norm", "ffn_norm"))
    for block, layer in zip(ours.decoder.blocks, peer.core.decoder.layers):
        attention(block.attn, layer.self_attn)
        attention(block.cross_attn, layer.multihead_attn)
        ffn_norms(block, layer, ("attn_norm", "cross_norm", "ffn_norm"))
    for stack, theirs in ((ours.encoder, peer.core.encoder), (ours.decoder, peer.core.decoder)):
        if not isinstance(theirs.norm, nn.Identity):  # Pre-Norm's final norms
            stack.final_norm.load_state_dict(theirs.norm.state_dict())


class TorchSeq2Seq(nn.Module):
    """torch.nn.Transformer with what a translation model needs around it: the peer."""

    def __init__(self, s: dict, placement: str) -> None:
        super().__init__()
        d = s["d_model"]
        self.embed = nn.Embedding(s["vocab"], d)
        self.core = nn.Transformer(
            d_model=d,
            nhead=s["heads"],
            num_encoder_layers=s["layers"],
            num_decoder_layers=s["layers"],
            dim_feedforward=s["d_ff"],
            dropout=0.0,
            batch_first=True,
            norm_first=placement == "pre",
        )
        self.head = nn.Linear(d, s["vocab"], bias=False)
        self.head.weight = self.embed.weight
        # the embedding initialised as tformer's (and the paper's, fairseq's): N(0, 1/d_model), so the
        # scaled embedding has unit variance. nn.Embedding's default N(0, 1) makes the tied output
        # projection's logits ~22 wide: the softmax gradients underflow to subnormal floats, which cost
        # a CPU microcode assist each (mm ran 4x slower on an Intel Xeon), a handicap that is not the peer's
        nn.init.normal_(self.embed.weight, 0.0, d**-0.5)
        if placement == "post":  # the paper's Post-Norm stacks end in their last block's norm
            self.core.encoder.norm, self.core.decoder.norm = nn.Identity(), nn.Identity()
        self.register_buffer("pe", sinusoidal_table(max(s["src"], s["tgt"]), d), persistent=False)
        self.scale = math.sqrt(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.embed(src) * self.scale + self.pe[: src.shape[1]]
        y = self.embed(tgt) * self.scale + self.pe[: tgt.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.head(self.core(x, y, tgt_mask=mask, tgt_is_causal=True))  # (B, T, V)


class MarianSeq2Seq(nn.Module):
    """HF `MarianMTModel` holding a tformer Post-Norm model's weights (`peers.marian_of_tformer`), called as
    the other two are: (source, target input) -> logits. No padding, so no masks but the causal one."""

    def __init__(self, ours: nn.Module) -> None:
        super().__init__()
        from peers import marian_of_tformer

        self.hf = marian_of_tformer(ours, pad_id=0, bos_id=1, eos_id=2).train()

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=src, decoder_input_ids=tgt, use_cache=False).logits  # (B, T, V)


def train_step(model: nn.Module, batch, optimizer, autocast) -> None:
    src, tgt_in, tgt_out = batch
    with autocast():
        logits = model(src, tgt_in)  # (B, T, V); both models take (source, target input)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # the step's time is the GPU's, not the time to queue it


def autocast_for(dtype: str):
    if dtype == "bf16":
        return lambda: torch.autocast(DEVICE.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def train_variants(s: dict, dtype: str) -> tuple[dict, dict, tuple]:
    g = torch.Generator().manual_seed(0)
    batch = tuple(
        torch.randint(4, s["vocab"], (s["batch"], n), generator=g).to(DEVICE)
        for n in (s["src"], s["tgt"], s["tgt"])
    )
    autocast = autocast_for(dtype)
    variants, models = {}, {}
    for placement in ("post", "pre"):
        peer, ours = TorchSeq2Seq(s, placement), tformer_model(s, placement)
        copy_peer_weights(peer, ours)
        models_of = [(f"torch nn.Transformer {placement}", peer), (f"tformer {placement}", ours)]
        if placement == "post":  # HF's Post-Norm translation model, with the same weights
            models_of.append(("HF Marian post", MarianSeq2Seq(ours)))
        for name, model in models_of:
            model.to(DEVICE)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            models[name] = model
            variants[name] = lambda m=model, o=opt: train_step(m, batch, o, autocast)
    return variants, models, batch


def first_loss(model: nn.Module, batch, autocast) -> float:
    """The loss of the batch before any step (the same weights give the same loss on both sides)."""
    src, tgt_in, tgt_out = batch
    with torch.no_grad(), autocast():
        return F.cross_entropy(model(src, tgt_in).float().flatten(0, 1), tgt_out.flatten()).item()


# ----------------------------------------------------------------------------- FLOPs and peak
def train_flops(s: dict) -> float:
    d, f, L, v = s["d_model"], s["d_ff"], s["layers"], s["vocab"]
    enc = L * (4 * d * d + 2 * d * f) + L * 2 * d * d  # per source token: + the decoder's cross K/V of it
    dec = L * (6 * d * d + 2 * d * f) + d * v  # per target token: self q k v o, cross q o, FFN, projection
    tokens_s, tokens_t = s["batch"] * s["src"], s["batch"] * s["tgt"]
    attn = 12 * d * L * (tokens_s * s["src"] + tokens_t * (s["tgt"] + s["src"]))
    return 6 * (enc * tokens_s + dec * tokens_t) + attn


def peak_shapes(s: dict) -> list:
    d, f, L, v = s["d_model"], s["d_ff"], s["layers"], s["vocab"]
    ns, nt = s["batch"] * s["src"], s["batch"] * s["tgt"]
    return [
        *linear_train_shapes(ns, d, d, 4 * L),  # encoder q, k, v, o
        *linear_train_shapes(ns, d, f, L),
        *linear_train_shapes(ns, f, d, L),
        *linear_train_shapes(nt, d, d, 6 * L),  # decoder self q k v o, cross q o
        *linear_train_shapes(ns, d, d, 2 * L),  # cross k, v over the memory
        *linear_train_shapes(nt, d, f, L),
        *linear_train_shapes(nt, f, d, L),
        *linear_train_shapes(nt, d, v, 1),
    ]


def train_section(s: dict, dtype: str, note: str) -> dict:
    variants, models, batch = train_variants(s, dtype)
    autocast = autocast_for(dtype)
    losses = {name: first_loss(model, batch, autocast) for name, model in models.items()}
    peak = MatmulPeak(peak_shapes(s), torch.bfloat16 if dtype == "bf16" else torch.float32, DEVICE)
    variants["matmul peak"] = peak
    print(f"\n[{dtype}] {note}", file=sys.stderr)
    with LoadMeter() as meter:
        times = round_robin(variants, rounds=s["rounds"])
    flops, peak_gflops = train_flops(s), peak.gflops_best()
    del times["matmul peak"]
    rows = []
    for placement in ("post", "pre"):
        ref = f"torch nn.Transformer {placement}"
        sub = {k: v for k, v in times.items() if k.endswith(placement)}
        for row in summarize(sub, ref, s["batch"] * s["tgt"]).values():
            d = row.as_dict()
            d["mfu"] = flops / row.best_s / 1e9 / peak_gflops
            d["first_loss"] = losses[row.name]
            rows.append(d)
    print_table(f"training step, {dtype} ({note}); {meter.line()}", rows, COLUMNS)
    vs_hf = {
        "speedup_paired_median": paired_median(times, "HF Marian post", "tformer post"),
        "speedup_best": min(times["HF Marian post"]) / min(times["tformer post"]),
    }
    print(
        f"tformer post vs HF Marian post: {vs_hf['speedup_paired_median']:.3f}x paired, "
        f"{vs_hf['speedup_best']:.3f}x best",
        flush=True,
    )
    return {
        "shape": s,
        "note": note,
        "train_gflop_per_step": flops / 1e9,
        "matmul_peak_gflops": peak_gflops,
        "rows": rows,
        "tformer_post_vs_hf_marian": vs_hf,
        "times_s": times,
        "load": meter.result,
    }


# ----------------------------------------------------------------------------- beam search
def beam_section(s: dict, run: str | None) -> dict:
    model = tformer_model(s, "pre").eval().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, s["vocab"], (BEAM["sentences"], BEAM["src"]), generator=g).to(DEVICE)
    common = dict(bos_id=1, eos_id=2, max_len=BEAM["max_len"], beam_size=BEAM["beam"], alpha=BEAM["alpha"])
    banned = (0, 1, 2)  # EOS banned: every hypothesis runs to max_len, the same work every round
    variants = {
        "beam 4, KV cache": lambda: beam_search(model, src, None, banned=banned, **common),
        "beam 4, uncached (slow twin)": lambda: beam_search(
            model, src, None, banned=banned, cached=False, **common
        ),
    }
    print("\n[beam] random-weight Pre-Norm model, EOS banned", file=sys.stderr)
    with LoadMeter() as meter:
        times = round_robin(variants, rounds=BEAM["rounds"])
    rows = [
        {"name": k, "best_s": min(v), "sentences_per_s": BEAM["sentences"] / min(v)} for k, v in times.items()
    ]
    cols = [("name", "search", "s"), ("best_s", "best s", ".2f"), ("sentences_per_s", "sentences/s", ".1f")]
    print_table(
        f"beam search, {BEAM['sentences']} x {BEAM['src']} source tokens -> {BEAM['max_len']}; {meter.line()}",
        rows,
        cols,
    )
    out = {"setup": BEAM, "rows": rows, "times_s": times, "load": meter.result}
    if run:
        out["trained_run"] = trained_beam(run)
    return out


# ----------------------------------------------------------------------------- search vs HF generate
def search_section(s: dict, run: str | None) -> dict:
    from peers import hf_canonical_outputs, hf_marian, marian_state_for_tformer, tformer_marian_config

    torch.manual_seed(0)
    hf = hf_marian(s, max(BEAM["src"], BEAM["max_len"] + 1)).eval().to(DEVICE)
    ours = build_model(tformer_marian_config(hf.config)).eval()
    ours.load_state_dict(marian_state_for_tformer(hf, ours))
    ours.to(DEVICE)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, s["vocab"], (BEAM["sentences"], BEAM["src"]), generator=g).to(DEVICE)
    mask = torch.ones_like(src, dtype=torch.bool)
    # pad and the decoder's start never; EOS not before the n_new-th token: every output is n_new + 1 long
    banned, n_new = [0, 1], BEAM["max_len"]

    ids = dict(bos=1, eos=2, banned=banned, max_len=n_new + 1, min_len=n_new)

    def tformer_search(beams: int):
        return tformer_outputs(ours, src, mask, beams, **ids)

    def hf_search(beams: int):
        return hf_canonical_outputs(hf, src, mask, beams, **ids)

    same = {f"beam {k}" if k > 1 else "greedy": tformer_search(k) == hf_search(k) for k in (BEAM["beam"], 1)}
    variants = {
        f"tformer beam {BEAM['beam']}": lambda: tformer_search(BEAM["beam"]),
        f"HF generate beam {BEAM['beam']}": lambda: hf_search(BEAM["beam"]),
        "tformer greedy": lambda: tformer_search(1),
        "HF generate greedy": lambda: hf_search(1),
    }
    print(f"\n[search] HF MarianMTModel vs tformer, same weights; same outputs: {same}", file=sys.stderr)
    with LoadMeter() as meter:
        times = round_robin(variants, rounds=8)  # a multiple of the 4 variants
    rows = search_rows(times, BEAM["sentences"])
    print_table(
        f"search vs HF generate, {BEAM['sentences']} x {BEAM['src']} source tokens -> {n_new}; {meter.line()}",
        rows,
        SEARCH_COLUMNS,
    )
    out = {
        "setup": {
            "sentences": BEAM["sentences"],
            "src": BEAM["src"],
            "beam": BEAM["beam"],
            "length_penalty": 0.0,
            "min_len": n_new,
            "max_len": n_new + 1,
            "rounds": 8,
            "peer": "transformers.MarianMTModel",
        },
        "same_outputs": same,
        "rows": rows,
        "times_s": times,
        "load": meter.result,
    }
    if run:
        out["trained_run"] = trained_search(run)
    return out


def trained_search(run: str, sentences: int = 200, batch: int = 32) -> dict:
    """tformer's search vs HF Marian's `generate` on a trained Post-Norm translation run's first test
    sentences (its model written into a MarianMTModel, `peers.marian_of_tformer`): real sentences, real
    EOS. Both take the same batches (sorted by source length) and the same rule (alpha 0, HF's
    canonical beam search), the length limit the model's context; the outputs are compared."""
    from peers import hf_canonical_outputs, marian_of_tformer

    from tformer.data.corpora import load_corpus
    from tformer.data.datasets import pad_sequences
    from tformer.runs import load_run
    from tformer.tasks.translation import load_translator

    loaded = load_run(run, device=DEVICE)
    translator, cfg = load_translator(loaded), loaded.train_config
    model, tok = translator.model.eval(), translator.tgt_tok
    try:
        hf = marian_of_tformer(model, tok.pad_id, tok.bos_id, tok.eos_id).to(DEVICE)
    except ValueError as e:
        print(f"trained run {run}: no Marian twin ({e}); skipped", file=sys.stderr)
        return {"run": run, "skipped": str(e)}
    texts = [p.src for p in load_corpus(cfg.data.corpus, direction=cfg.data.direction)["test"][:sentences]]
    sources, _ = translator.encode(texts)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    batches = [
        [
            t.to(DEVICE)
            for t in pad_sequences([torch.tensor(sources[i]) for i in order[j : j + batch]], tok.pad_id)
        ]
        for j in range(0, len(order), batch)
    ]
    limit = model.cfg.max_seq_len - 1  # generated tokens, EOS included: the decoder's positions end there
    banned = [tok.pad_id, tok.bos_id]

    ids = dict(bos=tok.bos_id, eos=tok.eos_id, banned=banned, max_len=limit, min_len=1)

    def tformer_search(beams: int):
        return [out for src, mask in batches for out in tformer_outputs(model, src, mask, beams, **ids)]

    def hf_search(beams: int):
        return [out for src, mask in batches for out in hf_canonical_outputs(hf, src, mask, beams, **ids)]

    same = {}
    for k in (BEAM["beam"], 1):
        a, b = tformer_search(k), hf_search(k)
        same[f"beam {k}" if k > 1 else "greedy"] = sum(x == y for x, y in zip(a, b))
    print(f"\n[search] trained run {run}: outputs equal to HF's for {same} of {len(texts)}", file=sys.stderr)
    with LoadMeter() as meter:
        times = round_robin(
            {
                f"tformer beam {BEAM['beam']}": lambda: tformer_search(BEAM["beam"]),
                f"HF generate beam {BEAM['beam']}": lambda: hf_search(BEAM["beam"]),
                "tformer greedy": lambda: tformer_search(1),
                "HF generate greedy": lambda: hf_search(1),
            },
            rounds=4,  # a multiple of the 4 variants
            warmup=0,
        )
    rows = search_rows(times, len(texts))
    title = f"trained run {run}: {len(texts)} test sentences, batches of {batch}; {meter.line()}"
    print_table(title, rows, SEARCH_COLUMNS)
    return {
        "run": run,
        "sentences": len(texts),
        "batch": batch,
        "max_len": limit,
        "min_len": 1,
        "length_penalty": 0.0,
        "same_outputs": same,
        "rows": rows,
        "times_s": times,
        "load": meter.result,
    }


def tformer_outputs(
    model, src, mask, beams, *, bos, eos, banned, max_len, min_len
) -> list[tuple[list[int], bool]]:
    """tformer's search as `Translator` runs it (`search`, fast_decode on: row-blocked linears on the CPU):
    beam search at alpha 0 (beams > 1) or greedy; (tokens, ended with EOS) per sentence."""
    method = "beam" if beams > 1 else "greedy"
    cfg = SearchConfig(method=method, beam_size=beams, length_penalty=0.0, max_len=max_len, min_len=min_len)
    return [
        (h.tokens, h.finished) for h in search(model, src, mask, cfg, bos_id=bos, eos_id=eos, banned=banned)
    ]


def search_rows(times: dict[str, list[float]], sentences: int) -> list[dict]:
    rows = []
    for ours_name, peer in (
        (f"tformer beam {BEAM['beam']}", f"HF generate beam {BEAM['beam']}"),
        ("tformer greedy", "HF generate greedy"),
    ):
        for name in (ours_name, peer):
            rows.append(
                {
                    "name": name,
                    "best_s": min(times[name]),
                    "sentences_per_s": sentences / min(times[name]),
                    "speedup_best": min(times[peer]) / min(times[name]),
                    "speedup_paired_median": paired_median(times, peer, name),
                }
            )
    return rows


SEARCH_COLUMNS = [
    ("name", "search", "s"),
    ("best_s", "best s", ".2f"),
    ("sentences_per_s", "sentences/s", ".1f"),
    ("speedup_paired_median", "x HF (paired)", ".2f"),
    ("speedup_best", "x HF (best)", ".2f"),
]


def trained_beam(run: str) -> dict:
    from tformer.data.corpora import load_corpus
    from tformer.generate.beam import SearchConfig
    from tformer.runs import load_run
    from tformer.tasks.translation import load_translator

    loaded = load_run(run, device=DEVICE)
    translator, cfg = load_translator(loaded), loaded.train_config
    texts = [p.src for p in load_corpus(cfg.data.corpus, direction=cfg.data.direction)["test"][:200]]
    sources, _ = translator.encode(texts)
    result = {}
    for name, search_cfg in (
        ("beam 4", SearchConfig(beam_size=4)),
        ("greedy", SearchConfig(method="greedy")),
    ):
        t = time.perf_counter()
        translator.hypotheses(sources, search_cfg)
        result[name] = len(texts) / (time.perf_counter() - t)
    print(
        f"trained run {run}: " + ", ".join(f"{k} {v:.1f} sentences/s" for k, v in result.items()), flush=True
    )
    return {"run": run, "sentences": len(texts), "sentences_per_s": result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, a smoke check")
    p.add_argument("--run", default=None, help="a trained translation run: also time beam search on it")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections (default all)"
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda: both models and the batches on the GPU")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2, the machine's cores)")
    p.add_argument("--out", default=None, help="JSON file name under benchmarks/results/")
    args = p.parse_args()
    setup(threads=args.threads)
    global DEVICE
    DEVICE = use_device(args.device)
    s = QUICK if args.quick else FULL
    info = cpu_info()
    results = {"cpu": info}
    if "fp32" in args.only:
        results["fp32"] = train_section(s, "fp32", "full shape" if not args.quick else "quick")
    if "bf16" in args.only and not args.skip_bf16:
        slow = DEVICE.type == "cpu" and not info["native_bf16_matmul"] and not args.quick
        shape = {**s, **SLOW_BF16} if slow else s
        note = "batch 1 x 32: this CPU has no native bf16 matmul" if slow else "same shape as fp32"
        results["bf16"] = train_section(shape, "bf16", note)
    if "beam" in args.only:
        results["beam"] = beam_section(s, args.run)
    if "search" in args.only:
        results["search"] = search_section(s, args.run)
    write_json(args.out or ("seq2seq_quick.json" if args.quick else "seq2seq.json"), results)


if __name__ == "__main__":
    main()
