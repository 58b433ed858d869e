"""What an s3:// model id names and which of its objects a model folder needs. No network:
the keys are checked here (unsafe ones refuse the whole model) before anything is fetched."""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import TypeGuard

from engine import PICKLE_SUFFIXES

logger = logging.getLogger(__name__)

# Files the engine and the tokenizer read from a transformers folder (top level only).
WANTED_NAMES = frozenset({
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
})
WANTED_SUFFIXES = (".safetensors", ".jinja")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]$", re.IGNORECASE)


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


def is_s3_uri(value: str | None) -> TypeGuard[str]:
    return value is not None and value.strip().lower().startswith("s3://")


def parse_s3_uri(value: str) -> S3Uri:
    """s3://bucket[/prefix[/]] → S3Uri; ValueError with the allowed form otherwise."""
    rest = value.strip()[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise S3ModelError(f"option.model_id={value!r}: expected s3://bucket/prefix with a "
                           "valid bucket name")
    return S3Uri(bucket, prefix.strip("/"))


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
