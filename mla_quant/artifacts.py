"""What the preparation step fits once and reuses (fitted transforms and their per-layer checkpoints, lloyd codebooks,
mixed-precision allocations): one store for all of them, with one identity, one lock and one provenance.

    art = artifact(cache_dir, "codebooks-deepseek_v3", payload, ".json")  # <cache_dir>/codebooks-deepseek_v3-<sha16>.json
    with art.held():                  # a job asking for the same artifact waits here, then reuses what was written
        stored = art.read_json()      # None: absent, made for another payload, or unreadable (said why)
        if stored is None:
            stored = art.write_json(fit(...))   # atomic, with the payload's SHA-256 and the provenance

Identity: the SHA-256 of the payload (what the artifact depends on, and nothing else) as JSON with sorted keys; the
file's name carries its first 16 hex digits and the file the whole, checked when it is read. Provenance: that SHA,
when and on which host it was made, and the versions of the libraries that made it (`provenance`).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_quant.record import config_sha256, write_json_atomic

# keys of a model's config group that change where or how it runs, not what it computes
MODEL_RUN_KEYS = ("device", "tokenizer", "resources", "streaming", "streaming_host_gb")
PROVENANCE_LIBRARIES = ("torch", "transformers")


def model_identity(model_cfg: Mapping) -> dict:
    """A model's config group (a plain mapping) without the keys that change where or how it runs (MODEL_RUN_KEYS):
    what an artifact fitted on the model depends on, beside its weights' fingerprint."""
    return {k: v for k, v in model_cfg.items() if k not in MODEL_RUN_KEYS}


def provenance(sha: str) -> dict[str, str]:
    """What every stored artifact says of itself: its identity's SHA-256, when (UTC) and where it was made, and the
    versions of the libraries that made it."""
    import importlib.metadata

    versions = {}
    for lib in PROVENANCE_LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = "absent"
    return {"config_sha256": sha, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": socket.gethostname(), **versions}


@contextmanager
def lock_file(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent) while the block runs; a process that holds it already is
    waited for (said once). The OS drops the lock when its holder dies, so a killed job never blocks the next."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks here (Windows): one job per artifact is the user's to ensure
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[artifacts] waiting for another job making {what}", flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        yield  # closing the file drops the lock


@dataclass(frozen=True)
class Artifact:
    """One stored artifact: its file and the SHA-256 of what it depends on."""

    path: Path
    sha: str

    def held(self):
        """The artifact's lock (`lock_file`), beside it: while one job fits it, another asking for it waits."""
        return lock_file(self.path.with_name(f".{self.path.name}.lock"), str(self.path))

    def read_json(self) -> dict | None:
        """The stored JSON artifact, or None when it is absent, was made for another payload, or cannot be read (said
        why): the caller fits it again."""
        if not self.path.is_file():
            return None
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"[artifacts] ignoring unreadable {self.path}: {err}")
            return None
        if not isinstance(stored, dict) or stored.get("config_sha256") != self.sha:
            print(f"[artifacts] {self.path} was made for another configuration; fitting again")
            return None
        return stored

    def write_json(self, data: Mapping[str, Any]) -> dict:
        """Store `data` atomically with the identity and the provenance; -> what was stored."""
        stored = {**data, "config_sha256": self.sha, "provenance": provenance(self.sha)}
        write_json_atomic(self.path, stored)
        return stored


def artifact(cache_dir: str | Path, stem: str, payload: Mapping, suffix: str) -> Artifact:
    """The artifact of `payload` (everything it depends on) in `cache_dir`: `<stem>-<first 16 hex of its
    SHA-256><suffix>`."""
    sha = config_sha256(payload)
    return Artifact(Path(cache_dir) / f"{stem}-{sha[:16]}{suffix}", sha)
