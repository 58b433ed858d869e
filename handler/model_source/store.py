"""Which model folder to serve: --model-dir, option.model_id (a local path or s3://bucket/prefix),
/opt/ml/model or the default model."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from handler.model_source.checks import check_model_dir, is_model_dir
from handler.model_source.default_model import default_model_dir, ensure_default_model
from handler.model_source.s3 import download_model, s3_cache_dir
from handler.model_source.s3_layout import is_s3_uri

logger = logging.getLogger(__name__)

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_dir(model_dir: Path | None, model_id: str | None, cache_dir: Path | None,
                      *, root: Path = SAGEMAKER_MODEL_DIR, fetch: bool = True,
                      has_handler: bool = False) -> Path:
    """The folder to load, in LMI's order; the embedded default model when nothing is given.

    With fetch=False, folders made on first use (the default model, an s3:// model's download)
    are returned even if not there yet, and nothing is built or downloaded.
    """
    if model_dir is not None:
        return check_model_dir(model_dir, has_handler)
    if model_id:
        if is_s3_uri(model_id):
            return download_model(model_id, cache_dir) if fetch else s3_cache_dir(model_id,
                                                                                  cache_dir)
        return check_model_dir(_local_model_id(model_id, root), has_handler)
    if is_model_dir(root):
        return root
    logger.info("no model given and %s holds none: serving the embedded default model", root)
    return ensure_default_model(cache_dir) if fetch else default_model_dir(cache_dir)


def _local_model_id(model_id: str, root: Path) -> Path:
    path = Path(model_id)
    if path.is_absolute():
        return path  # an operator's deliberate choice, like LMI's local paths
    resolved = Path(os.path.realpath(root / path))
    if not resolved.is_relative_to(os.path.realpath(root)):
        raise ValueError(f"option.model_id={model_id} escapes the model directory {root}")
    if not resolved.exists() and _HUB_ID.match(model_id):
        raise ValueError(f"option.model_id={model_id} looks like a model hub id, but model hubs "
                         "are not reachable from this server; use a local path")
    return resolved
