"""The llama.cpp anchor rows of `python -m bench`: plain llama.cpp greedy decoding of the target's GGUF (a bare
llama_decode loop, in the benchmark process) at one thread and at the cores specdec's configurations use, and
llama.cpp with llama-cpp-python's prompt-lookup drafter (LlamaPromptLookupDecoding) verifying each block in one
llama_decode. They run
interleaved with specdec's configurations on the same prompts and stop at EOS as they do; the JSON then carries
`llamacpp_tokens_per_s` (plain llama.cpp at the cores the headline configuration uses in all) and
`speedup_vs_llamacpp` (the headline over that), or nulls and the reason when llama.cpp cannot run."""

from __future__ import annotations

import os
import time

import numpy as np

from bench import analysis
from bench.configs import Config, Sample

PLAIN, PROMPT_LOOKUP = "llamacpp-plain", "llamacpp-prompt-lookup"


class DirectLlamaCpp:
    """Plain llama.cpp: one context; a prompt prefilled in one batch, then single-token decodes, each the argmax
    of its logits."""

    BATCH = 512  # tokens per llama_decode (the context's n_batch)

    def __init__(self, gguf: str, threads: int):
        import llama_cpp
        from llama_cpp import _logger

        _logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        self.ll = llama_cpp
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 4096, self.BATCH, self.BATCH
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.BATCH, 0, 1)

    def _feed(self, tokens: list[int], start: int) -> int:
        return self.feed_rows(tokens, start, rows=1)[-1]

    def feed_rows(self, tokens: list[int], start: int, rows: int) -> list[int]:
        """Decode tokens at positions start.. in one llama_decode (a prompt longer than a batch, BATCH tokens, in
        several); the argmax of the last `rows` positions."""
        while len(tokens) > self.BATCH:  # earlier chunks: no logits wanted (rows never reach past the last chunk)
            self.feed_rows(tokens[: self.BATCH], start, rows=0)
            tokens, start = tokens[self.BATCH:], start + self.BATCH
        batch = self.batch
        for j, t in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0] = t, start + j, 1, 0
            batch.logits[j] = j >= len(tokens) - rows
        batch.n_tokens = len(tokens)
        if self.ll.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i - rows), shape=(self.n_vocab,))
                    .argmax()) for i in range(rows)] if rows else []

    def crop(self, length: int) -> None:
        """Drop the cached positions from `length` on (rejected draft tokens)."""
        self.ll.llama_memory_seq_rm(self.mem, 0, length, -1)

    def generate(self, ids: list[int], n: int) -> tuple[int, float]:
        """(tokens, wall seconds) for n new tokens after ids."""
        t0 = time.perf_counter()
        self.ll.llama_memory_clear(self.mem, True)
        token = self._feed(ids, 0)
        for i in range(n - 1):
            token = self._feed([token], len(ids) + i)
        return n, time.perf_counter() - t0

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


class _SessionLM:
    """A DirectLlamaCpp behind the two calls bench.hf.step_costs makes of the services' CachedLM (extend n tokens,
    crop back), so the microbenchmark and the gRPC floor time the llama.cpp engine's forwards: logits for every
    new position, as a verify computes them."""

    def __init__(self, model: DirectLlamaCpp):
        self.model = model

    def extend(self, session, tokens: list[int]) -> list[int]:
        best = self.model.feed_rows(list(tokens), len(session.tokens), rows=len(tokens))
        session.tokens.extend(tokens)
        return best

    def crop(self, session, length: int) -> None:
        self.model.crop(length)
        del session.tokens[length:]


def llamacpp_session(target_model: str, threads: int, ids: list[int]):
    """((lm, session, next token) after prefilling ids on the target's GGUF at `threads`, close)."""
    from types import SimpleNamespace

    from target_service.engines.select import gguf_file

    model = DirectLlamaCpp(str(gguf_file(target_model)), threads)
    lm, session = _SessionLM(model), SimpleNamespace(tokens=[])
    model.ll.llama_memory_clear(model.mem, True)
    return (lm, session, lm.extend(session, list(ids))[-1]), model.close


def unavailable_reason(target_model: str) -> str | None:
    """Why llama.cpp cannot run the target here, or None."""
    from target_service.engines.select import gguf_file, llama_cpp_missing

    if gguf_file(target_model) is None:
        return f"the target {target_model!r} is not a GGUF model"
    missing = llama_cpp_missing()
    return f"llama-cpp-python is not installed ({missing})" if missing else None


def core_counts(threads: int, cpus: int, target_threads: int | None = None) -> list[int]:
    """The thread counts to measure plain llama.cpp at: 1, one model service's, the target's (a llama.cpp target
    drafting in the orchestrator gets the draft's cores too) and the target plus one draft process's, none above
    the machine's CPUs."""
    target = target_threads or threads
    return sorted({1, min(threads, cpus), min(target, cpus), min(target + threads, cpus)})


def headline_cores(head: dict | None, threads: int, cpus: int, target_threads: int | None = None) -> int:
    """The cores the headline configuration computes on in all: the target's threads, plus a draft process's
    (`threads`) unless it drafts inside the orchestrator (--draft local:ngram)."""
    local = head is not None and any(f.startswith("local:") for f in head.get("orchestrator_flags") or [])
    return min((target_threads or threads) + (0 if local else threads), cpus)


def _plain_run(gguf: str, threads: int, eos: set[int]):
    model = DirectLlamaCpp(gguf, threads)

    def run(ids: list[int], max_new: int) -> Sample:
        t0 = time.perf_counter()
        model.ll.llama_memory_clear(model.mem, True)
        token = model._feed(ids, 0)
        out = [token]
        while len(out) < max_new and token not in eos:
            token = model._feed([token], len(ids) + len(out) - 1)
            out.append(token)
        return Sample("", 0, out, time.perf_counter() - t0)

    return run, model.close


def _prompt_lookup_run(gguf: str, threads: int, eos: set[int], num_pred_tokens: int):
    """llama.cpp with prompt-lookup speculation: llama-cpp-python's drafter (LlamaPromptLookupDecoding: the longest
    n-gram of the context's tail, up to 2, found earlier in the context, and the tokens after it), each block verified
    in one llama_decode and accepted greedily. (llama-cpp-python 0.3.36's high-level `Llama.generate`, with or without
    its `draft_model`, repeats one token for this GGUF at temperature 0, so the loop is this one, on the low-level API
    as the plain rows.)"""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model = DirectLlamaCpp(gguf, threads)
    drafter = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)

    def run(ids: list[int], max_new: int) -> Sample:
        t0 = time.perf_counter()
        model.ll.llama_memory_clear(model.mem, True)
        out = [model._feed(ids, 0)]
        cached = len(ids)  # positions in the KV cache; out[-1] is not one yet
        while len(out) < max_new and out[-1] not in eos:
            room = max_new - len(out) - 1
            guess = [int(t) for t in drafter(np.asarray(ids + out, dtype=np.intc))[:room]] if room else []
            best = model.feed_rows([out[-1], *guess], cached, rows=len(guess) + 1)
            n = 0
            while n < len(guess) and guess[n] == best[n] and out[-1] not in eos:
                out.append(guess[n])
                n += 1
            cached += 1 + n  # the last token and the accepted guesses; the rejected ones leave the cache
            model.crop(cached)
            if out[-1] not in eos and len(out) < max_new:
                out.append(best[n])
        return Sample("", 0, out[:max_new], time.perf_counter() - t0)

    return run, model.close


def llamacpp_configs(args, eos_ids: list[int], cpus: int | None = None) -> tuple[list[Config], list]:
    """(the anchor configurations, their close functions); they stop at the target's EOS ids as specdec does.
    Unavailable rows carry the reason."""
    cpus = cpus or os.cpu_count() or 1
    counts = core_counts(args.threads, cpus, getattr(args, "target_threads", None))
    lookup_threads = counts[-1]
    names = [(f"{PLAIN}-t{t}", PLAIN, t, f"llama.cpp plain, {t} thread{'s' * (t > 1)} (in-process)")
             for t in counts]
    names.append((f"{PROMPT_LOOKUP}-t{lookup_threads}", PROMPT_LOOKUP, lookup_threads,
                  f"llama.cpp + llama-cpp-python prompt lookup (num_pred_tokens={args.prompt_lookup_num_tokens}), "
                  f"{lookup_threads} thread{'s' * (lookup_threads > 1)} (in-process)"))
    reason = unavailable_reason(args.target_model)
    if reason is not None:
        return [Config(n, kind, label, None, available=False, reason=reason) for n, kind, _, label in names], []
    from target_service.engines.select import gguf_file

    gguf = str(gguf_file(args.target_model))
    eos = {int(t) for t in eos_ids}
    cfgs, closers = [], []
    for name, kind, threads, label in names:
        run, close = (_plain_run(gguf, threads, eos) if kind == PLAIN
                      else _prompt_lookup_run(gguf, threads, eos, args.prompt_lookup_num_tokens))
        closers.append(close)
        cfgs.append(Config(name, kind, label, run, settings={"threads": threads}))
    return cfgs, closers


def headline_vs_llamacpp(res: dict, threads: int, cpus: int, target_threads: int | None = None) -> dict:
    """The JSON keys comparing the headline with plain llama.cpp on the cores the headline uses: the fastest plain
    row at that many threads or fewer (on a busy host llama.cpp's threads wait at barriers, and 2 threads can run
    far slower than one; docs/engines.md). target_threads: the target service's --threads (default threads)."""
    cfgs = {c["name"]: c for c in res["configs"]}
    head = cfgs.get(res.get("headline_config") or "")
    cores = headline_cores(head, threads, cpus, target_threads)
    plain = [c for c in res["configs"] if c.get("kind") == PLAIN and c.get("settings", {}).get("threads", 0) <= cores]
    ran = [c for c in plain if c.get("available") and c.get("tokens_per_s")]
    best = max(ran, key=lambda c: c["tokens_per_s"]) if ran else None
    tps = best["tokens_per_s"] if best else None
    out = {"llamacpp_tokens_per_s": tps, "llamacpp_cores": cores,
           "llamacpp_threads": best["settings"]["threads"] if best else None,
           "speedup_vs_llamacpp": analysis.ratio(res.get("tokens_per_s"), tps) if head else None}
    if tps is None:
        out["llamacpp_reason"] = next((c.get("reason") for c in plain if c.get("reason")),
                                      f"no plain llama.cpp row at {cores} threads or fewer")
    elif head is None:
        out["llamacpp_reason"] = "no headline configuration ran"
    return out
