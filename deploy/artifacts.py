"""What goes to S3: serving.properties and, from a local folder, safetensors + config/tokenizer.

Layout: s3://<bucket>/batchyard/<name>/<release>/ is one model's data (mounted by SageMaker at
/opt/ml/model); `switch` adds serving.properties.d/<release>.properties under that prefix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import ClientError

from deploy.aws import Aws, DeployError, aws_errors, error_code, is_access_denied, translate
from engine import PICKLE_SUFFIXES
from handler.config.properties import ConfigError, model_id_setting, parse_properties

logger = logging.getLogger(__name__)

KEY_ROOT = "batchyard"
# PICKLE_SUFFIXES are never uploaded: the engine refuses to load them (unpickling runs code).
# Weights, config, tokenizer (json, merges/vocab text, sentencepiece, tiktoken) and chat template.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".tiktoken", ".jinja")
_NOT_FOUND = {"404", "NoSuchBucket", "NotFound"}


def release_prefix(name: str, release: str) -> str:
    return f"{KEY_ROOT}/{name}/{release}/"


def parse_s3_uri(uri: str, option: str) -> tuple[str, str]:
    """s3://bucket/prefix → (bucket, "prefix/"); the prefix always ends with "/"."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise DeployError(f"{option} {uri!r}: expected s3://<bucket>/<prefix>/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def read_properties(path: Path) -> tuple[str, str | None]:
    """(the file's text, its option.model_id or None); the text is uploaded unchanged."""
    try:
        text = path.read_bytes().decode("utf-8")
        return text, model_id_setting(parse_properties(text, str(path)))
    except OSError as err:
        raise DeployError(f"--properties {path}: {err.strerror}") from err
    except (UnicodeDecodeError, ConfigError) as err:
        raise DeployError(f"--properties {path}: not a UTF-8 properties file ({err})") from err


def model_files(model_dir: Path) -> list[Path]:
    """The files of a local model folder to upload; pickle checkpoints are refused."""
    if not model_dir.is_dir():
        raise DeployError(f"--model-dir {model_dir}: not a folder")
    entries = sorted(model_dir.iterdir())
    pickles = [p.name for p in entries if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        more = f" and {len(pickles) - 3} more" if len(pickles) > 3 else ""
        raise DeployError(f"--model-dir {model_dir}: refusing to upload pickle checkpoints "
                          f"({', '.join(pickles[:3])}{more}); batchyard loads only *.safetensors "
                          "because unpickling can run arbitrary code: convert them to safetensors "
                          "or remove them")
    files = [p for p in entries if p.is_file() and not p.name.startswith(".")
             and p.suffix.lower() in UPLOAD_SUFFIXES]
    skipped = [p.name for p in entries if p not in files]
    if skipped:
        logger.warning("not uploaded from %s (not weights/config/tokenizer files; "
                       "--properties replaces serving.properties): %s", model_dir,
                       ", ".join(skipped))
    names = {p.name for p in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DeployError(f"--model-dir {model_dir}: needs config.json and *.safetensors weights")
    return files


def check_model_s3(aws: Aws, uri: str) -> str:
    """The normalised prefix URI; checks config.json and safetensors when the caller may list."""
    bucket, prefix = parse_s3_uri(uri, "--model-s3")
    normalised = f"s3://{bucket}/{prefix}"
    try:
        listing = aws.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix, Delimiter="/")
    except ClientError as err:
        if error_code(err) in _NOT_FOUND:
            raise DeployError(f"--model-s3 {uri}: no such S3 bucket {bucket}") from err
        if not is_access_denied(err):
            raise translate(err, f"listing {normalised}") from err
        logger.warning("cannot list %s: not checked (the execution role must be able to read it)",
                       normalised)
        return normalised
    names = {o["Key"][len(prefix):] for o in listing.get("Contents", [])}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise DeployError(f"--model-s3 {normalised}: needs config.json and *.safetensors weights "
                          "directly under that prefix")
    return normalised


def resolve_bucket(aws: Aws, bucket: str | None) -> str:
    """--bucket (must exist), else sagemaker-<region>-<account>, created when missing."""
    name = bucket or f"sagemaker-{aws.region}-{aws.account}"
    s3 = aws.client("s3")
    try:
        head = s3.head_bucket(Bucket=name)
    except ClientError as err:
        if error_code(err) in _NOT_FOUND and bucket:
            raise DeployError(f"--bucket {bucket}: no such S3 bucket (create it in {aws.region}, "
                              "or leave out --bucket to use sagemaker-<region>-<account>)") from err
        if error_code(err) in _NOT_FOUND:
            location = ({} if aws.region == "us-east-1"
                        else {"CreateBucketConfiguration": {"LocationConstraint": aws.region}})
            with aws_errors(f"creating the default bucket {name}"):
                s3.create_bucket(Bucket=name, **location)
            logger.info("created S3 bucket %s (kept for later deployments)", name)
            return name
        if error_code(err) == "403":
            raise DeployError(f"bucket {name}: access denied (it may belong to another account); "
                              "pass --bucket with a bucket you can write to") from err
        raise translate(err, f"checking bucket {name}") from err
    region = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
    if region and region != aws.region:
        raise DeployError(f"bucket {name} is in {region} but the endpoint in {aws.region}: "
                          "SageMaker reads model data from the endpoint's region")
    return name


@dataclass
class Uploaded:
    """The S3 objects this run wrote (for rollback)."""

    bucket: str
    keys: list[str] = field(default_factory=list)

    def put_text(self, aws: Aws, key: str, text: str) -> None:
        with aws_errors(f"uploading s3://{self.bucket}/{key}"):
            aws.client("s3").put_object(Bucket=self.bucket, Key=key, Body=text.encode("utf-8"))
        self.keys.append(key)

    def put_file(self, aws: Aws, key: str, path: Path) -> None:
        logger.info("uploading %s (%.1f MB) to s3://%s/%s", path.name,
                    path.stat().st_size / 1e6, self.bucket, key)
        self.keys.append(key)  # a failed multipart upload may still leave an object behind
        with aws_errors(f"uploading {path} to s3://{self.bucket}/{key}"):
            aws.client("s3").upload_file(str(path), self.bucket, key)

    def delete(self, aws: Aws) -> None:
        delete_keys(aws, self.bucket, self.keys)


def delete_keys(aws: Aws, bucket: str, keys: list[str]) -> None:
    s3 = aws.client("s3")
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start:start + 1000]]
        with aws_errors(f"deleting objects in s3://{bucket}"):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def list_keys(aws: Aws, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    with aws_errors(f"listing s3://{bucket}/{prefix}"):
        for page in aws.client("s3").get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix):
            keys.extend(o["Key"] for o in page.get("Contents", []))
    return keys
