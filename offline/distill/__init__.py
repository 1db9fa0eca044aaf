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
tokenizer, texts and prompts as parameters, so tests can run it on a tiny
random teacher.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

logger = logging.getLogger("specdec.distill")

REPORT_NAME = "distill_report.json"
TEACHER_CACHE_FORMAT = 2


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# offline text and prompts
# --------------------------------------------------------------------------

_CODE_CHARS = re.compile(r"[{}\[\]=<>|\\@#$%^*~`]")


def _is_prose(text: str, min_chars: int = 120) -> bool:
    if len(text) < min_chars:
        return False
    n = len(text)
    ascii_frac = sum(1 for c in text if ord(c) < 128) / n
    if ascii_frac < 0.98:
        return False
    alpha = sum(1 for c in text if c.isalpha() or c == " ") / n
    if alpha < 0.75:
        return False
    if len(_CODE_CHARS.findall(text)) / n > 0.02:
        return False
    words = text.split()
    return len(words) >= 20 and sum(len(w) for w in words) / len(words) < 9


def _paragraphs(text: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(line.strip() for line in para.strip().splitlines())
        if para:
            out.append(para)
    return out


def _docstrings(path: pathlib.Path) -> list[str]:
    try:
        src = path.read_text(encoding="utf-8", errors="strict")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 120:
                docs.append(doc)
    return docs


def _doc_file_text(path: pathlib.Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="strict")[:20000]
    except (OSError, UnicodeDecodeError):
        return []
    if path.name == "METADATA":  # long description follows the header block
        _, _, text = text.partition("\n\n")
    return [text] if text.strip() else []


def _candidate_files(roots: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    files: set[pathlib.Path] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                low = name.lower()
                if low.endswith(".py") or name == "METADATA" or (
                    low.endswith((".md", ".rst", ".txt")) and not low.startswith(("license", "copying", "record", "top_level", "entry_points", "requires", "sources", "dependency"))
                ):
                    files.add(pathlib.Path(dirpath) / name)
    return sorted(files)


def default_text_roots() -> list[pathlib.Path]:
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        p = paths.get(key)
        if p and pathlib.Path(p) not in roots:
            roots.append(pathlib.Path(p))
    return roots


@dataclass
class OfflineCorpus:
    texts: list[str]  # training text documents (paragraph blocks)
    train_passages: list[str]  # prose paragraphs for summarising prompts (training)
    heldout_passages: list[str]  # prose paragraphs from files never used in training
    code_snippets: list[str]
    heldout_code_snippets: list[str]
    n_files: int


def _function_snippets(path: pathlib.Path, max_chars: int = 600) -> list[str]:
    try:
        src = path.read_text(encoding="utf-8", errors="strict")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            if 4 <= n <= 16:
                seg = ast.get_source_segment(src, node, padded=True)
                seg = textwrap.dedent(seg) if seg else seg
                if seg and len(seg) <= max_chars and seg.isascii():
                    out.append(seg)
    return out


def collect_offline_text(
    target_chars: int,
    seed: int = 0,
    roots: Sequence[pathlib.Path] | None = None,
    n_passages: int = 64,
    n_heldout_passages: int = 16,
    progress: bool = True,
) -> OfflineCorpus:
    """English prose found on this machine: docstrings, READMEs, package descriptions.

    Deterministic for a given machine and ``seed``.  One in eight source files
    (by a hash of its path) is reserved for held-out passages / code and never
    contributes training text.
    """
    from tqdm.auto import tqdm

    files = _candidate_files(list(roots) if roots is not None else default_text_roots())
    rng = random.Random(seed)
    rng.shuffle(files)
    texts: list[str] = []
    passages: list[str] = []
    held_passages: list[str] = []
    snippets: list[str] = []
    held_snippets: list[str] = []
    n_chars = 0
    seen: set[str] = set()
    used = 0
    want_snippets = 48
    bar = tqdm(total=target_chars, desc="offline text (chars)", unit="ch", unit_scale=True, disable=not progress)
    for path in files:
        if (
            n_chars >= target_chars
            and len(passages) >= n_passages
            and len(held_passages) >= n_heldout_passages
            and len(snippets) >= want_snippets
            and len(held_snippets) >= want_snippets // 4
        ):
            break
        heldout = int(hashlib.sha1(str(path).encode()).hexdigest(), 16) % 8 == 0
        raw = _docstrings(path) if path.suffix == ".py" else _doc_file_text(path)
        used += 1
        if path.suffix == ".py":
            sn = _function_snippets(path)
            if sn:
                (held_snippets if heldout else snippets).append(sn[rng.randrange(len(sn))])
        for doc in raw:
            paras = [p for p in _paragraphs(doc) if p not in seen]
            prose = [p for p in paras if _is_prose(p)]
            for p in prose:
                seen.add(p)
            if heldout:
                held_passages.extend(p for p in prose if 250 <= len(p) <= 700)
                continue
            passages.extend(p for p in prose if 250 <= len(p) <= 700)
            if n_chars < target_chars and prose:
                block = "\n\n".join(prose)
                texts.append(block)
                n_chars += len(block)
                bar.update(len(block))
    bar.close()
    rng.shuffle(passages)
    rng.shuffle(held_passages)
    return OfflineCorpus(
        texts=texts,
        train_passages=passages[:n_passages],
        heldout_passages=held_passages[:n_heldout_passages],
        code_snippets=snippets[:want_snippets],
        heldout_code_snippets=held_snippets[: want_snippets // 4],
        n_files=used,
    )


_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "inflation", "machine learning",
    "the French Revolution", "vaccines", "climate change", "the stock market", "blockchain",
    "plate tectonics", "the immune system", "quantum computing", "democracy", "the Roman Empire",
    "gravity", "evolution", "electricity", "DNA", "the internet", "renewable energy",
    "the moon landing", "volcanoes", "the human heart", "compound interest", "supply and demand",
    "neural networks", "the printing press", "antibiotics", "rainbows", "tides", "earthquakes",
    "the greenhouse effect", "recycling", "meditation", "sleep", "jazz music", "the Olympic Games",
    "coffee", "chess", "honey bees", "the Great Wall of China", "the Renaissance", "encryption",
    "the solar system", "GPS", "the theory of relativity", "nuclear energy", "the Industrial Revolution",
    "public key cryptography", "operating systems", "cloud computing", "the periodic table",
    "ocean currents", "the nervous system", "probability", "the Pythagorean theorem", "taxes",
    "the Cold War", "artificial intelligence",
]
_ACTIVITIES = [
    "studying for exams", "staying productive at home", "learning a new language", "running a marathon",
    "saving money", "public speaking", "cooking healthy meals", "traveling on a budget", "starting a garden",
    "job interviews", "writing a novel", "taking better photos", "reducing stress", "making friends in a new city",
    "learning to code", "keeping a houseplant alive", "getting better sleep", "staying motivated at the gym",
    "managing a small team", "moving to a new apartment", "preparing for a hiking trip", "writing a resume",
    "negotiating a salary", "learning to play guitar", "organizing a kitchen",
]
_SUBJECTS = [
    "a robot who learns to paint", "a lost cat finding its way home", "a dragon who is afraid of fire",
    "a time traveler stuck in 1920", "a lighthouse keeper", "a talking tree", "a child who finds a treasure map",
    "an astronaut alone on Mars", "a detective in Paris", "a baker whose bread is magical", "the ocean at night",
    "a city after the rain", "a friendship between a fox and a crow", "an old library", "the first day of school",
    "a village in the mountains", "a musician who lost her voice", "autumn leaves", "a spaceship crew",
    "a penguin who wants to fly", "a haunted house", "winter mornings", "a small boat in a storm",
    "a programmer who talks to her computer", "the last tree on earth",
]
_CODE_TASKS = [
    "checks whether a string is a palindrome", "computes the factorial of a number",
    "returns the n-th Fibonacci number", "merges two sorted lists", "counts word frequencies in a text",
    "removes duplicates from a list while preserving order", "finds the largest element in a list",
    "checks if a number is prime", "converts Celsius to Fahrenheit", "flattens a nested list",
    "reverses the words in a sentence", "computes the greatest common divisor of two numbers",
    "reads a JSON file and returns a dictionary", "validates an email address with a regular expression",
    "implements binary search", "sorts a list of dictionaries by a key", "computes the mean and median of a list",
    "generates all permutations of a string", "checks whether two strings are anagrams",
    "counts the vowels in a string", "transposes a matrix", "returns the second largest number in a list",
    "converts a Roman numeral to an integer", "checks whether parentheses are balanced",
    "computes the sum of the digits of a number", "splits a list into chunks of size n",
    "finds the most common element in a list", "capitalizes the first letter of every word",
    "computes the dot product of two vectors", "removes all whitespace from a string",
]
_HOWTOS = [
    "read a file line by line", "make an HTTP request", "sort an array", "handle exceptions", "define a class",
    "reverse a string", "iterate over a dictionary", "format a date", "split a string", "use a hash map",
    "write a unit test", "create a thread", "parse JSON", "concatenate strings", "get the current time",
    "remove an element from a list", "check if a file exists", "convert a string to an integer",
    "find the length of an array", "generate a random number",
]
_LANGS = ["Python", "JavaScript", "Java", "C++", "Rust", "Go", "Bash", "C#", "TypeScript", "Ruby"]
_PAIRS = [
    ("Python", "JavaScript"), ("TCP", "UDP"), ("a list", "a tuple in Python"), ("RAM", "ROM"),
    ("weather", "climate"), ("viruses", "bacteria"), ("stocks", "bonds"), ("SQL", "NoSQL databases"),
    ("cats", "dogs as pets"), ("a compiler", "an interpreter"), ("renting", "buying a home"),
    ("HTTP", "HTTPS"), ("mitosis", "meiosis"), ("speed", "velocity"), ("a process", "a thread"),
    ("tea", "coffee"), ("git merge", "git rebase"), ("classical", "operant conditioning"),
    ("an LLC", "a corporation"), ("latitude", "longitude"),
]
_PEOPLE = ["my manager", "a colleague", "my landlord", "a customer", "my professor", "a friend", "the team"]
_MATTERS = [
    "a project delay", "a meeting next week", "a broken heater", "a refund request", "an extension on a deadline",
    "a thank-you for their help", "a new product launch", "a schedule change",
]

_CHAT_TEMPLATES = [
    "Explain {topic} in simple terms.", "What is {topic}?", "Give me {n} tips for {activity}.",
    "Write a short story about {subject}.", "Write a short poem about {subject}.",
    "What are the pros and cons of {topic}?", "How does {topic} work?", "Write an email to {person} about {matter}.",
    "What is the difference between {a} and {b}?", "Tell me three interesting facts about {topic}.",
    "Explain {topic} to a ten-year-old.", "What should I know before {activity}?",
    "Write a short dialogue between two friends about {topic}.", "Summarize the history of {topic} in a paragraph.",
]
_CODE_PROMPTS = [
    "Write a Python function that {task}.", "How do I {howto} in {lang}?",
    "Write a {lang} function that {task}.", "Explain what this Python code does:\n\n```python\n{snippet}\n```",
    "Write a docstring for this function:\n\n```python\n{snippet}\n```",
    "Write a Python function that {task}, with a short explanation.",
]
_PASSAGE_PROMPTS = [
    "Summarize the following passage in two sentences:\n\n{passage}",
    "What is the main point of this text?\n\n{passage}",
    "Rewrite this in plain English:\n\n{passage}",
    "Write three bullet points summarizing this:\n\n{passage}",
    "Summarize this:\n\n{passage}",
]


def _split(items: Sequence[Any], heldout: bool) -> list[Any]:
    """Every fifth item is held out (disjoint topic lists for train / held-out prompts)."""
    return [x for i, x in enumerate(items) if (i % 5 == 4) == heldout]


def build_prompts(
    n: int, seed: int, corpus: OfflineCorpus | None, heldout: bool = False,
    weights: tuple[float, float, float] = (0.45, 0.3, 0.25),
) -> list[str]:
    """``n`` distinct user messages (chat / code / passage), deterministic for ``seed``.

    Held-out prompts draw only from the held-out fifth of every topic list and
    from passages / code of held-out source files, so they never overlap
    training prompts.
    """
    rng = random.Random(f"prompts-{seed}-{int(heldout)}")
    pool = {
        "topic": _split(_TOPICS, heldout), "activity": _split(_ACTIVITIES, heldout),
        "subject": _split(_SUBJECTS, heldout), "task": _split(_CODE_TASKS, heldout),
        "howto": _split(_HOWTOS, heldout), "lang": _LANGS, "pair": _split(_PAIRS, heldout),
        "person": _PEOPLE, "matter": _MATTERS,
    }
    passages = (corpus.heldout_passages if heldout else corpus.train_passages) if corpus else []
    snippets = (corpus.heldout_code_snippets if heldout else corpus.code_snippets) if corpus else []
    code_templates = [t for t in _CODE_PROMPTS if "{snippet}" not in t or snippets]
    cats = ["chat", "code", "passage"] if passages else ["chat", "code"]
    w = list(weights[: len(cats)])
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 100 * n + 1000:
        tries += 1
        cat = rng.choices(cats, weights=w)[0]
        a, b = rng.choice(pool["pair"])
        fill = dict(
            topic=rng.choice(pool["topic"]), activity=rng.choice(pool["activity"]),
            subject=rng.choice(pool["subject"]), task=rng.choice(pool["task"]), howto=rng.choice(pool["howto"]),
            lang=rng.choice(pool["lang"]), a=a, b=b, person=rng.choice(pool["person"]),
            matter=rng.choice(pool["matter"]), n=rng.choice([3, 4, 5]),
            snippet=rng.choice(snippets) if snippets else "", passage=rng.choice(passages) if passages else "",
        )
        tpl = rng.choice({"chat": _CHAT_TEMPLATES, "code": code_templates, "passage": _PASSAGE_PROMPTS}[cat])
        p = tpl.format(**fill)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


# --------------------------------------------------------------------------
# teacher data
# --------------------------------------------------------------------------


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


@torch.no_grad()
def teacher_text_data(
    teacher: Any, tokenizer: Any, texts: Sequence[str], max_tokens: int, seq_len: int, batch: int, k: int,
    progress: bool = True, deadline: float | None = None,
) -> TeacherData:
    """Teacher distributions on fixed-length windows cut from the concatenated texts.

    Stops (``data.truncated``) before a batch that would start after ``deadline`` (``time.monotonic()``).
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        stream.append(eos)
        if len(stream) >= max_tokens:
            break
    n_win = min(len(stream), max_tokens) // seq_len
    windows = [torch.tensor(stream[i * seq_len:(i + 1) * seq_len]) for i in range(n_win)]
    data = TeacherData()
    dev = next(teacher.parameters()).device
    for i in _tqdm(range(0, len(windows), batch), desc="teacher: offline text", unit="batch", disable=not progress):
        if deadline is not None and time.monotonic() > deadline:
            logger.warning("time budget: offline text cut short after %d of %d windows", i, len(windows))
            data.truncated = True
            break
        x = torch.stack(windows[i:i + batch]).to(dev)
        with _FinalHidden(teacher, last_only=False) as cap:
            logits = teacher(input_ids=x).logits
        hid = cap.outputs[-1] if cap.outputs else None
        for b in range(x.shape[0]):
            data.add(x[b].cpu(), 0, logits[b, :-1], k, "text", None if hid is None else hid[b, :-1])
    return data


@torch.no_grad()
def teacher_generations(
    teacher: Any, tokenizer: Any, prompts: Sequence[str], max_new: int, batch: int, k: int, *,
    sample_mask: Sequence[bool] | None = None, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
    kind: str = "gen", progress: bool = True, desc: str = "teacher: generations", deadline: float | None = None,
    prompt_positions: bool = False,
) -> TeacherData:
    """Continue each chat-templated prompt with the teacher (greedy, or sampled where ``sample_mask``).

    Records the teacher's raw (temperature-1) logits at every generated
    position.  Prompts are batched (left padding) in order of length; sampled
    batches are seeded from ``seed`` and the batch index, so the result is
    reproducible.  Batches run in a seeded shuffled order; none starts after
    ``deadline`` (``time.monotonic()``; then ``data.truncated`` is set).

    With ``prompt_positions`` the teacher distributions at the prompt
    positions (computed anyway during prefill; only the part after the prefix
    common to all prompts, i.e. after the shared system prompt) are added as
    extra ``"prompt"`` sequences.
    """
    eos = _eos_ids(teacher, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    enc = [encode_prompt(tokenizer, p) for p in prompts]
    sample_mask = list(sample_mask) if sample_mask is not None else [False] * len(prompts)
    data = TeacherData()
    dev = next(teacher.parameters()).device
    groups = []
    for mode in (False, True):
        order = sorted((i for i in range(len(enc)) if sample_mask[i] == mode), key=lambda i: (len(enc[i]), i))
        if order:  # equal-sized batches (no small leftover batch)
            n_b = -(-len(order) // batch)
            size = -(-len(order) // n_b)
            groups += [(mode, order[j:j + size]) for j in range(0, len(order), size)]
    common = 0
    if prompt_positions and enc:
        shortest = min(len(e) for e in enc)
        while common < shortest and all(e[common] == enc[0][common] for e in enc):
            common += 1
        if len(enc) == 1:
            common = 0
    head = teacher.get_output_embeddings()
    results: dict[int, TeacherData] = {}
    groups = [(gi, mode, idxs) for gi, (mode, idxs) in enumerate(groups)]
    random.Random(f"batches-{seed}").shuffle(groups)
    for done, (gi, do_sample, idxs) in enumerate(_tqdm(groups, desc=desc, unit="batch", disable=not progress)):
        if deadline is not None and time.monotonic() > deadline:
            logger.warning("time budget: generations cut short after %d of %d batches", done, len(groups))
            data.truncated = True
            break
        L = max(len(enc[i]) for i in idxs)
        ids = torch.full((len(idxs), L), pad, dtype=torch.long)
        att = torch.zeros((len(idxs), L), dtype=torch.long)
        for r, i in enumerate(idxs):
            ids[r, L - len(enc[i]):] = torch.tensor(enc[i])
            att[r, L - len(enc[i]):] = 1
        kwargs: dict[str, Any] = dict(do_sample=False)
        if do_sample:
            torch.manual_seed(seed * 100003 + gi)
            kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        with _FinalHidden(teacher, last_only=False) as cap:
            out = teacher.generate(
                input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new, eos_token_id=eos,
                pad_token_id=pad, output_logits=True, return_dict_in_generate=True, **kwargs,
            )
        gen = out.sequences[:, L:].cpu()
        steps = out.logits  # tuple of (B, V) raw logits, one per generated token
        del out
        n_steps = len(steps)
        hid = (torch.stack([o[:, -1] for o in cap.outputs[:n_steps]], dim=1)
               if len(cap.outputs) >= n_steps and n_steps else None)
        prefill = cap.outputs[0] if cap.outputs and prompt_positions else None  # (B, L, H)
        for r, i in enumerate(idxs):
            item = results[i] = TeacherData()
            if prefill is not None and head is not None and len(enc[i]) - 1 > common:
                lo = L - len(enc[i]) + common
                ph = prefill[r, lo:L - 1]  # positions common .. len-2 predict prompt tokens common+1 ..
                item.add(torch.tensor(enc[i]), common, head(ph.to(dev, head.weight.dtype)).float().cpu(), k,
                         "prompt", ph)
            row = gen[r]
            n = row.shape[0]
            for j in range(n):
                if int(row[j]) in eos:
                    n = j + 1
                    break
            if n == 0:
                continue
            seq = torch.cat([torch.tensor(enc[i]), row[:n]])
            lg = torch.stack([steps[j][r] for j in range(n)]).cpu()
            item.add(seq, len(enc[i]) - 1, lg, k, kind + ("-sampled" if do_sample else ""),
                     None if hid is None else hid[r, :n])
        del steps, prefill, hid, cap
    for i in sorted(results):  # original prompt order
        data.extend(results[i])
    return data


# --------------------------------------------------------------------------
# student
# --------------------------------------------------------------------------


def _output_embedding(model: Any) -> torch.Tensor:
    emb = model.get_output_embeddings()
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.detach()
    return model.get_input_embeddings().weight.detach()


def svd_embedding(weight: torch.Tensor, dim: int, seed: int = 0) -> torch.Tensor:
    """Rank-``dim`` PCA of the (centred) embedding matrix: rows ``(E - mean) @ V_dim``.

    The mean row adds the same amount to every logit, so centring removes a
    direction that is useless for prediction.  If ``dim`` exceeds the rank,
    the extra columns are small random values.
    """
    E = weight.detach().float().cpu()
    E = E - E.mean(dim=0, keepdim=True)
    r = min(dim, E.shape[1], E.shape[0])
    U, S, Vh = torch.linalg.svd(E, full_matrices=False)
    out = U[:, :r] * S[:r]
    if r < dim:
        g = torch.Generator().manual_seed(seed)
        extra = torch.randn(E.shape[0], dim - r, generator=g) * out.std() * 0.1
        out = torch.cat([out, extra], dim=1)
    return out


@dataclass
class HiddenBasis:
    """Top principal directions of the teacher's final normed hidden states (uncentred second moment)."""

    P: torch.Tensor  # (H_teacher, k), orthonormal columns
    ev: torch.Tensor  # (k,) second moment along each direction
    energy: float  # fraction of the total second moment captured


def hidden_pca(data: TeacherData, k: int) -> HiddenBasis | None:
    if not data.has_hidden:
        return None
    H = torch.cat([h.float() for h in data.hidden])
    C = H.t() @ H / H.shape[0]
    ev, vec = torch.linalg.eigh(C.double())
    ev, vec = ev.flip(0).clamp_min(0), vec.flip(1)
    r = min(k, H.shape[1])
    P = vec[:, :r].float()
    # fix the sign of each direction (eigh's sign is arbitrary): largest-|.| entry positive
    sign = torch.sign(P.gather(0, P.abs().argmax(0, keepdim=True)))
    P = P * sign
    return HiddenBasis(P=P, ev=ev[:r].float(), energy=float(ev[:r].sum() / ev.sum().clamp_min(1e-30)))


def build_student(teacher: Any, cfg: DistillConfig, basis: HiddenBasis | None = None) -> Any:
    """A Llama with the teacher's vocabulary and tied embeddings, initialised per ``cfg.init``.

    ``"hidden-pca"`` (needs ``basis``): embedding = E @ P where E is the
    teacher's output embedding and P the top ``hidden`` principal directions
    of the teacher's final hidden states, and final-norm weights sqrt(ev), so
    that a student whose final hidden equals the teacher's (projected on P)
    reproduces the teacher's logits restricted to that subspace.
    """
    import transformers

    tc = teacher.config
    head_dim = cfg.hidden // cfg.heads
    kwargs: dict[str, Any] = {}
    rope = getattr(tc, "rope_parameters", None)
    if rope:
        kwargs["rope_parameters"] = dict(rope)
    elif getattr(tc, "rope_theta", None):
        kwargs["rope_theta"] = tc.rope_theta
    vocab = int(_output_embedding(teacher).shape[0])
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=head_dim, max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)), tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
        initializer_range=0.02, **kwargs,
    )
    torch.manual_seed(cfg.seed)
    student = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    init = cfg.init
    if init == "hidden-pca" and (basis is None or basis.P.shape[1] < cfg.hidden):
        logger.warning("hidden-pca init needs teacher hidden states with >= %d dims; using svd init", cfg.hidden)
        init = "svd"
    with torch.no_grad():
        emb = student.get_input_embeddings().weight
        if init == "hidden-pca":
            assert basis is not None
            emb.copy_(_output_embedding(teacher).float().cpu() @ basis.P[:, : cfg.hidden])
            student.model.norm.weight.copy_(basis.ev[: cfg.hidden].clamp_min(1e-12).sqrt())
        else:
            if init == "svd":
                emb.copy_(svd_embedding(_output_embedding(teacher), cfg.hidden, cfg.seed))
            elif init != "random":
                raise ValueError(f"unknown init {cfg.init!r} (hidden-pca, svd or random)")
            student.model.norm.weight.fill_(cfg.norm_init)
    student.tie_weights()
    gen_cfg = getattr(teacher, "generation_config", None)
    if gen_cfg is not None:
        student.generation_config.eos_token_id = gen_cfg.eos_token_id
        student.generation_config.pad_token_id = gen_cfg.pad_token_id
        student.generation_config.bos_token_id = gen_cfg.bos_token_id
    return student


def truncated_target(teacher: Any, n_layers: int) -> Any:
    """The target's first ``n_layers`` decoder layers + its final norm and lm_head (weights shared, not copied).

    Shallow copies with their own module tables, so the teacher is left untouched.
    """
    inner = copy.copy(teacher.model)
    inner._modules = dict(teacher.model._modules)
    inner._modules["layers"] = torch.nn.ModuleList(list(teacher.model.layers)[:n_layers])
    m = copy.copy(teacher)
    m._modules = dict(teacher._modules)
    m._modules["model"] = inner
    cfg = copy.deepcopy(teacher.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    m.config = cfg
    inner.config = cfg
    return m


# --------------------------------------------------------------------------
# loss, batching, training
# --------------------------------------------------------------------------


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


def _pad_batch(data: TeacherData, items: Sequence[int], pad_id: int, z: Sequence[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
    return ids, att, torch.cat(rows) * L + torch.cat(poss), torch.cat(tidx), torch.cat(tlogp), zt


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


def _student_loss(model: Any, ids: torch.Tensor, att: torch.Tensor, flat_pos: torch.Tensor, tidx: torch.Tensor,
                  tlogp: torch.Tensor, neg_samples: int = 0, gen: torch.Generator | None = None,
                  autocast: bool = False, return_hidden: bool = False) -> Any:
    """Per-position (top-k + tail) KL of the student at the loss positions.

    With ``neg_samples > 0`` the softmax is *sampled*: logits are computed only
    for the ids in the batch's teacher top-k lists plus ``neg_samples`` ids
    drawn uniformly from the rest of the vocabulary, whose exp-sum is scaled up
    to estimate the full partition function (about 4x cheaper than the full
    49152-way softmax, which dominates the cost of training a small draft).
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_pos)
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
    items = sorted(range(len(data)), key=lambda i: int(data.seqs[i].shape[0]))
    batch: list[int] = []
    batches = []
    for i in items:
        if batch and int(data.seqs[i].shape[0]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    for b in batches:
        kl = _student_loss(model, *_pad_batch(data, b, pad_id)[:5])
        total += float(kl.sum())
        n += int(kl.numel())
    model.train(was_training)
    return total / max(n, 1)


def _pretrain_hidden(student: Any, data: TeacherData, z: list[torch.Tensor], z_scale: float, cfg: DistillConfig,
                     pad_id: int, gen: torch.Generator, params: list[torch.nn.Parameter],
                     budget: float | None) -> dict[str, Any]:
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
        ids, att, flat_pos, _, _, zt = _pad_batch(data, items, pad_id, z)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            hidden = student.model(input_ids=ids, attention_mask=att).last_hidden_state
        h = hidden.float().reshape(-1, hidden.shape[-1]).index_select(0, flat_pos)
        loss = ((h - zt) ** 2).mean() / z_scale
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
    z = None
    if basis is not None and cfg.mse_weight > 0 and data.has_hidden and basis.P.shape[1] >= cfg.hidden:
        P = basis.P[:, : cfg.hidden]
        z = [h.float() @ P for h in data.hidden]  # type: ignore[union-attr]
        z_scale = float(basis.ev[: cfg.hidden].mean().clamp_min(1e-12))
    emb = student.get_input_embeddings().weight
    other = [p for n, p in student.named_parameters() if p is not emb]
    budget = cfg.time_budget_s if time_budget_s is None else time_budget_s
    t_start = time.monotonic()
    pre: dict[str, Any] = {"pre_steps": 0}
    if z is not None and cfg.pre_steps > 0:
        pre = _pretrain_hidden(student, data, z, z_scale, cfg, pad_id, gen, other,
                               budget=0.55 * budget if budget else None)
        if budget:
            budget = max(1.0, budget - (time.monotonic() - t_start))
    groups = [{"params": other, "lr": cfg.lr, "lr_mult": 1.0}]
    if cfg.embed_lr_mult > 0:
        groups.append({"params": [emb], "lr": cfg.lr * cfg.embed_lr_mult, "lr_mult": cfg.embed_lr_mult})
    else:
        emb.requires_grad_(False)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=cfg.weight_decay)
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
        ids, att, flat_pos, tidx, tlogp, zt = _pad_batch(data, items, pad_id, z)
        if cfg.train_topk:
            tidx, tlogp = tidx[:, : cfg.train_topk], tlogp[:, : cfg.train_topk]
        kl, h = _student_loss(student, ids, att, flat_pos, tidx, tlogp, cfg.neg_samples, gen, cfg.autocast_bf16,
                              return_hidden=True)
        loss = kl.mean()
        if zt is not None:
            mse = ((h - zt) ** 2).mean() / z_scale
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
    return {
        **pre,
        "steps": step, "planned_steps": cfg.steps,
        "stopped_by_time_budget": stopped_by_budget or bool(pre.get("pre_stopped_by_time_budget")),
        "train_seconds": round(time.monotonic() - t_start, 2),
        "first_loss": losses[0] if losses else None,
        "last_loss_mean10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "last_mse_mean10": (sum(mse_hist[-10:]) / len(mse_hist[-10:])) if mse_hist else None,
    }


# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------


@torch.no_grad()
def greedy_matches(model: Any, data: TeacherData, pad_id: int, batch_tokens: int = 4096) -> list[torch.Tensor]:
    """Per held-out sequence, a bool vector: model argmax == teacher argmax at each generated position."""
    model.eval()
    out: list[torch.Tensor | None] = [None] * len(data)
    items = sorted(range(len(data)), key=lambda i: int(data.seqs[i].shape[0]))
    batches, batch = [], []
    for i in items:
        if batch and int(data.seqs[i].shape[0]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    for b in batches:
        ids, att, flat_pos, tidx, _, _ = _pad_batch(data, b, pad_id)
        hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_pos)
        pred = model.lm_head(h).float().argmax(-1)
        match = pred == tidx[:, 0].long()
        off = 0
        for i in b:
            n = int(data.topk_idx[i].shape[0])
            out[i] = match[off:off + n].clone()
            off += n
    return [m for m in out if m is not None]


def acceptance_metrics(matches: Sequence[torch.Tensor], gamma: int) -> dict[str, float]:
    """Greedy speculative-decoding statistics from per-position argmax matches.

    * ``acceptance_rate``: fraction of positions where draft argmax == target argmax.
    * ``mean_accepted_len``: simulated greedy speculative decoding along each
      continuation: each round drafts ``gamma`` tokens, accepts up to the first
      mismatch, then the target supplies one token; mean accepted per round.
    * ``mean_accepted_len_any_start``: mean over every start position of the
      number of leading matches in the next ``gamma`` positions.
    * ``iid_expected_accepted_len``: ``sum_{i=1..gamma} a^i`` for the rate ``a``.
    """
    tot = sum(int(m.numel()) for m in matches)
    hits = sum(int(m.sum()) for m in matches)
    a = hits / max(tot, 1)
    rounds, accepted = 0, 0
    any_sum, any_n = 0, 0
    for m in matches:
        v = m.tolist()
        n = len(v)
        t = 0
        while t < n:
            k = 0
            while k < gamma and t + k < n and v[t + k]:
                k += 1
            rounds += 1
            accepted += k
            t += k + 1
        run = 0
        runs = [0] * n
        for j in range(n - 1, -1, -1):
            run = run + 1 if v[j] else 0
            runs[j] = run
        any_sum += sum(min(r, gamma) for r in runs)
        any_n += n
    return {
        "positions": tot,
        "acceptance_rate": a,
        "gamma": gamma,
        "mean_accepted_len": accepted / max(rounds, 1),
        "mean_accepted_len_any_start": any_sum / max(any_n, 1),
        "iid_expected_accepted_len": sum(a ** i for i in range(1, gamma + 1)),
    }


def expected_speedup(a: float, gamma: int, c: float) -> float:
    """Speculative speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)) for i.i.d. acceptance ``a``."""
    if a >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - a ** (gamma + 1)) / ((1 - a) * (gamma * c + 1))


@torch.no_grad()
def decode_latency_ms(model: Any, dtype: torch.dtype, prompt_len: int = 64, n_tokens: int = 32, vocab: int | None = None,
                      repeats: int = 3) -> float:
    """Per-token latency (ms) of cached single-token decode steps after a prefill, batch 1.

    The median step time of each of ``repeats`` runs, minimum over runs (robust to other load on the machine).
    """
    from transformers import DynamicCache

    m = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    m.eval()
    V = vocab or int(m.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats):
        ids = torch.randint(0, V, (1, prompt_len), generator=g)
        cache = DynamicCache(config=m.config)
        out = m(input_ids=ids, cache=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            out = m(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
        times.sort()
        best = min(best, times[len(times) // 2])
    return 1000.0 * best


# --------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def _dir_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_atomically(student: Any, tokenizer: Any, out: pathlib.Path, dtype: torch.dtype, report: dict[str, Any]) -> int:
    """save_pretrained + tokenizer + report into a temp dir next to ``out``, then rename into place."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model = copy.deepcopy(student).to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        size = _dir_size(tmp)
        report = dict(report, model_dir=str(out), model_size_bytes=size,
                      weights_size_bytes=sum(f.stat().st_size for f in tmp.glob("*.safetensors")))
        with open(tmp / REPORT_NAME, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        from specdec.models import replace_dir

        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


# --------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------


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
    train = teacher_generations(
        teacher, tokenizer, prompts, cfg.gen_max_new, cfg.gen_batch, cfg.topk,
        sample_mask=[i in sampled for i in range(len(prompts))], temperature=cfg.sample_temperature,
        top_p=cfg.sample_top_p, seed=cfg.seed, kind="gen", progress=cfg.progress,
        desc="teacher: generations (train prompts)", deadline=gen_deadline, prompt_positions=cfg.prompt_positions,
    )
    timings["teacher_generations_s"] = time.monotonic() - t
    t = time.monotonic()
    if texts and cfg.text_tokens > 0:
        train.extend(teacher_text_data(teacher, tokenizer, texts, cfg.text_tokens, cfg.text_seq_len, cfg.text_batch,
                                       cfg.topk, progress=cfg.progress, deadline=text_deadline))
    timings["teacher_text_s"] = time.monotonic() - t
    t = time.monotonic()
    held = teacher_generations(
        teacher, tokenizer, heldout_prompts, cfg.gen_max_new, cfg.gen_batch, cfg.topk, kind="heldout",
        progress=cfg.progress, desc="teacher: generations (held-out prompts)",
    )
    timings["teacher_heldout_s"] = time.monotonic() - t
    if train.truncated:
        timings["teacher_data_truncated_by_budget"] = 1.0
    if cache_path is not None and not train.truncated:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(f".tmp-{os.getpid()}")
        torch.save({"train": train.state(), "heldout": held.state()}, tmp)
        os.replace(tmp, cache_path)
    return train, held, timings


def run_distillation(
    teacher: Any,
    tokenizer: Any,
    *,
    texts: Sequence[str],
    prompts: Sequence[str],
    heldout_prompts: Sequence[str],
    cfg: DistillConfig,
    out_dir: pathlib.Path | str | None,
    teacher_cache: pathlib.Path | None = None,
    early_exit: Sequence[int] = (),
    latency: bool = True,
    extra_report: dict[str, Any] | None = None,
    started_at: float | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Distil a student from ``teacher``; returns (student float32, report).  Saves to ``out_dir`` if given.

    ``started_at`` (``time.monotonic()``) is when the whole run began, for
    ``cfg.total_budget_s`` (default: now).
    """
    t_start = time.monotonic()
    started_at = t_start if started_at is None else started_at
    teacher.eval()
    torch.manual_seed(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (_eos_ids(teacher, tokenizer) or [0])[0]
    train, held, timings = build_teacher_data(teacher, tokenizer, cfg, texts, prompts, heldout_prompts, teacher_cache,
                                              started_at=started_at)
    basis = hidden_pca(train, cfg.hidden) if cfg.init == "hidden-pca" or cfg.mse_weight > 0 else None
    student = build_student(teacher, cfg, basis)
    n_params = sum(p.numel() for p in student.parameters())
    logger.info("student: %d layers, hidden %d, %.2fM parameters (tied embeddings)", cfg.layers, cfg.hidden, n_params / 1e6)

    t = time.monotonic()
    kl_init = mean_kl(student, held, pad_id)
    acc_init = acceptance_metrics(greedy_matches(student, held, pad_id), cfg.gamma)
    ceiling = None
    if basis is not None and held.has_hidden and basis.P.shape[1] >= cfg.hidden:
        # acceptance of a perfect student (final hidden == teacher's, projected on the basis) with this head
        with torch.no_grad():
            head = student.get_input_embeddings().weight
            ceiling = acceptance_metrics(
                [(((h.float() @ basis.P[:, : cfg.hidden]) * 1.0) @ head.t()).argmax(-1) == ti[:, 0].long()
                 for h, ti in zip(held.hidden, held.topk_idx)], cfg.gamma)  # type: ignore[union-attr]
    timings["eval_init_s"] = time.monotonic() - t
    # post-training work (eval, latency, alternatives, save) takes roughly this long
    reserve = 30.0 + (40.0 if latency else 0.0) + 15.0 * len(early_exit)
    budget = cfg.time_budget_s
    if cfg.total_budget_s:
        left = cfg.total_budget_s - (time.monotonic() - started_at) - reserve
        budget = max(1.0, min(budget, left) if budget else left)
    train_stats = train_student(student, train, cfg, pad_id, time_budget_s=budget, basis=basis)
    train_stats["time_budget_s"] = round(budget, 1) if budget else None
    timings["train_s"] = train_stats["train_seconds"]

    t = time.monotonic()
    kl_final = mean_kl(student, held, pad_id)
    matches = greedy_matches(student, held, pad_id)
    acc = acceptance_metrics(matches, cfg.gamma)
    save_dt = _DTYPES[cfg.save_dtype]
    acc_saved = acc
    if save_dt != torch.float32:
        acc_saved = acceptance_metrics(greedy_matches(copy.deepcopy(student).to(save_dt), held, pad_id), cfg.gamma)
    timings["eval_s"] = time.monotonic() - t

    report: dict[str, Any] = {
        "config": cfg.to_json(),
        "student": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                    "intermediate": cfg.intermediate, "parameters": n_params, "tied_embeddings": True,
                    "saved_dtype": cfg.save_dtype},
        "data": {
            "train_sequences": len(train), "train_positions": train.num_positions(),
            "train_gen_positions": train.num_positions("gen") + train.num_positions("gen-sampled"),
            "train_gen_sampled_positions": train.num_positions("gen-sampled"),
            "train_text_positions": train.num_positions("text"),
            "train_prompt_positions": train.num_positions("prompt"),
            "train_prompts": len(prompts), "heldout_prompts": len(heldout_prompts),
            "heldout_positions": held.num_positions(), "offline_text_documents": len(texts),
        },
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
            for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                lat[name] = {"draft_ms": decode_latency_ms(student, dt), "target_ms": decode_latency_ms(teacher, dt)}
                lat[name]["cost_ratio"] = lat[name]["draft_ms"] / lat[name]["target_ms"]
                a = acc["acceptance_rate"] if dt == torch.float32 else acc_saved["acceptance_rate"]
                lat[name]["expected_speedup_iid"] = expected_speedup(a, cfg.gamma, lat[name]["cost_ratio"])
                # from the simulated accepted lengths: (1 + accepted) tokens per (gamma * c + 1) target-step costs
                lat[name]["speedup_by_gamma"] = {
                    g: (1 + m) / (int(g) * lat[name]["cost_ratio"] + 1) for g, m in report["heldout"]["mean_accepted_len_by_gamma"].items()}
            report["latency"] = lat
        ee: dict[str, Any] = {}
        for n in early_exit:
            m = truncated_target(teacher, int(n))
            r = acceptance_metrics(greedy_matches(m, held, pad_id), cfg.gamma)
            r["kl"] = mean_kl(m, held, pad_id)
            if latency:
                for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                    d = decode_latency_ms(m, dt)
                    r[f"{name}_ms"] = d
                    r[f"{name}_cost_ratio"] = d / lat[name]["target_ms"]
                    r[f"{name}_expected_speedup_iid"] = expected_speedup(r["acceptance_rate"], cfg.gamma, d / lat[name]["target_ms"])
            ee[str(n)] = r
            del m
        if ee:
            report["early_exit"] = ee
        timings["latency_and_alternatives_s"] = time.monotonic() - t
    if extra_report:
        report.update(extra_report)
    timings["total_s"] = time.monotonic() - t_start
    report["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    if out_dir is not None:
        report["model_size_bytes"] = save_atomically(student, tokenizer, pathlib.Path(out_dir), save_dt, report)
    return student, report


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


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


def teacher_cache_path(teacher: Any, tokenizer: Any, cfg: DistillConfig, corpus: OfflineCorpus,
                       prompts: Sequence[str], heldout: Sequence[str]) -> pathlib.Path:
    """The teacher-data cache file for these settings (shared by `specdec distill` and `specdec datastore`)."""
    from specdec.models import cache_dir

    key = _teacher_key(teacher, tokenizer, cfg, corpus.texts, prompts, heldout)
    return cache_dir() / "distill" / f"teacher-{key}.pt"


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
    _, report = run_distillation(
        teacher, tok, texts=corpus.texts, prompts=prompts, heldout_prompts=heldout, cfg=cfg, out_dir=out,
        teacher_cache=cache, early_exit=early, latency=not args.no_latency,
        extra_report={"target_model": args.target_model, "threads": args.threads,
                      "load_target_s": round(t_load, 2), "corpus_s": round(t_corpus, 2),
                      "heldout_prompt_examples": heldout[:4], "teacher_cache": str(cache) if cache else None,
                      "wall_s_before_pipeline": round(time.monotonic() - t0, 2)},
        started_at=t0,
    )
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


if __name__ == "__main__":
    sys.exit(main())
