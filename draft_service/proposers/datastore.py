"""A static n-gram datastore of the target's own output: which token most often followed each n-gram.

Prompt lookup only finds what the current context repeats; a chat model also repeats itself across
conversations ("Here's a", "I'd be happy to", code scaffolding). This table, built offline from the target's
generations (`specdec datastore`), drafts those phrases when the context has no match. The idea is REST
(He et al. 2023) and llama.cpp's static n-gram cache (`llama-lookup --lookup-cache-static`). Drafts are
deterministic (q one-hot), so verification stays exact whatever the table says; only speed depends on it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

FORMAT = 1


def datastore_path(target_spec: str) -> pathlib.Path:
    """Where `specdec datastore` writes the table for a target and where `--datastore auto` looks for it."""
    from specdec.models import models_dir

    name = target_spec.strip().rstrip("/").replace("\\", "/")
    slug = name.split("/")[-1] if os.path.sep in name or name.startswith((".", "/", "~")) else name.replace("/", "--")
    return models_dir() / f"{slug.lower()}-datastore.npz"


class NgramDatastore:
    """n-gram (n = 1..max_n) -> the token that followed it most often, looked up longest n-gram first."""

    def __init__(self, tables: dict[int, dict[tuple[int, ...], int]], meta: dict):
        self.tables = tables  # n -> {n-gram: next token}
        self.max_n = max(tables) if tables else 0
        self.meta = meta

    @classmethod
    def build(cls, sequences: Iterable[tuple[list[int], int]], max_n: int = 4, min_count: int = 1,
              max_entries_per_n: int = 1 << 18, **meta) -> "NgramDatastore":
        """sequences: (token ids, first position whose token is counted as a continuation). Ties go to the token
        seen first; entries are capped per n keeping the most frequent n-grams."""
        counts: dict[int, dict[tuple[int, ...], Counter]] = {n: defaultdict(Counter) for n in range(1, max_n + 1)}
        n_seq = n_tok = 0
        for ids, start in sequences:
            n_seq += 1
            for i in range(max(start, 1), len(ids)):
                n_tok += 1
                for n in range(1, min(max_n, i) + 1):
                    counts[n][tuple(ids[i - n:i])][ids[i]] += 1
        tables = {}
        for n, grams in counts.items():
            best = []
            for gram, followers in grams.items():
                token, count = followers.most_common(1)[0]
                if count >= min_count:
                    best.append((count, gram, token))
            best.sort(key=lambda e: -e[0])
            tables[n] = {gram: token for _, gram, token in best[:max_entries_per_n]}
        store = cls(tables, dict(meta, format=FORMAT, max_n=max_n, min_count=min_count, sequences=n_seq,
                                 tokens=n_tok))
        store.meta["entries"] = store.entries
        return store

    def next_token(self, context: list[int]) -> int | None:
        for n in range(min(self.max_n, len(context)), 0, -1):
            token = self.tables[n].get(tuple(context[len(context) - n:]))
            if token is not None:
                return token
        return None

    def continuation(self, context: list[int], max_len: int) -> list[int]:
        """Chain lookups: each drafted token extends the context the next lookup sees."""
        ctx = list(context[len(context) - self.max_n:])
        out: list[int] = []
        while len(out) < max_len:
            token = self.next_token(ctx)
            if token is None:
                break
            out.append(token)
            ctx = ctx[1:] + [token] if len(ctx) >= self.max_n else ctx + [token]
        return out

    def candidates(self, context: list[int], max_len: int) -> list[list[int]]:
        """One chain per n-gram length that has an entry (longest first): where the 4-gram and the 1-gram
        disagree on the next token, both are offered, as branches of a tree draft."""
        out: list[list[int]] = []
        if max_len <= 0:
            return out
        for n in range(min(self.max_n, len(context)), 0, -1):
            token = self.tables[n].get(tuple(context[len(context) - n:]))
            if token is not None:
                out.append([token] + self.continuation(list(context[len(context) - self.max_n:]) + [token],
                                                       max_len - 1))
        return out

    @property
    def entries(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def max_token(self) -> int:
        return max((max(max(g), t) for table in self.tables.values() for g, t in table.items()), default=-1)

    def save(self, path: str | os.PathLike) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"meta": np.array(json.dumps(self.meta))}
        for n, table in self.tables.items():
            grams = list(table)
            arrays[f"keys{n}"] = np.array(grams, dtype=np.int32).reshape(len(grams), n)
            arrays[f"next{n}"] = np.array([table[g] for g in grams], dtype=np.int32)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NgramDatastore":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: datastore format {meta.get('format')!r}, expected {FORMAT}")
            tables = {}
            for n in range(1, int(meta["max_n"]) + 1):
                keys, nxt = z[f"keys{n}"], z[f"next{n}"]
                tables[n] = dict(zip(map(tuple, keys.tolist()), nxt.tolist()))
        return cls(tables, meta)
