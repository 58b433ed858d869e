"""autoscale: Application Auto Scaling target tracking on invocations per instance."""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import ClientError

from deploy.aws import Aws, DeployError, aws_errors, is_access_denied, translate
from deploy.checks import check_name
from deploy.endpoint import VARIANT
from deploy.waiting import describe_endpoint

logger = logging.getLogger(__name__)

NAMESPACE = "sagemaker"
DIMENSION = "sagemaker:variant:DesiredInstanceCount"
METRIC = "SageMakerVariantInvocationsPerInstance"  # invocations per instance per minute
SCALE_IN_COOLDOWN = 300  # seconds: remove instances slowly (a new one takes minutes to start)
SCALE_OUT_COOLDOWN = 60  # seconds: add instances quickly


def resource_id(name: str, variant: str = VARIANT) -> str:
    return f"endpoint/{name}/variant/{variant}"


def policy_name(name: str, variant: str = VARIANT) -> str:
    return f"batchyard-{name}-{variant}-invocations"


def autoscale(aws: Aws, name: str, min_count: int, max_count: int, target: float,
              variant: str = VARIANT, scale_in_cooldown: int = SCALE_IN_COOLDOWN,
              scale_out_cooldown: int = SCALE_OUT_COOLDOWN) -> dict[str, Any]:
    """Register the variant's instance count (min..max) and a target-tracking policy."""
    check_name(name)
    if not 1 <= min_count <= max_count:
        raise DeployError(f"--min {min_count} --max {max_count}: need 1 <= min <= max")
    if target <= 0:
        raise DeployError(f"--target {target}: must be > 0 (invocations per instance per minute)")
    if scale_in_cooldown < 0 or scale_out_cooldown < 0:
        raise DeployError("cooldowns must be >= 0 seconds")
    desc = describe_endpoint(aws, name)
    if desc is None:
        raise DeployError(f"no endpoint {name} in {aws.region}")
    variants = [v["VariantName"] for v in desc.get("ProductionVariants", [])]
    if variant not in variants:
        raise DeployError(f"endpoint {name} has no variant {variant} (it has: "
                          f"{', '.join(variants) or 'none'})")
    rid = resource_id(name, variant)
    client = aws.client("application-autoscaling")
    with aws_errors(f"registering {rid} with Application Auto Scaling"):
        client.register_scalable_target(ServiceNamespace=NAMESPACE, ResourceId=rid,
                                        ScalableDimension=DIMENSION, MinCapacity=min_count,
                                        MaxCapacity=max_count)
    policy = policy_name(name, variant)
    with aws_errors(f"putting scaling policy {policy}"):
        client.put_scaling_policy(
            PolicyName=policy, ServiceNamespace=NAMESPACE, ResourceId=rid,
            ScalableDimension=DIMENSION, PolicyType="TargetTrackingScaling",
            TargetTrackingScalingPolicyConfiguration={
                "TargetValue": float(target),
                "PredefinedMetricSpecification": {"PredefinedMetricType": METRIC},
                "ScaleInCooldown": scale_in_cooldown,
                "ScaleOutCooldown": scale_out_cooldown,
            })
    return {"resource_id": rid, "min": min_count, "max": max_count, "target": target,
            "policy": policy}


def remove_autoscaling(aws: Aws, name: str, variant: str = VARIANT) -> bool:
    """Delete the variant's scaling policies and deregister it; False when none was there."""
    rid = resource_id(name, variant)
    client = aws.client("application-autoscaling")
    try:
        policies = client.describe_scaling_policies(
            ServiceNamespace=NAMESPACE, ResourceId=rid, ScalableDimension=DIMENSION
        ).get("ScalingPolicies", [])
        targets = client.describe_scalable_targets(
            ServiceNamespace=NAMESPACE, ResourceIds=[rid], ScalableDimension=DIMENSION
        ).get("ScalableTargets", [])
    except ClientError as err:
        if not is_access_denied(err):
            raise translate(err, f"reading the autoscaling of {rid}") from err
        logger.warning("cannot read the autoscaling of %s (no application-autoscaling:Describe* "
                       "permission): not removed", rid)
        return False
    with aws_errors(f"removing the autoscaling of {rid}"):
        for policy in policies:
            client.delete_scaling_policy(PolicyName=policy["PolicyName"],
                                         ServiceNamespace=NAMESPACE, ResourceId=rid,
                                         ScalableDimension=DIMENSION)
        if targets:
            client.deregister_scalable_target(ServiceNamespace=NAMESPACE, ResourceId=rid,
                                              ScalableDimension=DIMENSION)
    if policies or targets:
        logger.info("removed autoscaling of %s (%d policies)", rid, len(policies))
    return bool(policies or targets)
