"""Several orchestrator processes on one Redis: any of them serves, resumes, reads or cancels any session.

Real processes on loopback: one Redis, one target, one draft, orchestrators A and B (`specdec serve orchestrator`
twice, the same --redis), as two replicas behind a load balancer would be. A session streaming on A is read and
cancelled through B; A is SIGKILLed mid-stream and the client resumes the session through B (`specdec generate
--resume`), which waits for A's lease to run out (at most --session-lease-s) and continues it: the tokens the
client saw plus the resumed ones are exactly the target-only reference.
"""

import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from launcher.stack import ServiceProcess
from specdec.client import GenerationInterrupted, SpecdecClient
from specdec.v1 import orchestrator_pb2 as opb
from tests.harness import DRAFT_EARLY, TARGET

pytestmark = pytest.mark.serial  # timing-sensitive: runs after the parallel part, alone (scripts/test.sh)

PROMPT = [1, 5, 9, 12, 5, 9]
MAX_NEW = 400  # long enough to still be streaming when the test acts (a few seconds on a loaded CPU)
LEASE_S = 2.0
COMMON = ["--device", "cpu", "--dtype", "float32", "--threads", "1"]


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multi-orchestrator")
    target = ServiceProcess("target", ["target", "--model", TARGET, "--listen", "127.0.0.1:0", *COMMON], logs)
    draft = ServiceProcess("draft", ["draft", "--strategy", "model", "--model", DRAFT_EARLY, "--listen",
                                     "127.0.0.1:0", *COMMON], logs)
    procs = [target.start(), draft.start()]
    try:
        target_addr, draft_addr = target.wait_ready(180), draft.wait_ready(180)
        orchestrators = {}
        for name in ("A", "B"):
            orchestrators[name] = ServiceProcess(
                f"orchestrator-{name}", ["orchestrator", "--listen", "127.0.0.1:0", "--target", target_addr,
                                         "--draft", draft_addr, "--redis", redis_url, "--draft-len", "3",
                                         "--session-lease-s", str(LEASE_S), "--http-listen", ""], logs)
            procs.append(orchestrators[name].start())
        for p in orchestrators.values():
            p.wait_ready(180)
        yield orchestrators
    finally:
        for p in reversed(procs):
            p.kill()  # nothing to drain: the test is over


@pytest.fixture(scope="module")
def reference(cluster):
    with SpecdecClient(cluster["B"].address, timeout_s=120) as client:
        return client.generate(PROMPT, max_new_tokens=MAX_NEW, speculation=False, ignore_eos=True).token_ids


def _open_stream(client):
    """A greedy speculative stream and its first message with tokens."""
    stream = client.stream(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    for msg in stream:
        if msg.token_ids:
            return stream, msg
    raise AssertionError("the stream ended without tokens")


def test_get_and_cancel_through_the_other_orchestrator(cluster, reference):
    with SpecdecClient(cluster["A"].address, timeout_s=120) as a, SpecdecClient(cluster["B"].address) as b:
        stream, first = _open_stream(a)
        sid = first.session_id
        info = b.get_session(sid)  # A streams it; B reads what is stored
        assert info.status == "running" and info.prompt_tokens == len(PROMPT)
        assert list(info.generated_token_ids) == reference[:len(info.generated_token_ids)]
        assert b.cancel(sid) is True  # A's next commit sees the request and ends the stream
        received = list(first.token_ids)
        msgs = list(stream)
        received += [t for m in msgs for t in m.token_ids]
        assert msgs[-1].finish_reason == opb.FINISH_REASON_CANCELLED, "the stream on A was not cancelled"
        assert len(received) < MAX_NEW and received == reference[:len(received)]
        info = b.get_session(sid)
        assert info.status == "cancelled" and list(info.generated_token_ids) == received
        # A cancelled session continues where it stopped, on either orchestrator.
        rest = b.generate(resume_session_id=sid, resume_from=len(received))
        assert received + rest.token_ids == reference and rest.finish_reason == "length"
        with pytest.raises(grpc.RpcError) as e:
            b.get_session("no-such-session")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_orchestrator_killed_mid_stream_is_resumed_through_the_other(cluster, reference):
    a_proc, b_addr = cluster["A"], cluster["B"].address
    received, killed_at = [], []

    def kill_a_after_20_tokens(msg):
        received.extend(msg.token_ids)
        if len(received) >= 20 and not killed_at:
            a_proc.kill()  # SIGKILL: no chance to release its lease or to write anything
            killed_at.append(time.monotonic())

    with SpecdecClient(a_proc.address, timeout_s=120) as a:
        with pytest.raises(GenerationInterrupted) as e:
            a.generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True, on_message=kill_a_after_20_tokens)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    sid = e.value.session_id
    assert e.value.resume_from == len(received)  # the client knows where to go on from
    with SpecdecClient(b_addr, timeout_s=120) as b:
        info = b.get_session(sid)  # a session of the dead orchestrator, read through the live one
        assert info.status == "running" and len(info.generated_token_ids) < MAX_NEW, "killed too late to test a resume"
        assert list(info.generated_token_ids)[:len(received)] == received  # all the client saw was stored first
        # The client resumes through B, which waits for A's lease to lapse (nobody renews it), then continues.
        first_at = []
        rest = b.generate(resume_session_id=sid, resume_from=e.value.resume_from,
                          on_message=lambda msg: first_at or first_at.append(time.monotonic()))
        assert received + rest.token_ids == reference
        assert rest.finish_reason == "length" and rest.stats["generated_tokens"] == MAX_NEW
    # B's first message came once the lease A had just set (a commit sets it to LEASE_S) ran out: not before
    # (the lease fenced B out), and not much after (B polls the lease, it does not wait a fixed time).
    waited = first_at[0] - killed_at[0]
    assert LEASE_S / 2 < waited < LEASE_S + 1.5, f"B answered {waited:.2f} s after A died (lease {LEASE_S} s)"
    # A replay of the finished session through B, as a person would type it.
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--address", b_addr, f"--resume={sid}",
                          "--resume-from", "100", "--json"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == reference[100:]


def test_cancel_of_a_dead_orchestrators_session_is_recorded(cluster, reference):
    """CancelSession through B of a session whose orchestrator died mid-stream: nobody will read a cancel flag, so
    B waits the dead stream's lease out and records the cancellation itself."""
    a_proc, b_addr = cluster["A"], cluster["B"].address
    if not a_proc.alive():  # killed by the test above: a fresh A on the same address
        a_proc.start()
        a_proc.wait_ready(180)
    with SpecdecClient(a_proc.address, timeout_s=120) as a:
        stream, first = _open_stream(a)
        a_proc.kill()
        killed_at = time.monotonic()
    sid = first.session_id
    with SpecdecClient(b_addr, timeout_s=120) as b:
        assert b.cancel(sid) is True
        waited = time.monotonic() - killed_at
        assert LEASE_S / 2 < waited < LEASE_S + 1.5, f"{waited:.2f} s: not the wait for the dead stream's lease"
        info = b.get_session(sid)
        assert info.status == "cancelled" and info.finish_reason == opb.FINISH_REASON_CANCELLED
        stored = list(info.generated_token_ids)
        assert len(stored) < MAX_NEW and stored == reference[:len(stored)]
        # Cancelled is not lost: a resume goes on from what was stored.
        rest = b.generate(resume_session_id=sid, resume_from=len(stored))
        assert stored + rest.token_ids == reference
