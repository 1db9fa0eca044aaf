"""How the llama.cpp engine's KV cache is sized: a stream for each session the stack admits (`--max-sessions`) plus
one for the start-up profile, each `--llama-session-context` cells long, within a memory budget (`--max-cache-mb`)
and llama.cpp's sequence limit. llama.cpp allocates every stream when the context is created, so the plan is fixed
at start. When the budget cannot hold them all, a session's context shrinks first (down to MIN_SESSION_CONTEXT),
then the number of sessions; either is logged as one warning by the engine (CachePlan.shortfall)."""

from __future__ import annotations

from dataclasses import dataclass

CELL_UNIT = 256  # llama.cpp rounds each stream's cells up to a multiple of this (llama_n_ctx_seq)
MIN_SESSION_CONTEXT = 1024  # the budget shortens a session's context to this before it drops sessions


@dataclass(frozen=True)
class CachePlan:
    sessions: int  # sessions kept before the least recently used is evicted
    session_context: int  # cells of each session's stream: its context limit
    cells: int  # llama.cpp's n_ctx: a stream for each session and one spare (the profile)
    shortfall: str = ""  # why fewer sessions or shorter contexts than asked; empty when all fit

    def describe(self, sessions: int, session_context: int) -> str:
        """The warning for a shortfall against what was asked."""
        return (f"llama.cpp KV cache: {sessions} sessions of {session_context} tokens asked, {self.cells} cells hold "
                f"{self.sessions} sessions of {self.session_context} tokens ({self.shortfall}); a session beyond "
                f"them evicts the least recently used, which then resyncs its whole context; raise --max-cache-mb "
                f"or lower --max-sessions / --llama-session-context")


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def plan_cache(sessions: int, session_context: int, *, cell_bytes: int, budget_mib: int, context_cells: int = 0,
               max_sequences: int = 256, reserved_sequences: int = 1, unified: bool = False) -> CachePlan:
    """The cache for `sessions` sessions of `session_context` tokens. `cell_bytes`: one token's KV (all layers);
    `budget_mib`: the most the cache may take; `context_cells` > 0: an explicit cell limit as well (--llama-context);
    `max_sequences`: llama_max_parallel_sequences(), of which `reserved_sequences` are not sessions' (the profile's,
    a tree's scratch ones). `unified`: one pool of cells shared by the sessions (LRU eviction when it is full)
    instead of a stream each."""
    if sessions < 1 or session_context < 1 or budget_mib < 1 or cell_bytes < 1:
        raise ValueError(f"the llama.cpp cache needs sessions, a session context, a budget and a cell size of at "
                         f"least 1, got {sessions}, {session_context}, {budget_mib} MiB, {cell_bytes} bytes")
    wanted_context = _round_up(session_context, CELL_UNIT)
    reasons = []
    n = min(sessions, max_sequences - reserved_sequences)
    if n < sessions:
        reasons.append(f"llama.cpp allows {max_sequences} sequences, {reserved_sequences} of them not sessions'")
    cap = budget_mib * 1024 * 1024 // cell_bytes // CELL_UNIT * CELL_UNIT
    bound = f"--max-cache-mb {budget_mib} holds {cap} cells of {cell_bytes / 1024:.1f} KiB"
    if 0 < context_cells < cap:
        cap, bound = _round_up(context_cells, CELL_UNIT), f"--llama-context {context_cells} cells"
    if cap < 2 * CELL_UNIT:
        raise ValueError(f"the llama.cpp cache cannot hold one session: {bound}, less than {2 * CELL_UNIT}")
    context = wanted_context
    if unified:
        cells = min(cap, (n + 1) * context)
        context = min(context, cells)
        if cells < (n + 1) * wanted_context:
            reasons.append(f"{bound}, one pool shared by the sessions: they fit while they average under "
                           f"{cells // (n + 1)} tokens")
        return CachePlan(n, context, cells, "; ".join(reasons))
    if (n + 1) * context > cap:
        reasons.append(bound)
        floor = min(MIN_SESSION_CONTEXT, wanted_context)
        context = max(floor, cap // (n + 1) // CELL_UNIT * CELL_UNIT)  # shorter contexts first ...
        if (n + 1) * context > cap:  # ... then fewer sessions, at least one
            context = min(floor, cap // 2 // CELL_UNIT * CELL_UNIT)
            n = min(n, cap // context - 1)
    return CachePlan(n, context, (n + 1) * context, "; ".join(reasons))
