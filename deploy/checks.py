"""Input checks run before anything is created: names, timeouts, role, image."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from botocore.exceptions import ClientError

from deploy.aws import Aws, DeployError, error_code, is_access_denied, translate

logger = logging.getLogger(__name__)

# Model and endpoint-config names are "<name>-<release>" (release: 19 characters + "-"), and
# SageMaker names are at most 63 characters.
MAX_NAME_LENGTH = 43
_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
_ROLE_ARN = re.compile(r"^arn:aws(?:-cn|-us-gov)?:iam::(?P<account>\d{12}):role/"
                       r"(?:[\w+=,.@-]+/)*(?P<name>[\w+=,.@-]{1,64})$")
_ECR_URI = re.compile(r"^(?P<registry>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com"
                      r"(?:\.cn)?/(?P<repository>[a-z0-9][a-z0-9._/-]{1,255})"
                      r"(?::(?P<tag>[\w][\w.-]{0,127})|@(?P<digest>sha256:[0-9a-f]{64}))?$")
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")
TIMEOUT_RANGE = (60, 3600)  # SageMaker's range for both variant timeouts
EXAMPLE_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/batchyard:latest"


def check_name(name: str) -> str:
    if not _NAME.match(name) or len(name) > MAX_NAME_LENGTH:
        raise DeployError(f"--name {name!r}: use letters, digits and hyphens, starting and ending "
                          f"with a letter or digit, at most {MAX_NAME_LENGTH} characters")
    return name


def check_timeout(option: str, seconds: int) -> int:
    low, high = TIMEOUT_RANGE
    if not low <= seconds <= high:
        raise DeployError(f"{option} {seconds}: must be {low}..{high} seconds (SageMaker's range)")
    return seconds


def check_instance(instance_type: str, count: int) -> None:
    if not _INSTANCE_TYPE.match(instance_type):
        raise DeployError(f"--instance-type {instance_type!r}: expected a SageMaker instance type "
                          "such as ml.g5.xlarge")
    if count < 1:
        raise DeployError(f"--instance-count {count}: must be at least 1")


@dataclass(frozen=True)
class Image:
    uri: str
    registry: str
    region: str
    repository: str
    tag: str | None
    digest: str | None


def parse_image(uri: str) -> Image:
    match = _ECR_URI.match(uri)
    if match is None:
        raise DeployError(f"--image {uri!r} is not an ECR image URI (SageMaker pulls from ECR); "
                          f"expected e.g. {EXAMPLE_IMAGE}")
    return Image(uri, match["registry"], match["region"], match["repository"], match["tag"],
                 match["digest"])


def check_role(aws: Aws, role_arn: str) -> None:
    """The ARN's shape, then (when the caller may read IAM) that the role exists."""
    match = _ROLE_ARN.match(role_arn)
    if match is None:
        raise DeployError(f"--role {role_arn!r} is not an IAM role ARN; expected "
                          "arn:aws:iam::<account>:role/<name> (a SageMaker execution role)")
    if match["account"] != aws.account:
        logger.info("role %s is in account %s: not checked", role_arn, match["account"])
        return
    try:
        aws.client("iam").get_role(RoleName=match["name"])
    except ClientError as err:
        if error_code(err) == "NoSuchEntity":
            raise DeployError(f"--role {role_arn}: no such IAM role in account "
                              f"{match['account']}") from err
        if not is_access_denied(err):
            raise translate(err, f"looking up role {role_arn}") from err
        logger.warning("cannot check that role %s exists (no iam:GetRole); SageMaker will",
                       role_arn)


def check_image(aws: Aws, uri: str) -> Image:
    """The URI's shape, then (when it is in the caller's account) that the image is in ECR."""
    image = parse_image(uri)
    if image.region != aws.region:  # SageMaker's rule for the image and the model data
        raise DeployError(f"--image {uri} is in {image.region} but the endpoint in {aws.region}: "
                          f"SageMaker pulls only from ECR in the endpoint's region; push the "
                          f"image to {aws.region} (or pass --region {image.region})")
    if image.registry != aws.account:
        logger.info("image %s is in account %s: not checked (a missing image shows as a failed "
                    "endpoint)", uri, image.registry)
        return image
    image_id = {"imageDigest": image.digest} if image.digest else {"imageTag": image.tag or
                                                                    "latest"}
    try:
        aws.client("ecr", region=image.region).describe_images(
            registryId=image.registry, repositoryName=image.repository, imageIds=[image_id])
    except ClientError as err:
        if error_code(err) in {"RepositoryNotFoundException", "ImageNotFoundException"}:
            raise DeployError(f"--image {uri}: not in ECR ({error_code(err)}); push it first "
                              "(see docs/deploy.md, 'Push the image to ECR')") from err
        if not is_access_denied(err):
            raise translate(err, f"looking up image {uri} in ECR") from err
        logger.warning("cannot check that image %s exists (no ecr:DescribeImages); a missing "
                       "image shows as a failed endpoint", uri)
    return image
