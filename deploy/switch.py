"""switch: a new serving.properties on a live endpoint, blue/green through update_endpoint.

The new model keeps the current image, role and model data (the same S3 prefix, mounted at
/opt/ml/model); the new file is uploaded next to it as serving.properties.d/<release>.properties
and BATCHYARD_PROPERTIES points the container at it. The old config and model are deleted only
once the endpoint serves the new config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from deploy.artifacts import Uploaded, parse_s3_uri, read_properties
from deploy.aws import Aws, DeployError, aws_errors, make_tags, owned_by
from deploy.checks import check_name, check_timeout
from deploy.endpoint import (
    DEFAULT_TIMEOUT,
    MODEL_ID_ENV,
    PROPERTIES_ENV,
    delete_config,
    delete_model,
    new_release,
    variant_spec,
)
from deploy.waiting import Ledger, Waiting, describe_endpoint, wait_for

logger = logging.getLogger(__name__)

MODEL_DIR = "/opt/ml/model"
_BROKEN = {"Failed", "UpdateRollbackFailed", "OutOfService"}


def switch(aws: Aws, name: str, properties: Path, waiting: Waiting,
           startup_timeout: int | None = None, download_timeout: int | None = None
           ) -> dict[str, Any]:
    check_name(name)
    for option, value in (("--startup-timeout", startup_timeout),
                          ("--download-timeout", download_timeout)):
        if value is not None:
            check_timeout(option, value)
    text, model_id = read_properties(properties)
    desc = describe_endpoint(aws, name)
    if desc is None:
        raise DeployError(f"no endpoint {name} in {aws.region}: create it with "
                          "`batchyard deploy create`")
    if not owned_by(aws, desc["EndpointArn"], name):
        raise DeployError(f"endpoint {name} was not created by `batchyard deploy create`: "
                          "switch only changes endpoints it created")
    if desc["EndpointStatus"] != "InService":
        raise DeployError(f"endpoint {name} is {desc['EndpointStatus']}: switch needs it "
                          "InService (wait, or delete it)")
    sm = aws.client("sagemaker")
    old_config_name = desc["EndpointConfigName"]
    with aws_errors(f"describing endpoint config {old_config_name}"):
        old_config = sm.describe_endpoint_config(EndpointConfigName=old_config_name)
    if len(old_config["ProductionVariants"]) != 1:
        raise DeployError(f"endpoint config {old_config_name} has several variants; switch "
                          "handles the one-variant endpoints that create makes")
    variant = old_config["ProductionVariants"][0]
    old_model_name = variant["ModelName"]
    with aws_errors(f"describing model {old_model_name}"):
        old_model = sm.describe_model(ModelName=old_model_name)
    container = dict(old_model["PrimaryContainer"])
    container.pop("ModelDataUrl", None)  # ModelDataSource is the one we set
    data_uri = container.get("ModelDataSource", {}).get("S3DataSource", {}).get("S3Uri")
    if not data_uri:
        raise DeployError(f"model {old_model_name} has no S3 ModelDataSource to reuse")
    env = dict(container.get("Environment") or {})
    served = env.get(MODEL_ID_ENV)
    if served and model_id and model_id.rstrip("/") != served.rstrip("/"):
        raise DeployError(f"{properties} sets option.model_id={model_id}, but endpoint {name} "
                          f"serves {served}: remove option.model_id from the file (switch "
                          "changes serving.properties, not the model)")

    release = new_release()
    bucket, prefix = parse_s3_uri(data_uri, "model data")
    relative = f"serving.properties.d/{release}.properties"
    env[PROPERTIES_ENV] = f"{MODEL_DIR}/{relative}"
    container["Environment"] = env
    new_name = f"{name}-{release}"
    count = _instance_count(desc, variant)
    new_variant = variant_spec(
        new_name, variant["InstanceType"], count,
        startup_timeout or variant.get("ContainerStartupHealthCheckTimeoutInSeconds",
                                       DEFAULT_TIMEOUT),
        download_timeout or variant.get("ModelDataDownloadTimeoutInSeconds", DEFAULT_TIMEOUT),
        variant["VariantName"])
    extra = {k: old_model[k] for k in ("VpcConfig", "EnableNetworkIsolation") if old_model.get(k)}
    tags = make_tags(name, release)
    ledger = Ledger()
    try:
        uploaded = Uploaded(bucket)
        ledger.add(f"s3://{bucket}/{prefix}{relative}", lambda: uploaded.delete(aws))
        uploaded.put_text(aws, prefix + relative, text)
        with aws_errors(f"creating model {new_name}"):
            sm.create_model(ModelName=new_name, ExecutionRoleArn=old_model["ExecutionRoleArn"],
                            PrimaryContainer=container, Tags=tags, **extra)
        ledger.add(f"model {new_name}", lambda: delete_model(aws, new_name))
        with aws_errors(f"creating endpoint config {new_name}"):
            sm.create_endpoint_config(EndpointConfigName=new_name,
                                      ProductionVariants=[new_variant], Tags=tags)
        ledger.add(f"endpoint config {new_name}", lambda: delete_config(aws, new_name))
        with aws_errors(f"updating endpoint {name} to {new_name}"):
            sm.update_endpoint(EndpointName=name, EndpointConfigName=new_name)
    except BaseException as err:
        summary = ledger.describe_rollback(name)
        if isinstance(err, DeployError):
            raise DeployError(f"{err}; {summary}; endpoint {name} is unchanged") from err
        logger.error("%s", summary)
        raise
    logger.info("updating endpoint %s: %s → %s (blue/green)", name, old_config_name, new_name)
    previous_failure = desc.get("FailureReason")
    desc, result = wait_for(aws, name, waiting,
                            lambda d: _switched(d, new_name, previous_failure))
    kept = f"endpoint config {old_config_name} and model {old_model_name}"
    if result == "timeout":
        raise DeployError(f"endpoint {name} is still {desc['EndpointStatus']} after "
                          f"{waiting.timeout:.0f}s; kept {kept} and the new ones, {new_name}: "
                          f"once it serves {new_name}, remove the old ones with `aws sagemaker "
                          f"delete-endpoint-config --endpoint-config-name {old_config_name}` and "
                          f"`aws sagemaker delete-model --model-name {old_model_name}`")
    if result == "failed":
        reason = desc.get("FailureReason") or "no FailureReason given"
        if desc.get("EndpointConfigName") == new_name:
            raise DeployError(f"switch failed: endpoint {name} is {desc['EndpointStatus']}: "
                              f"{reason}; kept {kept} and {new_name}")
        raise DeployError(f"switch failed: {reason}; endpoint {name} still serves "
                          f"{old_config_name} (kept {kept}); {ledger.describe_rollback(name)}")
    deleted, left = [], []
    for what, delete in ((f"endpoint config {old_config_name}",
                          lambda: delete_config(aws, old_config_name)),
                         (f"model {old_model_name}", lambda: delete_model(aws, old_model_name))):
        try:
            delete()
            deleted.append(what)
        except DeployError as err:
            logger.warning("%s", err)
            left.append(what)
    return {"endpoint": name, "endpoint_config": new_name, "model": new_name,
            "properties": f"s3://{bucket}/{prefix}{relative}", "deleted": deleted,
            "left": left}


def _instance_count(desc: dict[str, Any], variant: dict[str, Any]) -> int:
    """The count running now (autoscaling may have changed it), else the config's."""
    for live in desc.get("ProductionVariants", []):
        if live.get("VariantName") == variant["VariantName"]:
            count = live.get("DesiredInstanceCount") or live.get("CurrentInstanceCount")
            if count:
                return int(count)
    return int(variant.get("InitialInstanceCount", 1))


def _switched(desc: dict[str, Any], new_config: str, previous_failure: str | None) -> str | None:
    status = desc["EndpointStatus"]
    if status == "InService" and desc.get("EndpointConfigName") == new_config:
        return "ok"
    if status in _BROKEN:
        return "failed"
    failure = desc.get("FailureReason")
    if status == "InService" and failure and failure != previous_failure:
        return "failed"  # SageMaker rolled back to the old config
    return None
