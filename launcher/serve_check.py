"""`specdec serve`'s authentication refusal without importing torch.

A service's module imports torch and transformers (seconds) before its own argument check runs; an operator who
left a listener beyond loopback unauthenticated should hear so at once. This reads only the flags the check needs
(the same TLS flags and orchestrator settings, so the same defaults and environment variables) and runs the same
check as the service (specdec/core/security.py). It only refuses: anything it cannot judge for certain (--help,
an abbreviated flag, a flag without its value, an unreadable tokens file) is left to the full parser and the
service, which check again.
"""

from __future__ import annotations

import argparse

from specdec.core.grpc_util import StartupError, add_tls_arguments
from specdec.core.security import UnauthenticatedListener, require_mtls, require_public_auth


class _Undecided(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # a malformed command line: the full parser says what is wrong
        raise _Undecided(message)


def _parser(service: str) -> _Parser:
    p = _Parser(add_help=False, allow_abbrev=False)
    add_tls_arguments(p)
    if service == "orchestrator":
        from orchestrator.settings import ServerSettings  # dataclasses only: no torch
        from specdec.core import settings

        settings.add_arguments(p, ServerSettings)
    else:  # the service's default --listen is loopback: only an explicit one can be refused
        p.add_argument("--listen", default=None)
    return p


def refusal(argv: list[str]) -> UnauthenticatedListener | None:
    """argv: what follows `specdec serve`. The refusal the service would give, or None (start it and let it check)."""
    if not argv or argv[0] not in ("target", "draft", "orchestrator"):
        return None
    service, rest = argv[0], argv[1:]
    p = _parser(service)
    known = {s for a in p._actions for s in a.option_strings}
    for arg in rest:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not name.startswith("-") or name in known:
            continue
        # -h, or a prefix argparse would expand to one of the flags read here: the full parser decides.
        if name in ("-h", "--help") or (name.startswith("--") and any(k.startswith(name) for k in known | {"--help"})):
            return None
    try:
        args, _ = p.parse_known_args(rest)
        if service == "orchestrator":
            require_public_auth(args)
        elif args.listen is not None:
            require_mtls(args)
    except UnauthenticatedListener as e:
        return e
    except (_Undecided, StartupError):
        return None
    return None
