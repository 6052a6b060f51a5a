"""Where `reformer import-hf` reads a checkpoint from: a local folder as it is, or a hub id (owner/name)
downloaded with huggingface_hub's snapshot_download, which caches and authenticates as that library does
(revision, cache_dir, token; HF_TOKEN, HF_HOME and HF_HUB_CACHE from the environment)."""

from __future__ import annotations

import re
from pathlib import Path

from .hf_errors import HFImportError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# what a transformers Reformer checkpoint needs: config, weights (either format), tokenizer files
ALLOW_PATTERNS = ["config.json", "*.safetensors", "pytorch_model.bin", "*.model", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json"]


def is_hub_id(source: str) -> bool:
    return bool(_HUB_ID.fullmatch(source)) and not Path(source).exists()


def resolve_checkpoint(source: str | Path, revision: str | None = None, cache_dir: str | Path | None = None,
                       token: str | bool | None = None) -> Path:
    """The local folder holding the checkpoint: `source` itself when it exists, else the hub download of
    `source` as a repository id. Raises HFImportError for a path that is neither."""
    text = str(source)
    if Path(text).exists() or not is_hub_id(text):
        if revision is not None:
            raise HFImportError(f"--revision {revision} applies to a hub id, but {text} is a local folder")
        return Path(text)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=text, revision=revision, cache_dir=cache_dir, token=token,
                                      allow_patterns=ALLOW_PATTERNS))
    except (RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise HFImportError(f"{text}: not a local folder, and downloading it from the hub failed "
                            f"({type(e).__name__}: {e})") from e
