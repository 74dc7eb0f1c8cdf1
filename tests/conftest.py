"""Fixtures: a tiny random-weight Llama with a real byte-level BPE tokenizer, and live servers."""
from __future__ import annotations

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


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1"])
    yield s
    s.stop()


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


@pytest.fixture(scope="session")
def default_server():
    s = LiveServer(["--threads", "1"], startup=600)  # torch's default threads thrash on a shared 2-core box
    yield s
    s.stop()
