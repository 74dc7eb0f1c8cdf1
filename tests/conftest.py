"""Fixtures: a tiny random-weight Llama with a real byte-level BPE tokenizer, and live servers."""
from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_ID = "tiny-llama"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# enforce_eager skips torch.compile: a cold start in seconds instead of minutes, same kernels' math
VLLM_ARGS = ("--backend", "vllm", "--threads", "1", "--kv-cache-gib", "1", "--vllm-arg", "enforce_eager=true")
DEFAULT_ARGS = ("--threads", "1")  # torch's default threads thrash on a shared 2-core box
API_KEY = "k3y"  # the key of `keyed_server`
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "Prices: 5€, 10£, 7¥ — naïve café déjà vu.", "日本語のテキストと中文文本。", "Emoji: 😀🚀🎉 and more ✨",
    "def f(x):\n    return x * 2\n", "Hello, world! Hello again; hello there.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000", "Ünïcödé text with äccents, ß and Ωmega.",
] * 20


def build_tiny_model(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions than the default init, so text is not uniform noise
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / TINY_ID)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, args: list[str], env: dict | None = None, startup: float = 180.0, expect_ready: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"probity-test-{self.port}.log"
        self.log = open(self.log_path, "wb")
        if "--batch-dir" not in args:
            # a batch store of its own: no test server resumes another's batch jobs
            args = [*args, "--batch-dir", str(self.log_path.with_suffix(".batches"))]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "probity", "serve", "--port", str(self.port), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)
        if expect_ready:
            self.wait_ready(startup)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout}s: {self.log_path.read_text()[-3000:]}")

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=kw.pop("timeout", 60), **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def engine_pid(self) -> int:
        return self.get("/health").json()["engine"]["pid"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Servers:
    """Live servers, one per set of flags and environment, started on first use and shared by
    every test that asks for the same flags; restarted when a test has ended one (the next
    get() sees the dead process), so no test depends on running before or after one that
    kills its server. At most `keep` of them stay alive besides the pinned ones: each server on
    the tiny model holds a 2 GiB KV pool (--kv-cache-gib), so the least recently used is
    stopped first. A test that must end its own server takes a fresh() one, never shared."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.live: collections.OrderedDict[tuple, LiveServer] = collections.OrderedDict()
        self.pinned: set[tuple] = set()
        self.fresh_ones: list[LiveServer] = []

    @staticmethod
    def key(args, env) -> tuple:
        return tuple(args), tuple(sorted((env or {}).items()))

    def get(self, args, env: dict | None = None, *, pin: bool = False, startup: float = 180.0) -> LiveServer:
        k = self.key(args, env)
        s = self.live.pop(k, None)
        if s is not None and s.proc.poll() is not None:   # a test ended it
            s.stop()
            s = None
        if s is None:
            unpinned = [other for other in self.live if other not in self.pinned]   # least recently used first
            while len(unpinned) >= self.keep:
                self.live.pop(unpinned.pop(0)).stop()
            s = LiveServer(list(args), env=env, startup=startup)
        else:
            s.wait_ready(startup)   # a previous test may have left its engine restarting
        self.live[k] = s
        if pin:
            self.pinned.add(k)
        return s

    def release(self, args, env: dict | None = None) -> None:
        """Stop the shared server for these flags now (a test that needs the machine to itself)."""
        k = self.key(args, env)
        s = self.live.pop(k, None)
        self.pinned.discard(k)
        if s is not None:
            s.stop()

    def fresh(self, args, env: dict | None = None, **kw) -> LiveServer:
        """A server of its own, for a test that ends it (it is stopped at the end of the session
        at the latest)."""
        s = LiveServer(list(args), env=env, **kw)
        self.fresh_ones.append(s)
        return s

    def close(self) -> None:
        while self.live:
            self.live.popitem()[1].stop()
        for s in self.fresh_ones:
            s.stop()


@pytest.fixture(scope="session")
def servers():
    s = Servers()
    yield s
    s.close()


def tiny_args(tiny_model_dir, *flags: str) -> list[str]:
    """The flags of a server on the tiny model: `tiny_server`'s, then `flags`."""
    return ["--model", str(tiny_model_dir), "--threads", "1", *flags]


@pytest.fixture(scope="session")
def tiny_server(servers, tiny_model_dir):
    return servers.get(tiny_args(tiny_model_dir), pin=True)


@pytest.fixture(scope="session")
def uncached_server(servers, tiny_model_dir):
    """The tiny model without the prefix cache (so no echo-cache answer either): where a test
    compares what a cache could otherwise answer and a salt cannot keep apart -- the n choices
    of one request, or lm-eval's requests, which carry no salt."""
    return servers.get(tiny_args(tiny_model_dir, "--no-prefix-cache"), pin=True)


@pytest.fixture(scope="session")
def tiny_client(tiny_server):
    import openai

    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    """The same tiny model in-process, for comparing numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tok


@pytest.fixture
def keyed_server(servers, tiny_model_dir) -> LiveServer:
    """The tiny model behind --api-key API_KEY (shared by the modules that need a key)."""
    return servers.get(tiny_args(tiny_model_dir, "--api-key", API_KEY))


@pytest.fixture(scope="session")
def default_server(servers):
    return servers.get(DEFAULT_ARGS, pin=True, startup=600)


@pytest.fixture(scope="session")
def vllm_available() -> None:
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must have .venv-vllm: `make test` runs `make setup-vllm` first")
        pytest.skip("vLLM is not set up here: run `make setup-vllm`")


@pytest.fixture
def vllm_server(servers, vllm_available) -> LiveServer:
    """The vLLM backend on the default model, shared by every test (a vLLM start is the slow
    part), and started again when a test has ended it."""
    return servers.get(VLLM_ARGS, pin=True, startup=600)
