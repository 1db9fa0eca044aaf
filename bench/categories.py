"""The `by_category` block of `python -m bench --json`: each prompt category's figures from the same interleaved run
(the samples of every configuration grouped by their prompt's category), so a drafter's gains on text that repeats
its input (edit, extraction, rag) and its cost where nothing repeats (chat, code) show apart instead of averaged.

Per category: the headline configuration's (speculative) tokens/s, specdec target-only, plain llama.cpp on the
cores the headline uses (the same plain row as the headline's `speedup_vs_llamacpp`), llama.cpp with prompt lookup,
the headline's acceptance and mean accepted length (tokens per verify), the speedups, and whether the headline's
greedy tokens equal target-only's on every prompt of the category."""

from __future__ import annotations

from bench import analysis
from bench.configs import Config, Sample
from specdec.eval_prompts import CATEGORIES, Prompt


def _tps(samples: list[Sample]) -> float | None:
    wall = sum(s.wall_s for s in samples)
    return sum(len(s.tokens) for s in samples) / wall if wall else None


def _acceptance(samples: list[Sample]) -> tuple[float | None, float | None]:
    """(accepted / proposed, tokens per verify step with the bonus token) from the services' stats."""
    proposed = sum(float(s.stats.get("draft_tokens_proposed", 0) or 0) for s in samples)
    accepted = sum(float(s.stats.get("draft_tokens_accepted", 0) or 0) for s in samples)
    verifies = sum(float(s.stats.get("verify_steps", 0) or 0) for s in samples)
    return (accepted / proposed if proposed else None, (accepted + verifies) / verifies if verifies else None)


def by_category(prompts: list[Prompt], cfgs: list[Config], head: str | None, plain: str | None,
                lookup: str | None) -> dict:
    """{category: figures} for every category with a prompt in this run, in CATEGORIES order. head / plain /
    lookup: the names of the speculative headline, the plain llama.cpp row and the prompt-lookup row (None or
    not run: their figures are null)."""
    by_name = {c.name: c for c in cfgs}
    kind_of = {p.name: p.kind for p in prompts}

    def samples(name: str | None, kind: str) -> list[Sample]:
        cfg = by_name.get(name or "")
        return [s for s in cfg.samples if kind_of.get(s.prompt) == kind] if cfg is not None else []

    out = {}
    for kind in [k for k in CATEGORIES if k in kind_of.values()]:
        spec, base = samples(head, kind), samples("specdec-target-only", kind)
        spec_tps, base_tps = _tps(spec), _tps(base)
        plain_tps, lookup_tps = _tps(samples(plain, kind)), _tps(samples(lookup, kind))
        acceptance, mal = _acceptance(spec)
        reference = {s.prompt: s.tokens for s in base if s.round == 0}
        pairs = [s.tokens == reference[s.prompt] for s in spec if s.prompt in reference]
        out[kind] = {
            "prompts": sorted({s.prompt for s in base} | {s.prompt for s in spec}),
            "speculative_tokens_per_s": spec_tps, "target_only_tokens_per_s": base_tps,
            "llamacpp_tokens_per_s": plain_tps, "llamacpp_prompt_lookup_tokens_per_s": lookup_tps,
            "acceptance_rate": acceptance, "mean_accepted_length": mal,
            "speedup_vs_target_only": analysis.ratio(spec_tps, base_tps),
            "speedup_vs_llamacpp": analysis.ratio(spec_tps, plain_tps),
            "speedup_vs_llamacpp_prompt_lookup": analysis.ratio(spec_tps, lookup_tps),
            "greedy_identical_to_target_only": all(pairs) if pairs else None,
        }
    return out
