"""The orchestrator's settings, each default written once: `specdec serve orchestrator`'s flags are generated from
these fields (specdec/core/settings.py), and `specdec run|up` (launcher/stack.py, launcher/cli.py) take their defaults from
here."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from orchestrator.replicas.discovery import is_dns, parse_dns
from specdec.core import settings
from specdec.core.settings import LONG_DRAFT_LEN, setting


@dataclass
class LoopConfig:
    """The speculative loop's settings (orchestrator/loop/)."""
    default_draft_len: int = setting(4, "default draft length (the starting one when adaptive)", flag="--draft-len")
    max_draft_len: int = setting(
        LONG_DRAFT_LEN, "largest draft length a request may ask for (a step drafts at most the smallest of this, the "
        "target's and the draft's advertised limits, and the request's max_draft_len)")
    adaptive_draft_len: bool = setting(
        True, "adapt the draft length per session from its acceptance (--no-adaptive-draft-len keeps --draft-len "
        "fixed; a request's max_draft_len fixes it too)")
    draft_len_policy: str = setting(
        "goodput", "with --adaptive-draft-len: goodput = the k that maximises expected tokens per ms from the "
        "session's acceptance and the measured target/draft costs (0 = target-only when no k pays; needs the "
        "target's forward profile, else heuristic); heuristic = transformers' +2/-1 schedule",
        choices=("goodput", "heuristic"))
    draft_min_confidence: float = setting(
        0.0, "the draft stops a block early when its top probability is below this (0 = never; llama.cpp p-min)")
    pipeline: str = setting(
        "off", "draft the next block while the target verifies (auto: when the measured saving, full-block rate x "
        "Propose round trip, beats --pipeline-min-gain-ms)", choices=("off", "on", "auto"))
    pipeline_min_gain_ms: float = setting(
        1.0, "auto pipelining: the mean saving per step a prefetch must bring (about one RPC's cost)")
    pipeline_max_sessions: int = setting(
        2, "auto pipelining: no prefetching while more than N sessions are generating; their drafting already fills "
        "the draft's time during each other's verifies, and a prefetch not accepted whole delays theirs "
        "(0 = no limit)")
    draft_prefill: str = setting(
        "target-kv", "how a new session's draft gets the prompt when it is the target's own weights in int8 (equal "
        "kv fingerprints): target-kv = the target prefills and hands its KV over (a few MiB through this process "
        "per session); own = the draft prefills, in parallel with the target", choices=("target-kv", "own"))
    speculation_max_sessions: int = setting(
        0, "decode target-only while more than N sessions are generating: a busy batched target is compute-bound "
        "and verifying drafts costs more than it saves (0 = always speculate)")
    tree_budget: int = setting(
        0, "tree speculation: the draft proposes a token tree of up to N nodes, verified in one target pass "
        "(0 = chain)")
    tree_branch: int = setting(0, "tree speculation: children of an uncertain node (0 = the draft's default, 2)")
    tree_branch_below: float = setting(
        0.0, "tree speculation: branch where the draft's top probability is below this (0 = default, 0.75)")
    fallback_chunk: int = setting(
        4, "tokens per target-only Decode call (degraded, paused by the draft length, or speculation off)")
    stream_block_tokens: int = setting(
        16, "tokens per block of a target-only generation's decode stream after its first token, which goes out "
        "at once (each block costs a wake-up of the target's stream thread, the orchestrator, Redis and the client)")
    draft_timeout_floor_ms: float = setting(100.0, "the shortest deadline of a Propose call")
    draft_timeout_factor: float = setting(
        2.0, "a Propose's deadline: this x the measured target step time (a slower draft is no help)")
    draft_first_call_timeout_ms: float = setting(5000.0, cli=False)  # a replica's first call prefills the prompt
    target_timeout_s: float = setting(30.0, cli=False)
    target_grace_s: float = setting(
        30.0, "wait this long for a dead target to return (only when no other target replica is usable)")
    store_grace_s: float = setting(10.0, "wait this long for Redis to return")


@dataclass
class ServerSettings:
    """The orchestrator process: addresses, the session store, limits, failure handling, authentication."""
    listen: str = setting("127.0.0.1:50050", "address of the public gRPC API")
    http_listen: str = setting(
        "127.0.0.1:8000", "the OpenAI-compatible HTTP API (docs/http.md) at HOST:PORT (port 0 = any free one; "
        "'' = no HTTP API)")
    target: str = setting(
        "127.0.0.1:50052", "target service addresses, comma-separated; 'dns:///NAME:PORT' is every address NAME "
        "resolves to, re-resolved while running. Several replicas form a pool: each session is placed on one (affinity, "
        "least loaded), and moves at once to another when its replica fails; all must serve the same model")
    draft: str = setting(
        "127.0.0.1:50051", "draft replica addresses, comma-separated ('' = no speculation); 'local:suffix' drafts with "
        "suffix trees over each session's context and its caller's recent outputs, 'local:ngram' with the n-gram "
        "drafter, inside this process (no Propose round trip); 'dns:///NAME:PORT' is every address NAME "
        "resolves to, one replica each, re-resolved while running (--scale'd compose services, Kubernetes headless "
        "Services)")
    resolve_interval_s: float = setting(
        5.0, "how often dns:/// draft and target addresses are resolved again (also soon after a replica fails)")
    local_datastore: str = setting(
        "auto", "n-gram datastore of a local:ngram drafter: auto (the target's, if `specdec datastore` built one), "
        "none, or a path")
    redis: str = setting(
        "redis://127.0.0.1:6379/0", "session store URL: redis://HOST:PORT/DB, redis+sentinel://HOST:PORT[,HOST:PORT]/"
        "MASTER (failover; commits wait for the replicas), or 'memory'")
    tokenizer: str | None = setting(None, "tokenizer spec (default: the target's model)")
    max_new_tokens_limit: int = setting(2048, "the most tokens a request may ask for")
    max_sessions: int = setting(64, "concurrent generations, running and queued; more get RESOURCE_EXHAUSTED")
    max_running: str = setting(
        "auto", "generations decoding at once; more wait in a FIFO queue (up to --max-sessions in all). auto: what "
        "the target pool serves well, per replica the sessions it caches and batches in one forward (GetInfo "
        "max_sessions, max_batch), summed over the replicas")
    admission: str = setting(
        "adaptive", "adaptive: run fewer generations than --max-running while the target's calls take over a "
        "quarter of their 30 s deadline (a starved or slower target), more again as they speed up; static: always "
        "--max-running", choices=("adaptive", "static"))
    queue_timeout_s: float = setting(
        120.0, "the longest a generation waits in the admission queue (or until its deadline); then "
        "RESOURCE_EXHAUSTED (HTTP 429)")
    max_sessions_per_principal: int = setting(
        0, "concurrent generations of one caller (bearer token); more get RESOURCE_EXHAUSTED (0 = --max-sessions)")
    session_ttl_s: int = setting(3600, "how long a session is kept in the store after its last write")
    startup_timeout_s: float = setting(
        60.0, "how long to wait at start for the target to answer (it may still be loading its model)")
    session_lease_s: float = setting(
        5.0, "a session's single-writer lease in Redis: a stream renews it every third of this; a crashed "
        "orchestrator's sessions can be resumed elsewhere after at most this long")
    breaker_open_s: float = setting(1.0, "how long a failed draft replica is skipped")
    breaker_failures: int = setting(
        2, "consecutive draft failures (timeouts, errors) that open a replica's breaker")
    auth_tokens_file: str | None = setting(
        help="file with one bearer token per line; when set, the public API requires one "
        "(default: $SPECDEC_AUTH_TOKENS_FILE)",
        default_factory=lambda: os.environ.get("SPECDEC_AUTH_TOKENS_FILE"))
    tls_public_no_client_cert: bool = setting(
        False, "public API over TLS without client certificates (bearer tokens authenticate instead)",
        action="store_true")
    admin_tokens_file: str | None = setting(
        help="bearer tokens (one per line) that also see internal addresses in GetOutline "
        "(default: $SPECDEC_ADMIN_TOKENS_FILE)",
        default_factory=lambda: os.environ.get("SPECDEC_ADMIN_TOKENS_FILE"))
    redis_password_file: str | None = setting(
        help="the session store's password, read from this file (never from the command line) "
        "(default: $SPECDEC_REDIS_PASSWORD_FILE)",
        default_factory=lambda: os.environ.get("SPECDEC_REDIS_PASSWORD_FILE"))


@dataclass
class OrchestratorSettings:
    """Everything the orchestrator runs by, built once from its flags (from_args) and checked there, then handed
    down whole: build_servicer(settings), OrchestratorServicer(settings, connections)."""
    server: ServerSettings = field(default_factory=ServerSettings)
    loop: LoopConfig = field(default_factory=LoopConfig)
    auth_tokens: list[str] = field(default_factory=list)  # read from --auth-tokens-file
    admin_tokens: list[str] = field(default_factory=list)  # read from --admin-tokens-file
    store_url: str = ""  # --redis with the password of --redis-password-file ('': --redis as given)

    @property
    def max_running(self) -> int:
        """--max-running as a number (0: auto, what the target pool serves)."""
        return 0 if self.server.max_running == "auto" else int(self.server.max_running)

    @property
    def session_store_url(self) -> str:
        return self.store_url or self.server.redis

    def problems(self) -> list[str]:
        """One line for each bad flag or combination of flags (empty: all is well)."""
        return [*_server_problems(self.server), *_loop_problems(self.loop)]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "OrchestratorSettings":
        """The settings of `specdec serve orchestrator`'s flags, checked before anything process-wide is set up;
        the bearer tokens and the Redis password are read from their files (never from the command line)."""
        from specdec.core.grpc_util import StartupError
        from specdec.core.security import read_secret, require_public_auth, url_with_password

        out = cls(settings.from_args(ServerSettings, args), settings.from_args(LoopConfig, args))
        if problems := out.problems():
            raise SystemExit("\n".join(problems))
        out.auth_tokens, out.admin_tokens = require_public_auth(args)
        if args.redis_password_file:
            if "://" not in args.redis or args.redis.startswith("memory"):
                raise StartupError(f"--redis-password-file needs a redis:// store URL, not {args.redis!r}")
            out.store_url = url_with_password(args.redis, read_secret(args.redis_password_file, "the Redis password"))
        return out


def _server_problems(s: ServerSettings) -> list[str]:
    out = []
    if not s.startup_timeout_s > 0:
        out.append(f"--startup-timeout-s must be positive, got {s.startup_timeout_s}")
    if s.max_sessions < 1 or s.max_sessions_per_principal < 0:
        out.append("--max-sessions must be at least 1 and --max-sessions-per-principal 0 (= --max-sessions) or more")
    if not (s.max_running == "auto" or (s.max_running.isdigit() and int(s.max_running) >= 1)):
        out.append(f"--max-running must be auto or at least 1, got {s.max_running!r}")
    if not s.queue_timeout_s > 0:
        out.append(f"--queue-timeout-s must be positive, got {s.queue_timeout_s}")
    if not s.resolve_interval_s > 0:
        out.append(f"--resolve-interval-s must be positive, got {s.resolve_interval_s}")
    if not 0.1 <= s.session_lease_s <= 3600:
        out.append(f"--session-lease-s must be between 0.1 and 3600 seconds, got {s.session_lease_s}")
    for flag, addresses in (("--target", s.target), ("--draft", s.draft)):
        for address in (a.strip() for a in (addresses or "").split(",")):
            if is_dns(address):
                try:
                    parse_dns(address)
                except ValueError as e:
                    out.append(f"{flag}: {e}")
    return out


def _loop_problems(c: LoopConfig) -> list[str]:
    out = []
    if not 0 <= c.tree_budget <= 64 or not 0 <= c.tree_branch <= 16 or not 0 <= c.tree_branch_below <= 1:
        out.append("--tree-budget must be in 0..64, --tree-branch in 0..16, --tree-branch-below in [0, 1]")
    if c.pipeline_max_sessions < 0:
        out.append(f"--pipeline-max-sessions must be 0 (no limit) or more, got {c.pipeline_max_sessions}")
    if not 1 <= c.max_draft_len:
        out.append(f"--max-draft-len must be at least 1, got {c.max_draft_len}")
    return out
