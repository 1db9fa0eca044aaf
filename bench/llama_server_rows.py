"""The llama-server anchor's rows (bench/llama_server.py runs the server): per concurrency level of
`python -m bench --serving` a server with `-np N` on the level's own requests, and specdec's figures over its
(`vs_llama_server`); for `python -m bench` one-stream configurations, plain and with llama-server's n-gram
speculation, interleaved with specdec's, and the keys comparing the headline with them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bench import llama_server as ls

log = logging.getLogger("bench.llama_server")

# The targets for specdec against llama-server on the same load, at every measured level.
MIN_TOKENS_PER_S_RATIO = 0.95
MAX_TPOT_P99_RATIO = 1.10
PLAIN, NGRAM = "llama-server", "llama-server-ngram"


def ctx_per_slot(prompts: list[list[int]], max_new: int, margin: int = 64) -> int:
    """KV cells each slot needs: the longest prompt, the new tokens and a margin, rounded up to 256."""
    need = max((len(p) for p in prompts), default=0) + max_new + margin
    return -(-need // 256) * 256


def _ratio(a, b):
    return a / b if a is not None and b else None


@dataclass
class ServingAnchor:
    """llama-server beside the serving benchmark's stack: found once, started per level with -np N."""
    binary: str | None
    found: str  # how the binary was found, or why there is none
    gguf: str | None = None
    threads: int = 1
    ctx: int = 512
    log_dir: str | None = None
    levels_failed: dict = field(default_factory=dict)

    @classmethod
    def create(cls, choice: str, target_model: str, threads: int, prompts: list[list[int]], max_new: int,
               log_dir: str | None = None) -> "ServingAnchor":
        from target_service.engines.select import gguf_file

        gguf = gguf_file(target_model)
        if gguf is None:
            return cls(None, f"the target {target_model!r} is not a GGUF model")
        binary, found = ls.find_binary(choice)
        return cls(binary, found, str(gguf), threads, ctx_per_slot(prompts, max_new), log_dir)

    def level(self, n: int, jobs, max_new: int, warmup_tokens: int, timeout_s: float, specdec: dict) -> dict:
        """One closed-loop level on a fresh server with -np n: {"llama_server": its summary,
        "vs_llama_server": specdec's over it}; specdec: mode -> (summary, records) of the same level."""
        from bench.serving_metrics import same_outputs, summarise_level

        try:
            with ls.LlamaServer(self.binary, self.gguf, threads=self.threads, parallel=n, ctx_per_slot=self.ctx,
                                log_dir=self.log_dir) as server:
                client = ls.Completions(server.url, timeout_s)
                try:
                    ls.closed_loop(min(2, n), jobs[: min(2, n)], client, warmup_tokens, timeout_s=timeout_s)
                    wall, recs = ls.closed_loop(n, jobs, client, max_new, timeout_s=timeout_s)
                finally:
                    client.close()
        except Exception as e:  # noqa: BLE001 - the anchor failing must not sink specdec's run
            log.error("llama-server at %d streams: %s", n, e)
            self.levels_failed[n] = f"{type(e).__name__}: {str(e)[:300]}"
            return {"llama_server": None, "vs_llama_server": None}
        summary = summarise_level(recs, wall)
        return {"llama_server": summary, "vs_llama_server": vs_llama_server(specdec, summary, recs, same_outputs)}

    def describe(self, levels: list[dict]) -> dict:
        out = {"binary": self.binary, "found": self.found, "threads": self.threads, "ctx_per_slot": self.ctx,
               "command": (f"llama-server -m {self.gguf} -t {self.threads} -tb {self.threads} -np N "
                           f"-c {self.ctx}*N --no-webui") if self.binary else None,
               "client": "httpx, streaming /v1/completions with token-id prompts, temperature 0, the same max "
                         "tokens, stopping at EOS as specdec does; each level on a fresh server with -np N after 2 "
                         "untimed warm-up requests",
               "levels_failed": dict(self.levels_failed)}
        out["targets"] = evaluate_targets(levels) if self.binary else {}
        return out


def vs_llama_server(specdec: dict, server: dict, server_recs, same_outputs) -> dict:
    """specdec's aggregate tokens/s and p99 TPOT over llama-server's at one level (per specdec mode)."""
    out = {}
    for mode, (summary, recs) in specdec.items():
        out[mode] = {"tokens_per_s_ratio": _ratio(summary["tokens_per_s"], server["tokens_per_s"]),
                     "tpot_p99_ratio": _ratio(summary["tpot_p99_ms"], server["tpot_p99_ms"]),
                     "same_tokens": same_outputs(recs, server_recs),
                     "same_output_tokens": summary["output_tokens"] == server["output_tokens"]}
    spec = out.get("speculative", {})
    out["tokens_per_s_ratio"], out["tpot_p99_ratio"] = spec.get("tokens_per_s_ratio"), spec.get("tpot_p99_ratio")
    return out


def evaluate_targets(levels: list[dict]) -> dict:
    """specdec (its default, speculative) >= 0.95x llama-server's tokens/s and p99 TPOT <= 1.1x its, every level."""
    measured = [r for r in levels if r.get("vs_llama_server")]
    out = {}
    for key, threshold, worse in (("tokens_per_s_ratio", MIN_TOKENS_PER_S_RATIO, lambda v: v < MIN_TOKENS_PER_S_RATIO),
                                  ("tpot_p99_ratio", MAX_TPOT_P99_RATIO, lambda v: v > MAX_TPOT_P99_RATIO)):
        vals = [(r["concurrency"], r["vs_llama_server"][key]) for r in measured
                if r["vs_llama_server"].get(key) is not None]
        if not vals:
            out[key] = {"met": None, "threshold": threshold, "value": None, "why": "no level measured"}
            continue
        missed = [(n, v) for n, v in vals if worse(v)]
        pick = max if key == "tpot_p99_ratio" else min
        n_worst, v_worst = pick(vals, key=lambda x: x[1])
        out[key] = {"met": not missed and len(vals) == len(levels), "threshold": threshold, "value": v_worst,
                    "at_concurrency": n_worst,
                    "why": "; ".join(f"{n} streams: {v:.2f}x" for n, v in missed)
                    + ("" if len(vals) == len(levels) else "; some levels not measured")}
    return out


def serving_markdown(serving: dict) -> list[str]:
    anchor = serving.get("llama_server")
    if not anchor:
        return []
    if not anchor.get("binary"):
        return ["## Against llama-server", "", f"Not measured: {anchor.get('found')}.", ""]
    f = lambda x, nd=1: "n/a" if x is None else f"{x:.{nd}f}"  # noqa: E731
    out = ["## Against llama-server", "",
           f"llama.cpp's llama-server ({anchor['found']}): `{anchor['command']}`, driven by {anchor['client']}.", "",
           "| streams | tokens/s specdec / target-only / llama-server | specdec / llama-server | TPOT p99 (ms) "
           "specdec / llama-server | p99 TPOT ratio | TTFT p50 (ms) llama-server | failed (llama-server) |",
           "|---|---|---|---|---|---|---|"]
    for r in serving.get("levels", []):
        srv, vs = r.get("llama_server"), r.get("vs_llama_server")
        if not srv:
            out.append(f"| {r['concurrency']} | not measured | | | | | |")
            continue
        out.append(f"| {r['concurrency']} | {f(r['spec_tokens_per_s'])} / {f(r['target_only_tokens_per_s'])} / "
                   f"{f(srv['tokens_per_s'])} | **{f(vs['tokens_per_s_ratio'], 2)}** | {f(r['tpot_p99_ms'])} / "
                   f"{f(srv['tpot_p99_ms'])} | {f(vs['tpot_p99_ratio'], 2)} | {f(srv['ttft_p50_ms'])} "
                   f"| {srv['errors']} |")
    for key, t in anchor.get("targets", {}).items():
        out.append(f"\n{key} (target {t['threshold']}): {f(t['value'], 2)}, "
                   f"{'met' if t['met'] else 'not met' if t['met'] is False else 'not measured'}"
                   + (f" ({t['why']})" if t.get("why") else ""))
    return out + [""]


# --- python -m bench: one-stream rows ---------------------------------------------------------------------------

def llama_server_configs(args, threads: int, prompts: list[list[int]]) -> tuple[list, list]:
    """(the one-stream configurations: llama-server plain and with n-gram speculation, their close functions);
    unavailable ones carry the reason. They stop at EOS as specdec's configurations do."""
    from bench.configs import Config, Sample
    from target_service.engines.select import gguf_file

    names = [(PLAIN, (), f"llama-server -np 1, {threads} thread{'s' * (threads > 1)} (HTTP, /v1/completions)"),
             (NGRAM, ls.NGRAM_SPEC_ARGS, f"llama-server -np 1 {' '.join(ls.NGRAM_SPEC_ARGS)}, {threads} "
                                         f"thread{'s' * (threads > 1)} (HTTP, /v1/completions)")]
    gguf = gguf_file(args.target_model)
    binary, found = (None, f"the target {args.target_model!r} is not a GGUF model") if gguf is None else \
        ls.find_binary(getattr(args, "llama_server", "auto"))
    if binary is None:
        return [Config(n, n, label, None, available=False, reason=found) for n, _, label in names], []
    cfgs, closers = [], []
    ctx = ctx_per_slot(prompts, args.max_new_tokens)
    for name, extra, label in names:
        server = ls.LlamaServer(binary, str(gguf), threads=threads, parallel=1, ctx_per_slot=ctx, extra_args=extra,
                                log_dir=getattr(args, "log_dir", None))
        try:
            server.start()
        except Exception as e:  # noqa: BLE001 - e.g. an older build without --spec-type: that row says why
            cfgs.append(Config(name, name, label, None, available=False, reason=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        client = ls.Completions(server.url)

        def run(ids: list[int], max_new: int, client=client) -> Sample:
            rec = client.stream("", ids, max_new)
            if rec.error:
                raise RuntimeError(f"llama-server: {rec.error}")
            return Sample("", 0, rec.token_ids, rec.wall_s,
                          extra={"ttft_s": rec.ttft_s, "first_tokens": rec.chunks[0][1] if rec.chunks else 0})

        closers += [client.close, server.stop]
        cfgs.append(Config(name, name, label, run, settings={"threads": threads, "binary": binary, "found": found,
                                                              "args": server.command()[3:]}))
    return cfgs, closers


def runner_keys(res: dict) -> dict:
    """`python -m bench`'s keys: llama-server's tokens/s at one stream (plain and n-gram speculative) and the
    headline's speedup over each, or nulls and the reason."""
    by = {c["name"]: c for c in res.get("configs", [])}
    out = {}
    for name, key in ((PLAIN, "llama_server"), (NGRAM, "llama_server_ngram")):
        row = by.get(name, {})
        tps = row.get("tokens_per_s") if row.get("available") else None
        out[f"{key}_tokens_per_s"] = tps
        out[f"speedup_vs_{key}"] = _ratio(res.get("tokens_per_s"), tps)
        if tps is None:
            out[f"{key}_reason"] = row.get("reason", "not configured")
    return out
