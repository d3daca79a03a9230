"""Text generation with a decoder LM: one prefill over the prompts, then one cached step per token.

Shapes: prompts are lists of token ids, left-padded into tokens (B, L) with key_padding (B, L) True for
real tokens and positions counted from each prompt's first real token, so a padded row computes what
it would alone. Each decode step feeds (B, 1) new tokens against the KV cache.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from tformer.generate.sampling import SamplingConfig, apply_repetition_penalty, sample_next
from tformer.model.checks import check_finite_outputs, check_not_meta
from tformer.model.compiled_step import CompiledDecodeStep
from tformer.model.decode_step import DecodeStep
from tformer.model.linear import decoding_layout
from tformer.model.norms import rms_norms_as_layer_norm
from tformer.schema import require_bool


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    real = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, length - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            real[i, length - len(p) :] = True
    return tokens, real


def is_token_id(value) -> bool:
    """An integer (Python, NumPy or a 0-d integer tensor), not a bool."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_token_id(value, vocab_size: int, what: str) -> None:
    """A token id argument (eos_id, pad_id, a banned id): an integer in [0, vocab_size)."""
    if not is_token_id(value) or not 0 <= operator.index(value) < vocab_size:
        raise ValueError(f"{what} must be a token id in [0, {vocab_size}), got {value!r}")


def as_token_lists(prompts, vocab_size: int | None = None, what: str = "prompt") -> list[list[int]]:
    """Prompts as lists of Python ints: a list of prompts, each a list, tuple or 1-D array / tensor of
    integer ids, or one 2-D tensor (B, T) (a string, a float id or an id outside [0, vocab_size) is an
    error naming the prompt and index; `what` names them, e.g. "text" or "source")."""
    if isinstance(prompts, Tensor) and prompts.dim() != 2:
        raise TypeError(
            f"prompts must be a list of token-id lists or a 2-D tensor (batch, length), got a {prompts.dim()}-D "
            "tensor; wrap one prompt in a list: [ids]"
        )
    if isinstance(prompts, (str, bytes, set, frozenset, dict)) or not hasattr(prompts, "__iter__"):
        raise TypeError(
            f"prompts must be a list of token-id lists (e.g. [[5, 17, 3]]), got {type(prompts).__name__}"
        )
    out = []
    for i, p in enumerate(prompts):
        one_dim = getattr(p, "ndim", 1) == 1  # tensors and arrays: one row of ids
        if isinstance(p, (str, bytes, set, frozenset, dict)) or not hasattr(p, "__iter__") or not one_dim:
            raise TypeError(f"{what} {i} must be a list of token ids, got {_kind(p)}")
        ids = list(p)
        bad = next((t for t in ids if not is_token_id(t)), None)
        if bad is not None:
            raise TypeError(f"{what} {i} holds {bad!r}: token ids are integers")
        ids = [operator.index(t) for t in ids]
        if vocab_size is not None:
            at = next((j for j, t in enumerate(ids) if not 0 <= t < vocab_size), None)
            if at is not None:
                raise ValueError(
                    f"{what} {i} holds id {ids[at]} at index {at}; allowed ids are 0..{vocab_size - 1}"
                )
        out.append(ids)
    return out


def _kind(value) -> str:
    ndim = getattr(value, "ndim", None)
    return f"a {ndim}-D {type(value).__name__}" if ndim is not None else type(value).__name__


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. some text)")
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))  # the longest (the first of them)
    longest, fits = len(prompts[i]), max_seq_len - max_new_tokens  # fits: prompt tokens max_new_tokens leave
    which = f"prompt {i} ({_tokens(longest)})" if len(prompts) > 1 else f"the prompt ({_tokens(longest)})"
    if longest >= max_seq_len:
        shorter = f"give at most {_tokens(fits)} with max_new_tokens={max_new_tokens}" if fits >= 1 else ""
        raise ValueError(
            f"{which} leaves no room for new tokens in the model's context of {_tokens(max_seq_len)}"
            + (f"; {shorter}" if shorter else f"; give at most {_tokens(max_seq_len - 1)}")
        )
    if longest + max_new_tokens > max_seq_len:
        shorter = f", or shorten the prompt to at most {_tokens(fits)}" if fits >= 1 else ""
        raise ValueError(
            f"{which} + max_new_tokens={max_new_tokens} exceeds the model's context of {max_seq_len} "
            f"tokens; lower max_new_tokens to at most {max_seq_len - longest}{shorter}"
        )


def truncate_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int
) -> tuple[list[list[int]], list[int]]:
    """(prompts cut to their last max_seq_len - max_new_tokens tokens, indices of those that were cut):
    the opt-in alternative to check_prompts' error for prompts longer than the context allows."""
    keep = max_seq_len - max_new_tokens
    if keep < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of "
            f"{max_seq_len} tokens; lower it to at most {max_seq_len - 1}"
        )
    cut = [i for i, p in enumerate(prompts) if len(p) > keep]
    return [list(p[-keep:]) if len(p) > keep else list(p) for p in prompts], cut


@torch.inference_mode()  # no_grad without version counting: every small op of a decoding step is cheaper
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    eos_id: int | None = None,
    pad_id: int = 0,
    decode: Callable[[list[int]], str] | None = None,
    on_step: Callable[[Tensor], None] | None = None,
    fast_decode: bool = True,
    compile: bool = False,
) -> list[list[int]]:
    """New tokens for each prompt (the prompt excluded), stopping at EOS, a stop string or the budget.

    decode: turns a row's new ids into text; needed for `sampling.stop_strings`.
    on_step: called with the (B,) tokens of each step, for streaming.
    fast_decode: on the CPU, where it pays on this machine (`tformer.model.linear.row_blocking_pays`,
        measured once per process), compute the linear layers' products of a few rows (each decoding
        step) as row-blocked products (`tformer.model.linear.row_blocked_linears`: 1.3-2.2x faster at 1
        to 64 rows where MKL runs a one-row product on one core; q/k/v and gate/up as one product each
        over their weights stacked once per call, a copy held until the call returns); RMSNorm as one LayerNorm
        (`tformer.model.norms.rms_norms_as_layer_norm`: fewer small ops per step); after the prompt,
        run each step as the flat `tformer.model.decode_step.DecodeStep` read from the model once
        (no module calls, checks or mask objects per step: 1.27x at batch 1 on the benchmark model)
        where the model is one it knows, else as `model(...)`.
        False: `model(...)` per step with plain `F.linear` and `torch.rms_norm` (the slow twins).
    compile: run each step after the prompt as `tformer.model.compiled_step.CompiledDecodeStep` under
        `torch.compile`: the first call for a model shape and batch size compiles (~35-40 s the
        first time on 2 CPU cores, 3-9 s from torch's on-disk cache), later ones (any prompt length)
        reuse it. Models it does not take (MoE layers that drop tokens over a capacity, other norms)
        decode as with compile=False, with a warning.
    """
    arch = getattr(getattr(model, "cfg", None), "arch", None)
    if arch != "decoder":
        raise ValueError(
            f"generate needs a decoder LM, got {'a model of arch ' + repr(arch) if arch else type(model).__name__}"
            + (
                "; an encoder-decoder decodes with tformer.generate.beam.search"
                if arch == "encoder_decoder"
                else ""
            )
        )
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    require_bool(fast_decode=fast_decode, compile=compile)
    if compile and not fast_decode:
        raise ValueError("compile=True is a fast path; fast_decode=False asks for the slow twin: choose one")
    prompts = as_token_lists(prompts, model.cfg.vocab_size)
    check_prompts(prompts, sampling.max_new_tokens, model.cfg.max_seq_len)
    vocab = model.cfg.vocab_size
    check_token_id(pad_id, vocab, "pad_id")
    if eos_id is not None:
        check_token_id(eos_id, vocab, "eos_id")
    if sampling.stop_strings and decode is None:
        raise ValueError("stop_strings need decode= (a function from token ids to text) to be found")
    for name, fn in (("decode", decode), ("on_step", on_step)):  # before any step runs
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function (or None), got {type(fn).__name__}")
    check_not_meta(model)
    was_training = model.training
    with contextlib.ExitStack() as layout:
        layout.callback(model.train, was_training)  # also when a step raises
        model.eval()  # no dropout while decoding (the mode is put back above)
        step = None
        if compile:  # read the model before the contexts below patch its forwards
            step = CompiledDecodeStep.build(model, len(prompts))
        if fast_decode and step is None:
            layout.enter_context(decoding_layout(model))
            layout.enter_context(rms_norms_as_layer_norm(model))
        return _generate(model, prompts, sampling, eos_id, pad_id, decode, on_step, fast_decode, step)


def _generate(
    model, prompts, sampling, eos_id, pad_id, decode, on_step, fast_decode, step_fn
) -> list[list[int]]:
    device = next(model.parameters()).device
    tokens, real = _left_pad(prompts, pad_id, device)
    b, length = tokens.shape
    padded = not bool(real.all())
    positions = (real.cumsum(-1) - 1).clamp_min(0) if padded else None
    key_padding = real if padded else None
    cache = model.new_cache(length + sampling.max_new_tokens)
    logits = model(tokens, positions=positions, key_padding_mask=key_padding, cache=cache)[:, -1]
    check_finite_outputs(logits, "next-token logits after the prompt")  # greedy would pick id 0 from NaN
    if step_fn is None and fast_decode:  # after the prefill, inside the decoding contexts
        step_fn = DecodeStep.build(model, b)
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    history = tokens.masked_fill(~real, -1) if sampling.repetition_penalty != 1.0 else None
    next_pos = real.sum(-1, keepdim=True)  # (B, 1)
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b  # host-side bookkeeping: one .tolist() per step instead of small tensor ops
    held = torch.tensor([eos_id], device=device) if sampling.min_new_tokens and eos_id is not None else None
    for step in range(sampling.max_new_tokens):
        if held is not None and step < sampling.min_new_tokens:  # too early to end: EOS not drawable
            logits = logits.index_fill(-1, held, float("-inf"))
        if history is not None:
            logits = apply_repetition_penalty(
                logits, history.clamp_min(0), sampling.repetition_penalty, mask=history >= 0
            )
        nxt = sample_next(
            logits,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            generator=generator,
        )
        if any(done):  # finished rows keep feeding pad_id
            nxt = nxt.masked_fill(torch.tensor(done, device=device), pad_id)
        ids = nxt.tolist()
        if on_step is not None:
            on_step(torch.tensor([-1 if d else t for t, d in zip(ids, done)], device=device))
        for row, tok, finished in zip(out, ids, done):
            if not finished:
                row.append(tok)
        done = _finished(ids, done, out, eos_id, sampling.stop_strings, decode)
        if all(done) or step == sampling.max_new_tokens - 1:  # no forward for a token never drawn
            break
        if history is not None:
            history = torch.cat([history, nxt[:, None]], dim=1)
        if padded:
            key_padding = torch.cat([key_padding, torch.ones(b, 1, dtype=torch.bool, device=device)], dim=1)
            positions = next_pos
            next_pos = next_pos + 1
        if step_fn is not None:
            logits = step_fn(nxt, positions, key_padding, cache)
        else:
            logits = model(nxt[:, None], positions=positions, key_padding_mask=key_padding, cache=cache)[
                :, -1
            ]
    return [_strip(row, eos_id) for row in out]


def _finished(
    ids: list[int], done: list[bool], out: list[list[int]], eos_id: int | None, stops: Sequence[str], decode
) -> list[bool]:
    """Rows finished before or now: EOS drawn, or (with `decode`) a stop string in the row's text."""
    now = [d or (eos_id is not None and t == eos_id) for t, d in zip(ids, done)]
    if stops and decode is not None:
        now = [d or bool(row and any(s in _text(decode, row) for s in stops)) for d, row in zip(now, out)]
    return now


def _text(decode, row: list[int]) -> str:
    text = decode(row)
    if not isinstance(text, str):
        raise TypeError(f"decode must return the text (a str) of the token ids it is given, got {type(text).__name__}")  # fmt: skip
    return text


def _strip(row: list[int], eos_id: int | None) -> list[int]:
    return row[:-1] if eos_id is not None and row and row[-1] == eos_id else row


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """Cut generated text at the first stop string (the stop string itself is removed)."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
