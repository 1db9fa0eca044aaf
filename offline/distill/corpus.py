"""The training text: English found offline on this machine (docstrings, READMEs, package descriptions;
nothing is downloaded) and the fixed chat / code / passage prompts, with disjoint held-out sets."""

from __future__ import annotations

import ast
import hashlib
import os
import pathlib
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence


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
