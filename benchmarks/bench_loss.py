"""The fused head and loss (`fused_loss: true`, tformer.model.loss) against the logits path, on its own.

One call is the forward and backward of the output projection and the summed cross-entropy of N = 2,048
tokens (8 x 256) at d_model 512, for vocabularies of 8,192 and 32,768, in fp32 and under bf16 autocast:
  logits  F.linear, then torch's cross-entropy on the fp32 logits (the trainer's default path)
  fused   linear_cross_entropy: 1,024 rows of logits at a time, the gradients made in the forward
For each: the best time and the paired median ratio (a round-robin, harness.py), and the peak bytes of
the tensors the call makes (its inputs and the weight left out; the gradients it leaves counted), taken
by a dispatch mode that adds each new storage and drops it once freed.

    python benchmarks/bench_loss.py            # ~1 minute, writes results/loss.json
    python benchmarks/bench_loss.py --quick    # seconds (small shapes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import LoadMeter, print_table, round_robin, setup, summarize, write_json  # noqa: E402

from tformer.model.loss import linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

FULL = dict(tokens=2048, d_model=512, vocabs=(8192, 32768), rounds=7)
QUICK = dict(tokens=256, d_model=64, vocabs=(1024,), rounds=2)
FNS = {"logits": linear_cross_entropy_reference, "fused": linear_cross_entropy}


class PeakBytes(TorchDispatchMode):
    """The most bytes held at once by storages that ops made under the mode (views and in-place results
    are not new storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in tree_leaves(out):
                if type(t) is torch.Tensor and t.layout == torch.strided:
                    storage = t.untyped_storage()
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file name under benchmarks/results/")
    args = ap.parse_args()
    setup(args.threads)
    s = QUICK if args.quick else FULL
    sections = []
    for vocab in s["vocabs"]:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(s["tokens"], s["d_model"], generator=g).requires_grad_()
        w = (0.05 * torch.randn(vocab, s["d_model"], generator=g)).requires_grad_()
        targets = torch.randint(0, vocab, (s["tokens"],), generator=g)
        for dtype in ("fp32", "bf16"):

            def call(fn, dtype=dtype, h=h, w=w, targets=targets) -> None:
                h.grad = w.grad = None
                with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                    loss = fn(h, w, targets)
                loss.backward()

            peaks = {}
            for name, fn in FNS.items():
                with PeakBytes() as meter:
                    call(fn)
                peaks[name] = meter.peak
            with LoadMeter() as load:
                times = round_robin({n: (lambda fn=fn: call(fn)) for n, fn in FNS.items()}, s["rounds"])
            rows = []
            for name, row in summarize(times, "logits", s["tokens"]).items():
                rows.append({**row.as_dict(), "peak_mib": round(peaks[name] / 2**20, 1)})
            title = (
                f"head + loss, vocabulary {vocab:,}, {dtype}, {s['tokens']} tokens x d_model {s['d_model']}"
            )
            columns = [
                ("name", "path", "s"),
                ("best_s", "best s", ".4f"),
                ("speedup_paired_median", "speed vs logits (paired)", ".3f"),
                ("peak_mib", "peak MiB made", ".1f"),
            ]
            print_table("\n" + title, rows, columns)
            print("  " + load.line())
            sections.append({"vocab": vocab, "dtype": dtype, "rows": rows, "load": load.result})
    write_json(
        args.out or ("loss_quick.json" if args.quick else "loss.json"), {"config": s, "sections": sections}
    )


if __name__ == "__main__":
    main()
