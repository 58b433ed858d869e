"""switch: a new serving.properties on a live endpoint, blue/green through update_endpoint.

The new model keeps the current image, role and model data (the same S3 prefix, mounted at
/opt/ml/model); the new file is uploaded next to it as serving.properties.d/<release>.properties
and BATCHYARD_PROPERTIES points the container at it. The old config and model are deleted only
once the endpoint serves the new config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Serving:
    """What the endpoint serves before the switch: one config, its one variant and model."""

    desc: dict[str, Any]  # describe_endpoint, read once before anything changes
    config_name: str
    variant: dict[str, Any]
    model_name: str
    model: dict[str, Any]  # describe_model
    container: dict[str, Any]  # the model's PrimaryContainer without ModelDataUrl
    data_uri: str

    @property
    def kept(self) -> str:
        return f"endpoint config {self.config_name} and model {self.model_name}"


@dataclass(frozen=True)
class _Release:
    """The model and endpoint config the switch creates, both named <name>-<release>."""

    name: str
    text: str  # the new serving.properties, uploaded unchanged
    bucket: str
    key: str
    container: dict[str, Any]
    variant: dict[str, Any]
    extra: dict[str, Any]  # create_model arguments carried over from the old model
    tags: list[dict[str, str]]

    @property
    def properties_uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def switch(aws: Aws, name: str, properties: Path, waiting: Waiting,
           startup_timeout: int | None = None, download_timeout: int | None = None
           ) -> dict[str, Any]:
    """Blue/green: new model + config beside the old ones, update_endpoint, wait, delete the old."""
    text, serving = _validate_switch(aws, name, properties, startup_timeout, download_timeout)
    release = _plan_release(name, text, serving, startup_timeout, download_timeout)
    ledger = _create_and_update(aws, name, serving, release)
    _wait_switched(aws, name, waiting, serving, release, ledger)
    deleted, left = _cleanup_old(aws, serving)
    return {"endpoint": name, "endpoint_config": release.name, "model": release.name,
            "properties": release.properties_uri, "deleted": deleted, "left": left}


def _validate_switch(aws: Aws, name: str, properties: Path, startup_timeout: int | None,
                     download_timeout: int | None) -> tuple[str, _Serving]:
    """(the new file's text, what the endpoint serves now); raises before anything is made."""
    check_name(name)
    for option, value in (("--startup-timeout", startup_timeout),
                          ("--download-timeout", download_timeout)):
        if value is not None:
            check_timeout(option, value)
    text, model_id = read_properties(properties)
    serving = _read_serving(aws, _live_endpoint(aws, name))
    served = (serving.container.get("Environment") or {}).get(MODEL_ID_ENV)
    if served and model_id and model_id.rstrip("/") != served.rstrip("/"):
        raise DeployError(f"{properties} sets option.model_id={model_id}, but endpoint {name} "
                          f"serves {served}: remove option.model_id from the file (switch "
                          "changes serving.properties, not the model)")
    return text, serving


def _live_endpoint(aws: Aws, name: str) -> dict[str, Any]:
    """describe_endpoint of an InService endpoint that `create` made."""
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
    return desc


def _read_serving(aws: Aws, desc: dict[str, Any]) -> _Serving:
    sm = aws.client("sagemaker")
    config_name = desc["EndpointConfigName"]
    with aws_errors(f"describing endpoint config {config_name}"):
        config = sm.describe_endpoint_config(EndpointConfigName=config_name)
    if len(config["ProductionVariants"]) != 1:
        raise DeployError(f"endpoint config {config_name} has several variants; switch "
                          "handles the one-variant endpoints that create makes")
    variant = config["ProductionVariants"][0]
    model_name = variant["ModelName"]
    with aws_errors(f"describing model {model_name}"):
        model = sm.describe_model(ModelName=model_name)
    container = dict(model["PrimaryContainer"])
    container.pop("ModelDataUrl", None)  # ModelDataSource is the one we set
    data_uri = container.get("ModelDataSource", {}).get("S3DataSource", {}).get("S3Uri")
    if not data_uri:
        raise DeployError(f"model {model_name} has no S3 ModelDataSource to reuse")
    return _Serving(desc, config_name, variant, model_name, model, container, data_uri)


def _plan_release(name: str, text: str, serving: _Serving, startup_timeout: int | None,
                  download_timeout: int | None) -> _Release:
    """The new model: the old one's container, pointed at the new file beside its data."""
    release = new_release()
    bucket, prefix = parse_s3_uri(serving.data_uri, "model data")
    relative = f"serving.properties.d/{release}.properties"
    env = dict(serving.container.get("Environment") or {})
    env[PROPERTIES_ENV] = f"{MODEL_DIR}/{relative}"
    new_name = f"{name}-{release}"
    old = serving.variant
    new_variant = variant_spec(
        new_name, old["InstanceType"], _instance_count(serving.desc, old),
        startup_timeout or old.get("ContainerStartupHealthCheckTimeoutInSeconds",
                                   DEFAULT_TIMEOUT),
        download_timeout or old.get("ModelDataDownloadTimeoutInSeconds", DEFAULT_TIMEOUT),
        old["VariantName"])
    extra = {k: serving.model[k] for k in ("VpcConfig", "EnableNetworkIsolation")
             if serving.model.get(k)}
    return _Release(new_name, text, bucket, prefix + relative,
                    {**serving.container, "Environment": env}, new_variant, extra,
                    make_tags(name, release))


def _create_and_update(aws: Aws, name: str, serving: _Serving, release: _Release) -> Ledger:
    """Upload, create model + config, update_endpoint; what this run made is in the ledger."""
    sm = aws.client("sagemaker")
    ledger = Ledger()
    try:
        uploaded = Uploaded(release.bucket)
        ledger.add(release.properties_uri, lambda: uploaded.delete(aws))
        uploaded.put_text(aws, release.key, release.text)
        with aws_errors(f"creating model {release.name}"):
            sm.create_model(ModelName=release.name,
                            ExecutionRoleArn=serving.model["ExecutionRoleArn"],
                            PrimaryContainer=release.container, Tags=release.tags,
                            **release.extra)
        ledger.add(f"model {release.name}", lambda: delete_model(aws, release.name))
        with aws_errors(f"creating endpoint config {release.name}"):
            sm.create_endpoint_config(EndpointConfigName=release.name,
                                      ProductionVariants=[release.variant], Tags=release.tags)
        ledger.add(f"endpoint config {release.name}", lambda: delete_config(aws, release.name))
        with aws_errors(f"updating endpoint {name} to {release.name}"):
            sm.update_endpoint(EndpointName=name, EndpointConfigName=release.name)
    except BaseException as err:
        summary = ledger.describe_rollback(name)
        if isinstance(err, DeployError):
            raise DeployError(f"{err}; {summary}; endpoint {name} is unchanged") from err
        logger.error("%s", summary)
        raise
    logger.info("updating endpoint %s: %s → %s (blue/green)", name, serving.config_name,
                release.name)
    return ledger


def _wait_switched(aws: Aws, name: str, waiting: Waiting, serving: _Serving, release: _Release,
                   ledger: Ledger) -> None:
    """Wait until the endpoint serves the new config; on failure say what was kept or undone."""
    new_name, old_config = release.name, serving.config_name
    previous_failure = serving.desc.get("FailureReason")
    desc, result = wait_for(aws, name, waiting,
                            lambda d: _switched(d, new_name, previous_failure))
    if result == "timeout":
        raise DeployError(f"endpoint {name} is still {desc['EndpointStatus']} after "
                          f"{waiting.timeout:.0f}s; kept {serving.kept} and the new ones, "
                          f"{new_name}: once it serves {new_name}, remove the old ones with `aws "
                          f"sagemaker delete-endpoint-config --endpoint-config-name {old_config}` "
                          f"and `aws sagemaker delete-model --model-name {serving.model_name}`")
    if result == "failed":
        reason = desc.get("FailureReason") or "no FailureReason given"
        if desc.get("EndpointConfigName") == new_name:
            raise DeployError(f"switch failed: endpoint {name} is {desc['EndpointStatus']}: "
                              f"{reason}; kept {serving.kept} and {new_name}")
        raise DeployError(f"switch failed: {reason}; endpoint {name} still serves "
                          f"{old_config} (kept {serving.kept}); {ledger.describe_rollback(name)}")


def _cleanup_old(aws: Aws, serving: _Serving) -> tuple[list[str], list[str]]:
    """(deleted, left): the old config and model; one that cannot go is reported, not fatal."""
    deleted, left = [], []
    for what, delete in ((f"endpoint config {serving.config_name}",
                          lambda: delete_config(aws, serving.config_name)),
                         (f"model {serving.model_name}",
                          lambda: delete_model(aws, serving.model_name))):
        try:
            delete()
            deleted.append(what)
        except DeployError as err:
            logger.warning("%s", err)
            left.append(what)
    return deleted, left


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
