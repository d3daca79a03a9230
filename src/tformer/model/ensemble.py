"""An ensemble of trained encoder-decoders, searched and scored as one model.

The ensemble's distribution over the next token is the mean of its members' probabilities, p(y) =
1/n sum_i p_i(y), the rule of the ensembles in fairseq and Marian; its "logits" are log p, so a softmax
over them gives p back (log-probabilities are their own log-softmax). Every member keeps its own encoder
output and KV cache: the searches in `tformer.generate.beam` step each member (`EnsembleSteps`) and average
there, and `forward` averages the members' outputs for a loss. The members may differ in shape, positions
or norms; they must share the target and source vocabularies (the same tokenizers), which the callers that
load runs check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Ensemble(nn.Module):
    """Encoder-decoders whose next-token probabilities are averaged. `cfg` is the first member's with the
    shortest context of all (what every member can read)."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        members = list(members)
        if not members or not all(isinstance(m, nn.Module) for m in members):
            raise TypeError("an ensemble takes a list of one or more models")
        archs = {getattr(getattr(m, "cfg", None), "arch", None) for m in members}
        if archs != {"encoder_decoder"}:
            raise ValueError(
                f"an ensemble takes encoder-decoders, got models of arch {sorted(map(str, archs))}"
            )
        for name in ("vocab_size", "resolved_src_vocab_size"):
            sizes = [getattr(m.cfg, name) for m in members]
            if len(set(sizes)) > 1:
                raise ValueError(
                    f"the ensemble's members differ in {name} ({sizes}): they must share vocabularies"
                )
        self.members = nn.ModuleList(members)
        self.cfg = members[0].cfg.replace(max_seq_len=min(m.cfg.max_seq_len for m in members))
        # in evaluation mode unless every member trains (loaded runs are evaluated): a search restores the
        # mode it found, and an ensemble left in training mode would have put its members' dropout back on
        self.training = all(m.training for m in members)  # (the members' own modes left as they are)

    def __len__(self) -> int:
        return len(self.members)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        targets: Tensor | None = None,
        label_smoothing: float = 0.0,
        tgt_right_padded: bool = False,
    ) -> Tensor:
        """(B, T, V) log of the members' mean next-token probabilities (fp32); the fused loss (`targets`)
        is the members' own business: an ensemble is scored from these."""
        if targets is not None:
            raise ValueError(
                "an ensemble returns log-probabilities; score them (fused_loss off), not targets"
            )
        return mean_log_probs(
            [
                m(src, tgt, src_key_padding_mask, tgt_key_padding_mask, tgt_right_padded=tgt_right_padded)
                for m in self.members
            ]
        )


def mean_log_probs(logits: Sequence[Tensor]) -> Tensor:
    """log(1/n sum_i softmax(logits_i)) over the last dimension, in fp32 (summed pairwise: two (..., V)
    tensors at a time, not n)."""
    total = torch.log_softmax(logits[0].float(), dim=-1)
    for x in logits[1:]:
        total = torch.logaddexp(total, torch.log_softmax(x.float(), dim=-1))
    return total - math.log(len(logits))
