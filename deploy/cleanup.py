"""delete: autoscaling, the endpoint, then every config and model tagged for it; idempotent."""

from __future__ import annotations

import logging
from typing import Any

from deploy.artifacts import KEY_ROOT, delete_keys, list_keys, parse_s3_uri
from deploy.autoscale import remove_autoscaling
from deploy.aws import Aws, DeployError, aws_errors, owned_by
from deploy.checks import check_name
from deploy.endpoint import VARIANT, delete_config, delete_endpoint, delete_model
from deploy.waiting import Waiting, describe_endpoint, wait_gone

logger = logging.getLogger(__name__)


def delete(aws: Aws, name: str, waiting: Waiting, *, purge_artifacts: bool = False,
           bucket: str | None = None) -> dict[str, Any]:
    """Remove what `create`/`switch` made for `name`; {"deleted": [...], "kept": [...]}."""
    check_name(name)
    deleted: list[str] = []
    desc = describe_endpoint(aws, name)
    if desc is not None and not owned_by(aws, desc["EndpointArn"], name):
        raise DeployError(f"endpoint {name} was not created by `batchyard deploy create` (no "
                          "batchyard:endpoint tag): not deleting it")
    variants = [v["VariantName"] for v in (desc or {}).get("ProductionVariants", [])] or [VARIANT]
    for variant in variants:  # deregister before the endpoint goes (AWS's advice)
        if remove_autoscaling(aws, name, variant):
            deleted.append(f"autoscaling of variant {variant}")
    if desc is not None and delete_endpoint(aws, name):
        deleted.append(f"endpoint {name}")
        if not wait_gone(aws, name, waiting):
            logger.warning("endpoint %s is still being deleted after %.0fs", name,
                           waiting.timeout)
    sm = aws.client("sagemaker")
    configs = _owned(aws, name, "list_endpoint_configs", "EndpointConfigs",
                     "EndpointConfigName", "EndpointConfigArn")
    models = _owned(aws, name, "list_models", "Models", "ModelName", "ModelArn")
    roots: set[tuple[str, str]] = set()
    for model in models:
        with aws_errors(f"describing model {model}"):
            container = sm.describe_model(ModelName=model)["PrimaryContainer"]
        uri = container.get("ModelDataSource", {}).get("S3DataSource", {}).get("S3Uri")
        if uri:
            data_bucket, prefix = parse_s3_uri(uri, "model data")
            ours = f"{KEY_ROOT}/{name}/"
            roots.add((data_bucket, ours if prefix.startswith(ours) else prefix))
    if bucket:
        roots.add((bucket, f"{KEY_ROOT}/{name}/"))
    deleted += [f"endpoint config {c}" for c in configs if delete_config(aws, c)]
    deleted += [f"model {m}" for m in models if delete_model(aws, m)]
    kept: list[str] = []
    for data_bucket, prefix in sorted(roots):
        if purge_artifacts:
            keys = list_keys(aws, data_bucket, prefix)
            delete_keys(aws, data_bucket, keys)
            if keys:
                deleted.append(f"{len(keys)} S3 objects under s3://{data_bucket}/{prefix}")
        else:
            kept.append(f"s3://{data_bucket}/{prefix}")
    return {"deleted": deleted, "kept": kept}


def _owned(aws: Aws, name: str, operation: str, key: str, name_key: str,
           arn_key: str) -> list[str]:
    """Resources named "<name>-..." that carry batchyard:endpoint=<name>."""
    found: list[str] = []
    with aws_errors(f"listing SageMaker resources of {name} ({operation})"):
        pages = aws.client("sagemaker").get_paginator(operation).paginate(NameContains=name)
        for page in pages:
            for item in page.get(key, []):
                if item[name_key].startswith(f"{name}-") and owned_by(aws, item[arn_key], name):
                    found.append(item[name_key])
    return found
