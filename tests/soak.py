"""A bounded mixed soak against a live server (loopback only): lm-eval-shaped echo arrays,
seeded sampled streams with logprobs, greedy chat with top logprobs, tokenizer calls, clients
that drop the socket mid-stream, malformed bodies — and one SIGKILL of the engine halfway.

Used by tests/test_soak.py on both backends, and runnable by hand against the default model
(`python tests/soak.py --seconds 150 --clients 24`) for the figures in the closing notes."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx

MALFORMED = [  # (body, code, param): each a client fault with its named 400, whatever the engine's state
    ({"prompt": "ok", "logprobs": 99}, "invalid_value", "logprobs"),
    ({"prompt": [[1, 2], "x"]}, "invalid_type", "prompt[1]"),
    ({"prompt": "ok", "max_tokens": -1}, "invalid_value", "max_tokens"),
    ('{"model": "M", "prompt": "a\\ud800"}', "invalid_value", "prompt"),
    ('{"model": "M", "prompt": ', "invalid_json", None),
    ("[]", "invalid_body", None),
]


@dataclass
class Outcome:
    kind: str
    status: int          # 0: the client dropped the socket itself
    code: str | None
    t0: float
    t1: float
    complete: bool = True  # a stream that ended with [DONE]


def _code(r: httpx.Response) -> str | None:
    try:
        j = r.json()
    except ValueError:
        return None
    return (j.get("error") or {}).get("code") if isinstance(j, dict) else None


class Soak:
    def __init__(self, url: str, model: str, port: int, seed: int = 0):
        self.url, self.model, self.port = url, model, port
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.texts = ["The capital of France is", "Question: what is 2 + 2?\nAnswer:", "Once upon a time",
                      "def add(a, b):\n    return", "Paris is the capital of"]

    def pick(self, xs):
        with self.lock:
            return self.rng.choice(xs)

    def record(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)

    # ------------------------------------------------------------ traffic kinds
    def echo_array(self, client: httpx.Client) -> None:
        ctx = self.pick(self.texts)
        body = {"model": self.model, "prompt": [ctx + c for c in (" yes", " no", " maybe", " Paris")],
                "echo": True, "logprobs": 1, "max_tokens": 0}
        self._post(client, "echo_array", "/v1/completions", body)

    def seeded_stream(self, client: httpx.Client) -> None:
        body = {"model": self.model, "prompt": self.pick(self.texts), "max_tokens": 16, "temperature": 1.0,
                "seed": self.pick(range(1000)), "logprobs": 2, "stream": True}
        t0 = time.monotonic()
        with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            text = r.read().decode()
        self.record(Outcome("seeded_stream", r.status_code, None if r.status_code == 200 else _code(r), t0,
                            time.monotonic(), text.endswith("data: [DONE]\n\n") if r.status_code == 200 else True))

    def greedy_chat(self, client: httpx.Client) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.pick(self.texts)}],
                "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        self._post(client, "greedy_chat", "/v1/chat/completions", body)

    def tokenize(self, client: httpx.Client) -> None:
        self._post(client, "tokenize", "/tokenize", {"prompt": self.pick(self.texts)})

    def malformed(self, client: httpx.Client) -> None:
        body, code, param = self.pick(MALFORMED)
        data = body.replace('"M"', json.dumps(self.model)) if isinstance(body, str) else \
            json.dumps({"model": self.model, **body})
        t0 = time.monotonic()
        r = client.post(self.url + "/v1/completions", content=data.encode(), headers={"content-type": "application/json"})
        got = (_code(r), r.json()["error"]["param"] if _code(r) else None)
        self.record(Outcome("malformed", r.status_code, got[0] if got == (code, param) else f"WRONG {got}", t0,
                            time.monotonic()))

    def dropper(self, client: httpx.Client) -> None:
        """Starts a stream, reads its first bytes, and hangs up."""
        body = json.dumps({"model": self.model, "prompt": self.pick(self.texts), "max_tokens": 64,
                           "stream": True}).encode()
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            c.recv(256)
        self.record(Outcome("dropped", 0, None, t0, time.monotonic()))

    def _post(self, client, kind: str, path: str, body: dict) -> None:
        t0 = time.monotonic()
        r = client.post(self.url + path, json=body)
        self.record(Outcome(kind, r.status_code, None if r.status_code == 200 else _code(r), t0, time.monotonic()))

    KINDS = ("echo_array", "seeded_stream", "greedy_chat", "tokenize", "malformed", "dropper")

    # ------------------------------------------------------------ the run
    def probe(self) -> list:
        r = httpx.post(self.url + "/v1/completions", json={
            "model": self.model, "prompt": "The quick brown fox jumps over", "max_tokens": 6, "temperature": 0,
            "echo": True, "logprobs": 5}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    def run(self, seconds: float, clients: int, kill_at: float | None, engine_pid) -> dict:
        deadline = time.monotonic() + seconds
        marks: dict[str, float] = {}

        def worker(i: int) -> None:
            with httpx.Client(timeout=180) as client:
                while time.monotonic() < deadline:
                    getattr(self, self.pick(self.KINDS))(client)

        def killer() -> None:
            time.sleep(kill_at)
            pid = engine_pid()
            marks["kill"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while True:  # the server has seen it once /health stops saying ok
                h = httpx.get(self.url + "/health", timeout=30)
                if h.status_code != 200 or h.json()["engine"]["pid"] != pid:
                    marks["down"] = time.monotonic()
                    break
                time.sleep(0.01)
            while True:
                h = httpx.get(self.url + "/health", timeout=30)
                if h.status_code == 200 and h.json()["engine"]["pid"] != pid:
                    marks["back"] = time.monotonic()
                    return
                time.sleep(0.05)

        with cf.ThreadPoolExecutor(clients + 1) as pool:
            futs = [pool.submit(worker, i) for i in range(clients)]
            if kill_at is not None:
                futs.append(pool.submit(killer))
            for f in futs:
                f.result()
        return marks

    def verdict(self, marks: dict) -> tuple[Counter, list[str]]:
        """Counts by (kind, status, code), and every outcome the contract does not allow."""
        counts: Counter = Counter()
        bad = []
        kill, down = marks.get("kill"), marks.get("down")
        for o in self.outcomes:
            counts[(o.kind, o.status, o.code)] += 1
            at_kill = kill is not None and o.t0 <= down and o.t1 >= kill
            if o.kind == "dropped":
                continue
            if o.kind == "malformed":
                if o.status != 400 or (o.code or "").startswith("WRONG"):
                    bad.append(f"client fault answered {o.status} {o.code}")
            elif o.status == 200:
                if not o.complete and not at_kill:
                    bad.append(f"{o.kind} stream cut short outside the kill")
            elif not (at_kill and o.status == 500 and o.code == "engine_error"):
                bad.append(f"{o.kind} answered {o.status} {o.code} (t0 {o.t0 - (kill or 0):+.2f}s from the kill)")
        return counts, bad


def server_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle(url: str, within: float = 30.0) -> dict:
    """/health once nothing is in flight or abandoned any more."""
    deadline = time.monotonic() + within
    while True:
        h = httpx.get(url + "/health", timeout=30).json()
        if (h["status"] == "ok" and h["engine"]["in_flight"] == 0 and h["engine"]["abandoned"] == 0
                and h["active"] == 0 and h["queued"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import LiveServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--args", default="--threads 2", help="probity serve arguments")
    a = ap.parse_args()
    s = LiveServer(a.args.split(), startup=600)
    try:
        model = s.get("/v1/models").json()["data"][0]["id"]
        soak = Soak(s.url, model, s.port)
        before, rss0 = soak.probe(), server_rss(s.proc.pid)
        marks = soak.run(a.seconds, a.clients, a.seconds / 2, s.engine_pid)
        h = settle(s.url)
        after, rss1 = soak.probe(), server_rss(s.proc.pid)
        counts, bad = soak.verdict(marks)
        for k, n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
            print(f"{k[0]:>14} {k[1]:>4} {k[2] or '':<24} {n:>6}")
        print(f"requests {sum(counts.values())}, contract breaks {len(bad)}: {bad[:5]}")
        print(f"restart under load: {marks['back'] - marks['kill']:.2f}s (kill to /health ok with the new pid)")
        print(f"probe identical before and after: {before == after}; in flight after: {h['engine']['in_flight']}, "
              f"abandoned {h['engine']['abandoned']}")
        print(f"server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB; engine memory {h['engine']['memory']}")
    finally:
        s.stop()
