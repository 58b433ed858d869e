"""create and switch: model + endpoint config (+ endpoint), then wait for InService.

Every resource is named "<name>-<release>" (release: UTC time to the millisecond) and tagged
batchyard:endpoint=<name>, so `delete` finds all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from deploy.artifacts import (
    Uploaded,
    check_model_s3,
    model_files,
    read_properties,
    release_prefix,
    resolve_bucket,
)
from deploy.aws import Aws, DeployError, aws_errors, is_not_found, make_tags, translate
from deploy.checks import (
    check_image,
    check_instance,
    check_name,
    check_role,
    check_timeout,
    parse_image,
)
from deploy.waiting import Ledger, Waiting, describe_endpoint, wait_for

logger = logging.getLogger(__name__)

VARIANT = "AllTraffic"
DEFAULT_TIMEOUT = 900  # seconds, ContainerStartupHealthCheck and ModelDataDownload
MODEL_ID_ENV = "HF_MODEL_ID"  # the container reads it as option.model_id (LMI alias)
PROPERTIES_ENV = "BATCHYARD_PROPERTIES"  # the container reads serving.properties from there


@dataclass(frozen=True)
class CreateRequest:
    name: str
    image: str
    role: str
    properties: Path
    instance_type: str
    instance_count: int = 1
    model_dir: Path | None = None
    model_s3: str | None = None
    bucket: str | None = None
    startup_timeout: int = DEFAULT_TIMEOUT
    download_timeout: int = DEFAULT_TIMEOUT
    keep_on_failure: bool = False


def new_release() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond // 1000:03d}"


def variant_spec(model: str, instance_type: str, count: int, startup: int, download: int,
                 variant: str = VARIANT) -> dict[str, Any]:
    return {"VariantName": variant, "ModelName": model, "InstanceType": instance_type,
            "InitialInstanceCount": count, "InitialVariantWeight": 1.0,
            "ContainerStartupHealthCheckTimeoutInSeconds": startup,
            "ModelDataDownloadTimeoutInSeconds": download}


def create(aws: Aws, req: CreateRequest, waiting: Waiting) -> dict[str, Any]:
    """Upload, create model + config + endpoint, wait; roll back what this run made on failure."""
    check_name(req.name)
    check_timeout("--startup-timeout", req.startup_timeout)
    check_timeout("--download-timeout", req.download_timeout)
    check_instance(req.instance_type, req.instance_count)
    parse_image(req.image)
    text, model_id = read_properties(req.properties)
    files = model_files(req.model_dir) if req.model_dir else []
    if req.model_s3 and model_id and model_id.rstrip("/") != req.model_s3.rstrip("/"):
        raise DeployError(f"{req.properties} sets option.model_id={model_id}, which would win "
                          f"over --model-s3 {req.model_s3}: remove it from the file")
    if req.model_dir and model_id:
        logger.warning("%s sets option.model_id=%s: the container loads that, not the folder "
                       "uploaded from %s", req.properties, model_id, req.model_dir)
    existing = describe_endpoint(aws, req.name)
    if existing is not None:
        raise DeployError(f"endpoint {req.name} already exists ({existing['EndpointStatus']}): "
                          f"use `batchyard deploy switch --name {req.name} --properties FILE` to "
                          f"change it, or `batchyard deploy delete --name {req.name}` first")
    check_role(aws, req.role)
    check_image(aws, req.image)
    model_s3 = check_model_s3(aws, req.model_s3) if req.model_s3 else None
    bucket = resolve_bucket(aws, req.bucket)

    release = new_release()
    prefix = release_prefix(req.name, release)
    data_uri = f"s3://{bucket}/{prefix}"
    resource = f"{req.name}-{release}"
    tags = make_tags(req.name, release)
    sm = aws.client("sagemaker")
    ledger = Ledger()
    try:
        uploaded = Uploaded(bucket)
        ledger.add(f"the S3 objects under {data_uri}", lambda: uploaded.delete(aws))
        uploaded.put_text(aws, prefix + "serving.properties", text)
        for path in files:
            uploaded.put_file(aws, prefix + path.name, path)
        container: dict[str, Any] = {
            "Image": req.image,
            "ModelDataSource": {"S3DataSource": {"S3Uri": data_uri, "S3DataType": "S3Prefix",
                                                 "CompressionType": "None"}},
            "Environment": {MODEL_ID_ENV: model_s3} if model_s3 else {},
        }
        with aws_errors(f"creating model {resource}"):
            sm.create_model(ModelName=resource, ExecutionRoleArn=req.role,
                            PrimaryContainer=container, Tags=tags)
        ledger.add(f"model {resource}", lambda: delete_model(aws, resource))
        variant = variant_spec(resource, req.instance_type, req.instance_count,
                               req.startup_timeout, req.download_timeout)
        with aws_errors(f"creating endpoint config {resource}"):
            sm.create_endpoint_config(EndpointConfigName=resource, ProductionVariants=[variant],
                                      Tags=tags)
        ledger.add(f"endpoint config {resource}", lambda: delete_config(aws, resource))
        with aws_errors(f"creating endpoint {req.name}"):
            sm.create_endpoint(EndpointName=req.name, EndpointConfigName=resource, Tags=tags)
        ledger.add(f"endpoint {req.name}", lambda: delete_endpoint(aws, req.name))
    except BaseException as err:
        summary = ledger.describe_rollback(req.name)
        if isinstance(err, DeployError):
            raise DeployError(f"{err}; {summary}") from err
        logger.error("%s", summary)
        raise
    logger.info("created model, endpoint config %s and endpoint %s; waiting for InService",
                resource, req.name)
    desc, result = wait_for(aws, req.name, waiting, _created)
    if result == "timeout":
        raise DeployError(f"endpoint {req.name} is still {desc['EndpointStatus']} after "
                          f"{waiting.timeout:.0f}s and was left as it is: watch it with `aws "
                          f"sagemaker describe-endpoint --endpoint-name {req.name}`, remove it "
                          f"with `batchyard deploy delete --name {req.name}`")
    if result == "failed":
        reason = desc.get("FailureReason") or "no FailureReason given"
        if req.keep_on_failure:
            raise DeployError(f"endpoint {req.name} is {desc['EndpointStatus']}: {reason}; kept "
                              f"for inspection (remove with `batchyard deploy delete --name "
                              f"{req.name} --purge-artifacts`)")
        raise DeployError(f"endpoint {req.name} is {desc['EndpointStatus']}: {reason}; "
                          f"{ledger.describe_rollback(req.name)}")
    return {"endpoint": req.name, "arn": desc.get("EndpointArn"), "model": resource,
            "endpoint_config": resource, "model_data": data_uri, "model_id": model_s3}


def _created(desc: dict[str, Any]) -> str | None:
    status = desc["EndpointStatus"]
    if status == "InService":
        return "ok"
    return None if status in {"Creating", "Updating", "SystemUpdating"} else "failed"


def delete_model(aws: Aws, name: str) -> bool:
    """Delete a model; False when it was already gone."""
    return _delete(aws, "delete_model", "model", ModelName=name)


def delete_config(aws: Aws, name: str) -> bool:
    return _delete(aws, "delete_endpoint_config", "endpoint config", EndpointConfigName=name)


def delete_endpoint(aws: Aws, name: str) -> bool:
    return _delete(aws, "delete_endpoint", "endpoint", EndpointName=name)


def _delete(aws: Aws, operation: str, kind: str, **name: str) -> bool:
    try:
        getattr(aws.client("sagemaker"), operation)(**name)
        return True
    except ClientError as err:
        if is_not_found(err):
            return False
        raise translate(err, f"deleting {kind} {next(iter(name.values()))}") from err
