"""Helper processes that tests/test_multihost.py runs inside its network namespaces:

    python -m tests.netns_agent agent                         the load client (JSON lines on stdin/stdout)
    python -m tests.netns_agent relay LISTEN UPSTREAM CONTROL  a TCP relay delaying one direction
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
import sys
import threading
import time


def generate_resuming(addresses: list[str], first: int, prompt: list[int], max_new_tokens: int,
                      speculation: bool | None, rpc_timeout_s: float, attempts: int = 6, progress: list | None = None,
                      ) -> dict:
    """One greedy generation through addresses[first]; when its stream breaks after the session started (the
    orchestrator died), resume the session through the next orchestrator from the first token not received, as
    a client behind a load balancer would. `progress` (a list) receives the tokens as they arrive."""
    import grpc

    from specdec.client import GenerationInterrupted, SpecdecClient

    tokens = progress if progress is not None else []
    sid, served, errors = "", [], []
    t0 = time.perf_counter()

    def on_message(msg) -> None:
        if msg.token_ids:
            if msg.offset > len(tokens):
                errors.append(f"hole: a message at offset {msg.offset} after {len(tokens)} tokens")
            del tokens[msg.offset:]  # a resume sends on from the offset asked for: nothing is received twice
            tokens.extend(msg.token_ids)

    for attempt in range(attempts):
        address = addresses[(first + attempt) % len(addresses)]
        served.append(address)
        try:
            with SpecdecClient(address, timeout_s=rpc_timeout_s) as client:
                if sid:
                    r = client.generate(resume_session_id=sid, resume_from=len(tokens), on_message=on_message)
                else:
                    r = client.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0,
                                        speculation=speculation, on_message=on_message)
            return {"token_ids": list(tokens), "finish_reason": r.finish_reason, "stats": r.stats,
                    "wall_s": time.perf_counter() - t0, "session_id": r.session_id, "served_by": served,
                    "resumes": attempt, "errors": errors}
        except GenerationInterrupted as e:  # the session exists: resume it elsewhere
            sid = e.session_id
            errors.append(f"{address}: {e.code().name}: {e.details()}")
        except grpc.RpcError as e:  # refused before a (resumed) stream started: try the next orchestrator
            errors.append(f"{address}: {e.code().name}: {e.details()}")
        time.sleep(0.2)
    return {"error": f"no orchestrator completed the generation in {attempts} attempts: {'; '.join(errors)}",
            "token_ids": list(tokens), "served_by": served}


class Load:
    """Generations running in the background (one thread each), so the test can act while they stream."""

    def __init__(self, req: dict):
        self.progress = [[] for _ in req["prompts"]]
        self.results: list[dict | None] = [None] * len(req["prompts"])
        self.threads = []
        for i, prompt in enumerate(req["prompts"]):
            def run(i=i, prompt=prompt):
                try:
                    self.results[i] = generate_resuming(req["addresses"], i, prompt, req["max_new_tokens"],
                                                        req["speculation"], req["rpc_timeout_s"],
                                                        progress=self.progress[i])
                except Exception as e:  # noqa: BLE001
                    self.results[i] = {"error": f"{type(e).__name__}: {e}"}

            self.threads.append(threading.Thread(target=run, daemon=True))
            self.threads[-1].start()

    def collect(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self.threads):
            return {"error": f"generations still running after {timeout_s} s: tokens so far "
                             f"{[len(p) for p in self.progress]}"}
        errors = [r["error"] for r in self.results if r.get("error")]
        return {"error": "; ".join(errors)} if errors else {"results": self.results}


def _wait_redis(url: str, timeout_s: float) -> bool:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
        except Exception:  # noqa: BLE001
            time.sleep(0.1)
    return False


def _ping(address: str, n: int) -> dict:
    """Median gRPC health-check round trip to a service, in ms."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)  # connect first
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        times.append((time.perf_counter() - t0) * 1e3)
    channel.close()
    return {"median_ms": round(statistics.median(times), 2)}


def agent_main() -> int:
    """Load client in its own namespace (the test process stays in the root namespace)."""
    import grpc

    load: Load | None = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "wait_redis":
                reply = {"ok": _wait_redis(req["url"], req["timeout_s"])}
            elif req["op"] == "ping":
                reply = _ping(req["address"], req["n"])
            elif req["op"] == "generate":  # one after another, prompt i through addresses[i % n]
                results = [generate_resuming(req["addresses"], i, prompt, req["max_new_tokens"], req["speculation"],
                                             req["rpc_timeout_s"]) for i, prompt in enumerate(req["prompts"])]
                errors = [r["error"] for r in results if r.get("error")]
                reply = {"error": "; ".join(errors)} if errors else {"results": results}
            elif req["op"] == "start":  # all at once, in the background
                load = Load(req)
                reply = {"ok": True}
            elif req["op"] == "progress":
                reply = {"tokens": [len(p) for p in load.progress]}
            elif req["op"] == "collect":
                reply = load.collect(req["timeout_s"])
            else:
                reply = {"error": f"unknown op {req['op']}"}
        except grpc.RpcError as e:
            reply = {"error": f"{e.code().name}: {e.details()}"}
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply, default=str), flush=True)
    return 0


def relay_main(listen: str, upstream: str, control: str) -> int:
    """TCP relay on a draft host: bytes from the draft to the rest are held for the current delay (read from the
    control file, in ms), in order, like netem on the draft's egress."""
    lhost, lport = listen.rsplit(":", 1)
    uhost, uport = upstream.rsplit(":", 1)
    delay = [0.0]

    async def poll_control():
        while True:
            try:
                delay[0] = float(pathlib.Path(control).read_text().strip() or 0) / 1e3
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.05)

    async def pump(reader, writer, delayed: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def sender():
            try:
                while True:
                    due, data = await queue.get()
                    if data is None:
                        break
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        task = asyncio.create_task(sender())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                queue.put_nowait((loop.time() + (delay[0] if delayed else 0.0), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, None))
            await task

    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(uhost, int(uport))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pump(client_reader, up_writer, delayed=False),
                             pump(up_reader, client_writer, delayed=True))

    async def main():
        asyncio.create_task(poll_control())
        server = await asyncio.start_server(handle, lhost, int(lport))
        print(f"RELAY_READY {listen} -> {upstream}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["agent"]:
        raise SystemExit(agent_main())
    if sys.argv[1:2] == ["relay"]:
        raise SystemExit(relay_main(*sys.argv[2:5]))
    raise SystemExit("usage: python -m tests.netns_agent agent | relay LISTEN UPSTREAM CONTROL_FILE")
