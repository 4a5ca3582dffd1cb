"""A stand-in for llama.cpp's `llama-server` in the bench peer's tests: the same flags, ``/health`` and the
``/completion`` answers' shape (non-streamed JSON with ``tokens``; streamed ``data: {...}`` events), no model.

Its greedy "model": the i-th generated token of a prompt is ``(sum(prompt) + i) % 1000 + 32`` (`answer`). It answers
503 on ``/health`` for its first two polls (a model still loading), and 400 with an ``error`` when a request lacks
the fields the bench must send. ``FAKE_LLAMA_ARGV`` (a path): where it writes its argv as JSON. With
``FAKE_LLAMA_CRASH=1`` it kills itself with SIGSEGV at start unless given ``--no-repack`` (as llama.cpp's AMX
buffer did on a Xeon).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REQUIRED = {"ignore_eos": True, "temperature": 0.0, "cache_prompt": False, "return_tokens": True}


def answer(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 + 32 for i in range(n)]


class Handler(BaseHTTPRequestHandler):
    health_polls = 0

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
        if self.path != "/health":
            return self._json(404, {"error": {"message": "not found"}})
        Handler.health_polls += 1
        if Handler.health_polls <= 2:
            return self._json(503, {"error": {"message": "Loading model"}})
        return self._json(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        bad = [k for k, v in REQUIRED.items() if body.get(k) != v]
        prompt = body.get("prompt")
        if self.path != "/completion" or bad or not isinstance(prompt, list) or not prompt:
            return self._json(400, {"error": {"message": f"bad request: {bad or 'prompt'}"}})
        tokens = answer(prompt, int(body["n_predict"]))
        if not body.get("stream"):
            return self._json(200, {"content": "", "tokens": tokens, "stop": True,
                                    "tokens_predicted": len(tokens), "tokens_evaluated": len(prompt)})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in tokens:
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": [t], "stop": False}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: " + json.dumps({"content": "", "tokens": [], "stop": True,
                                                  "timings": {}}).encode() + b"\n\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("-m", "-t", "-tb", "-np", "-c", "--host", "--port"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--cont-batching", action="store_true")
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args()
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "w") as f:
            json.dump(sys.argv[1:], f)
    if os.environ.get("FAKE_LLAMA_CRASH") == "1" and not args.no_repack:
        print("init: llama threadpool init, n_threads = 2", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
