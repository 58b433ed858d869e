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
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from handler.model_source.checks import check_model_dir
from handler.model_source.default_model import default_cache_dir
from handler.model_source.s3_layout import (
    S3ModelError,
    S3Object,
    S3Uri,
    parse_s3_uri,
    plan_download,
)

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".batchyard-complete"
ENDPOINT_ENV = "BATCHYARD_AWS_ENDPOINT_URL"  # boto3 itself reads AWS_ENDPOINT_URL(_S3)
PROGRESS_SECONDS = 10.0
_ACCESS_CODES = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId",
                 "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AccountProblem"}


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
