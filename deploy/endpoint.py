"""create: model + endpoint config + endpoint, then wait for InService (switch.py reuses the
naming and the container settings).

Every resource is named "<name>-<release>" (release: UTC time to the millisecond) and tagged
batchyard:endpoint=<name>, so `delete` finds all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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
    keep_on_failure: bool = field(default=False, kw_only=True)


def new_release() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond // 1000:03d}"


def variant_spec(model: str, instance_type: str, count: int, startup: int, download: int,
                 variant: str = VARIANT) -> dict[str, Any]:
    return {"VariantName": variant, "ModelName": model, "InstanceType": instance_type,
            "InitialInstanceCount": count, "InitialVariantWeight": 1.0,
            "ContainerStartupHealthCheckTimeoutInSeconds": startup,
            "ModelDataDownloadTimeoutInSeconds": download}


@dataclass(frozen=True)
class _Inputs:
    """What the checks of a CreateRequest produced."""

    text: str  # serving.properties, uploaded unchanged
    files: list[Path]  # from --model-dir
    model_s3: str | None  # checked --model-s3, set as HF_MODEL_ID
    bucket: str


@dataclass(frozen=True)
class _Release:
    """This run's names: model and endpoint config <name>-<release>, data under its prefix."""

    resource: str
    bucket: str
    prefix: str
    tags: list[dict[str, str]]

    @property
    def data_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def create(aws: Aws, req: CreateRequest, waiting: Waiting) -> dict[str, Any]:
    """Upload, create model + config + endpoint, wait; roll back what this run made on failure."""
    inputs = _validate_create(aws, req)
    release = _plan_release(req.name, inputs.bucket)
    ledger = _create_resources(aws, req, inputs, release)
    desc = _wait_in_service(aws, req, waiting, ledger)
    return {"endpoint": req.name, "arn": desc.get("EndpointArn"), "model": release.resource,
            "endpoint_config": release.resource, "model_data": release.data_uri,
            "model_id": inputs.model_s3}


def _validate_create(aws: Aws, req: CreateRequest) -> _Inputs:
    """Every check that can fail before anything is created: local ones first, then AWS's."""
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
    return _Inputs(text, files, model_s3, resolve_bucket(aws, req.bucket))


def _plan_release(name: str, bucket: str) -> _Release:
    release = new_release()
    return _Release(f"{name}-{release}", bucket, release_prefix(name, release),
                    make_tags(name, release))


def _create_resources(aws: Aws, req: CreateRequest, inputs: _Inputs, release: _Release) -> Ledger:
    """Upload, then model, endpoint config, endpoint; what this run made is in the ledger."""
    sm = aws.client("sagemaker")
    ledger = Ledger()
    try:
        _upload(aws, ledger, inputs, release)
        container = _container(req.image, release, inputs.model_s3)
        with aws_errors(f"creating model {release.resource}"):
            sm.create_model(ModelName=release.resource, ExecutionRoleArn=req.role,
                            PrimaryContainer=container, Tags=release.tags)
        ledger.add(f"model {release.resource}", lambda: delete_model(aws, release.resource))
        variant = variant_spec(release.resource, req.instance_type, req.instance_count,
                               req.startup_timeout, req.download_timeout)
        with aws_errors(f"creating endpoint config {release.resource}"):
            sm.create_endpoint_config(EndpointConfigName=release.resource,
                                      ProductionVariants=[variant], Tags=release.tags)
        ledger.add(f"endpoint config {release.resource}",
                   lambda: delete_config(aws, release.resource))
        with aws_errors(f"creating endpoint {req.name}"):
            sm.create_endpoint(EndpointName=req.name, EndpointConfigName=release.resource,
                               Tags=release.tags)
        ledger.add(f"endpoint {req.name}", lambda: delete_endpoint(aws, req.name))
    except BaseException as err:
        summary = ledger.describe_rollback(req.name)
        if isinstance(err, DeployError):
            raise DeployError(f"{err}; {summary}") from err
        logger.error("%s", summary)
        raise
    logger.info("created model, endpoint config %s and endpoint %s; waiting for InService",
                release.resource, req.name)
    return ledger


def _upload(aws: Aws, ledger: Ledger, inputs: _Inputs, release: _Release) -> None:
    """serving.properties, then the model files; registered first so a partial upload goes too."""
    uploaded = Uploaded(release.bucket)
    ledger.add(f"the S3 objects under {release.data_uri}", lambda: uploaded.delete(aws))
    uploaded.put_text(aws, release.prefix + "serving.properties", inputs.text)
    for path in inputs.files:
        uploaded.put_file(aws, release.prefix + path.name, path)


def _container(image: str, release: _Release, model_s3: str | None) -> dict[str, Any]:
    return {
        "Image": image,
        "ModelDataSource": {"S3DataSource": {"S3Uri": release.data_uri, "S3DataType": "S3Prefix",
                                             "CompressionType": "None"}},
        "Environment": {MODEL_ID_ENV: model_s3} if model_s3 else {},
    }


def _wait_in_service(aws: Aws, req: CreateRequest, waiting: Waiting, ledger: Ledger
                     ) -> dict[str, Any]:
    """describe_endpoint once InService; a failed endpoint is rolled back unless kept."""
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
    return desc


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
