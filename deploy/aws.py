"""AWS clients (one endpoint-URL override for all of them) and one-line error messages."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)

logger = logging.getLogger(__name__)

ENDPOINT_URL_ENV = "BATCHYARD_AWS_ENDPOINT_URL"
TAG_ENDPOINT = "batchyard:endpoint"  # on every model, endpoint config and endpoint we create
TAG_RELEASE = "batchyard:release"
IAM_HINT = "the caller needs the IAM permissions listed in docs/deploy.md ('IAM permissions')"
_BAD_CREDENTIALS = {"ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId",
                    "UnrecognizedClientException", "SignatureDoesNotMatch", "InvalidAccessKeyId"}


class DeployError(Exception):
    """A failure explained in one line; the CLI prints it and exits with status 2."""


def error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def error_message(err: ClientError) -> str:
    error = err.response.get("Error", {})
    text = str(error.get("Message") or error.get("message") or error_code(err) or err)
    return " ".join(text.split())


def is_access_denied(err: ClientError) -> bool:
    code = error_code(err)
    return code.startswith("AccessDenied") or code in {"UnauthorizedOperation",
                                                       "AuthorizationError", "403"}


def is_not_found(err: ClientError) -> bool:
    """SageMaker answers a missing model, config or endpoint with ValidationException."""
    code = error_code(err)
    return (code in {"ValidationException", "ValidationError"}
            and "could not find" in error_message(err).lower())


def translate(err: Exception, doing: str) -> DeployError:
    """One line for the user: what we were doing, what AWS said, and what to do about it."""
    if isinstance(err, ClientError):
        code, message = error_code(err), error_message(err)
        if is_access_denied(err):
            return DeployError(f"permission denied while {doing}: {message} ({IAM_HINT})")
        if code in _BAD_CREDENTIALS:
            return DeployError(f"AWS rejected the credentials while {doing}: {message}")
        if "role" in message.lower() and "assume" in message.lower():
            return DeployError(f"SageMaker cannot use the execution role ({doing}): {message} "
                               "(its trust policy must allow sagemaker.amazonaws.com)")
        if code == "ResourceLimitExceeded":
            return DeployError(f"AWS quota reached while {doing}: {message} "
                               "(ask for an increase in Service Quotas)")
        return DeployError(f"{doing} failed: {code}: {message}")
    if isinstance(err, NoCredentialsError):
        return DeployError("no AWS credentials found (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY, or run `aws configure`)")
    if isinstance(err, EndpointConnectionError):
        return DeployError(f"cannot reach {err.kwargs.get('endpoint_url')} while {doing}")
    return DeployError(f"{doing} failed: {' '.join(str(err).split())}")


@contextmanager
def aws_errors(doing: str) -> Iterator[None]:
    """Turn boto errors raised inside the block into a one-line DeployError."""
    try:
        yield
    except (ClientError, BotoCoreError) as err:
        raise translate(err, doing) from err


class Aws:
    """One session, one region, one optional endpoint URL for every client (moto in tests)."""

    def __init__(self, region: str | None = None, endpoint_url: str | None = None,
                 default_region: str | None = None) -> None:
        self.session = boto3.Session(region_name=region or None)
        region = self.session.region_name or default_region
        if not region:
            raise DeployError("no AWS region: pass --region or set AWS_DEFAULT_REGION")
        self.region: str = region
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_URL_ENV) or None
        self._clients: dict[tuple[str, str, str | None], Any] = {}
        self._account: str | None = None

    def client(self, service: str, region: str | None = None, endpoint_url: str | None = None,
               read_timeout: int = 60, *, allow_unsigned: bool = False) -> Any:
        """A cached boto3 client; allow_unsigned: no credentials → unsigned (a local container)."""
        region = region or self.region
        url = endpoint_url or self.endpoint_url
        key = (service, region, url)
        if key not in self._clients:
            config = Config(retries={"mode": "standard", "max_attempts": 3},
                            read_timeout=read_timeout, user_agent_extra="batchyard-deploy")
            if allow_unsigned and url and self.session.get_credentials() is None:
                config = config.merge(Config(signature_version=UNSIGNED))
            try:
                self._clients[key] = self.session.client(service, region_name=region,
                                                         endpoint_url=url, config=config)
            except (NoRegionError, ValueError) as err:
                raise DeployError(f"cannot make a {service} client: {err}") from err
            logger.debug("%s client: region %s, endpoint %s", service, region, url or "AWS")
        return self._clients[key]

    @property
    def account(self) -> str:
        if self._account is None:
            with aws_errors("reading the caller's account (sts:GetCallerIdentity)"):
                self._account = str(self.client("sts").get_caller_identity()["Account"])
        return self._account


def make_tags(name: str, release: str) -> list[dict[str, str]]:
    return [{"Key": TAG_ENDPOINT, "Value": name}, {"Key": TAG_RELEASE, "Value": release}]


def owned_by(aws: Aws, arn: str, name: str) -> bool:
    """True when the SageMaker resource carries our tag for endpoint `name`."""
    with aws_errors(f"reading the tags of {arn}"):
        tags = aws.client("sagemaker").list_tags(ResourceArn=arn).get("Tags", [])
    return any(t["Key"] == TAG_ENDPOINT and t["Value"] == name for t in tags)
