"""Tasks: what data a run reads, what loss it minimises and how it is evaluated.

A task object has `setup(cfg, run_dir, device, resume=False)` (a resumed run checks its data against the
run's data.json instead of recording it), `model_config(cfg)`, `train_loader(cfg)`,
`loss(model, batch) -> (loss sum, targets)`, `count_targets(batch)`, `count_inputs(batch)`,
`evaluate(model, max_batches) -> dict`, `tokenizer_json()`, `describe_result(report)` and
`show_sample(model)`. The trainer knows nothing else about the task. The translation task calls its model
as `model(src, tgt_in, src_mask, tgt_mask, tgt_right_padded=True)` (tformer's `EncoderDecoder`).
"""

from __future__ import annotations

from tformer.schema import ConfigError


def make_task(name: str):
    if name == "lm":
        from tformer.tasks.lm import LMTask

        return LMTask()
    if name == "translation":
        from tformer.tasks.translation import TranslationTask

        return TranslationTask()
    if name == "classification":
        from tformer.tasks.classification import ClassificationTask

        return ClassificationTask()
    raise ConfigError(f"unknown task {name!r}; available: lm, translation, classification")
