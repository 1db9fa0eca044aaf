"""Training: hidden-state regression first, then KL(target || student) on the top-k + tail distributions with
a sampled softmax, AdamW with warm-up and cosine decay, capped by the time budgets."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from offline.distill.config import DistillConfig
from offline.distill.student import HiddenBasis
from offline.distill.teacher import TeacherData, _tqdm

logger = logging.getLogger("specdec.distill")


def topk_kl(student_logits: torch.Tensor, idx: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row over the k teacher ids plus one "tail" bin for the rest of the vocabulary.

    ``p`` is the teacher's top-k (log-probs ``logp`` at ids ``idx``) with tail
    mass ``1 - sum(p)``; ``q`` the student's softmax.  Exact KL of the
    (k+1)-bin coarsening of both distributions; with k = vocab it is the full KL.
    """
    s = student_logits.float()
    lz = torch.logsumexp(s, dim=-1, keepdim=True)
    lq = s.gather(-1, idx.long()) - lz
    p = logp.exp()
    kl = (p * (logp - lq)).sum(-1)
    tail_p = (1.0 - p.sum(-1)).clamp_min(0.0)
    q_top = lq.exp().sum(-1).clamp(max=1.0 - 1e-6)
    tail_lq = torch.log1p(-q_top)
    kl = kl + tail_p * (torch.log(tail_p.clamp_min(1e-12)) - tail_lq)
    return kl


class LossBatch(NamedTuple):
    """A padded training batch: right-padded ids and mask, the flat (row * L + pos) loss positions, their
    teacher top-k ids and log-probs, and (with hidden targets) the teacher's hidden states there."""

    ids: torch.Tensor
    att: torch.Tensor
    flat_pos: torch.Tensor
    tidx: torch.Tensor
    tlogp: torch.Tensor
    zt: torch.Tensor | None = None


@dataclass(frozen=True)
class HiddenTargets:
    """The teacher's final hidden states in the student's PCA coordinates (one tensor per sequence) and their mean
    second moment, which normalises the MSE."""

    z: list[torch.Tensor]
    scale: float


def _pad_batch(data: TeacherData, items: Sequence[int], pad_id: int,
               z: Sequence[torch.Tensor] | None = None) -> LossBatch:
    """Right-padded ids/mask, flat (row * L + pos) loss positions, their top-k targets and hidden targets."""
    L = max(int(data.seqs[i].shape[0]) for i in items)
    ids = torch.full((len(items), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(items), L), dtype=torch.long)
    rows, poss, tidx, tlogp = [], [], [], []
    for r, i in enumerate(items):
        s = data.seqs[i]
        ids[r, : s.shape[0]] = s
        att[r, : s.shape[0]] = 1
        n = data.topk_idx[i].shape[0]
        rows.append(torch.full((n,), r, dtype=torch.long))
        poss.append(torch.arange(data.starts[i], data.starts[i] + n))
        tidx.append(data.topk_idx[i])
        tlogp.append(data.topk_logp[i])
    zt = torch.cat([z[i] for i in items]) if z is not None else None
    return LossBatch(ids, att, torch.cat(rows) * L + torch.cat(poss), torch.cat(tidx), torch.cat(tlogp), zt)


def length_sorted_batches(data: TeacherData, batch_tokens: int) -> list[list[int]]:
    """Every sequence once, shortest first, in batches of at most ``batch_tokens`` padded tokens (evaluation:
    no shuffling)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted(range(len(data)), key=lambda i: int(data.seqs[i].shape[0])):
        if batch and int(data.seqs[i].shape[0]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def make_batches(data: TeacherData, batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffle sequences, then fill batches up to ``batch_tokens`` padded tokens (in order of length)."""
    order = torch.randperm(len(data), generator=gen).tolist()
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    # sort within chunks of 64 shuffled items by length to limit padding
    chunks = [sorted(order[j:j + 64], key=lambda i: int(data.seqs[i].shape[0])) for j in range(0, len(order), 64)]
    for i in (x for c in chunks for x in c):
        n = int(data.seqs[i].shape[0])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[j] for j in perm]


def _student_loss(model: Any, batch: LossBatch, neg_samples: int = 0, gen: torch.Generator | None = None,
                  autocast: bool = False, return_hidden: bool = False) -> Any:
    """Per-position (top-k + tail) KL of the student at the batch's loss positions.

    With ``neg_samples > 0`` the softmax is *sampled*: logits are computed only
    for the ids in the batch's teacher top-k lists plus ``neg_samples`` ids
    drawn uniformly from the rest of the vocabulary, whose exp-sum is scaled up
    to estimate the full partition function (about 4x cheaper than the full
    49152-way softmax, which dominates the cost of training a small draft).
    """
    tidx, tlogp = batch.tidx, batch.tlogp
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=batch.ids, attention_mask=batch.att).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.flat_pos)
        if neg_samples <= 0:
            logits = model.lm_head(h)  # only at loss positions
            kl = topk_kl(logits, tidx, tlogp)
            return (kl, h.float()) if return_hidden else kl
        weight = model.lm_head.weight
        V = weight.shape[0]
        cand = torch.unique(tidx.long())
        free = torch.ones(V, dtype=torch.bool)
        free[cand] = False
        rest = free.nonzero().squeeze(1)
        n_neg = min(neg_samples, int(rest.numel()))
        neg = rest[torch.randperm(rest.numel(), generator=gen)[:n_neg]] if n_neg else rest[:0]
        sub = torch.cat([cand, neg])
        logits = h @ weight.index_select(0, sub).t()
    logits = logits.float()
    if n_neg:
        corr = torch.zeros(sub.numel())
        corr[cand.numel():] = math.log((V - cand.numel()) / n_neg)
        logits = logits + corr
    local = torch.searchsorted(cand, tidx.long())
    kl = topk_kl(logits, local, tlogp)
    return (kl, h.float()) if return_hidden else kl


@torch.no_grad()
def mean_kl(model: Any, data: TeacherData, pad_id: int, batch_tokens: int = 4096) -> float:
    """Mean (top-k + tail) KL(teacher || model) over all loss positions of ``data``."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for b in length_sorted_batches(data, batch_tokens):
        kl = _student_loss(model, _pad_batch(data, b, pad_id))
        total += float(kl.sum())
        n += int(kl.numel())
    model.train(was_training)
    return total / max(n, 1)


def _pretrain_hidden(student: Any, data: TeacherData, targets: HiddenTargets, cfg: DistillConfig, pad_id: int,
                     gen: torch.Generator, params: list[torch.nn.Parameter], budget: float | None) -> dict[str, Any]:
    """Phase 1: regress the student's final normed hidden state onto the teacher's (PCA coordinates).

    Only the body (and final norm) trains; the tied embedding / head stays at
    its hidden-pca initialisation, which is exactly the head for which these
    targets give the teacher's logits.  No vocabulary-sized matmul, so a step
    costs a fraction of a KL step.
    """
    emb = student.get_input_embeddings().weight
    emb.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=cfg.pre_lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=cfg.weight_decay)
    warm = max(1, int(cfg.warmup_frac * cfg.pre_steps))
    student.train()
    t0 = time.monotonic()
    batches: list[list[int]] = []
    hist: list[float] = []
    stopped = False
    step = 0
    bar = _tqdm(total=cfg.pre_steps, desc="training student (phase 1: hidden MSE)", unit="step",
                disable=not cfg.progress)
    while step < cfg.pre_steps:
        if not batches:
            batches = make_batches(data, cfg.pre_batch_tokens, gen)
        items = batches.pop()
        if step < warm:
            scale = (step + 1) / warm
        else:
            scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.pre_steps - warm)))
        for g in opt.param_groups:
            g["lr"] = cfg.pre_lr * scale
        ids, att, flat_pos, _, _, zt = _pad_batch(data, items, pad_id, targets.z)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            hidden = student.model(input_ids=ids, attention_mask=att).last_hidden_state
        h = hidden.float().reshape(-1, hidden.shape[-1]).index_select(0, flat_pos)
        loss = ((h - zt) ** 2).mean() / targets.scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        hist.append(loss.item())
        bar.update(1)
        bar.set_postfix(mse=f"{sum(hist[-10:]) / len(hist[-10:]):.3f}")
        if budget and time.monotonic() - t0 > budget and step < cfg.pre_steps:
            stopped = True
            logger.warning("phase 1 stopped by the time budget (%.0fs) after %d/%d steps", budget, step, cfg.pre_steps)
            break
    bar.close()
    if cfg.embed_lr_mult > 0:
        emb.requires_grad_(True)
    return {"pre_steps": step, "pre_planned_steps": cfg.pre_steps, "pre_stopped_by_time_budget": stopped,
            "pre_seconds": round(time.monotonic() - t0, 2),
            "pre_first_mse": hist[0] if hist else None,
            "pre_last_mse_mean10": sum(hist[-10:]) / max(1, len(hist[-10:]))}


def train_student(
    student: Any, data: TeacherData, cfg: DistillConfig, pad_id: int, time_budget_s: float | None = None,
    basis: HiddenBasis | None = None,
) -> dict[str, Any]:
    """KL distillation for ``cfg.steps`` steps (or until the time budget is spent).

    Loss per position: (top-k + tail) KL(teacher || student), plus, with a
    ``basis`` and ``cfg.mse_weight > 0``, ``mse_weight`` times the mean squared
    error between the student's final normed hidden state and the teacher's
    projected on the basis (normalised by the mean second moment): a dense,
    vocabulary-free signal that matches what the hidden-pca head needs.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    targets = _hidden_targets(data, cfg, basis)
    emb = student.get_input_embeddings().weight
    other = [p for n, p in student.named_parameters() if p is not emb]
    budget = cfg.time_budget_s if time_budget_s is None else time_budget_s
    t_start = time.monotonic()
    pre: dict[str, Any] = {"pre_steps": 0}
    if targets is not None and cfg.pre_steps > 0:
        pre = _pretrain_hidden(student, data, targets, cfg, pad_id, gen, other,
                               budget=0.55 * budget if budget else None)
        if budget:
            budget = max(1.0, budget - (time.monotonic() - t_start))
    groups = [{"params": other, "lr": cfg.lr, "lr_mult": 1.0}]
    if cfg.embed_lr_mult > 0:
        groups.append({"params": [emb], "lr": cfg.lr * cfg.embed_lr_mult, "lr_mult": cfg.embed_lr_mult})
    else:
        emb.requires_grad_(False)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=cfg.weight_decay)
    out = _kl_phase(student, data, targets, cfg, pad_id, gen, opt, budget)
    return {
        **pre,
        "steps": out["steps"], "planned_steps": cfg.steps,
        "stopped_by_time_budget": out["stopped_by_time_budget"] or bool(pre.get("pre_stopped_by_time_budget")),
        "train_seconds": round(time.monotonic() - t_start, 2),
        "first_loss": out["first_loss"],
        "last_loss_mean10": out["last_loss_mean10"],
        "last_mse_mean10": out["last_mse_mean10"],
    }


def _hidden_targets(data: TeacherData, cfg: DistillConfig, basis: HiddenBasis | None) -> HiddenTargets | None:
    """The hidden-state MSE's targets, where there is a basis wide enough, an MSE weight and teacher hidden states."""
    if basis is None or cfg.mse_weight <= 0 or not data.has_hidden or basis.P.shape[1] < cfg.hidden:
        return None
    P = basis.P[:, : cfg.hidden]
    return HiddenTargets([h.float() @ P for h in data.hidden],  # type: ignore[union-attr]
                         float(basis.ev[: cfg.hidden].mean().clamp_min(1e-12)))


def _kl_phase(student: Any, data: TeacherData, targets: HiddenTargets | None, cfg: DistillConfig, pad_id: int,
              gen: torch.Generator, opt: torch.optim.Optimizer, budget: float | None) -> dict[str, Any]:
    """Phase 2: the KL (plus the weighted hidden MSE) for cfg.steps steps, warm-up then cosine decay, stopped by
    `budget` seconds."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, cfg.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    student.train()
    t0 = time.monotonic()
    batches: list[list[int]] = []
    losses: list[float] = []
    mse_hist: list[float] = []
    stopped_by_budget = False
    step = 0
    bar = _tqdm(total=cfg.steps, desc="training student", unit="step", disable=not cfg.progress)
    ema = None
    while step < cfg.steps:
        if not batches:
            batches = make_batches(data, cfg.batch_tokens, gen)
        items = batches.pop()
        scale = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * g["lr_mult"] * scale
        batch = _pad_batch(data, items, pad_id, targets.z if targets is not None else None)
        if cfg.train_topk:
            batch = batch._replace(tidx=batch.tidx[:, : cfg.train_topk], tlogp=batch.tlogp[:, : cfg.train_topk])
        kl, h = _student_loss(student, batch, cfg.neg_samples, gen, cfg.autocast_bf16, return_hidden=True)
        loss = kl.mean()
        if batch.zt is not None:
            mse = ((h - batch.zt) ** 2).mean() / targets.scale
            loss = loss + cfg.mse_weight * mse
            mse_hist.append(mse.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], cfg.grad_clip)
        opt.step()
        step += 1
        lv = loss.item()
        losses.append(lv)
        ema = lv if ema is None else 0.9 * ema + 0.1 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if budget and time.monotonic() - t0 > budget and step < cfg.steps:
            stopped_by_budget = True
            logger.warning("training stopped by the time budget (%.0fs) after %d/%d steps", budget, step, cfg.steps)
            break
    bar.close()
    student.eval()
    return {"steps": step, "stopped_by_time_budget": stopped_by_budget,
            "first_loss": losses[0] if losses else None,
            "last_loss_mean10": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "last_mse_mean10": (sum(mse_hist[-10:]) / len(mse_hist[-10:])) if mse_hist else None}
