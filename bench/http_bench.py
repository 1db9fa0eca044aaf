"""HTTP beside gRPC on the same requests: the OpenAI-compatible API (streaming, through the official `openai`
client) against the gRPC API (streaming, specdec.client), both on the headline configuration's orchestrator.

The two transports alternate per request (the order flips every request) so load drifts hit both alike. Reported:
tokens/s over all requests of each transport, their ratio `http_grpc_ratio` (HTTP / gRPC; the target is >= 0.97)
and the time to the first streamed tokens (ttft)."""

from __future__ import annotations

import logging
import statistics
import time

log = logging.getLogger("bench.http")

TARGET_RATIO = 0.97


def _grpc_run(address: str, draft_len: int):
    from specdec.client import SpecdecClient

    client = SpecdecClient(address)

    def run(ids: list[int], max_new: int) -> tuple[list[int], float, float | None]:
        r = client.generate(ids, max_new_tokens=max_new, max_draft_len=draft_len)
        return list(r.token_ids), r.wall_s, r.ttft_s

    return run, client.close


def _http_run(url: str, draft_len: int):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def run(ids: list[int], max_new: int) -> tuple[list[int], float, float | None]:
        t0 = time.perf_counter()
        tokens, ttft = [], None
        stream = client.completions.create(model=model, prompt=ids, max_tokens=max_new, temperature=0, stream=True,
                                           extra_body={"max_draft_len": draft_len})
        for chunk in stream:
            block = (chunk.model_extra or {}).get("specdec", {}).get("token_ids", [])
            if block and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += block
        return tokens, time.perf_counter() - t0, ttft

    return run, client.close


def _summary(samples: list[tuple[list[int], float, float | None]]) -> dict:
    wall = sum(s[1] for s in samples)
    ttfts = [s[2] * 1000 for s in samples if s[2] is not None]
    return {"tokens_per_s": sum(len(s[0]) for s in samples) / wall if wall else None,
            "ttft_ms_median": statistics.median(ttfts) if ttfts else None,
            "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else None, "requests": len(samples)}


def measure(grpc_address: str, http_url: str, jobs: list[tuple[str, list[int]]], max_new: int, rounds: int,
            draft_len: int = 0, warmup_tokens: int = 8) -> dict:
    """The same streamed greedy requests over both APIs of one orchestrator."""
    grpc_run, grpc_close = _grpc_run(grpc_address, draft_len)
    http_run, http_close = _http_run(http_url, draft_len)
    runs = {"grpc": grpc_run, "http": http_run}
    samples: dict[str, list] = {"grpc": [], "http": []}
    same = True
    try:
        for run in runs.values():  # warm-up: connections, the first session, untimed
            run(jobs[0][1], warmup_tokens)
        i = 0
        for _ in range(rounds):
            for _name, ids in jobs:
                order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                i += 1
                got = {}
                for kind in order:
                    got[kind] = runs[kind](ids, max_new)
                    samples[kind].append(got[kind])
                same = same and got["grpc"][0] == got["http"][0]
    finally:
        grpc_close()
        http_close()
    grpc, http = _summary(samples["grpc"]), _summary(samples["http"])
    ratio = http["tokens_per_s"] / grpc["tokens_per_s"] if grpc["tokens_per_s"] and http["tokens_per_s"] else None
    # Per request pair (same prompt, back to back): robust to load that drifts during the run.
    paired = [(len(h[0]) / h[1]) / (len(g[0]) / g[1]) for g, h in zip(samples["grpc"], samples["http"])
              if g[0] and h[0] and g[1] > 0 and h[1] > 0]
    return {"grpc": grpc, "http": http, "http_grpc_ratio": ratio,
            "http_grpc_ratio_paired_median": statistics.median(paired) if paired else None,
            "ttft_ms": {"grpc": grpc["ttft_ms_median"], "http": http["ttft_ms_median"]},
            "target_ratio": TARGET_RATIO, "meets_target": ratio is not None and ratio >= TARGET_RATIO,
            "same_tokens": same, "client": "openai (streaming /v1/completions, token-id prompts) vs specdec.client "
                                           "(streaming Generate)"}


def run_in_bench(services, cfgs, jobs: list[tuple[str, list[int]]], args, not_measured: dict) -> dict | None:
    """bench/runner.py's hook: the headline configuration's orchestrator (bench.configs.headline), both APIs."""
    from bench.configs import headline

    cfg = headline([c for c in cfgs if c.orchestrator], getattr(args, "headline_fixed", None))
    if cfg is None:
        not_measured["http_grpc_ratio"] = "no speculative configuration ran"
        return None
    proc = services.procs.get(cfg.orchestrator)
    url = getattr(proc, "http_url", None)
    if not url:
        not_measured["http_grpc_ratio"] = "the orchestrator serves no HTTP API in this checkout"
        return None
    try:
        out = measure(services.addresses[cfg.orchestrator], url, jobs, args.max_new_tokens, max(1, args.rounds),
                      cfg.draft_len or 0, args.warmup_tokens)
    except Exception as e:  # noqa: BLE001 - one broken comparison must not sink the whole run
        log.error("http vs grpc failed: %s", e)
        not_measured["http_grpc_ratio"] = f"failed during the run: {type(e).__name__}: {str(e)[:300]}"
        return None
    out["config"] = cfg.name
    return out


def markdown_lines(res: dict) -> list[str]:
    h = res.get("http")
    if not h:
        why = res.get("not_measured", {}).get("http_grpc_ratio")
        return ["## HTTP vs gRPC", "", f"Not measured: {why}", ""] if why else []

    def f(x, nd=1):
        return "n/a" if x is None else f"{x:.{nd}f}"

    return ["## HTTP vs gRPC", "",
            f"The same streamed greedy requests on `{h['config']}`'s orchestrator, alternating: the OpenAI-compatible "
            f"API through the `openai` client vs the gRPC API ({h['grpc']['requests']} requests each).", "",
            "| API | tokens/s | ttft median (ms) | ttft mean (ms) |", "|---|---|---|---|",
            *(f"| {k} | {f(h[k]['tokens_per_s'])} | {f(h[k]['ttft_ms_median'])} | {f(h[k]['ttft_ms_mean'])} |"
              for k in ("grpc", "http")), "",
            f"HTTP / gRPC tokens/s: **{f(h['http_grpc_ratio'], 3)}** (target >= {h['target_ratio']}: "
            f"{'met' if h['meets_target'] else 'not met'}; median of the per-request-pair ratios "
            f"{f(h.get('http_grpc_ratio_paired_median'), 3)}); same tokens on both: "
            f"{'yes' if h['same_tokens'] else 'NO'}.",
            ""]
