"""The orchestrator's answer to a replica's cache-miss: resend the whole committed context once (the replica holds
the session through that call); any other error, or a miss of the resend, goes to the caller."""

import grpc
import pytest

from orchestrator.replicas.clients import _call_with_resync


class Refused(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


MISS = Refused(grpc.StatusCode.FAILED_PRECONDITION, "cache-miss: session s holds 0 tokens, request assumes 5")


def scripted(*outcomes):
    """fn for _call_with_resync: records each call's (prefix_len, tokens), raises or returns the next outcome."""
    calls, left = [], list(outcomes)

    def fn(delta):
        calls.append((delta.prefix_len, list(delta.tokens)))
        outcome = left.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return fn, calls


COMMITTED = [1, 2, 3, 4, 5, 6]


def test_a_miss_resends_the_whole_context():
    fn, calls = scripted(MISS, "reply")
    assert _call_with_resync(fn, COMMITTED, 5) == ("reply", True)
    assert calls == [(5, [6]), (0, COMMITTED)]


def test_a_missed_resend_and_other_errors_reach_the_caller():
    fn, calls = scripted(MISS, MISS, "never")
    with pytest.raises(grpc.RpcError) as e:
        _call_with_resync(fn, COMMITTED, 5)
    assert e.value is MISS and calls == [(5, [6]), (0, COMMITTED)]
    other = Refused(grpc.StatusCode.FAILED_PRECONDITION, "sampling parameters differ")
    fn, calls = scripted(MISS, other)
    with pytest.raises(grpc.RpcError) as e:
        _call_with_resync(fn, COMMITTED, 5)
    assert e.value is other and len(calls) == 2
    fn, calls = scripted(Refused(grpc.StatusCode.UNAVAILABLE, "down"))
    with pytest.raises(grpc.RpcError):
        _call_with_resync(fn, COMMITTED, 5)
    assert calls == [(5, [6])]
