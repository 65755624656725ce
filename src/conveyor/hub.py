"""Models by Hugging Face repository name (``conveyor pull``, ``list``, ``rm`` and ``--model
REPO``), kept in huggingface_hub's cache: downloads resume where a cut connection left them
(huggingface_hub's own), every file pulled is checked against the Hub's checksum (an LFS file's
sha256, a small file's git blob id) and fetched again when it does not match, and a cached
model is found without the network (``HF_HUB_OFFLINE=1``, or after a pull). ``HF_ENDPOINT``
names another Hub.

A reference is ``REPO`` or ``REPO:SELECTOR`` (``REPO`` is ``owner/name``): the selector is a file
of the repository, or a GGUF quantization tag (``Q4_K_M``, ``Q8_0``, ``F16``, ...) choosing the
GGUF file (all parts of a split one) whose name carries it. Without one: the repository's
safetensors model (``config.json``, weights, tokenizer files) if it has one, else its GGUF file of
the first preferred tag found (``PREFERRED_QUANTS``), else its first GGUF file."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_REF = re.compile(r"(?P<repo>[\w.\-]+/[\w.\-]+)(?::(?P<selector>[\w.\-/]+))?")
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K", "Q5_K_M", "F16", "BF16")
HF_MODEL_FILES = re.compile(r"(config\.json|generation_config\.json|tokenizer(_config)?\.json|"
                            r"special_tokens_map\.json|tokenizer\.model|.*\.safetensors|"
                            r"model\.safetensors\.index\.json)")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class ModelRef:
    repo_id: str
    selector: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.selector}" if self.selector else "")


def parse_ref(text: str) -> ModelRef | None:
    """The reference ``text`` names, None where it is no repository reference (or a path that
    exists)."""
    m = REPO_REF.fullmatch(text)
    if m is None or os.path.exists(text):
        return None
    return ModelRef(m.group("repo"), m.group("selector"))


def _quant_in(name: str, tag: str) -> bool:
    """Whether a GGUF file name carries quantization ``tag`` (bounded by separators)."""
    stem = _SPLIT.sub(".gguf", name).removesuffix(".gguf").upper()
    return re.search(rf"(^|[-_.]){re.escape(tag.upper())}($|[-_.])", stem) is not None


def choose_files(files: list[str], selector: str | None, repo: str = "") -> list[str]:
    """The files of a repository (``files``: its file names) that a reference's selector names;
    ValueError, listing what there is, when none matches."""
    gguf = sorted(f for f in files if f.endswith(".gguf"))
    if selector is not None and selector in files:
        chosen = [selector]
    elif selector is not None:
        chosen = [f for f in gguf if _quant_in(f, selector)]
        if not chosen:
            tags = sorted({t for f in gguf for t in PREFERRED_QUANTS if _quant_in(f, t)})
            raise ValueError(f"{repo} has no file or GGUF quantization {selector!r} (GGUF files: "
                             f"{', '.join(gguf) or 'none'}{'; tags: ' + ', '.join(tags) if tags else ''})")
    elif "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return sorted(f for f in files if "/" not in f and HF_MODEL_FILES.fullmatch(f))
    elif gguf:
        tag = next((t for t in PREFERRED_QUANTS if any(_quant_in(f, t) for f in gguf)), None)
        chosen = [f for f in gguf if _quant_in(f, tag)] if tag else gguf[:1]
    else:
        raise ValueError(f"{repo} holds neither a safetensors model (config.json and "
                         f"*.safetensors) nor a GGUF file")
    first = chosen[0]
    split = _SPLIT.search(first)
    if split is None:
        return [first]
    prefix = first[:split.start()]
    return sorted(f for f in files if f.startswith(prefix) and _SPLIT.search(f))


def _local_path(paths: list[Path], files: list[str]) -> str:
    """What ``--model`` loads: the GGUF file (the first part of a split one), or the folder."""
    if files[0].endswith(".gguf"):
        return str(paths[0])
    return str(paths[0].parent)


def file_digest(path: Path, lfs: bool) -> str:
    """An LFS file's sha256, or a small file's git blob id (sha1 of its header and bytes)."""
    h = hashlib.sha256() if lfs else hashlib.sha1()  # noqa: S324 - git's blob id is sha1
    if not lfs:
        h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _expected(sibling: Any) -> tuple[str | None, bool]:
    if sibling.lfs is not None:
        return sibling.lfs.sha256, True
    return sibling.blob_id, False


def _drop(path: Path) -> None:
    """Remove a cached file: its blob and the snapshot's link to it."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def pull(ref: ModelRef, verify: bool = True, progress: bool = True) -> str:
    """Download what ``ref`` names into the cache (resuming, checking each file; a file whose
    checksum does not match is fetched again once) and return the local path."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    info = HfApi().model_info(ref.repo_id, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = choose_files(list(siblings), ref.selector, ref.repo_id)
    (enable_progress_bars if progress else disable_progress_bars)()
    paths = []
    for name in files:
        path = Path(hf_hub_download(ref.repo_id, name, revision=info.sha))
        want, lfs = _expected(siblings[name])
        if verify and want is not None and file_digest(path, lfs) != want:
            _drop(path)
            path = Path(hf_hub_download(ref.repo_id, name, revision=info.sha,
                                        force_download=True))
            if file_digest(path, lfs) != want:
                raise ValueError(f"{ref.repo_id}/{name}: the download does not match the "
                                 f"Hub's checksum {want}")
        paths.append(path)
    return _local_path(paths, files)


def _cached_repo(repo_id: str) -> Any:
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir()
    except Exception:  # no cache folder yet
        return None
    return next((r for r in cache.repos if r.repo_id == repo_id and r.repo_type == "model"),
                None)


def cached_path(ref: ModelRef) -> str | None:
    """The local path of a reference already in the cache (its newest revision), without the
    network; None when it is not there."""
    repo = _cached_repo(ref.repo_id)
    if repo is None:
        return None
    for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
        chosen = _chosen_in(revision, ref)
        if chosen is not None:
            return _local_path(list(chosen.values()), list(chosen))
    return None


def _chosen_in(revision: Any, ref: ModelRef) -> dict[str, Path] | None:
    """The files ``ref`` picks in a cached revision, by name (relative to its snapshot) to
    their path; None where it picks none there."""
    by_name = {str(f.file_path.relative_to(revision.snapshot_path)): f.file_path
               for f in revision.files}
    try:
        files = choose_files(list(by_name), ref.selector, ref.repo_id)
    except ValueError:
        return None
    return {name: by_name[name] for name in files}


@functools.cache
def resolve(model: str) -> str | None:
    """The local path ``--model`` loads for a repository reference (None: ``model`` is no
    reference): from the cache when ``HF_HUB_OFFLINE`` is set, else pulled (cached files are
    not downloaded again)."""
    ref = parse_ref(model)
    if ref is None:
        return None
    from huggingface_hub import constants

    if constants.is_offline_mode():
        path = cached_path(ref)
        if path is None:
            raise ValueError(f"model {model!r} is not in the Hugging Face cache and "
                             "HF_HUB_OFFLINE is set: run `conveyor pull` with the network first")
        return path
    try:
        return pull(ref, verify=False, progress=False)
    except ValueError:
        raise
    except Exception as e:  # the Hub unreachable, the repository missing, ...
        path = cached_path(ref)
        if path is None:
            raise ValueError(f"cannot fetch model {model!r}: {e}") from e
        return path


def list_cached() -> list[dict[str, Any]]:
    """The cached model repositories: id, size in bytes, files of the newest revision."""
    from huggingface_hub import scan_cache_dir

    try:
        cache = scan_cache_dir()
    except Exception:
        return []
    out = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        files = sorted(str(f.file_path.relative_to(newest.snapshot_path))
                       for f in newest.files) if newest else []
        out.append({"repo_id": repo.repo_id, "size": repo.size_on_disk, "files": files,
                    "last_modified": repo.last_modified})
    return out


def remove(ref: ModelRef) -> list[str]:
    """Delete a cached repository (with a selector: only the files it names); the removed
    files' names. ValueError when nothing of it is cached."""
    from huggingface_hub import scan_cache_dir

    repo = _cached_repo(ref.repo_id)
    if repo is None:
        raise ValueError(f"{ref.repo_id} is not in the Hugging Face cache")
    if ref.selector is None:
        names = sorted({str(f.file_path.relative_to(r.snapshot_path))
                        for r in repo.revisions for f in r.files})
        scan_cache_dir().delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
        return names
    removed = set()
    for revision in repo.revisions:
        for name, path in (_chosen_in(revision, ref) or {}).items():
            _drop(path)
            removed.add(name)
    if not removed:
        raise ValueError(f"{ref} matches no cached file")
    return sorted(removed)
