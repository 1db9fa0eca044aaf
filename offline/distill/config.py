"""The distillation's settings (:class:`DistillConfig`) and the report's file name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


REPORT_NAME = "distill_report.json"
TEACHER_CACHE_FORMAT = 2


@dataclass
class DistillConfig:
    # student architecture
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 1024
    # "hidden-pca": tied embedding = target embedding projected on the top principal
    # directions of the target's final (normed) hidden states; "svd": truncated SVD of
    # the target's embedding matrix; "random"
    init: str = "hidden-pca"
    norm_init: float = 0.1  # initial final-norm weight for "svd" / "random" (small initial logits)
    # teacher data
    topk: int = 64
    text_tokens: int = 8192  # offline text tokens run through the teacher
    text_seq_len: int = 128
    text_batch: int = 16
    gen_max_new: int = 128
    gen_batch: int = 32
    sample_fraction: float = 1 / 3  # fraction of training prompts continued by sampling
    sample_temperature: float = 0.8
    sample_top_p: float = 0.95
    prompt_positions: bool = True  # also train on the teacher's distributions at (training) prompt positions
    # training
    steps: int = 200
    batch_tokens: int = 2048
    lr: float = 3e-3
    embed_lr_mult: float = 0.3  # lr multiplier for the (tied) embedding; 0 freezes it
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    mse_weight: float = 1.0  # + weight * MSE(student final hidden, teacher final hidden in PCA coordinates)
    pre_steps: int = 400  # phase 1: hidden-state MSE only (no vocabulary projection: cheap), frozen embedding
    pre_batch_tokens: int = 4096
    pre_lr: float = 3e-3
    neg_samples: int = 4096  # sampled softmax: batch top-k ids + this many random others (0 = full vocab)
    train_topk: int = 0  # use only the first train_topk teacher ids in the loss (0 = all stored)
    autocast_bf16: bool = True  # bfloat16 autocast for the student forward during training (CPU)
    time_budget_s: float = 420.0  # cap on training time
    total_budget_s: float = 870.0  # training also stops early enough for the whole run to end within this
    # evaluation / output
    gamma: int = 4
    save_dtype: str = "bfloat16"
    seed: int = 0
    progress: bool = True

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


QUICK_OVERRIDES: dict[str, Any] = dict(
    text_tokens=2048,
    gen_max_new=48,
    gen_batch=16,
    steps=25,
    pre_steps=40,
    batch_tokens=1024,
    time_budget_s=60.0,
    total_budget_s=150.0,
)
