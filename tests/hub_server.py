"""A local, in-process fake of the Hugging Face Hub for tests.

No machine that runs this project's tests can reach huggingface.co, so tests that exercise uploads and
downloads talk to :class:`LocalHub`: a ``ThreadingHTTPServer`` on ``127.0.0.1`` (random free port) that
speaks the subset of the Hub HTTP protocol that the *real* ``huggingface_hub`` 2.x, ``transformers`` 5.x,
``peft`` and ``datasets`` clients use (see ``/work/shared/docs/hub-protocol.md``). It is standard library
only, apart from PyYAML (already a hard dependency of ``huggingface_hub``) to parse README front matter.

Checked with huggingface_hub 2.4.0, transformers 5.23, peft 0.21 and datasets 5.2: ``create_repo``,
``upload_file``/``upload_folder``/``create_commit``, ``push_to_hub`` of transformers and peft models,
``hf_hub_download``, ``snapshot_download``, ``from_pretrained`` (online, and offline from the cache it filled),
``PeftModel.from_pretrained(base, repo_id)``, ``datasets.load_dataset(repo_id)`` of a jsonl dataset repo (via
``HfFileSystem``: revision info, tree listing, resolve), ``model_info``/``dataset_info``, ``list_repo_commits``,
``list_repo_refs``, ``list_repo_tree``, ``get_paths_info``, ``file_exists``/``repo_exists``, branches and tags.

What it implements
------------------
* repos of type ``model``, ``dataset`` and ``space`` (``create_repo`` / ``delete_repo`` /
  ``update_repo_settings``); a new repo gets an ``initial commit`` holding ``.gitattributes``, as on the Hub;
* a linear history per branch: every commit has a 40-hex sha, ``main`` points to the latest one, and any
  revision can be given as a branch, a tag, a full sha or an unambiguous sha prefix (>= 7 chars);
  ``create_branch`` / ``delete_branch`` / ``create_tag`` / ``delete_tag``;
* uploads: ``validate-yaml``, ``preupload`` (``lfs`` when the path matches an ``filter=lfs`` pattern of the
  revision's ``.gitattributes`` -- ``*.safetensors``, ``*.bin``, ... by default -- or the size is at least
  ``lfs_threshold``; ``oid`` of the current file so unchanged files are skipped), the Git LFS batch API with
  ``PUT`` upload and ``verify``, and the NDJSON ``commit`` endpoint (``header``, ``file``, ``lfsFile``,
  ``deletedFile``, ``deletedFolder``; ``parentCommit`` is checked);
* downloads: ``HEAD``/``GET`` ``/{repo}/resolve/{rev}/{path}`` (also ``/raw/``) answered directly (no
  redirect) with ``X-Repo-Commit``, ``ETag`` (git blob sha1, or sha256 for LFS files, plus ``X-Linked-Etag`` /
  ``X-Linked-Size``), ``Content-Length`` and ``Range`` support; errors carry ``X-Error-Code``
  (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``);
* ``model_info`` / ``dataset_info`` / ``space_info`` / ``repo_info`` (``id``, ``sha``, ``siblings``,
  ``cardData`` parsed from the README.md YAML front matter, ``tags`` = front-matter tags + ``library_name`` +
  ``license:...``, ``library_name``, ``pipeline_tag``, ``config`` from ``config.json``),
  ``list_repo_tree`` (recursive or not, ``expand`` gives ``lastCommit``), ``get_paths_info``,
  ``list_repo_refs``, ``list_repo_commits`` and ``whoami``;
* auth: ``LocalHub(token="hf_x")`` makes every write (and ``whoami``) require ``Authorization: Bearer hf_x``;
  anything else gets ``401`` with a JSON ``{"error": ...}`` body and ``X-Error-Message: Invalid credentials in
  Authorization header``, which the client raises as a plain ``HfHubHTTPError`` (``.response.status_code ==
  401``). Reads stay anonymous unless the repo is private or ``read_requires_token=True``; then (and only if
  the hub has a token) a missing or wrong token reads as ``RepoNotFound`` -> ``RepositoryNotFoundError``, as on
  the Hub.

Not implemented: Xet storage (clients must run with ``HF_HUB_DISABLE_XET=1``: with Xet on, uploads ask for
``/xet-write-token`` and never fall back to LFS -- the server answers 400 with an explanation), pull requests
(``create_pr=True`` gets 400), discussions, ``list_models``/search, multipart LFS, ``.gitignore`` filtering,
super-squash, duplicating repos, the dataset viewer ``/parquet`` API.

How client code has to be pointed at it
---------------------------------------
``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_DISABLE_XET`` and ``HF_HUB_OFFLINE`` into
module constants *at import time*, and ``huggingface_hub.hf_api.api`` / ``transformers.utils.hub._hf_api``
keep the endpoint they were created with. Two ways work, both exercised by ``tests/publish/test_hub_server.py``:

1. **Subprocess (robust, the reference path).** Run the client code in a fresh interpreter with the
   environment from :func:`hub_env`::

       with LocalHub(token="hf_test") as hub:
           env = hub_env(hub, tmp_path)                   # HF_ENDPOINT, HF_HOME, HF_TOKEN, XET off, ...
           out = run_client_json('''
               from huggingface_hub import HfApi
               emit(HfApi().create_repo("me/x").repo_id)   # emit(): prelude helper, any JSON value
           ''', env)

   ``run_client`` raises ``AssertionError`` with the child's output when it fails (``check=False`` to get the
   ``CompletedProcess`` instead). Cost: importing torch + transformers takes seconds per child.

2. **In-process (fast, best effort).** :func:`patch_hub_clients` re-points the already imported clients by
   patching, and restoring on exit, every cached value known to matter with huggingface_hub 2.4 /
   transformers 5.23 / peft 0.21 / datasets 5.2: ``huggingface_hub.constants.ENDPOINT``,
   ``HUGGINGFACE_CO_URL_TEMPLATE``, ``HF_HOME``/``HF_HUB_CACHE``/``HF_XET_CACHE``/``HF_TOKEN_PATH``/
   ``HF_STORED_TOKENS_PATH``/``HF_ASSETS_CACHE``, ``HF_HUB_DISABLE_XET``, ``HF_HUB_OFFLINE``,
   ``huggingface_hub.hf_api.api.endpoint``, ``transformers.utils.hub._hf_api`` (reset so it is rebuilt),
   ``datasets.config`` (``HF_ENDPOINT``, ``HUB_DATASETS_URL``, ``HUB_DATASETS_HFFS_URL``, caches, offline), the
   ``HfFileSystem`` instance cache, and the environment variables (``HF_TOKEN``, ``HF_ENDPOINT``, ...). It also
   closes ``huggingface_hub``'s pooled connections on entry and exit, and imports ``datasets.config`` first
   (when datasets is installed) so that it is patched rather than first imported inside the block and left
   pointing at the hub afterwards. Use it as::

       with LocalHub() as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
           model.push_to_hub("me/tiny")
           AutoModelForCausalLM.from_pretrained("me/tiny")

   Client code must not run in other threads while the block is active (the patches are process-wide).
   If a future client caches something else, fall back to the subprocess path.

Lifecycle
---------
``LocalHub()`` creates its storage in a temporary directory (or ``root=``); ``start()`` binds a random free
port (``hub.endpoint`` is ``http://127.0.0.1:PORT``); ``stop()`` (alias ``kill()``) closes the listening
socket *and* severs every open keep-alive connection -- otherwise the clients' connection pools would still be
answered by the old handler threads -- so clients then get a connection error, as from a dead Hub
(``httpx2.ConnectError``: huggingface_hub 2.4 uses the ``httpx2`` package). Some client calls retry connection
errors with backoff (``http_backoff``, up to ~20 s: tree listing, preupload, LFS); ``model_info`` fails and
``hf_hub_download`` falls back to the cache at once. ``start()`` after ``stop()`` serves the same repos again on
the same port; ``close()`` (or leaving the ``with`` block) stops the server and deletes the storage it created.

``hub.requests`` logs ``(method, path, status)`` of every request; ``hub.fail_next = [True, False, ...]``
answers the next requests with ``hub.fail_status`` (503) or normally. Repos can be seeded and inspected
without HTTP: ``hub.create_repo``, ``hub.commit``, ``hub.read_file``, ``hub.list_files``, ``hub.list_commits``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as _dt
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml  # PyYAML is a hard dependency of huggingface_hub: not a new dependency.

__all__ = [
    "DEFAULT_GITATTRIBUTES",
    "HubError",
    "LocalHub",
    "client_env_overrides",
    "hub_env",
    "patch_hub_clients",
    "run_client",
    "run_client_json",
]

REPO_TYPES = ("model", "dataset", "space")
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_TYPE_FROM_PLURAL = {"models": "model", "datasets": "dataset", "spaces": "space"}
_YAML_BLOCK_RE = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")
_INVALID_CREDENTIALS = "Invalid credentials in Authorization header"

#: The ``.gitattributes`` of a new repo (a trimmed copy of the Hub's); its ``filter=lfs`` patterns decide which
#: files ``preupload`` sends to LFS.
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lz4",
        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
    )
)


# --------------------------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------------------------


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _iso(d: _dt.datetime) -> str:
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def parse_front_matter(text: str) -> dict[str, Any] | None:
    """The YAML metadata block of a README.md, ``None`` when it has none; ``yaml.YAMLError`` if malformed."""
    match = _YAML_BLOCK_RE.search(text)
    if match is None:
        return None
    data = yaml.safe_load(match.group(2))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise yaml.YAMLError("README.md metadata must be a YAML mapping")
    return json.loads(json.dumps(data, default=str))  # dates etc. -> JSON-compatible values


class HubError(Exception):
    """An error answered to the client: HTTP status, message and optional ``X-Error-Code``."""

    def __init__(self, status: int, message: str, code: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra

    @classmethod
    def repo_not_found(cls, repo_type: str, repo_id: str, status: int = 404) -> HubError:
        return cls(status, f"Repository not found: {repo_type} {repo_id}", "RepoNotFound")

    @classmethod
    def revision_not_found(cls, revision: str) -> HubError:
        return cls(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    @classmethod
    def entry_not_found(cls, path: str) -> HubError:
        return cls(404, f"Entry not found: {path}", "EntryNotFound")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file at some commit: its content is the blob ``sha256`` of the store."""

    sha256: str
    size: int
    lfs: bool
    git_oid: str  # git blob sha1 of the content, or of the LFS pointer for LFS files

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid

    @property
    def preupload_oid(self) -> str:
        """What ``preupload`` reports: huggingface_hub compares it with its own ``_local_oid``."""
        return self.sha256 if self.lfs else self.git_oid


@dataclasses.dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    author: str
    date: _dt.datetime
    files: dict[str, FileEntry]


@dataclasses.dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: _dt.datetime
    commits: dict[str, Commit] = dataclasses.field(default_factory=dict)
    branches: dict[str, str] = dataclasses.field(default_factory=dict)
    tags: dict[str, str] = dataclasses.field(default_factory=dict)

    def resolve(self, revision: str | None) -> Commit:
        rev = revision or "main"
        oid = self.branches.get(rev) or self.tags.get(rev)
        if oid is None and rev.startswith("refs/heads/"):
            oid = self.branches.get(rev[len("refs/heads/") :])
        if oid is None and rev.startswith("refs/tags/"):
            oid = self.tags.get(rev[len("refs/tags/") :])
        if oid is None and rev in self.commits:
            oid = rev
        if oid is None and len(rev) >= 7 and re.fullmatch(r"[0-9a-f]+", rev):
            matches = [sha for sha in self.commits if sha.startswith(rev)]
            oid = matches[0] if len(matches) == 1 else None
        if oid is None:
            raise HubError.revision_not_found(rev)
        return self.commits[oid]

    def history(self, commit: Commit) -> Iterator[Commit]:
        current: Commit | None = commit
        while current is not None:
            yield current
            current = self.commits[current.parent] if current.parent else None


class HubStorage:
    """Thread-safe repos (in memory) and content-addressed blobs (on disk, by sha256)."""

    def __init__(self, root: Path, *, username: str, lfs_threshold: int) -> None:
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.username = username
        self.lfs_threshold = lfs_threshold
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.RLock()
        self._counter = 0

    # blobs ----------------------------------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> Path:
        return self.blob_dir / sha256

    def has_blob(self, sha256: str) -> bool:
        return re.fullmatch(r"[0-9a-f]{64}", sha256 or "") is not None and self.blob_path(sha256).is_file()

    def put_blob(self, data: bytes, expected_sha256: str | None = None) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if expected_sha256 is not None and sha != expected_sha256:
            raise HubError(400, f"Content sha256 {sha} does not match oid {expected_sha256}")
        path = self.blob_path(sha)
        if not path.exists():
            tmp = path.with_name(f"{sha}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def read_blob(self, sha256: str) -> bytes:
        return self.blob_path(sha256).read_bytes()

    # repos ----------------------------------------------------------------------------------------------------

    def get_repo(self, repo_type: str, repo_id: str) -> Repo:
        with self.lock:
            repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError.repo_not_found(repo_type, repo_id)
        return repo

    def has_repo(self, repo_type: str, repo_id: str) -> bool:
        return (repo_type, repo_id) in self.repos

    def create_repo(self, repo_type: str, repo_id: str, *, private: bool = False) -> Repo:
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type: {repo_type}")
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id):
            raise HubError(400, f"Invalid repo id: {repo_id!r} (expected 'namespace/name')")
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                url = self.repo_url_path(repo_type, repo_id)
                raise HubError(409, f"You already created this {repo_type} repo", url=url)
            repo = Repo(repo_type, repo_id, private, _now())
            self.repos[(repo_type, repo_id)] = repo
            self.commit(repo, "main", {".gitattributes": DEFAULT_GITATTRIBUTES.encode()}, title="initial commit",
                        author="system")
            return repo

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            if self.repos.pop((repo_type, repo_id), None) is None:
                raise HubError.repo_not_found(repo_type, repo_id)

    @staticmethod
    def repo_url_path(repo_type: str, repo_id: str) -> str:
        return f"/{_URL_PREFIX[repo_type]}{repo_id}"

    def lfs_patterns(self, commit: Commit) -> list[str]:
        entry = commit.files.get(".gitattributes")
        text = self.read_blob(entry.sha256).decode(errors="replace") if entry else DEFAULT_GITATTRIBUTES
        patterns = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and not parts[0].startswith("#") and "filter=lfs" in parts[1:]:
                patterns.append(parts[0])
        return patterns

    def is_lfs_path(self, commit: Commit, path: str, size: int) -> bool:
        if size >= self.lfs_threshold:
            return True
        name = path.rsplit("/", 1)[-1]
        for pattern in self.lfs_patterns(commit):
            if "/" in pattern.strip("/"):
                if fnmatch.fnmatch(path, pattern.strip("/")):
                    return True
            elif fnmatch.fnmatch(name, pattern):
                return True
        return False

    def commit(
        self,
        repo: Repo,
        branch: str,
        operations: Mapping[str, bytes | None] | list[dict[str, Any]],
        *,
        title: str,
        message: str = "",
        author: str | None = None,
        parent_commit: str | None = None,
    ) -> Commit:
        """Create a commit on ``branch``.

        ``operations`` is either ``{path: bytes | None}`` (``None`` deletes; LFS or regular is decided like
        ``preupload``) or the NDJSON items of the ``/commit`` API after the header.
        """
        with self.lock:
            head: Commit | None = None
            if repo.commits:
                if branch not in repo.branches:
                    if branch in repo.tags or branch in repo.commits:
                        raise HubError(400, f"Can only commit to a branch, not to {branch!r}")
                    raise HubError.revision_not_found(branch)
                head = repo.commits[repo.branches[branch]]
                if parent_commit is not None and parent_commit != head.oid:
                    raise HubError(412, f"A commit has happened since: {parent_commit} is not the head of {branch}")
            files = dict(head.files) if head else {}
            if isinstance(operations, Mapping):
                items: list[dict[str, Any]] = []
                for path, data in operations.items():
                    if data is None:
                        items.append({"key": "deletedFile", "value": {"path": path}})
                    elif head is not None and self.is_lfs_path(head, path, len(data)):
                        sha = self.put_blob(data)
                        items.append({"key": "lfsFile", "value": {"path": path, "oid": sha, "size": len(data)}})
                    else:
                        content = base64.b64encode(data).decode()
                        items.append({"key": "file", "value": {"path": path, "content": content, "encoding": "base64"}})
            else:
                items = list(operations)
            for item in items:
                self._apply(files, item)
            self._counter += 1
            seed = json.dumps([repo.repo_id, head.oid if head else None, title, message, self._counter,
                               sorted((p, e.sha256) for p, e in files.items()), secrets.token_hex(8)])
            new = Commit(
                oid=hashlib.sha1(seed.encode()).hexdigest(),
                parent=head.oid if head else None,
                title=title,
                message=message,
                author=author or self.username,
                date=_now(),
                files=files,
            )
            repo.commits[new.oid] = new
            repo.branches[branch] = new.oid
            return new

    def _apply(self, files: dict[str, FileEntry], item: dict[str, Any]) -> None:
        key, value = item.get("key"), item.get("value") or {}
        path = str(value.get("path", "")).strip("/")
        if not path and key != "deletedFolder":
            raise HubError(400, f"Missing path in commit operation {key!r}")
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubError(400, f"Unsupported encoding {value.get('encoding')!r}")
            data = base64.b64decode(value.get("content", ""))
            sha = self.put_blob(data)
            files[path] = FileEntry(sha, len(data), False, _git_blob_sha1(data))
        elif key == "lfsFile":
            oid = value.get("oid", "")
            if not self.has_blob(oid):
                raise HubError(400, f"LFS object {oid} for {path} was never uploaded")
            size = self.blob_path(oid).stat().st_size
            if value.get("size") is not None and int(value["size"]) != size:
                raise HubError(400, f"LFS object {oid}: size {value['size']} != stored size {size}")
            files[path] = FileEntry(oid, size, True, _git_blob_sha1(_lfs_pointer(oid, size)))
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            prefix = f"{path}/" if path else ""
            doomed = [p for p in files if p.startswith(prefix)]
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in doomed:
                del files[p]
        else:
            raise HubError(400, f"Unsupported commit operation {key!r}")


# --------------------------------------------------------------------------------------------------------------
# HTTP front end
# --------------------------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    """Keeps track of open connections so that ``stop()`` can sever keep-alive sockets too."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], hub: LocalHub) -> None:
        self.hub = hub
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def sever_connections(self) -> None:
        with self.connections_lock:
            conns = list(self.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _flag(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect
    timeout = 60  # idle keep-alive connections are dropped after this many seconds
    server_version = "LocalHub/1.0"

    # plumbing -------------------------------------------------------------------------------------------------

    @property
    def hub(self) -> LocalHub:
        return self.server.hub

    @property
    def store(self) -> HubStorage:
        return self.server.hub.storage

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # requests are recorded in hub.requests instead of stderr

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.hub.requests.append((self.command, self.path, int(code) if isinstance(code, int) else code))

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _body(self) -> bytes:
        if getattr(self, "_body_cache", None) is not None:
            return self._body_cache
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            data = b"".join(chunks)
        else:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._body_cache = data
        return data

    def _json_body(self) -> Any:
        raw = self._body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as err:
            raise HubError(400, f"Invalid JSON body: {err}") from err

    def _send(
        self,
        status: int,
        body: bytes = b"",
        *,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json; charset=utf-8",
        content_length: int | None = None,
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _send_json(self, data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(data, default=str).encode(), headers=headers)

    def _send_error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message.encode("ascii", "replace").decode()}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="LocalHub"'
        self._send_json({"error": err.message, **err.extra}, err.status, headers)

    def _dispatch(self) -> None:
        self._body_cache: bytes | None = None
        try:
            if self.hub.fail_next and self.hub.fail_next.pop(0):
                status = self.hub.fail_status
                raise HubError(status, f"Simulated failure ({status})")
            self._route()
        except HubError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:  # noqa: BLE001 - report server bugs to the client, not as a hang
            self._send_error(HubError(400, f"LocalHub internal error: {type(err).__name__}: {err}"))
        finally:
            if self.command in ("POST", "PUT", "DELETE"):
                with contextlib.suppress(Exception):
                    self._body()  # always drain the body so the keep-alive connection stays in sync

    # auth -----------------------------------------------------------------------------------------------------

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _authorized(self) -> bool:
        return self.hub.token is None or self._token() == self.hub.token

    def _require_write(self) -> None:
        if not self._authorized():
            raise HubError(401, _INVALID_CREDENTIALS)

    def _require_read(self, repo: Repo) -> None:
        if (repo.private or self.hub.read_requires_token) and not self._authorized():
            raise HubError.repo_not_found(repo.repo_type, repo.repo_id, status=401)

    def _readable_repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.store.get_repo(repo_type, repo_id)
        self._require_read(repo)
        return repo

    # routing --------------------------------------------------------------------------------------------------

    def _route(self) -> None:
        url = urlsplit(self.path)
        self.query = parse_qs(url.query, keep_blank_values=True)
        segs = [unquote(s) for s in url.path.split("/")[1:]]
        method = self.command
        if segs and segs[-1] == "" and len(segs) > 1:
            segs = segs[:-1]
        if segs[:1] == ["api"]:
            rest = segs[1:]
            if rest == ["whoami-v2"] and method == "GET":
                return self._whoami()
            if rest == ["validate-yaml"] and method == "POST":
                return self._validate_yaml()
            if rest == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if rest == ["repos", "delete"] and method == "DELETE":
                return self._delete_repo()
            if rest[:1] and rest[0] in _TYPE_FROM_PLURAL:
                return self._repo_api(_TYPE_FROM_PLURAL[rest[0]], rest[1:])
            raise HubError(404, f"LocalHub does not implement {method} {url.path}")
        if segs[:2] == ["_lfs", "upload"] and len(segs) == 3 and method == "PUT":
            return self._lfs_upload(segs[2])
        if segs[:2] == ["_lfs", "verify"] and method == "POST":
            return self._lfs_verify()
        repo_type = "model"
        if segs[:1] in (["datasets"], ["spaces"]):
            repo_type, segs = _TYPE_FROM_PLURAL[segs[0]], segs[1:]
        if len(segs) >= 3 and segs[-4:-1] == ["info", "lfs", "objects"] and segs[-1] == "batch":
            repo_id = "/".join(segs[:-4])
            return self._lfs_batch(repo_type, repo_id.removesuffix(".git"))
        for k in (2, 1):
            if len(segs) >= k + 2 and segs[k] in ("resolve", "raw") and method in ("GET", "HEAD"):
                return self._resolve(repo_type, "/".join(segs[:k]), segs[k + 1], "/".join(segs[k + 2 :]))
        raise HubError(404, f"LocalHub does not implement {method} {url.path}")

    def _split_repo(self, repo_type: str, rest: list[str]) -> tuple[str, list[str]]:
        """``ns/name/action...`` or (canonical repos without namespace) ``name/action...``."""
        if len(rest) >= 2 and self.store.has_repo(repo_type, "/".join(rest[:2])):
            return "/".join(rest[:2]), rest[2:]
        if rest and self.store.has_repo(repo_type, rest[0]):
            return rest[0], rest[1:]
        if not rest:
            raise HubError(404, "Missing repo id")
        return "/".join(rest[:2]), rest[2:]

    def _repo_api(self, repo_type: str, rest: list[str]) -> None:
        repo_id, action = self._split_repo(repo_type, rest)
        method = self.command
        name = action[0] if action else ""
        if name in ("xet-write-token", "xet-read-token"):
            raise HubError(400, "LocalHub does not support Xet storage: run clients with HF_HUB_DISABLE_XET=1")
        if not action and method == "GET":
            return self._info(repo_type, repo_id, None)
        if name == "revision" and len(action) >= 2 and method == "GET":
            return self._info(repo_type, repo_id, "/".join(action[1:]))
        if name == "tree" and len(action) >= 2 and method == "GET":
            return self._tree(repo_type, repo_id, action[1], "/".join(action[2:]))
        if name == "paths-info" and len(action) == 2 and method == "POST":
            return self._paths_info(repo_type, repo_id, action[1])
        if name == "preupload" and len(action) == 2 and method == "POST":
            return self._preupload(repo_type, repo_id, action[1])
        if name == "commit" and len(action) == 2 and method == "POST":
            return self._commit(repo_type, repo_id, action[1])
        if name == "commits" and len(action) == 2 and method == "GET":
            return self._commits(repo_type, repo_id, action[1])
        if name == "refs" and len(action) == 1 and method == "GET":
            return self._refs(repo_type, repo_id)
        if name == "branch" and len(action) == 2 and method in ("POST", "DELETE"):
            return self._branch(repo_type, repo_id, action[1])
        if name == "tag" and len(action) == 2 and method in ("POST", "DELETE"):
            return self._tag(repo_type, repo_id, action[1])
        if name == "settings" and len(action) == 1 and method == "PUT":
            return self._settings(repo_type, repo_id)
        raise HubError(404, f"LocalHub does not implement {method} /api/{repo_type}s/{repo_id}/{'/'.join(action)}")

    # account / repos ------------------------------------------------------------------------------------------

    def _whoami(self) -> None:
        if self._token() is None or not self._authorized():
            raise HubError(401, _INVALID_CREDENTIALS)
        name = self.store.username
        self._send_json({
            "type": "user", "id": hashlib.sha1(name.encode()).hexdigest()[:24], "name": name, "fullname": name,
            "email": f"{name}@localhost", "emailVerified": True, "isPro": False, "orgs": [],
            "auth": {"type": "access_token", "accessToken": {"displayName": "local-hub", "role": "write"}},
        })

    def _validate_yaml(self) -> None:
        body = self._json_body()
        try:
            parse_front_matter(str(body.get("content", "")))
        except yaml.YAMLError as err:
            self._send_json({"errors": [{"message": f"Invalid YAML metadata: {err}"}], "warnings": []}, 400)
            return
        self._send_json({"errors": [], "warnings": []})

    def _repo_id_from_body(self, body: Mapping[str, Any]) -> tuple[str, str]:
        repo_type = body.get("type") or "model"
        name, org = body.get("name"), body.get("organization")
        if not name:
            raise HubError(400, "Missing repo name")
        return repo_type, f"{org or self.store.username}/{name}"

    def _create_repo(self) -> None:
        self._require_write()
        body = self._json_body()
        repo_type, repo_id = self._repo_id_from_body(body)
        private = body.get("visibility") == "private" or bool(body.get("private"))
        try:
            self.store.create_repo(repo_type, repo_id, private=private)
        except HubError as err:
            if err.status == 409:
                err.extra["url"] = self.hub.endpoint + err.extra["url"]
            raise
        url = self.hub.endpoint + self.store.repo_url_path(repo_type, repo_id)
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self) -> None:
        self._require_write()
        self.store.delete_repo(*self._repo_id_from_body(self._json_body()))
        self._send_json({})

    def _settings(self, repo_type: str, repo_id: str) -> None:
        self._require_write()
        repo = self.store.get_repo(repo_type, repo_id)
        body = self._json_body()
        if "private" in body or "visibility" in body:
            repo.private = bool(body.get("private")) or body.get("visibility") == "private"
        self._send_json({"private": repo.private})

    # read API -------------------------------------------------------------------------------------------------

    def _info(self, repo_type: str, repo_id: str, revision: str | None) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            commit = repo.resolve(revision)
        self._send_json(self.hub.repo_info_dict(repo, commit, blobs=_flag(self.query.get("blobs", [""])[0])))

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            commit = repo.resolve(revision)
        path = path.strip("/")
        recursive = _flag(self.query.get("recursive", [""])[0])
        expand = _flag(self.query.get("expand", [""])[0])
        prefix = f"{path}/" if path else ""
        under = {p: e for p, e in commit.files.items() if p.startswith(prefix)}
        if path and not under:
            if path in commit.files:
                raise HubError(400, f"{path} is a file, not a directory")
            raise HubError.entry_not_found(path)
        dirs: set[str] = set()
        entries: list[dict[str, Any]] = []
        for p, entry in under.items():
            rel = p[len(prefix) :].split("/")
            for depth in range(1, len(rel)):
                if recursive or depth == 1:
                    dirs.add(prefix + "/".join(rel[:depth]))
            if recursive or len(rel) == 1:
                entries.append(self.hub.entry_dict(repo, commit, p, expand=expand))
        entries += [self.hub.entry_dict(repo, commit, d, expand=expand) for d in dirs]
        self._send_json(sorted(entries, key=lambda e: (e["type"] != "directory", e["path"])))

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            commit = repo.resolve(revision)
        raw = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            body = json.loads(raw or b"{}")
            paths, expand = body.get("paths", []), _flag(body.get("expand"))
        else:
            form = parse_qs(raw.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), _flag(form.get("expand", [""])[0])
        out = []
        for path in ([paths] if isinstance(paths, str) else paths):
            path = path.strip("/")
            if path in commit.files or any(p.startswith(f"{path}/") for p in commit.files):
                out.append(self.hub.entry_dict(repo, commit, path, expand=expand))
        self._send_json(out)

    def _commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            history = list(repo.history(repo.resolve(revision)))
        self._send_json([
            {"id": c.oid, "title": c.title, "message": c.message, "date": _iso(c.date),
             "authors": [{"user": c.author}]}
            for c in history
        ])

    def _refs(self, repo_type: str, repo_id: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o} for n, o in repo.branches.items()]
            tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": o} for n, o in repo.tags.items()]
        self._send_json({"branches": branches, "converts": [], "tags": tags, "pullRequests": []})

    # write API ------------------------------------------------------------------------------------------------

    def _branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        self._require_write()
        repo = self.store.get_repo(repo_type, repo_id)
        with self.store.lock:
            if self.command == "DELETE":
                if branch not in repo.branches:
                    raise HubError.revision_not_found(branch)
                if branch == "main":
                    raise HubError(403, "Cannot delete the main branch")
                del repo.branches[branch]
            else:
                if branch in repo.branches:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                repo.branches[branch] = repo.resolve(self._json_body().get("startingPoint")).oid
        self._send_json({})

    def _tag(self, repo_type: str, repo_id: str, name: str) -> None:
        self._require_write()
        repo = self.store.get_repo(repo_type, repo_id)
        with self.store.lock:
            if self.command == "DELETE":
                if repo.tags.pop(name, None) is None:
                    raise HubError.revision_not_found(name)
            else:
                tag = self._json_body().get("tag")
                if not tag:
                    raise HubError(400, "Missing tag name")
                if tag in repo.tags:
                    raise HubError(409, f"Reference already exists: refs/tags/{tag}")
                repo.tags[tag] = repo.resolve(name).oid
        self._send_json({})

    def _reject_pr(self) -> None:
        if _flag(self.query.get("create_pr", [""])[0]):
            raise HubError(400, "LocalHub does not support pull requests (create_pr=True)")

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        self._require_write()
        self._reject_pr()
        repo = self.store.get_repo(repo_type, repo_id)
        with self.store.lock:
            commit = repo.resolve(revision)
        files = []
        for item in self._json_body().get("files", []):
            path, size = str(item.get("path", "")), int(item.get("size", 0))
            existing = commit.files.get(path)
            files.append({
                "path": path,
                "uploadMode": "lfs" if self.store.is_lfs_path(commit, path, size) else "regular",
                "shouldIgnore": False,
                "oid": existing.preupload_oid if existing else None,
            })
        self._send_json({"files": files, "commitOid": commit.oid})

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        body = self._json_body()
        if body.get("operation") != "upload":
            self.store.get_repo(repo_type, repo_id)
            raise HubError(400, "LocalHub's LFS batch API only supports 'upload'; downloads go through /resolve")
        self._require_write()
        self.store.get_repo(repo_type, repo_id)
        objects = []
        for obj in body.get("objects", []):
            oid, size = str(obj.get("oid", "")), int(obj.get("size", 0))
            if not re.fullmatch(r"[0-9a-f]{64}", oid):
                objects.append({"oid": oid, "size": size, "error": {"code": 422, "message": "Invalid oid"}})
            elif self.store.has_blob(oid):
                objects.append({"oid": oid, "size": size})  # no "actions": already stored
            else:
                secret = quote(self.hub.upload_secret)
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{self.hub.endpoint}/_lfs/upload/{oid}?secret={secret}", "header": {}},
                    "verify": {"href": f"{self.hub.endpoint}/_lfs/verify?secret={secret}", "header": {}},
                }})
        self._send(200, json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def _check_upload_secret(self) -> None:
        if self.query.get("secret", [""])[0] != self.hub.upload_secret:
            raise HubError(403, "Invalid or missing LFS upload signature")

    def _lfs_upload(self, oid: str) -> None:
        self._check_upload_secret()
        self.store.put_blob(self._body(), expected_sha256=oid)
        self._send(200, b"", headers={"ETag": f'"{oid}"'})

    def _lfs_verify(self) -> None:
        self._check_upload_secret()
        body = self._json_body()
        oid, size = str(body.get("oid", "")), body.get("size")
        if not self.store.has_blob(oid):
            raise HubError(404, f"LFS object {oid} not found")
        if size is not None and self.store.blob_path(oid).stat().st_size != int(size):
            raise HubError(400, f"LFS object {oid} has a different size")
        self._send_json({"success": True})

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        self._require_write()
        self._reject_pr()
        repo = self.store.get_repo(repo_type, repo_id)
        try:
            items = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        except ValueError as err:
            raise HubError(400, f"Invalid NDJSON commit payload: {err}") from err
        if not items or items[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a 'header' line")
        header = items[0].get("value") or {}
        commit = self.store.commit(
            repo,
            revision,
            items[1:],
            title=header.get("summary") or "Commit",
            message=header.get("description") or "",
            parent_commit=header.get("parentCommit"),
        )
        url = f"{self.hub.endpoint}{self.store.repo_url_path(repo_type, repo_id)}/commit/{commit.oid}"
        self._send_json({"success": True, "commitOid": commit.oid, "commitUrl": url, "pullRequestUrl": None})

    # downloads ------------------------------------------------------------------------------------------------

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        with self.store.lock:
            commit = repo.resolve(revision)
        entry = commit.files.get(path)
        if entry is None:
            raise HubError.entry_not_found(path)
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{entry.etag}"', "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers |= {"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)}
        start, end = 0, entry.size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header and entry.size > 0:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
            if match is None or (not match.group(1) and not match.group(2)):
                raise HubError(416, f"Unsupported range {range_header!r}")
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)), entry.size - 1) if match.group(2) else entry.size - 1
            else:
                start = max(entry.size - int(match.group(2)), 0)
            if start >= entry.size or start > end:
                self._send(416, b"", headers={"Content-Range": f"bytes */{entry.size}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        length = max(end - start + 1, 0)
        self._send(status, b"", headers=headers, content_type="application/octet-stream", content_length=length)
        if self.command == "GET" and length:
            with open(self.store.blob_path(entry.sha256), "rb") as fh:
                fh.seek(start)
                remaining = length
                while remaining:
                    chunk = fh.read(min(remaining, 1 << 20))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    remaining -= len(chunk)


# --------------------------------------------------------------------------------------------------------------
# Public object
# --------------------------------------------------------------------------------------------------------------


class LocalHub:
    """A fake Hugging Face Hub served on ``127.0.0.1`` from this process (see the module docstring).

    Args:
        token: if set, writes (create/delete repo, preupload, LFS, commit, branches, tags, settings) and
            ``whoami`` require ``Authorization: Bearer <token>``; reads of private repos too.
        read_requires_token: also require the token for every read.
        username: the namespace of repos created without an organization, and ``whoami()["name"]``.
        lfs_threshold: files at least this large (bytes) are uploaded through LFS whatever their name.
        root: where to keep blobs; a temporary directory (deleted by ``close()``) by default.
        port: port to bind; ``0`` (default) picks a free one. A restart after ``stop()`` reuses the port.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        read_requires_token: bool = False,
        username: str = "local-user",
        lfs_threshold: int = 10 * 1024 * 1024,
        root: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.token = token
        self.read_requires_token = read_requires_token
        self.host, self.port = host, port
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="localhub-")) if root is None else Path(root)
        self.storage = HubStorage(self.root, username=username, lfs_threshold=lfs_threshold)
        self.upload_secret = secrets.token_urlsafe(16)
        self.requests: list[tuple[str, str, Any]] = []
        #: Queue of booleans: each request pops one; True answers it with ``fail_status`` (flaky-server tests).
        self.fail_next: list[bool] = []
        self.fail_status = 503
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ------------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if not self.port:
            raise RuntimeError("LocalHub.endpoint is known once start() has bound a port")
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> LocalHub:
        if self._server is not None:
            return self
        self._server = _Server((self.host, self.port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"LocalHub:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: close the listening socket and sever open keep-alive connections.

        Clients then fail with a connection error (``httpx.ConnectError``), like against a dead Hub. The repos
        are kept: ``start()`` serves them again on the same port.
        """
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.sever_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    kill = stop  # alias: "simulate a dead server"

    def close(self) -> None:
        """Stop and delete the storage directory if this object created it."""
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # server-side helpers (no HTTP) ----------------------------------------------------------------------------

    def url(self, repo_id: str, repo_type: str = "model") -> str:
        return self.endpoint + HubStorage.repo_url_path(repo_type, repo_id)

    def create_repo(self, repo_id: str, repo_type: str = "model", *, private: bool = False,
                    exist_ok: bool = False) -> str:
        """Create a repo directly in the store; returns its URL."""
        try:
            self.storage.create_repo(repo_type, repo_id, private=private)
        except HubError as err:
            if not (exist_ok and err.status == 409):
                raise
        return self.url(repo_id, repo_type)

    def commit(self, repo_id: str, files: Mapping[str, bytes | str | None], *, repo_type: str = "model",
               branch: str = "main", message: str = "Seed commit") -> str:
        """Commit ``{path: content}`` (``None`` deletes) directly; returns the new commit sha."""
        repo = self.storage.get_repo(repo_type, repo_id)
        ops = {p: (c.encode() if isinstance(c, str) else c) for p, c in files.items()}
        return self.storage.commit(repo, branch, ops, title=message).oid

    def read_file(self, repo_id: str, path: str, *, repo_type: str = "model", revision: str = "main") -> bytes:
        commit = self.storage.get_repo(repo_type, repo_id).resolve(revision)
        if path not in commit.files:
            raise HubError.entry_not_found(path)
        return self.storage.read_blob(commit.files[path].sha256)

    def list_files(self, repo_id: str, *, repo_type: str = "model", revision: str = "main") -> dict[str, FileEntry]:
        return dict(self.storage.get_repo(repo_type, repo_id).resolve(revision).files)

    def list_commits(self, repo_id: str, *, repo_type: str = "model", revision: str = "main") -> list[Commit]:
        repo = self.storage.get_repo(repo_type, repo_id)
        return list(repo.history(repo.resolve(revision)))

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return self.storage.has_repo(repo_type, repo_id)

    # JSON views -----------------------------------------------------------------------------------------------

    def card_data(self, commit: Commit) -> dict[str, Any] | None:
        entry = commit.files.get("README.md")
        if entry is None:
            return None
        try:
            return parse_front_matter(self.storage.read_blob(entry.sha256).decode(errors="replace"))
        except yaml.YAMLError:
            return None

    def repo_info_dict(self, repo: Repo, commit: Commit, *, blobs: bool = False) -> dict[str, Any]:
        card = self.card_data(commit)
        meta = card or {}
        tags = meta.get("tags") or []
        tags = [tags] if isinstance(tags, str) else [str(t) for t in tags]
        library = meta.get("library_name")
        if library:
            tags.append(str(library))
        licenses = meta.get("license")
        for lic in [licenses] if isinstance(licenses, str) else licenses or []:
            tags.append(f"license:{lic}")
        siblings = []
        for path in sorted(commit.files):
            sibling: dict[str, Any] = {"rfilename": path}
            entry = commit.files[path]
            if blobs:
                sibling |= {"size": entry.size, "blobId": entry.git_oid}
                if entry.lfs:
                    pointer_size = len(_lfs_pointer(entry.sha256, entry.size))
                    sibling["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": pointer_size}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(f"{repo.repo_type}/{repo.repo_id}".encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0] if "/" in repo.repo_id else None,
            "sha": commit.oid,
            "lastModified": _iso(commit.date),
            "createdAt": _iso(repo.created_at),
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": list(dict.fromkeys(tags)),
            "siblings": siblings,
            "usedStorage": sum(e.size for e in commit.files.values()),
        }
        if card is not None:
            info["cardData"] = card
        if repo.repo_type == "model":
            info |= {"modelId": repo.repo_id, "library_name": library, "pipeline_tag": meta.get("pipeline_tag"),
                     "spaces": []}
            config = self._json_file(commit, "config.json")
            if isinstance(config, dict):
                info["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
        elif repo.repo_type == "dataset":
            info |= {"description": meta.get("description", ""), "citation": None, "paperswithcode_id": None}
        else:
            info |= {"sdk": meta.get("sdk"), "runtime": {"stage": "NO_APP_FILE"}}
        return info

    def _json_file(self, commit: Commit, path: str) -> Any:
        entry = commit.files.get(path)
        if entry is None or entry.size > 1 << 20:
            return None
        try:
            return json.loads(self.storage.read_blob(entry.sha256))
        except ValueError:
            return None

    def entry_dict(self, repo: Repo, commit: Commit, path: str, *, expand: bool = False) -> dict[str, Any]:
        """A ``tree`` / ``paths-info`` item for a file or a directory at ``commit``."""
        entry = commit.files.get(path)
        if entry is not None:
            out: dict[str, Any] = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
            if entry.lfs:
                pointer_size = len(_lfs_pointer(entry.sha256, entry.size))
                out["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": pointer_size}
            if expand:
                out["lastCommit"] = self._last_commit(repo, commit, lambda c: c.files.get(path))
                out["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False, "virusNames": None},
                                             "pickleImportScan": None}
            return out
        prefix = f"{path}/"

        def snapshot(c: Commit) -> Any:
            return tuple(sorted((p, e.git_oid) for p, e in c.files.items() if p.startswith(prefix))) or None

        out = {"type": "directory", "oid": hashlib.sha1(repr(snapshot(commit)).encode()).hexdigest(), "size": 0,
               "path": path}
        if expand:
            out["lastCommit"] = self._last_commit(repo, commit, snapshot)
        return out

    @staticmethod
    def _last_commit(repo: Repo, commit: Commit, key: Any) -> dict[str, Any]:
        """The oldest commit of the unbroken run, back from ``commit``, where ``key`` stays the same."""
        current = key(commit)
        last = commit
        for c in repo.history(commit):
            if key(c) != current:
                break
            last = c
        return {"id": last.oid, "title": last.title, "date": _iso(last.date)}


# --------------------------------------------------------------------------------------------------------------
# Running client code against a LocalHub
# --------------------------------------------------------------------------------------------------------------

_CLIENT_ENV_DROP = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_OIDC_RESOURCE", "HF_HUB_ENABLE_HF_TRANSFER",
)


def client_env_overrides(hub: LocalHub, hf_home: str | os.PathLike[str], *, token: str | None = None,
                         offline: bool = False) -> dict[str, str]:
    """The environment variables a Hub client needs to talk to ``hub`` (only the ones this sets)."""
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "0",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_DATASETS_OFFLINE": "1" if offline else "0",
        "TRANSFORMERS_OFFLINE": "1" if offline else "0",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if token:
        env["HF_TOKEN"] = token
    return env


_DEFAULT_TOKEN = object()


def hub_env(hub: LocalHub, tmp_path: str | os.PathLike[str], *, token: Any = _DEFAULT_TOKEN,
            offline: bool = False, **extra: str) -> dict[str, str]:
    """A full environment (``os.environ`` + overrides) for a subprocess that talks to ``hub``.

    ``HF_HOME`` is ``tmp_path/hf_home`` (created), so the cache starts empty and is private to the test; pass
    the same ``tmp_path`` again (e.g. with ``offline=True``) to reuse the cache. ``token`` defaults to
    ``hub.token`` (``HF_TOKEN``); ``token=None`` sends no token, ``token="wrong"`` a bad one. Any inherited
    HF token / cache / offline variables are removed first. ``PYTHONPATH`` gets the repository root and the
    ``tests`` directory, so child scripts can ``import hf_janus`` and ``import hub_server``.
    """
    hf_home = Path(tmp_path) / "hf_home"
    hf_home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _CLIENT_ENV_DROP}
    tok = hub.token if token is _DEFAULT_TOKEN else token
    env.update(client_env_overrides(hub, hf_home, token=tok, offline=offline))
    here = Path(__file__).resolve().parent
    paths = [str(here.parent), str(here)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


_RESULT_MARK = "@@LOCALHUB_RESULT@@"
_PRELUDE = f"""\
import json as _lh_json, sys as _lh_sys
def emit(value):
    '''Hand a JSON-serialisable value back to run_client_json().'''
    print({_RESULT_MARK!r} + _lh_json.dumps(value), flush=True)
"""


def run_client(script: str, env: Mapping[str, str], *, timeout: float = 300, check: bool = True,
               cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (dedented) in a fresh ``python`` with ``env``; an ``emit(value)`` helper is predefined.

    With ``check=True`` a non-zero exit raises ``AssertionError`` carrying the child's stdout and stderr.
    """
    code = _PRELUDE + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"client script failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def run_client_json(script: str, env: Mapping[str, str], **kwargs: Any) -> Any:
    """``run_client`` and return the value of the last ``emit(...)`` (``None`` if nothing was emitted)."""
    proc = run_client(script, env, **kwargs)
    results = [line[len(_RESULT_MARK) :] for line in proc.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    return json.loads(results[-1]) if results else None


# --------------------------------------------------------------------------------------------------------------
# In-process patching (fast path)
# --------------------------------------------------------------------------------------------------------------


def close_client_connections() -> None:
    """Drop huggingface_hub's pooled HTTP connections (call after stopping a server the clients used)."""
    hub_http = sys.modules.get("huggingface_hub.utils._http")
    if hub_http is None:
        return
    for name in ("close_session", "reset_sessions"):
        fn = getattr(hub_http, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                fn()
            return


@contextlib.contextmanager
def patch_hub_clients(hub: LocalHub, hf_home: str | os.PathLike[str], *, token: Any = _DEFAULT_TOKEN,
                      offline: bool = False) -> Iterator[dict[str, str]]:
    """Point the *already imported* huggingface_hub / transformers / peft / datasets of this process at ``hub``.

    Patches (and restores on exit) the environment variables of :func:`client_env_overrides` plus the module
    attributes the clients cached at import time (listed in the module docstring), and closes pooled
    connections on exit. Yields the environment overrides. ``token`` as in :func:`hub_env`.
    """
    import huggingface_hub  # noqa: F401 - make sure the modules to patch exist
    from huggingface_hub import constants, hf_api

    if importlib.util.find_spec("datasets") is not None:
        # datasets.config copies HF_ENDPOINT at import: import it now so that it is patched (and restored)
        # rather than first imported inside the block and left pointing at this hub afterwards.
        importlib.import_module("datasets.config")

    hf_home = Path(hf_home)
    hf_home.mkdir(parents=True, exist_ok=True)
    tok = hub.token if token is _DEFAULT_TOKEN else token
    overrides = client_env_overrides(hub, hf_home, token=tok, offline=offline)
    hub_cache = hf_home / "hub"
    patches: list[tuple[Any, str, Any]] = [
        (constants, "ENDPOINT", hub.endpoint),
        (constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"),
        (constants, "HF_HOME", str(hf_home)),
        (constants, "HF_HUB_CACHE", str(hub_cache)),
        (constants, "HUGGINGFACE_HUB_CACHE", str(hub_cache)),
        (constants, "HF_ASSETS_CACHE", str(hf_home / "assets")),
        (constants, "HF_XET_CACHE", str(hf_home / "xet")),
        (constants, "HF_TOKEN_PATH", str(hf_home / "token")),
        (constants, "HF_STORED_TOKENS_PATH", str(hf_home / "stored_tokens")),
        (constants, "HF_HUB_DISABLE_XET", True),
        (constants, "HF_HUB_OFFLINE", offline),
        (constants, "HF_HUB_DISABLE_TELEMETRY", True),
        (constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False),
        (hf_api.api, "endpoint", hub.endpoint),
    ]
    tf_hub = sys.modules.get("transformers.utils.hub")
    if tf_hub is not None:
        patches += [(tf_hub, "_hf_api", None), (tf_hub, "HF_HUB_OFFLINE", offline)]
    ds_config = sys.modules.get("datasets.config")
    if ds_config is not None:
        ds_cache = hf_home / "datasets"
        for attr, value in (
            ("HF_ENDPOINT", hub.endpoint),
            ("HUB_DATASETS_URL", hub.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}"),
            ("HUB_DATASETS_HFFS_URL", "hf://datasets/{repo_id}@{revision}/{path}"),
            ("HF_CACHE_HOME", str(hf_home)),
            ("HF_DATASETS_CACHE", ds_cache),
            ("HF_MODULES_CACHE", hf_home / "modules"),
            ("DOWNLOADED_DATASETS_PATH", ds_cache / "downloads"),
            ("EXTRACTED_DATASETS_PATH", ds_cache / "downloads" / "extracted"),
            ("HF_HUB_OFFLINE", offline),
            ("HF_DATASETS_OFFLINE", offline),
        ):
            patches.append((ds_config, attr, value))
    patches = [(obj, attr, value) for obj, attr, value in patches if hasattr(obj, attr)]

    def clear_hffs_instances() -> None:  # fsspec caches HfFileSystem instances, with their endpoint
        hffs_cls = getattr(sys.modules.get("huggingface_hub.hf_file_system"), "HfFileSystem", None)
        if hffs_cls is not None and hasattr(hffs_cls, "clear_instance_cache"):
            hffs_cls.clear_instance_cache()

    saved_env = {k: os.environ.get(k) for k in (*overrides, *_CLIENT_ENV_DROP)}
    saved_attrs = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for k in _CLIENT_ENV_DROP:
            os.environ.pop(k, None)
        os.environ.update(overrides)
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        clear_hffs_instances()
        close_client_connections()
        yield overrides
    finally:
        for obj, attr, value in reversed(saved_attrs):
            setattr(obj, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        clear_hffs_instances()
        close_client_connections()
