"""`batchyard deploy …`: SageMaker endpoints for the batchyard container (boto3 only)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from deploy.aws import ENDPOINT_URL_ENV, Aws, DeployError, translate
from deploy.endpoint import DEFAULT_TIMEOUT, VARIANT, CreateRequest
from deploy.waiting import Waiting

logger = logging.getLogger(__name__)

_handler: logging.Handler | None = None
WAIT_MARGIN = 1200  # seconds for instance provisioning on top of download + start-up timeouts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    _log_to_stderr(verbose=args.verbose)
    try:
        return COMMANDS[args.command](args)
    except DeployError as err:
        print(f"batchyard deploy: error: {err}", file=sys.stderr)
    except (ClientError, BotoCoreError) as err:
        print(f"batchyard deploy: error: {translate(err, f'running `{args.command}`')}",
              file=sys.stderr)
    except KeyboardInterrupt:
        print("batchyard deploy: interrupted", file=sys.stderr)
        return 130
    return 2


def _log_to_stderr(*, verbose: bool) -> None:
    """Progress and diagnostics of the deploy package go to stderr, whatever the root logger."""
    global _handler
    package = logging.getLogger("deploy")
    if _handler is not None:
        package.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("batchyard deploy: %(message)s"))
    package.addHandler(_handler)
    package.setLevel(logging.DEBUG if verbose else logging.INFO)
    package.propagate = False
    if verbose:
        logging.basicConfig(level=logging.DEBUG)  # botocore's requests and retries too


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchyard deploy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    create = _command(sub, "create", "upload serving.properties (+ model), create the endpoint")
    create.add_argument("--image", required=True, help="ECR image URI of the batchyard container")
    create.add_argument("--role", required=True, help="SageMaker execution role ARN")
    create.add_argument("--properties", required=True, type=Path, help="serving.properties")
    model = create.add_mutually_exclusive_group()
    model.add_argument("--model-dir", type=Path, help="local model folder to upload "
                       "(safetensors + config/tokenizer files)")
    model.add_argument("--model-s3", help="s3:// prefix of a model already in S3 (the container "
                       "downloads it: option.model_id)")
    create.add_argument("--instance-type", required=True, help="e.g. ml.g5.xlarge")
    create.add_argument("--instance-count", type=int, default=1)
    create.add_argument("--bucket", help="S3 bucket for the artifacts (must exist; default: "
                        "sagemaker-<region>-<account>, created when missing)")
    _timeouts(create, DEFAULT_TIMEOUT)
    create.add_argument("--keep-on-failure", action="store_true",
                        help="keep a failed endpoint and its artifacts for inspection")
    _wait_options(create)

    switch = _command(sub, "switch", "new serving.properties on a live endpoint (blue/green)")
    switch.add_argument("--properties", required=True, type=Path)
    _timeouts(switch, None)
    _wait_options(switch)

    invoke = _command(sub, "invoke", "send one prompt through sagemaker-runtime")
    invoke.add_argument("--prompt", required=True)
    invoke.add_argument("--parameters", help='JSON object, e.g. \'{"max_new_tokens": 64}\'')
    invoke.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    invoke.add_argument("--endpoint-url", help="sagemaker-runtime URL, e.g. "
                        "http://localhost:8080 for a local container")

    scale = _command(sub, "autoscale", "target tracking on invocations per instance")
    scale.add_argument("--min", type=int, required=True, dest="min_count")
    scale.add_argument("--max", type=int, required=True, dest="max_count")
    scale.add_argument("--target", type=float, required=True,
                       help="invocations per instance per minute")
    scale.add_argument("--variant", default=VARIANT)
    scale.add_argument("--scale-in-cooldown", type=int, default=300, help="seconds (300)")
    scale.add_argument("--scale-out-cooldown", type=int, default=60, help="seconds (60)")

    delete = _command(sub, "delete", "endpoint, its configs, models and autoscaling")
    delete.add_argument("--purge-artifacts", action="store_true",
                        help="also delete s3://<bucket>/batchyard/<name>/")
    delete.add_argument("--bucket", help="with --purge-artifacts: also look in this bucket")
    _wait_options(delete)
    return parser


def _command(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    p.add_argument("--name", required=True, help="endpoint name")
    p.add_argument("--region", help="default: AWS_DEFAULT_REGION or the AWS config")
    p.add_argument("--aws-endpoint-url", help=f"one URL for every AWS client (default: "
                   f"${ENDPOINT_URL_ENV}; for tests against moto)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _timeouts(p: argparse.ArgumentParser, default: int | None) -> None:
    text = f"seconds, 60..3600 ({default})" if default else "seconds, 60..3600 (default: current)"
    p.add_argument("--startup-timeout", type=int, default=default,
                   help=f"ContainerStartupHealthCheckTimeoutInSeconds: {text}")
    p.add_argument("--download-timeout", type=int, default=default,
                   help=f"ModelDataDownloadTimeoutInSeconds: {text}")


def _wait_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait-timeout", type=float, help="seconds to wait for the endpoint "
                   "(default: download + start-up timeouts + 20 min; delete: 20 min)")
    p.add_argument("--poll-interval", type=float, default=30.0, help="seconds (30)")


def _waiting(args: argparse.Namespace, default_timeout: float | None = None) -> Waiting:
    startup = getattr(args, "startup_timeout", None) or 3600
    download = getattr(args, "download_timeout", None) or 3600
    timeout = default_timeout or startup + download + WAIT_MARGIN
    if args.wait_timeout is not None:
        timeout = args.wait_timeout
    return Waiting(timeout=max(0.0, timeout), interval=max(0.0, args.poll_interval))


def _aws(args: argparse.Namespace, default_region: str | None = None) -> Aws:
    return Aws(args.region, args.aws_endpoint_url, default_region)


def _create(args: argparse.Namespace) -> int:
    from deploy.endpoint import create

    req = CreateRequest(args.name, args.image, args.role, args.properties, args.instance_type,
                        args.instance_count, args.model_dir, args.model_s3, args.bucket,
                        args.startup_timeout, args.download_timeout,
                        keep_on_failure=args.keep_on_failure)
    result = create(_aws(args), req, _waiting(args))
    print(f"endpoint {result['endpoint']} is InService ({result['arn']})")
    print(f"  model data: {result['model_data']} (mounted at /opt/ml/model)")
    if result["model_id"]:
        print(f"  model:      {result['model_id']} (HF_MODEL_ID, downloaded by the container)")
    print(f"  model and endpoint config: {result['model']}")
    print(f"  try it: batchyard deploy invoke --name {args.name} --prompt 'Hello' --stream")
    return 0


def _switch(args: argparse.Namespace) -> int:
    from deploy.switch import switch

    result = switch(_aws(args), args.name, args.properties, _waiting(args),
                    args.startup_timeout, args.download_timeout)
    print(f"endpoint {result['endpoint']} now serves {result['endpoint_config']} "
          f"({result['properties']})")
    if result["deleted"]:
        print(f"  deleted the old {' and '.join(result['deleted'])}")
    if result["left"]:
        print(f"  could not delete the old {' and '.join(result['left'])}: remove by hand")
    return 0


def _invoke(args: argparse.Namespace) -> int:
    from deploy.invoke import invoke, invoke_stream

    aws = _aws(args, default_region="us-east-1" if args.endpoint_url else None)
    if not args.stream:
        print(invoke(aws, args.name, args.prompt, args.parameters, args.endpoint_url))
        return 0

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    last = invoke_stream(aws, args.name, args.prompt, args.parameters, args.endpoint_url, write)
    print()
    details = last.get("details")
    if isinstance(details, dict):
        logger.info("finish_reason=%s, generated_tokens=%s", details.get("finish_reason"),
                    details.get("generated_tokens"))
    return 0


def _autoscale(args: argparse.Namespace) -> int:
    from deploy.autoscale import autoscale

    result = autoscale(_aws(args), args.name, args.min_count, args.max_count, args.target,
                       args.variant, args.scale_in_cooldown, args.scale_out_cooldown)
    print(f"autoscaling {result['resource_id']}: {result['min']}..{result['max']} instances, "
          f"target {result['target']:g} invocations per instance per minute "
          f"(policy {result['policy']})")
    return 0


def _delete(args: argparse.Namespace) -> int:
    from deploy.cleanup import delete

    result = delete(_aws(args), args.name, _waiting(args, WAIT_MARGIN),
                    purge_artifacts=args.purge_artifacts, bucket=args.bucket)
    if result["deleted"]:
        print(f"deleted: {'; '.join(result['deleted'])}")
    else:
        print(f"nothing to delete: no endpoint, endpoint config, model or autoscaling of "
              f"{args.name} is left")
    for uri in result["kept"]:
        print(f"kept S3 artifacts under {uri} (remove with --purge-artifacts, or "
              f"`aws s3 rm --recursive {uri}`)")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "create": _create, "switch": _switch, "invoke": _invoke, "autoscale": _autoscale,
    "delete": _delete,
}

if __name__ == "__main__":
    raise SystemExit(main())
