"""A fake engine for protocol and capability tests (never for behaviour tests).

    python fake_engine.py SCENARIO LOGFILE

Writes every frame it receives to LOGFILE (one kind+id per line) and answers according to
SCENARIO. "less" declares fewer capabilities than the real engine and answers every
generate with one token "A".
"""
import json
import os
import sys
import time

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
        "eos_token": None, "pad_token": None, "dtype": "float32", "fingerprint": "fp_fake", "chat_template": None, "source": "fake"},
        "capabilities": c, "concurrency": 4})


def one_token(rid, members=1):
    send("ACCEPT", rid, {"members": [{"prompt_tokens": 1, "cached_tokens": 0}] * members})
    for m in range(members):
        send("TOKEN", rid, {"member": m, "choice": 0, "tokens": [{"id": 65, "bytes": "41", "logprob": -0.5}]})
    send("DONE", rid, {"choices": [{"member": m, "choice": 0, "finish_reason": "length", "stop": None,
                                    "completion_tokens": 1} for m in range(members)],
                       "usage": {"prompt_tokens": members, "completion_tokens": members, "cached_tokens": 0}})


def hostile(rid: int, name: str) -> None:
    """Misbehave as `name` says, in answer to request `rid`."""
    accept = P.encode("ACCEPT", rid, {"members": [{"prompt_tokens": 1, "cached_tokens": 0}]})
    token = P.encode("TOKEN", rid, {"member": 0, "choice": 0, "tokens": [{"id": 65, "bytes": "41", "logprob": -0.5}]})
    done = P.encode("DONE", rid, {"choices": [{"member": 0, "choice": 0, "finish_reason": "length", "stop": None,
                                               "completion_tokens": 2}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}})
    if name == "ok":
        raw(accept + token + token + done)
    elif name == "bad_header":
        raw(accept + b"what is this\n")
    elif name == "oversize_length":
        raw(accept + b"TOKEN %d 999999999\n" % rid)
    elif name == "short_payload_then_exit":
        raw(accept + b"TOKEN %d 100\n{\"member\":0" % rid)
        os._exit(0)
    elif name == "short_payload_then_stall":
        raw(accept + b"TOKEN %d 100\n{\"member\":0" % rid)
    elif name == "missing_terminator":
        raw(accept + token[:-1] + b"X")
    elif name == "bad_json":
        raw(accept + b"TOKEN %d 5\n{oops\n" % rid)
    elif name == "unknown_kind":
        raw(accept + b"FROB %d 2\n{}\n" % rid)
    elif name == "foreign_id":
        raw(accept + P.encode("TOKEN", rid + 1000, {"member": 0, "choice": 0, "tokens": [
            {"id": 65, "bytes": "41", "logprob": -0.5}]}))
    elif name == "second_accept":
        raw(accept + token + accept)
    elif name == "token_before_accept":
        raw(token + accept)
    elif name == "member_out_of_range":
        raw(accept + P.encode("TOKEN", rid, {"member": 3, "choice": 0, "tokens": [
            {"id": 65, "bytes": "41", "logprob": -0.5}]}))
    elif name == "echo_out_of_order":
        pos = {"id": 65, "bytes": "41", "logprob": None, "top": None}
        raw(accept + P.encode("ECHO", rid, {"member": 0, "start": 5, "positions": [pos]}))
    elif name == "frame_after_done":
        raw(accept + token + done + token)
    elif name == "silence":
        pass
    elif name == "die_before_accept":
        os._exit(1)
    elif name == "die_after_accept":
        raw(accept)
        os._exit(1)
    elif name == "die_mid_echo":
        pos = {"id": 65, "bytes": "41", "logprob": None, "top": None}
        raw(accept + P.encode("ECHO", rid, {"member": 0, "start": 0, "positions": [pos]}))
        time.sleep(0.2)
        os._exit(1)
    elif name == "die_mid_stream":
        raw(accept + token)
        time.sleep(0.3)
        os._exit(1)
    elif name == "grp_between_tokens":
        grp = b"".join(P.encode(k, rid, {"x": 1}) for k in ("GRPP", "GRPG", "GRPS", "GRPE"))
        raw(accept + token + grp + token + P.encode("GRPP", 0, {}) + done)
    elif name == "close_stdin":
        os.close(0)  # the server's next write to us fails; stay alive so EOF is not what it sees
        with open(logfile, "a") as log:
            log.write("STDIN CLOSED\n")  # what a test waits for before it writes again
        time.sleep(60)
    elif name == "error_zero":
        raw(P.encode("ERROR", 0, {"code": "INTERNAL", "message": "boom"}))
    else:
        raise SystemExit(f"unknown scenario {name}")


if scenario == "less":
    ready(max_logprobs=5, echo=False, token_ids=False, seed=False, chat_template=False, max_members=4)
elif scenario == "crash_after_first_start":
    # the first engine comes up and dies; every restart dies before READY
    marker = logfile + ".started"
    if os.path.exists(marker):
        sys.exit(1)
    open(marker, "w").close()
    ready()
    time.sleep(0.5)
    sys.exit(1)
else:
    ready()

with open(logfile, "a") as log:
    while True:
        f = reader.read()
        if f is None:
            sys.exit(0)
        log.write(f"{f.kind} {f.id} {json.dumps(f.payload, sort_keys=True)}\n")
        log.flush()
        if f.kind == "SUBMIT" and scenario == "hostile":
            # the scenario is the prompt text, or the last message's content for chat requests
            member = f.payload["members"][0]
            hostile(f.id, member.get("text") or (member.get("messages") or [{}])[-1].get("content", "ok"))
        elif f.kind == "SUBMIT":
            one_token(f.id, len(f.payload.get("members", [{}])))
