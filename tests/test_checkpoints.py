"""Checkpoints as people have them: sharded safetensors (test_families.py serves them), PyTorch
.bin weights where no safetensors exist, a Hugging Face hub id from the local Hugging Face
cache and an Ollama model name from the local Ollama store -- all without any network."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from probity.engine.loader import ModelNotFound, default_model_path, load, resolve


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tiny_model_dir, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "refs" / "v2").write_text("4567ef01")
    for commit in ("0123abcd", "4567ef01"):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert resolve("acme/tiny-llama") == (repo / "snapshots" / "0123abcd", "acme/tiny-llama")
    assert resolve("acme/tiny-llama@v2")[0] == repo / "snapshots" / "4567ef01"
    assert resolve("acme/tiny-llama@0123abcd")[0] == repo / "snapshots" / "0123abcd"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ModelNotFound) as e:
        resolve("acme/tiny-llama")
    assert "acme/tiny-llama" in str(e.value) and str(tmp_path / "elsewhere") in str(e.value)


def test_an_ollama_name_resolves_to_its_gguf_blob(tmp_path, monkeypatch):
    gguf = default_model_path()
    digest = "sha256:" + "ab" * 32
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / digest.replace(":", "-")).symlink_to(gguf)
    manifest = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    assert resolve("smollm2:135m") == (blobs / digest.replace(":", "-"), "smollm2:135m")
    with pytest.raises(ModelNotFound, match="no Ollama manifest"):
        resolve("smollm2:1.7b")


def test_bin_weights_load_where_no_safetensors_exist_with_a_warning(tiny_hf, tmp_path, capfd):
    model, tok = tiny_hf
    folder = tmp_path / "bin-model"
    folder.mkdir()
    model.config.save_pretrained(folder)   # transformers 5 writes only safetensors: the .bin is made by hand
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tok.save_pretrained(folder)
    assert not list(folder.glob("*.safetensors")) and list(folder.glob("*.bin"))
    loaded = load(str(folder))
    assert "warning: no safetensors" in capfd.readouterr().err
    for (name, a), b in zip(model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a, b), name
