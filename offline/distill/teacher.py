"""Teacher data: the target's top-k next-token distributions (and final hidden states) over the corpus and
its own continuations of the prompts, cached by a hash of everything that determines them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from offline.distill.config import DistillConfig, TEACHER_CACHE_FORMAT
from offline.distill.corpus import OfflineCorpus

logger = logging.getLogger("specdec.distill")


@dataclass
class TeacherData:
    """Token sequences with top-k teacher distributions at their loss positions.

    For sequence ``i`` (ids ``seqs[i]``, length L) the teacher distribution at
    position ``p`` (predicting token ``p+1``) is stored for
    ``p in range(starts[i], L - 1)`` as ``topk_idx[i][p - starts[i]]`` (int32)
    and ``topk_logp[i][...]`` (float32 log-probabilities of those ids).
    """

    seqs: list[torch.Tensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    topk_idx: list[torch.Tensor] = field(default_factory=list)
    topk_logp: list[torch.Tensor] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    hidden: list[torch.Tensor | None] = field(default_factory=list)  # teacher final normed hidden (float16)

    _FIELDS = ("seqs", "starts", "topk_idx", "topk_logp", "kinds", "hidden")
    truncated: bool = False  # a time budget cut the teacher pass short (never cached)

    def add(self, seq: torch.Tensor, start: int, logits: torch.Tensor, k: int, kind: str,
            hidden: torch.Tensor | None = None) -> None:
        """``logits``: (L-1-start, V) teacher logits for positions start .. L-2; ``hidden`` likewise (n, H)."""
        assert logits.shape[0] == seq.shape[0] - 1 - start, (logits.shape, seq.shape, start)
        assert hidden is None or hidden.shape[0] == logits.shape[0], (hidden.shape, logits.shape)
        self.hidden.append(None if hidden is None else hidden.detach().to(torch.float16).cpu())
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        self.seqs.append(seq.to(torch.int64).cpu())
        self.starts.append(int(start))
        self.topk_idx.append(idx.to(torch.int32).cpu())
        self.topk_logp.append(vals.float().cpu())
        self.kinds.append(kind)

    def extend(self, other: "TeacherData") -> None:
        for name in self._FIELDS:
            getattr(self, name).extend(getattr(other, name))
        self.truncated = self.truncated or other.truncated

    def __len__(self) -> int:
        return len(self.seqs)

    def num_positions(self, kind: str | None = None) -> int:
        return sum(int(t.shape[0]) for t, k in zip(self.topk_idx, self.kinds) if kind is None or k == kind)

    def state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "TeacherData":
        return cls(**{k: list(v) for k, v in state.items() if k in cls._FIELDS})

    @property
    def has_hidden(self) -> bool:
        return bool(self.hidden) and all(h is not None for h in self.hidden)


def _tqdm(it: Iterable[Any] | None = None, **kw: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(it, **kw)


def encode_prompt(tokenizer: Any, user_message: str) -> list[int]:
    """Chat-template the user message (if the tokenizer has a template) and tokenize it."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(user_message, add_special_tokens=False)["input_ids"]]


def _eos_ids(teacher: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for v in (getattr(teacher.generation_config, "eos_token_id", None), teacher.config.eos_token_id, tokenizer.eos_token_id):
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if x is not None and int(x) not in ids:
                ids.append(int(x))
    return ids


class _FinalHidden:
    """Forward hook on the teacher's final norm: collects its output (the lm_head input) per forward call."""

    def __init__(self, teacher: Any, last_only: bool):
        inner = getattr(teacher, "model", None)
        self.module = getattr(inner, "norm", None) if inner is not None else None
        self.last_only = last_only
        self.outputs: list[torch.Tensor] = []
        self._handle = None

    def __enter__(self) -> "_FinalHidden":
        if self.module is not None:
            self._handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, module: Any, inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        self.outputs.append((out[:, -1] if self.last_only else out).detach().float().cpu())

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()


@dataclass(frozen=True)
class TextPass:
    """The teacher over offline text: up to ``max_tokens`` tokens cut into windows of ``seq_len``, ``batch``
    windows a forward, the top ``k`` of each distribution kept. No batch starts after ``deadline``
    (``time.monotonic()``)."""

    max_tokens: int
    seq_len: int
    batch: int
    k: int
    progress: bool = True
    deadline: float | None = None


@torch.no_grad()
def teacher_text_data(teacher: Any, tokenizer: Any, texts: Sequence[str], spec: TextPass) -> TeacherData:
    """Teacher distributions on fixed-length windows cut from the concatenated texts.

    Stops (``data.truncated``) before a batch that would start after ``spec.deadline``.
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        stream.append(eos)
        if len(stream) >= spec.max_tokens:
            break
    seq_len, batch = spec.seq_len, spec.batch
    n_win = min(len(stream), spec.max_tokens) // seq_len
    windows = [torch.tensor(stream[i * seq_len:(i + 1) * seq_len]) for i in range(n_win)]
    data = TeacherData()
    dev = next(teacher.parameters()).device
    for i in _tqdm(range(0, len(windows), batch), desc="teacher: offline text", unit="batch",
                   disable=not spec.progress):
        if spec.deadline is not None and time.monotonic() > spec.deadline:
            logger.warning("time budget: offline text cut short after %d of %d windows", i, len(windows))
            data.truncated = True
            break
        x = torch.stack(windows[i:i + batch]).to(dev)
        with _FinalHidden(teacher, last_only=False) as cap:
            logits = teacher(input_ids=x).logits
        hid = cap.outputs[-1] if cap.outputs else None
        for b in range(x.shape[0]):
            data.add(x[b].cpu(), 0, logits[b, :-1], spec.k, "text", None if hid is None else hid[b, :-1])
    return data


@dataclass(frozen=True)
class GenerationPass:
    """How the teacher continues a prompt set: ``max_new`` tokens, ``batch`` prompts a call, the top ``k`` of each
    distribution kept; greedy, or sampled (``temperature``, ``top_p``, seeded from ``seed``) where
    ``sample_mask`` says so. ``kind`` labels the sequences; no batch starts after ``deadline``
    (``time.monotonic()``); ``prompt_positions`` also keeps the prompt positions' distributions."""

    max_new: int
    batch: int
    k: int
    sample_mask: Sequence[bool] | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    kind: str = "gen"
    progress: bool = True
    desc: str = "teacher: generations"
    deadline: float | None = None
    prompt_positions: bool = False


@torch.no_grad()
def teacher_generations(teacher: Any, tokenizer: Any, prompts: Sequence[str], spec: GenerationPass) -> TeacherData:
    """Continue each chat-templated prompt with the teacher (greedy, or sampled where ``spec.sample_mask``).

    Records the teacher's raw (temperature-1) logits at every generated
    position.  Prompts are batched (left padding) in order of length; sampled
    batches are seeded from ``spec.seed`` and the batch index, so the result is
    reproducible.  Batches run in a seeded shuffled order; none starts after
    ``spec.deadline`` (then ``data.truncated`` is set).

    With ``spec.prompt_positions`` the teacher distributions at the prompt
    positions (computed anyway during prefill; only the part after the prefix
    common to all prompts, i.e. after the shared system prompt) are added as
    extra ``"prompt"`` sequences.
    """
    eos = _eos_ids(teacher, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    enc = [encode_prompt(tokenizer, p) for p in prompts]
    sample_mask = list(spec.sample_mask) if spec.sample_mask is not None else [False] * len(prompts)
    common = _common_prefix(enc) if spec.prompt_positions else 0
    groups = _batch_groups(enc, sample_mask, spec.batch, spec.seed)
    data = TeacherData()
    results: dict[int, TeacherData] = {}
    for done, (gi, do_sample, idxs) in enumerate(_tqdm(groups, desc=spec.desc, unit="batch",
                                                       disable=not spec.progress)):
        if spec.deadline is not None and time.monotonic() > spec.deadline:
            logger.warning("time budget: generations cut short after %d of %d batches", done, len(groups))
            data.truncated = True
            break
        batch = _PromptBatch(teacher, enc, idxs, pad, eos)
        batch.generate(spec, gi, do_sample)
        for r, i in enumerate(idxs):
            results[i] = batch.record(r, common, spec.k, spec.kind + ("-sampled" if do_sample else ""))
        del batch  # its logits (batch x steps x vocabulary) before the next batch's
    for i in sorted(results):  # original prompt order
        data.extend(results[i])
    return data


def _common_prefix(enc: list[list[int]]) -> int:
    """The length of the prefix every prompt shares (the system prompt); 0 for a single prompt."""
    common = 0
    if enc:
        shortest = min(len(e) for e in enc)
        while common < shortest and all(e[common] == enc[0][common] for e in enc):
            common += 1
        if len(enc) == 1:
            common = 0
    return common


def _batch_groups(enc: list[list[int]], sample_mask: list[bool], batch: int,
                  seed: int) -> list[tuple[int, bool, list[int]]]:
    """(group index, sampled, prompt indices): greedy and sampled prompts apart, in order of length, in
    equal-sized batches (no small leftover batch), the batches in a seeded shuffled order."""
    groups = []
    for mode in (False, True):
        order = sorted((i for i in range(len(enc)) if sample_mask[i] == mode), key=lambda i: (len(enc[i]), i))
        if order:
            n_b = -(-len(order) // batch)
            size = -(-len(order) // n_b)
            groups += [(mode, order[j:j + size]) for j in range(0, len(order), size)]
    indexed = [(gi, mode, idxs) for gi, (mode, idxs) in enumerate(groups)]
    random.Random(f"batches-{seed}").shuffle(indexed)
    return indexed


class _PromptBatch:
    """One left-padded batch of prompts, continued by the teacher; then each row's teacher data."""

    def __init__(self, teacher: Any, enc: list[list[int]], idxs: list[int], pad: int, eos: list[int]):
        self.teacher, self.eos, self.pad = teacher, eos, pad
        self.prompts = [enc[i] for i in idxs]
        self.width = L = max(len(e) for e in self.prompts)
        self.ids = torch.full((len(idxs), L), pad, dtype=torch.long)
        self.att = torch.zeros((len(idxs), L), dtype=torch.long)
        for r, e in enumerate(self.prompts):
            self.ids[r, L - len(e):] = torch.tensor(e)
            self.att[r, L - len(e):] = 1

    def generate(self, spec: GenerationPass, gi: int, do_sample: bool) -> None:
        """Continue the batch; keep the generated ids, each step's logits and the final hidden states."""
        teacher = self.teacher
        dev = next(teacher.parameters()).device
        kwargs: dict[str, Any] = dict(do_sample=False)
        if do_sample:
            torch.manual_seed(spec.seed * 100003 + gi)
            kwargs = dict(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=0)
        with _FinalHidden(teacher, last_only=False) as cap:
            out = teacher.generate(
                input_ids=self.ids.to(dev), attention_mask=self.att.to(dev), max_new_tokens=spec.max_new,
                eos_token_id=self.eos, pad_token_id=self.pad, output_logits=True, return_dict_in_generate=True,
                **kwargs,
            )
        self.gen = out.sequences[:, self.width:].cpu()
        self.steps = out.logits  # tuple of (B, V) raw logits, one per generated token
        del out
        n_steps = len(self.steps)
        self.hid = (torch.stack([o[:, -1] for o in cap.outputs[:n_steps]], dim=1)
                    if len(cap.outputs) >= n_steps and n_steps else None)
        self.prefill = cap.outputs[0] if cap.outputs and spec.prompt_positions else None  # (B, L, H)

    def record(self, r: int, common: int, k: int, kind: str) -> TeacherData:
        """Row r's teacher data: its prompt positions after `common` (where kept), then its reply up to EOS."""
        item = TeacherData()
        prompt, L = self.prompts[r], self.width
        head = self.teacher.get_output_embeddings()
        if self.prefill is not None and head is not None and len(prompt) - 1 > common:
            dev = next(self.teacher.parameters()).device
            lo = L - len(prompt) + common
            ph = self.prefill[r, lo:L - 1]  # positions common .. len-2 predict prompt tokens common+1 ..
            item.add(torch.tensor(prompt), common, head(ph.to(dev, head.weight.dtype)).float().cpu(), k,
                     "prompt", ph)
        row = self.gen[r]
        n = row.shape[0]
        for j in range(n):
            if int(row[j]) in self.eos:
                n = j + 1
                break
        if n == 0:
            return item
        seq = torch.cat([torch.tensor(prompt), row[:n]])
        lg = torch.stack([self.steps[j][r] for j in range(n)]).cpu()
        item.add(seq, len(prompt) - 1, lg, k, kind, None if self.hid is None else self.hid[r, :n])
        return item


def _output_embedding(model: Any) -> torch.Tensor:
    emb = model.get_output_embeddings()
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.detach()
    return model.get_input_embeddings().weight.detach()


def _teacher_key(teacher: Any, tokenizer: Any, cfg: DistillConfig, texts: Sequence[str], prompts: Sequence[str],
                 heldout: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(teacher.config.to_dict(), sort_keys=True, default=str).encode())
    w = _output_embedding(teacher)
    h.update(w[:: max(1, w.shape[0] // 64)].float().numpy().tobytes())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    params = {k: getattr(cfg, k) for k in ("topk", "text_tokens", "text_seq_len", "gen_max_new", "sample_fraction",
                                           "sample_temperature", "sample_top_p", "seed", "prompt_positions")}
    h.update(json.dumps([TEACHER_CACHE_FORMAT, params, list(texts), list(prompts), list(heldout)]).encode())
    return h.hexdigest()[:24]


def build_teacher_data(
    teacher: Any, tokenizer: Any, cfg: DistillConfig, texts: Sequence[str], prompts: Sequence[str],
    heldout_prompts: Sequence[str], cache_path: pathlib.Path | None = None, started_at: float | None = None,
) -> tuple[TeacherData, TeacherData, dict[str, float]]:
    """(train data, held-out data, stage timings); loads / stores ``cache_path`` if given.

    With ``cfg.total_budget_s``, training-prompt generations stop starting new
    batches after 50% of the total budget and offline text after 58% (counted
    from ``started_at``), so a slow / busy machine still leaves time to train;
    held-out generations always run.  Truncated data is not cached.
    """
    started_at = time.monotonic() if started_at is None else started_at
    gen_deadline = text_deadline = None
    if cfg.total_budget_s:
        gen_deadline = started_at + 0.50 * cfg.total_budget_s
        text_deadline = started_at + 0.58 * cfg.total_budget_s
    if cache_path is not None and cache_path.is_file():
        try:
            blob = torch.load(cache_path, weights_only=True)
            logger.info("loaded cached teacher data %s", cache_path)
            return TeacherData.from_state(blob["train"]), TeacherData.from_state(blob["heldout"]), {"cached": 1.0}
        except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt
            logger.warning("ignoring unreadable teacher cache %s: %s", cache_path, e)
    timings: dict[str, float] = {}
    rng = random.Random(f"sample-{cfg.seed}")
    n_sample = int(round(cfg.sample_fraction * len(prompts)))
    sampled = set(rng.sample(range(len(prompts)), n_sample)) if n_sample else set()
    t = time.monotonic()
    train = teacher_generations(teacher, tokenizer, prompts, GenerationPass(
        cfg.gen_max_new, cfg.gen_batch, cfg.topk, sample_mask=[i in sampled for i in range(len(prompts))],
        temperature=cfg.sample_temperature, top_p=cfg.sample_top_p, seed=cfg.seed, kind="gen",
        progress=cfg.progress, desc="teacher: generations (train prompts)", deadline=gen_deadline,
        prompt_positions=cfg.prompt_positions))
    timings["teacher_generations_s"] = time.monotonic() - t
    t = time.monotonic()
    if texts and cfg.text_tokens > 0:
        train.extend(teacher_text_data(teacher, tokenizer, texts, TextPass(
            cfg.text_tokens, cfg.text_seq_len, cfg.text_batch, cfg.topk, progress=cfg.progress,
            deadline=text_deadline)))
    timings["teacher_text_s"] = time.monotonic() - t
    t = time.monotonic()
    held = teacher_generations(teacher, tokenizer, heldout_prompts, GenerationPass(
        cfg.gen_max_new, cfg.gen_batch, cfg.topk, kind="heldout", progress=cfg.progress,
        desc="teacher: generations (held-out prompts)"))
    timings["teacher_heldout_s"] = time.monotonic() - t
    if train.truncated:
        timings["teacher_data_truncated_by_budget"] = 1.0
    if cache_path is not None and not train.truncated:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(f".tmp-{os.getpid()}")
        torch.save({"train": train.state(), "heldout": held.state()}, tmp)
        os.replace(tmp, cache_path)
    return train, held, timings


def teacher_cache_path(teacher: Any, tokenizer: Any, cfg: DistillConfig, corpus: OfflineCorpus,
                       prompts: Sequence[str], heldout: Sequence[str]) -> pathlib.Path:
    """The teacher-data cache file for these settings (shared by `specdec distill` and `specdec datastore`)."""
    from specdec.models import cache_dir

    key = _teacher_key(teacher, tokenizer, cfg, corpus.texts, prompts, heldout)
    return cache_dir() / "distill" / f"teacher-{key}.pt"
