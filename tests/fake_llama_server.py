"""A stand-in for llama.cpp's llama-server, speaking the part of its API the benchmark uses: /health (503 while
"loading", then 200), /props (the command line it got) and a streamed /v1/completions whose chunks carry
`__verbose.tokens` as llama-server's do with return_tokens + verbose. Greedy "decoding" is a fixed function of the
prompt, so a test knows the tokens to expect: token i = (sum(prompt) + 7 i) % 1000, EOS (2) ends a request unless
ignore_eos. At most -np requests decode at once; the rest wait, as llama-server's queue does.

    python tests/fake_llama_server.py -m MODEL --port P -np N [...]   (unknown flags accepted)
    FAKE_LLAMA_SERVER_MODE=exit|never-ready  changes its behaviour for the failure tests"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EOS = 2
TOKEN_DELAY_S = 0.002


def expected_tokens(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    out = []
    for i in range(max_tokens):
        t = (sum(prompt) + 7 * i) % 1000
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--port", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("-np", type=int, default=1)
    args, _ = p.parse_known_args()
    mode = os.environ.get("FAKE_LLAMA_SERVER_MODE", "")
    if mode == "exit":
        print("error: invalid argument: --no-such-flag", flush=True)
        return 1
    ready_at = time.monotonic() + 0.3
    slots = threading.Semaphore(args.np)
    argv = sys.argv[1:]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                ok = mode != "never-ready" and time.monotonic() >= ready_at
                self._json(200 if ok else 503, {"status": "ok" if ok else "loading model"})
            elif self.path == "/props":
                self._json(200, {"argv": argv})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/completions" or not isinstance(body.get("prompt"), list):
                self._json(400, {"error": "token-id prompts on /v1/completions only"})
                return
            tokens = expected_tokens(body["prompt"], int(body["max_tokens"]), bool(body.get("ignore_eos")))
            with slots:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for t in tokens:
                    time.sleep(TOKEN_DELAY_S)
                    self._chunk({"choices": [{"text": f"<{t}>", "finish_reason": None}],
                                 "__verbose": {"tokens": [t]}})
                self._chunk({"choices": [{"text": "", "finish_reason": "length"}],
                             "usage": {"completion_tokens": len(tokens), "prompt_tokens": len(body["prompt"])}})
                self._write(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, event: dict) -> None:
            self._write(b"data: " + json.dumps(event).encode() + b"\n\n")

        def _write(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
