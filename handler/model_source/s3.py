"""option.model_id=s3://bucket/prefix: download the model folder with boto3 into a local cache.

Runs in the model-loader thread (the port is already bound and /ping answers 503 meanwhile).
Only what the engine reads is downloaded: config, tokenizer and *.safetensors files at the top
of the prefix. Pickle checkpoints are never fetched; a key that could escape the target folder
refuses the whole model. The cache folder is `<cache>/s3/<sha256(uri)[:16]>/<name>`; it is
filled in a temporary folder next to it and renamed into place with a completion marker, so a
complete folder is reused on later starts without any S3 request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine import PICKLE_SUFFIXES
from handler.model_source.checks import check_model_dir
from handler.model_source.default_model import default_cache_dir

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".batchyard-complete"
ENDPOINT_ENV = "BATCHYARD_AWS_ENDPOINT_URL"  # boto3 itself reads AWS_ENDPOINT_URL(_S3)
PROGRESS_SECONDS = 10.0
# Files the engine and the tokenizer read from a transformers folder (top level only).
WANTED_NAMES = frozenset({
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
})
WANTED_SUFFIXES = (".safetensors", ".jinja")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]$", re.IGNORECASE)
_ACCESS_CODES = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId",
                 "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AccountProblem"}


class S3ModelError(ValueError):
    """A model that cannot come from S3; one line naming the URI (and the key, if one)."""


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the whole bucket

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def list_prefix(self) -> str:
        """The prefix is a folder: s3://b/llama does not take in s3://b/llama-2/..."""
        return f"{self.prefix}/" if self.prefix else ""


@dataclass(frozen=True)
class S3Object:
    key: str
    name: str  # the file name in the model folder
    size: int


def is_s3_uri(value: str | None) -> bool:
    return bool(value) and value.strip().lower().startswith("s3://")


def parse_s3_uri(value: str) -> S3Uri:
    """s3://bucket[/prefix[/]] → S3Uri; ValueError with the allowed form otherwise."""
    rest = value.strip()[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise S3ModelError(f"option.model_id={value!r}: expected s3://bucket/prefix with a "
                           "valid bucket name")
    return S3Uri(bucket, prefix.strip("/"))


def s3_cache_dir(uri: str | S3Uri, cache_dir: Path | None = None) -> Path:
    """Where the model of `uri` lives once downloaded (whether or not it is there yet)."""
    uri = parse_s3_uri(uri) if isinstance(uri, str) else uri
    digest = hashlib.sha256(str(uri).encode()).hexdigest()[:16]
    name = re.sub(r"[^\w.-]", "_", (uri.prefix.rsplit("/", 1)[-1] or uri.bucket))[:100]
    if name.strip(".") == "":
        name = "model"
    return (cache_dir or default_cache_dir()) / "s3" / digest / name


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def download_model(uri: str, cache_dir: Path | None = None,
                   environ: Mapping[str, str] | None = None, client=None) -> Path:
    """The local folder holding the model of `uri`: the cached one, or downloaded now."""
    environ = os.environ if environ is None else environ
    parsed = parse_s3_uri(uri)
    dest = s3_cache_dir(parsed, cache_dir)
    try:
        if is_complete(dest):
            logger.info("%s: using the cached download in %s", parsed, dest)
            return check_model_dir(dest)
        client = client or s3_client(environ)
        plan = plan_download(parsed, list_objects(client, parsed))
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with _locked(dest.parent / ".lock"):
                if not is_complete(dest):  # another process may have finished it meanwhile
                    _download_into(client, parsed, plan, dest)
        except OSError as err:
            raise S3ModelError(f"cannot download {parsed} into {dest.parent}: "
                               f"{err.strerror or err} (BATCHYARD_CACHE_DIR must name a "
                               "writable folder with room for the model)") from err
        return check_model_dir(dest)
    except S3ModelError as err:
        logger.error("%s", err)
        raise


def s3_client(environ: Mapping[str, str]):
    """An S3 client: credentials and AWS_ENDPOINT_URL(_S3) from boto3's own chain; our endpoint
    override and AWS_REGION (which botocore does not read) on top; bounded timeouts."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=10, read_timeout=60, user_agent_extra="batchyard",
                    retries={"max_attempts": 5, "mode": "standard"})
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or None
    # A fresh session: boto3's default session is not safe to share between threads.
    return boto3.session.Session().client("s3", region_name=region, config=config,
                                          endpoint_url=environ.get(ENDPOINT_ENV) or None)


def list_objects(client, uri: S3Uri) -> list[dict]:
    """Every object under the prefix (keys and sizes); S3ModelError when there is none."""
    from botocore.exceptions import BotoCoreError, ClientError

    objects: list[dict] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket,
                                                                 Prefix=uri.list_prefix)
        for page in pages:
            objects += page.get("Contents", [])
    except (BotoCoreError, ClientError) as err:
        raise S3ModelError(f"cannot list {uri}: {describe_error(err, uri)}") from err
    if not objects:
        raise S3ModelError(f"no objects under {uri}/ (is the prefix right?)")
    return objects


def plan_download(uri: S3Uri, objects: list[dict]) -> list[S3Object]:
    """The objects to fetch; S3ModelError for an unsafe key or a folder that cannot be served."""
    wanted: list[S3Object] = []
    skipped: list[str] = []
    pickles: list[str] = []
    for obj in objects:
        key, size = obj["Key"], int(obj.get("Size", 0))
        relative = key[len(uri.list_prefix):]
        name = safe_relative_path(uri, key, relative)
        if name is None:
            continue  # a "folder" placeholder object
        if "/" in name:
            skipped.append(f"{key} (in a subfolder; only top-level files are used)")
        elif name in WANTED_NAMES or name.endswith(WANTED_SUFFIXES):
            twin = next((o.key for o in wanted if o.name == name), None)
            if twin is not None:
                raise S3ModelError(f"{uri}: refusing the model because object keys {twin!r} "
                                   f"and {key!r} both name the file {name}")
            wanted.append(S3Object(key, name, size))
        elif name.endswith(PICKLE_SUFFIXES):
            pickles.append(name)
            skipped.append(f"{key} (pickle checkpoint: never loaded)")
        elif name == "serving.properties":
            skipped.append(f"{key} (settings are read only from the local serving.properties "
                           "and the environment)")
        else:
            skipped.append(f"{key} (not needed for serving)")
    names = {o.name for o in wanted}
    if not any(n.endswith(".safetensors") for n in names):
        if pickles:
            raise S3ModelError(
                f"{uri} has only pickle checkpoints ({', '.join(sorted(pickles)[:3])}), no "
                "*.safetensors weights: unpickling can run arbitrary code, so they are never "
                "loaded; convert the model to safetensors (save_pretrained(..., "
                "safe_serialization=True))")
        raise S3ModelError(f"{uri} has no *.safetensors weights at the top of the prefix")
    if "config.json" not in names:
        raise S3ModelError(f"{uri} has no config.json at the top of the prefix: not a "
                           "transformers model folder")
    for line in skipped[:20]:
        logger.info("%s: skipping %s", uri, line)
    if len(skipped) > 20:
        logger.info("%s: skipping %d more files not needed for serving", uri, len(skipped) - 20)
    return sorted(wanted, key=lambda o: (o.name.endswith(".safetensors"), o.name))


def safe_relative_path(uri: S3Uri, key: str, relative: str) -> str | None:
    """The normalised path of an object below the target folder (None for a folder object).

    Refuses the whole model, naming the key, for a key that is absolute, holds `..`, a
    backslash or a control character, or that would land outside the folder.
    """
    def refuse(why: str) -> S3ModelError:
        return S3ModelError(f"{uri}: refusing the model because object key {key!r} {why}; "
                            "fix or remove that object")

    if "\\" in relative:
        raise refuse("contains a backslash")
    if any(ord(c) < 32 or ord(c) == 127 for c in relative):
        raise refuse("contains a control character")
    if relative.startswith("/"):
        raise refuse("is an absolute path")
    if ".." in relative.split("/"):
        raise refuse("contains a '..' component")
    if relative == "" or relative.endswith("/"):
        return None
    name = posixpath.normpath(relative)
    if name in (".", "") or name.startswith(("/", "../")) or name == "..":
        raise refuse("resolves outside the model folder")
    return name


def describe_error(err: BaseException, uri: S3Uri) -> str:
    """One line for botocore's errors: missing bucket, access denied, unreachable, ..."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(err, NoCredentialsError | PartialCredentialsError):
        return ("no AWS credentials found (the endpoint's execution role, or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    if isinstance(err, ConnectionError):
        return f"cannot reach S3: {err}"
    if isinstance(err, ClientError):
        error = err.response.get("Error", {})
        code = str(error.get("Code", "?"))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return f"bucket {uri.bucket} does not exist"
        if code in _ACCESS_CODES or status == 403 or code == "403":
            return (f"access denied ({code}): the role needs s3:ListBucket on "
                    f"arn:aws:s3:::{uri.bucket} and s3:GetObject on "
                    f"arn:aws:s3:::{uri.bucket}/{uri.list_prefix}*")
        if code in ("NoSuchKey", "404"):
            return "an object disappeared while downloading (was the prefix being rewritten?)"
        return f"{code}: {error.get('Message') or err}"
    return f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One downloader per URI among processes sharing the cache (released if a process dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_into(client, uri: S3Uri, plan: list[S3Object], dest: Path) -> None:
    """Fetch `plan` into a temporary folder next to `dest`, then rename it into place."""
    from boto3.exceptions import Boto3Error
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    total = sum(o.size for o in plan)
    free = shutil.disk_usage(dest.parent).free
    if total > free:
        raise S3ModelError(f"cannot download {uri}: {_size(total)} needed, only {_size(free)} "
                           f"free in {dest.parent}")
    for stale in dest.parent.glob(".partial-*"):  # left by a killed process (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    transfer = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20,
                              max_concurrency=8)
    progress = _Progress(uri, len(plan), total)
    logger.info("%s: downloading %d files (%s) into %s", uri, len(plan), _size(total), dest)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
    try:
        for obj in plan:
            target = tmp / obj.name
            if target.parent != tmp:  # plan_download keeps only plain top-level names
                raise S3ModelError(f"{uri}: refusing object key {obj.key!r}")
            try:
                client.download_file(uri.bucket, obj.key, str(target), Config=transfer,
                                     Callback=progress.add)
            except (BotoCoreError, ClientError, Boto3Error) as err:
                raise S3ModelError(f"cannot download {uri} (object {obj.key}): "
                                   f"{describe_error(err, uri)}") from err
            if target.stat().st_size != obj.size:
                raise S3ModelError(f"cannot download {uri}: {obj.key} has "
                                   f"{target.stat().st_size} bytes, the listing said {obj.size}")
            progress.file_done()
        marker = {"uri": str(uri), "files": {o.name: o.size for o in plan}}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        shutil.rmtree(dest, ignore_errors=True)  # an incomplete folder of an older version
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after the rename
    progress.finish(dest)


class _Progress:
    """Bytes and files done, logged at most every PROGRESS_SECONDS (callbacks come from
    s3transfer's worker threads)."""

    def __init__(self, uri: S3Uri, files: int, total: int) -> None:
        self.uri, self.files, self.total = uri, files, total
        self.done_files = self.done_bytes = 0
        self.started = self.last_log = time.monotonic()
        self.lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.done_bytes += nbytes
            now = time.monotonic()
            if now - self.last_log >= PROGRESS_SECONDS:
                self.last_log = now
                rate = self.done_bytes / max(now - self.started, 1e-9)
                logger.info("%s: %d/%d files, %s of %s (%.0f%%), %s/s", self.uri,
                            self.done_files, self.files, _size(self.done_bytes),
                            _size(self.total), 100 * self.done_bytes / max(self.total, 1),
                            _size(rate))

    def file_done(self) -> None:
        with self.lock:
            self.done_files += 1

    def finish(self, dest: Path) -> None:
        seconds = time.monotonic() - self.started
        logger.info("%s: downloaded %d files, %s in %.1f s (%s/s) into %s", self.uri,
                    self.done_files, _size(self.done_bytes), seconds,
                    _size(self.done_bytes / max(seconds, 1e-9)), dest)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
