"""A fake engine for protocol and capability tests (never for behaviour tests).

    python fake_engine.py SCENARIO LOGFILE

Writes every frame it receives to LOGFILE (one kind+id per line) and answers according to
SCENARIO. "less" declares fewer capabilities than the real engine and answers every
generate with one token "A".
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from probity import protocol as P  # noqa: E402

scenario, logfile = sys.argv[1], sys.argv[2]
out = os.fdopen(os.dup(1), "wb", buffering=0)
reader = P.SyncReader(os.fdopen(0, "rb"), "server")


def send(kind, rid, payload):
    out.write(P.encode(kind, rid, payload))


def raw(data: bytes):
    out.write(data)


def ready(**caps):
    c = {"logprobs": True, "max_logprobs": 32, "echo": True, "token_ids": True, "seed": True,
         "chat_template": True, "max_members": 128, "max_choices": 16}
    c.update(caps)
    send("READY", 0, {"protocol": 1, "model": {
        "id": "fake", "context_length": 64, "vocab_size": 100, "eos_token_ids": [0], "bos_token": None,
        "eos_token": None, "dtype": "float32", "fingerprint": "fp_fake", "chat_template": None, "source": "fake"},
        "capabilities": c, "concurrency": 4})


def one_token(rid, members=1):
    send("ACCEPT", rid, {"members": [{"prompt_tokens": 1, "cached_tokens": 0}] * members})
    for m in range(members):
        send("TOKEN", rid, {"member": m, "choice": 0, "tokens": [{"id": 65, "bytes": "41", "logprob": -0.5}]})
    send("DONE", rid, {"choices": [{"member": m, "choice": 0, "finish_reason": "length", "stop": None,
                                    "completion_tokens": 1} for m in range(members)],
                       "usage": {"prompt_tokens": members, "completion_tokens": members, "cached_tokens": 0}})


if scenario == "less":
    ready(max_logprobs=5, echo=False, token_ids=False, seed=False, chat_template=False, max_members=4)
else:
    ready()

with open(logfile, "a") as log:
    while True:
        f = reader.read()
        if f is None:
            sys.exit(0)
        log.write(f"{f.kind} {f.id} {json.dumps(f.payload, sort_keys=True)}\n")
        log.flush()
        if f.kind == "SUBMIT":
            one_token(f.id, len(f.payload.get("members", [{}])))
