"""Distil a small draft model from the target (``specdec distill``).

Pipeline (see docs/distill.md for the design and measured numbers):

1. **Teacher data.**  The target ("teacher") produces its full next-token
   distributions (temperature 1), stored top-k truncated (``--topk`` log-probs
   plus the remaining tail mass), over

   * its own continuations of a fixed, varied set of chat-template prompts
     (chat, code, summarising / rewriting a passage), greedy and sampled --
     what the draft has to predict at serving time; and
   * English text found offline on this machine at run time: docstrings of
     the stdlib and installed Python packages, READMEs / docs / package
     descriptions (nothing is downloaded).

   A separate set of HELD-OUT prompts (built from disjoint topic lists and
   disjoint source files) gets greedy target continuations for evaluation
   only.  Teacher data is cached under ``cache_dir()/distill`` keyed by a hash
   of everything that determines it (``--no-teacher-cache`` to disable).
2. **Student.**  A small Llama (default 2 layers, hidden 256) with the target's
   vocabulary and tokenizer and tied embeddings.  Its embedding / head is the
   target's embedding projected on the top principal directions of the
   target's final (normed) hidden states ("hidden-pca"; ``--init svd`` uses a
   truncated SVD of the embedding matrix instead, which keeps far less of the
   target's argmax: see docs/distill.md).
3. **Training.**  Phase 1 (``--pre-steps``): regress the student's final
   hidden state onto the target's (in the PCA coordinates) -- no
   vocabulary-sized matmul, so cheap.  Phase 2 (``--steps``):
   KL(target || student) on the (top-k + tail) target distributions with a
   sampled softmax (batch candidates + ``--neg-samples`` random ids), plus the
   hidden-state MSE.  AdamW, warm-up + cosine decay, bfloat16 autocast; fixed
   step counts (reproducible from ``--seed``), capped by ``--time-budget-s``
   and ``--total-budget-s`` (whole run).
4. **Evaluation** on the held-out continuations: greedy acceptance rate per
   position (student argmax == target argmax along the target's own greedy
   continuation) and the mean accepted length for draft length ``--gamma``
   (a chain accepts until its first mismatch), plus per-token decode latency
   of draft and target, and optionally the target's own first N layers as a
   draft (``--early-exit 4,8``).
5. **Save** with ``save_pretrained`` plus the target's tokenizer and
   ``distill_report.json`` into ``cache_dir()/models/smollm2-draft`` (or
   ``--out``), atomically (temp dir, then rename).

The pipeline itself (:func:`run_distillation`) takes the teacher model,
tokenizer, texts and prompts (``DistillSources``) as parameters, so tests can
run it on a tiny random teacher.

Modules: ``config``, ``corpus`` (step 1's text and prompts), ``teacher`` (step 1's teacher data),
``student`` (step 2, and step 5's atomic save), ``train`` (step 3), ``evaluate`` (step 4) and ``pipeline``
(all five steps and the command line); their public names are re-exported here.
"""

from __future__ import annotations

from offline.distill.config import QUICK_OVERRIDES, REPORT_NAME, TEACHER_CACHE_FORMAT, DistillConfig
from offline.distill.corpus import OfflineCorpus, build_prompts, collect_offline_text, default_text_roots
from offline.distill.evaluate import acceptance_metrics, decode_latency_ms, expected_speedup, greedy_matches
from offline.distill.pipeline import (DistillRun, DistillSources, _parser, main, prompt_counts, prompt_sets,
                                      run_distillation)
from offline.distill.student import (HiddenBasis, build_student, hidden_pca, save_atomically, svd_embedding,
                                     truncated_target)
from offline.distill.teacher import (GenerationPass, TeacherData, TextPass, build_teacher_data, encode_prompt,
                                     teacher_cache_path, teacher_generations, teacher_text_data)
from offline.distill.train import make_batches, mean_kl, topk_kl, train_student

__all__ = [
    "DistillConfig", "DistillRun", "DistillSources", "GenerationPass", "HiddenBasis", "OfflineCorpus", "QUICK_OVERRIDES", "REPORT_NAME", "TEACHER_CACHE_FORMAT",
    "TeacherData", "TextPass", "acceptance_metrics", "build_prompts", "build_student", "build_teacher_data",
    "collect_offline_text", "decode_latency_ms", "default_text_roots", "encode_prompt", "expected_speedup",
    "greedy_matches", "hidden_pca", "main", "make_batches", "mean_kl", "prompt_counts", "prompt_sets",
    "run_distillation", "save_atomically", "svd_embedding", "teacher_cache_path", "teacher_generations",
    "teacher_text_data", "topk_kl", "train_student", "truncated_target",
]
