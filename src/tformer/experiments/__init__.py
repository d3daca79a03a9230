"""The seed's claims as runnable studies that train competing variants and write reports.

    norm  Post-Norm vs Pre-Norm at several depths, with and without warm-up (experiments/norm.py)
    rope  sinusoidal vs learned vs RoPE (+ PI / NTK / YaRN at evaluation), trained at L, read at 8L
    moe   dense vs Switch vs GShard vs DeepSeekMoE at equal active parameters, with ablations

Each study module has FULL and QUICK settings, `run(setting, run_dir)` (trains every arm through
experiments/runner.py, logging arms/<name>/metrics.jsonl) and `report(run_dir)` (builds the report
from those logs only). `tformer experiment <study>` drives them; docs/experiments.md explains them.
"""

STUDIES = {
    "norm": "tformer.experiments.norm",
    "rope": "tformer.experiments.rope",
    "moe": "tformer.experiments.moe",
}
