"""The whole distillation (:func:`run_distillation`: teacher data, student, training, evaluation, report)
and the `specdec distill` command line."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import pathlib
import time
from typing import Any, Sequence

import torch

from offline.distill.config import DistillConfig, QUICK_OVERRIDES, REPORT_NAME
from offline.distill.corpus import OfflineCorpus, build_prompts, collect_offline_text
from offline.distill.evaluate import acceptance_metrics, decode_latency_ms, expected_speedup, greedy_matches
from offline.distill.student import _DTYPES, build_student, hidden_pca, save_atomically, truncated_target
from offline.distill.teacher import _eos_ids, build_teacher_data, teacher_cache_path
from offline.distill.train import mean_kl, train_student

logger = logging.getLogger("specdec.distill")


_LATENCY_DTYPES = (("float32", torch.float32), ("bfloat16", torch.bfloat16))


def _train_budget(cfg: DistillConfig, started_at: float, latency: bool, early_exits: int) -> float:
    """Seconds the training may take: cfg.time_budget_s, within what cfg.total_budget_s leaves after the
    post-training work (eval, latency, alternatives, save), which takes roughly `reserve`."""
    reserve = 30.0 + (40.0 if latency else 0.0) + 15.0 * early_exits
    budget = cfg.time_budget_s
    if cfg.total_budget_s:
        left = cfg.total_budget_s - (time.monotonic() - started_at) - reserve
        budget = max(1.0, min(budget, left) if budget else left)
    return budget


def _data_summary(train, held) -> dict[str, int]:
    return {"train_sequences": len(train), "train_positions": train.num_positions(),
            "train_gen_positions": train.num_positions("gen") + train.num_positions("gen-sampled"),
            "train_gen_sampled_positions": train.num_positions("gen-sampled"),
            "train_text_positions": train.num_positions("text"),
            "train_prompt_positions": train.num_positions("prompt"), "heldout_positions": held.num_positions()}


def _student_summary(cfg: DistillConfig, n_params: int) -> dict[str, Any]:
    return {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
            "intermediate": cfg.intermediate, "parameters": n_params, "tied_embeddings": True,
            "saved_dtype": cfg.save_dtype}


def _acceptance_as_saved(student, save_dt, held, pad_id: int, cfg: DistillConfig) -> dict[str, Any]:
    """The held-out acceptance of a copy of the student in the dtype it is saved in."""
    return acceptance_metrics(greedy_matches(copy.deepcopy(student).to(save_dt), held, pad_id), cfg.gamma)


def _head_ceiling(student, held, basis, cfg: DistillConfig) -> dict[str, Any] | None:
    """Acceptance of a perfect student (final hidden == teacher's, projected on the basis) with this head."""
    if basis is None or not held.has_hidden or basis.P.shape[1] < cfg.hidden:
        return None
    with torch.no_grad():
        head = student.get_input_embeddings().weight
        return acceptance_metrics(
            [(((h.float() @ basis.P[:, : cfg.hidden]) * 1.0) @ head.t()).argmax(-1) == ti[:, 0].long()
             for h, ti in zip(held.hidden, held.topk_idx)], cfg.gamma)  # type: ignore[union-attr]


def _latency(student, teacher, accs: tuple[dict, dict], cfg: DistillConfig, by_gamma: dict) -> dict[str, Any]:
    """Draft and target decode latency per dtype, with the speedup they imply (accs: float32's, the saved dtype's)."""
    lat: dict[str, Any] = {}
    for name, dt in _LATENCY_DTYPES:
        lat[name] = {"draft_ms": decode_latency_ms(student, dt), "target_ms": decode_latency_ms(teacher, dt)}
        lat[name]["cost_ratio"] = lat[name]["draft_ms"] / lat[name]["target_ms"]
        a = accs[0 if dt == torch.float32 else 1]["acceptance_rate"]
        lat[name]["expected_speedup_iid"] = expected_speedup(a, cfg.gamma, lat[name]["cost_ratio"])
        # from the simulated accepted lengths: (1 + accepted) tokens per (gamma * c + 1) target-step costs
        lat[name]["speedup_by_gamma"] = {g: (1 + m) / (int(g) * lat[name]["cost_ratio"] + 1)
                                         for g, m in by_gamma.items()}
    return lat


def _early_exit(teacher, layers: int, held, pad_id: int, cfg: DistillConfig, lat: dict) -> dict[str, Any]:
    """The teacher cut after `layers` layers as the draft: its acceptance, KL and (with `lat`) latency."""
    m = truncated_target(teacher, layers)
    r = acceptance_metrics(greedy_matches(m, held, pad_id), cfg.gamma)
    r["kl"] = mean_kl(m, held, pad_id)
    for name, dt in _LATENCY_DTYPES if lat else ():
        d = decode_latency_ms(m, dt)
        r[f"{name}_ms"] = d
        r[f"{name}_cost_ratio"] = d / lat[name]["target_ms"]
        r[f"{name}_expected_speedup_iid"] = expected_speedup(r["acceptance_rate"], cfg.gamma, d / lat[name]["target_ms"])
    return r


@dataclasses.dataclass(frozen=True)
class DistillSources:
    """What the teacher data is made from: offline texts, the training prompts and the held-out prompts."""

    texts: Sequence[str]
    prompts: Sequence[str]
    heldout_prompts: Sequence[str]


@dataclasses.dataclass(frozen=True)
class DistillRun:
    """Where the student goes and what else the run measures: ``out_dir`` (None: not saved), the teacher-data
    cache file, the target's first N layers to evaluate as drafts (``early_exit``), the decode latency, fields
    added to the report, and ``started_at`` (``time.monotonic()``) when the whole run began, for
    ``cfg.total_budget_s`` (None: now)."""

    out_dir: pathlib.Path | str | None = None
    teacher_cache: pathlib.Path | None = None
    early_exit: Sequence[int] = ()
    latency: bool = True
    extra_report: dict[str, Any] | None = None
    started_at: float | None = None


def run_distillation(teacher: Any, tokenizer: Any, sources: DistillSources, cfg: DistillConfig,
                     run: DistillRun = DistillRun()) -> tuple[Any, dict[str, Any]]:
    """Distil a student from ``teacher``; returns (student float32, report).  Saves to ``run.out_dir`` if given."""
    texts, prompts, heldout_prompts = sources.texts, sources.prompts, sources.heldout_prompts
    early_exit, latency = run.early_exit, run.latency
    t_start = time.monotonic()
    started_at = t_start if run.started_at is None else run.started_at
    teacher.eval()
    torch.manual_seed(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (_eos_ids(teacher, tokenizer) or [0])[0]
    train, held, timings = build_teacher_data(teacher, tokenizer, cfg, texts, prompts, heldout_prompts,
                                              run.teacher_cache, started_at=started_at)
    basis = hidden_pca(train, cfg.hidden) if cfg.init == "hidden-pca" or cfg.mse_weight > 0 else None
    student = build_student(teacher, cfg, basis)
    n_params = sum(p.numel() for p in student.parameters())
    logger.info("student: %d layers, hidden %d, %.2fM parameters (tied embeddings)", cfg.layers, cfg.hidden, n_params / 1e6)

    t = time.monotonic()
    kl_init = mean_kl(student, held, pad_id)
    acc_init = acceptance_metrics(greedy_matches(student, held, pad_id), cfg.gamma)
    ceiling = _head_ceiling(student, held, basis, cfg)
    timings["eval_init_s"] = time.monotonic() - t
    budget = _train_budget(cfg, started_at, latency, len(early_exit))
    train_stats = train_student(student, train, cfg, pad_id, time_budget_s=budget, basis=basis)
    train_stats["time_budget_s"] = round(budget, 1) if budget else None
    timings["train_s"] = train_stats["train_seconds"]

    t = time.monotonic()
    kl_final = mean_kl(student, held, pad_id)
    matches = greedy_matches(student, held, pad_id)
    acc = acceptance_metrics(matches, cfg.gamma)
    save_dt = _DTYPES[cfg.save_dtype]
    acc_saved = _acceptance_as_saved(student, save_dt, held, pad_id, cfg) if save_dt != torch.float32 else acc
    timings["eval_s"] = time.monotonic() - t

    report: dict[str, Any] = {
        "config": cfg.to_json(),
        "student": _student_summary(cfg, n_params),
        "data": {**_data_summary(train, held), "train_prompts": len(prompts), "heldout_prompts": len(heldout_prompts),
                 "offline_text_documents": len(texts)},
        "train": train_stats,
        "heldout": {
            "kl_init": kl_init, "kl_final": kl_final,
            "init": acc_init, "float32": acc, "saved_dtype": acc_saved,
            "head_ceiling": ceiling,
            "mean_accepted_len_by_gamma": {str(g): acceptance_metrics(matches, g)["mean_accepted_len"]
                                           for g in range(1, 9)},
        },
        "hidden_basis": None if basis is None else {"dims": int(basis.P.shape[1]), "energy": basis.energy},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    if latency or early_exit:
        t = time.monotonic()
        lat: dict[str, Any] = {}
        if latency:
            lat = _latency(student, teacher, (acc, acc_saved), cfg, report["heldout"]["mean_accepted_len_by_gamma"])
            report["latency"] = lat
        ee = {str(n): _early_exit(teacher, int(n), held, pad_id, cfg, lat) for n in early_exit}
        if ee:
            report["early_exit"] = ee
        timings["latency_and_alternatives_s"] = time.monotonic() - t
    if run.extra_report:
        report.update(run.extra_report)
    timings["total_s"] = time.monotonic() - t_start
    report["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    if run.out_dir is not None:
        report["model_size_bytes"] = save_atomically(student, tokenizer, pathlib.Path(run.out_dir), save_dt, report)
    return student, report


def _parser() -> argparse.ArgumentParser:
    d = DistillConfig()
    p = argparse.ArgumentParser(
        prog="specdec distill",
        description="Distil a small draft model from the target (default SmolLM2-135M-Instruct): "
                    "KL(target || student) on the target's own generations and offline text.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target-model", default="smollm2", help="teacher / target model spec (specdec.models.load_model)")
    p.add_argument("--out", default=None,
                   help="output dir (default cache_dir()/models/smollm2-draft; with --quick, smollm2-draft-quick)")
    p.add_argument("--quick", action="store_true", help="tiny budgets (~1-2 min) for smoke tests")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--init", choices=["hidden-pca", "svd", "random"], default=d.init,
                   help="embedding init: target embedding projected on the top principal directions of its final "
                        "hidden states (hidden-pca), truncated SVD of the embedding (svd), or random")
    p.add_argument("--mse-weight", type=float, default=d.mse_weight,
                   help="weight of the hidden-state MSE term (student final hidden vs teacher's in PCA coordinates)")
    p.add_argument("--neg-samples", type=int, default=d.neg_samples,
                   help="sampled softmax: random non-candidate ids per step (0 = full-vocabulary softmax)")
    p.add_argument("--no-autocast", action="store_true", help="train in float32 instead of bfloat16 autocast")
    p.add_argument("--topk", type=int, default=d.topk, help="teacher distribution: top-k log-probs + tail mass")
    p.add_argument("--train-prompts", type=int, default=None, help="number of training prompts (default 192; quick 16)")
    p.add_argument("--heldout-prompts", type=int, default=None, help="number of held-out prompts (default 24; quick 8)")
    p.add_argument("--text-tokens", type=int, default=None, help=f"offline text tokens (default {d.text_tokens})")
    p.add_argument("--gen-max-new", type=int, default=None, help=f"max new tokens per generation (default {d.gen_max_new})")
    p.add_argument("--gen-batch", type=int, default=None)
    p.add_argument("--sample-fraction", type=float, default=d.sample_fraction,
                   help="fraction of training prompts continued by sampling (the rest greedy)")
    p.add_argument("--pre-steps", type=int, default=None,
                   help=f"phase-1 steps: hidden-state MSE only, cheap (default {d.pre_steps}; quick 40; 0 = none)")
    p.add_argument("--steps", type=int, default=None, help=f"phase-2 (KL + MSE) training steps (default {d.steps})")
    p.add_argument("--batch-tokens", type=int, default=None, help=f"padded tokens per step (default {d.batch_tokens})")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--embed-lr-mult", type=float, default=d.embed_lr_mult, help="0 freezes the tied embedding")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help=f"cap on training time in seconds (default {d.time_budget_s:.0f}; quick 60)")
    p.add_argument("--total-budget-s", type=float, default=None,
                   help=f"training stops early enough for the whole run (load, teacher data, training, eval, save) "
                        f"to end within this many seconds (default {d.total_budget_s:.0f}; quick 150; 0 = no limit)")
    p.add_argument("--gamma", type=int, default=d.gamma, help="draft length for the acceptance report")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default=d.save_dtype)
    p.add_argument("--early-exit", default="",
                   help="comma-separated N: also evaluate the target's first N layers (+ norm, lm_head) as drafts")
    p.add_argument("--no-latency", action="store_true", help="skip the per-token decode latency measurement")
    p.add_argument("--no-teacher-cache", action="store_true", help="do not read/write cached teacher data")
    p.add_argument("--no-progress", action="store_true")
    return p


def prompt_counts(quick: bool, n_train: int | None, n_held: int | None) -> tuple[int, int]:
    """Training and held-out prompt counts: the given ones, else the defaults (quick: 16 and 8, else 192 and 24)."""
    return (n_train if n_train is not None else (16 if quick else 192),
            n_held if n_held is not None else (8 if quick else 24))


def prompt_sets(cfg: DistillConfig, n_train: int, n_held: int) -> tuple[OfflineCorpus, list[str], list[str]]:
    """(offline corpus, training prompts, held-out prompts), deterministic for cfg.seed on a given machine."""
    corpus = collect_offline_text(int(cfg.text_tokens * 4.5), seed=cfg.seed, progress=cfg.progress,
                                  n_passages=max(8, n_train // 3), n_heldout_passages=max(4, n_held // 3))
    prompts = build_prompts(n_train, cfg.seed, corpus)
    heldout = build_prompts(n_held, cfg.seed, corpus, heldout=True)
    logger.info("offline corpus: %d documents (%d chars) from %d files; %d train / %d held-out prompts",
                len(corpus.texts), sum(map(len, corpus.texts)), corpus.n_files, len(prompts), len(heldout))
    return corpus, prompts, heldout


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    t0 = time.monotonic()
    from specdec.models import DRAFT_DIRNAME, cache_dir, load_model

    cfg = DistillConfig()
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK_OVERRIDES)
    overrides = dict(
        seed=args.seed, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, init=args.init, topk=args.topk, sample_fraction=args.sample_fraction,
        lr=args.lr, embed_lr_mult=args.embed_lr_mult, gamma=args.gamma, save_dtype=args.save_dtype,
        progress=not args.no_progress, mse_weight=args.mse_weight, neg_samples=args.neg_samples,
        autocast_bf16=not args.no_autocast,
    )
    for name in ("text_tokens", "gen_max_new", "gen_batch", "steps", "pre_steps", "batch_tokens", "time_budget_s", "total_budget_s"):
        v = getattr(args, name)
        if v is not None:
            overrides[name] = v
    cfg = dataclasses.replace(cfg, **overrides)
    n_train, n_held = prompt_counts(args.quick, args.train_prompts, args.heldout_prompts)
    out = pathlib.Path(args.out).expanduser() if args.out else cache_dir() / "models" / (
        DRAFT_DIRNAME + ("-quick" if args.quick else ""))

    loaded = load_model(args.target_model, device="cpu", dtype="float32")
    t_load = time.monotonic() - t0
    teacher, tok = loaded.model, loaded.tokenizer
    t = time.monotonic()
    corpus, prompts, heldout = prompt_sets(cfg, n_train, n_held)
    t_corpus = time.monotonic() - t
    cache = None if args.no_teacher_cache else teacher_cache_path(teacher, tok, cfg, corpus, prompts, heldout)
    early = [int(x) for x in args.early_exit.split(",") if x.strip()]
    _, report = run_distillation(teacher, tok, DistillSources(corpus.texts, prompts, heldout), cfg, DistillRun(
        out_dir=out, teacher_cache=cache, early_exit=early, latency=not args.no_latency,
        extra_report={"target_model": args.target_model, "threads": args.threads,
                      "load_target_s": round(t_load, 2), "corpus_s": round(t_corpus, 2),
                      "heldout_prompt_examples": heldout[:4], "teacher_cache": str(cache) if cache else None,
                      "wall_s_before_pipeline": round(time.monotonic() - t0, 2)},
        started_at=t0))
    report["wall_s"] = round(time.monotonic() - t0, 2)
    tmp = out / f".{REPORT_NAME}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:  # add the final wall time
        json.dump(report, fh, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / REPORT_NAME)
    _print_summary(report, out)
    return 0


def _print_summary(report: dict[str, Any], out: pathlib.Path) -> None:
    h = report["heldout"]
    f32, sv = h["float32"], h["saved_dtype"]
    lines = [
        f"draft saved to {out} ({report.get('model_size_bytes', 0) / 1e6:.1f} MB, {report['student']['saved_dtype']}, "
        f"{report['student']['parameters'] / 1e6:.2f}M params)",
        f"held-out: {f32['positions']} positions; KL {h['kl_init']:.3f} -> {h['kl_final']:.3f}",
        f"held-out greedy acceptance: {f32['acceptance_rate']:.3f} (float32), {sv['acceptance_rate']:.3f} (saved dtype); "
        f"mean accepted length at draft length {f32['gamma']}: {f32['mean_accepted_len']:.2f} (float32), "
        f"{sv['mean_accepted_len']:.2f} (saved dtype)",
    ]
    for name, v in report.get("latency", {}).items():
        lines.append(f"decode latency {name}: draft {v['draft_ms']:.2f} ms/token, target {v['target_ms']:.2f} ms/token "
                     f"(c = {v['cost_ratio']:.3f}, expected speedup ~{v['expected_speedup_iid']:.2f}x)")
    for n, r in report.get("early_exit", {}).items():
        extra = f", {r['float32_ms']:.2f} ms/token fp32 (c = {r['float32_cost_ratio']:.3f})" if "float32_ms" in r else ""
        lines.append(f"target first {n} layers as draft: acceptance {r['acceptance_rate']:.3f}, "
                     f"mean accepted len {r['mean_accepted_len']:.2f}{extra}")
    lines.append(f"wall time {report['wall_s']:.0f}s (training {report['train']['train_seconds']:.0f}s, "
                 f"{report['train']['steps']} steps); report: {out / REPORT_NAME}")
    print("\n".join(lines), flush=True)
