"""`tformer demo`: a smoke run of the model core on zero-install text (Python's own pydoc topics)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tformer import build_model
from tformer.presets import tiny


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    for arch in ("decoder", "encoder", "encoder_decoder"):
        model = build_model(tiny(arch))
        n = sum(p.numel() for p in model.parameters())
        print(f"built {arch:<16} {n:>9,} parameters")
    from pydoc_data.topics import topics

    text = "\n".join(topics.values())[:200_000].encode("utf-8", "ignore")
    data = torch.tensor(list(text), dtype=torch.long)
    cfg = tiny("decoder").replace(vocab_size=256, max_seq_len=128)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - 65, (16,))
        batch = torch.stack([data[s : s + 65] for s in starts])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0 or step == args.steps:  # the last step too
            print(f"step {step:>4}  loss {loss.item():.3f}  ({loss.item() / 0.6931:.2f} bits/byte)")
    return 0
