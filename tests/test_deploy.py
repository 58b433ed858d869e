"""`batchyard deploy` against a real moto server on loopback (no network, no AWS account).

moto 5.2.5 has no UpdateEndpoint and makes every endpoint InService at once, so a few in-process
shims (installed for this module only) add UpdateEndpoint and let a test make an endpoint fail,
stay "Creating" for some polls, or deny one call. Streaming is checked against a local HTTP
server that speaks the SageMaker event-stream format, as the container's runtime paths will.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
import requests
from botocore.exceptions import ClientError
from moto.core.exceptions import ServiceException
from moto.core.responses import ActionResult
from moto.sagemaker.models import SageMakerModelBackend
from moto.sagemaker.responses import SageMakerResponse
from moto.server import ThreadedMotoServer

from deploy.aws import translate
from deploy.cli import main as deploy_main
from deploy.invoke import JsonLinesSplitter, print_tokens
from handler.cli import main as batchyard_main

REGION = "us-east-1"
ACCOUNT = "123456789012"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/batchyard-sagemaker"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/batchyard:latest"
DEFAULT_BUCKET = f"sagemaker-{REGION}-{ACCOUNT}"
INSTANCE = "ml.g4dn.xlarge"  # moto's instance-type list has no ml.g5
PAGED = "option.rolling_batch=paged\noption.max_rolling_batch_size=16\n"
CONTINUOUS = "option.rolling_batch=scheduler\n"
SIM: dict[str, Any] = {"fail": {}, "pending": {}, "deny": set(), "update_fail": {}}


class _Denied(ServiceException):
    code = "AccessDeniedException"


def _update_endpoint(self: SageMakerResponse) -> ActionResult:
    name, config = self._get_param("EndpointName"), self._get_param("EndpointConfigName")
    endpoint = self.sagemaker_backend.endpoints[name]
    if name in SIM["update_fail"]:  # SageMaker rolls back: old config, InService, a reason
        endpoint.failure_reason = SIM["update_fail"][name]
    else:
        variants = self.sagemaker_backend.describe_endpoint_config(config)["ProductionVariants"]
        endpoint.endpoint_config_name = config
        endpoint.production_variants = endpoint._process_production_variants(variants)
    return ActionResult({"EndpointArn": endpoint.arn})


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    create_endpoint = SageMakerModelBackend.create_endpoint
    describe_endpoint = SageMakerModelBackend.describe_endpoint
    create_config = SageMakerResponse.create_endpoint_config

    def create_endpoint_shim(self, endpoint_name, endpoint_config_name, tags):  # type: ignore
        endpoint = create_endpoint(self, endpoint_name, endpoint_config_name, tags)
        if endpoint_name in SIM["fail"]:
            endpoint.endpoint_status, endpoint.failure_reason = "Failed", SIM["fail"][endpoint_name]
        return endpoint

    def describe_endpoint_shim(self, endpoint_name):  # type: ignore
        response = describe_endpoint(self, endpoint_name)
        if SIM["pending"].get(endpoint_name, 0) > 0:
            SIM["pending"][endpoint_name] -= 1
            response = {**response, "EndpointStatus": "Creating"}
        return response

    def create_config_shim(self):  # type: ignore
        if self._get_param("EndpointConfigName").split("-")[0] in SIM["deny"]:
            raise _Denied("User: arn:aws:iam::123456789012:user/dev is not authorized to "
                          "perform: sagemaker:CreateEndpointConfig")
        return create_config(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SageMakerModelBackend, "create_endpoint", create_endpoint_shim)
        patch.setattr(SageMakerModelBackend, "describe_endpoint", describe_endpoint_shim)
        patch.setattr(SageMakerResponse, "create_endpoint_config", create_config_shim)
        patch.setattr(SageMakerResponse, "update_endpoint", _update_endpoint, raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


@pytest.fixture(autouse=True)
def aws(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Fresh moto state with a role and a pushed image; clients pointed at moto."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": "/nonexistent",
                       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                       "BATCHYARD_AWS_ENDPOINT_URL": moto_url}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)
    requests.post(f"{moto_url}/moto-api/reset", timeout=10)
    for table in SIM.values():
        table.clear()
    clients = {name: boto3.client(name, region_name=REGION, endpoint_url=moto_url)
               for name in ("s3", "sagemaker", "iam", "ecr", "application-autoscaling")}
    clients["iam"].create_role(RoleName="batchyard-sagemaker", AssumeRolePolicyDocument="{}")
    clients["ecr"].create_repository(repositoryName="batchyard")
    manifest = {"schemaVersion": 2, "config": {"digest": "sha256:" + "0" * 64}, "layers": [],
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}
    clients["ecr"].put_image(repositoryName="batchyard", imageManifest=json.dumps(manifest),
                             imageTag="latest")
    yield clients


@pytest.fixture
def props(tmp_path: Path) -> Path:
    path = tmp_path / "paged.properties"
    path.write_text(PAGED)
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text("not uploaded")
    return folder


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = deploy_main([*args, "--poll-interval", "0"] if args[0] in {"create", "switch", "delete"}
                       else list(args))
    out, err = capsys.readouterr()
    return code, out, err


def create_args(name: str, props: Path, *extra: str) -> list[str]:
    return ["create", "--name", name, "--image", IMAGE, "--role", ROLE, "--properties",
            str(props), "--instance-type", INSTANCE, *extra]


def keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def names(sm: Any, name: str) -> tuple[list[str], list[str]]:
    models = [m["ModelName"] for m in sm.list_models()["Models"]]
    configs = [c["EndpointConfigName"] for c in sm.list_endpoint_configs()["EndpointConfigs"]]
    ours = re.compile(rf"^{name}-\d{{8}}-\d{{6}}-\d{{3}}$")  # <name>-<release>
    return [m for m in models if ours.match(m)], [c for c in configs if ours.match(c)]


def tags_of(sm: Any, arn: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in sm.list_tags(ResourceArn=arn)["Tags"]}


def test_create_uploads_the_model_and_creates_an_inservice_endpoint(aws, capsys, props,
                                                                    model_dir) -> None:
    SIM["pending"]["demo"] = 2  # two polls "Creating" before InService
    code, out, err = run(capsys, *create_args("demo", props, "--model-dir", str(model_dir),
                                              "--instance-count", "2", "--startup-timeout", "600",
                                              "--download-timeout", "1200"))
    assert code == 0, err
    assert "endpoint demo is InService" in out
    assert "Creating" in err and "InService" in err  # progress while waiting
    sm, s3 = aws["sagemaker"], aws["s3"]
    endpoint = sm.describe_endpoint(EndpointName="demo")
    assert endpoint["EndpointStatus"] == "InService"
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    [variant] = config["ProductionVariants"]
    assert variant["InstanceType"] == INSTANCE and variant["InitialInstanceCount"] == 2
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 600
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 1200
    model = sm.describe_model(ModelName=variant["ModelName"])
    source = model["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    release = variant["ModelName"].removeprefix("demo-")
    prefix = f"batchyard/demo/{release}/"
    assert source == {"S3Uri": f"s3://{DEFAULT_BUCKET}/{prefix}", "S3DataType": "S3Prefix",
                      "CompressionType": "None"}
    assert model["PrimaryContainer"]["Image"] == IMAGE and model["ExecutionRoleArn"] == ROLE
    assert keys(s3, DEFAULT_BUCKET) == [prefix + f for f in ("config.json", "model.safetensors",
                                                             "serving.properties",
                                                             "tokenizer.json")]
    body = s3.get_object(Bucket=DEFAULT_BUCKET, Key=prefix + "serving.properties")["Body"]
    assert body.read().decode() == PAGED
    for arn in (endpoint["EndpointArn"], config["EndpointConfigArn"], model["ModelArn"]):
        assert tags_of(sm, arn) == {"batchyard:endpoint": "demo", "batchyard:release": release}


def test_create_with_model_s3_uploads_only_the_properties(aws, capsys, props, model_dir) -> None:
    s3 = aws["s3"]
    for bucket in ("models", "artifacts"):
        s3.create_bucket(Bucket=bucket)
    for path in model_dir.iterdir():
        s3.put_object(Bucket="models", Key=f"smol/{path.name}", Body=path.read_bytes())
    code, _, err = run(capsys, *create_args("remote", props, "--model-s3", "s3://models/smol",
                                            "--bucket", "artifacts"))
    assert code == 0, err
    [key] = keys(s3, "artifacts")
    assert key.startswith("batchyard/remote/") and key.endswith("/serving.properties")
    sm = aws["sagemaker"]
    [model], _ = names(sm, "remote")
    container = sm.describe_model(ModelName=model)["PrimaryContainer"]
    assert container["Environment"] == {"HF_MODEL_ID": "s3://models/smol/"}
    assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == (
        f"s3://artifacts/{key.removesuffix('serving.properties')}")
    assert run(capsys, "switch", "--name", "remote", "--properties", str(props))[0] == 0
    [model], _ = names(sm, "remote")
    environment = sm.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]
    assert environment["HF_MODEL_ID"] == "s3://models/smol/"  # still the same model
    assert environment["BATCHYARD_PROPERTIES"].startswith("/opt/ml/model/serving.properties.d/")


def test_model_s3_conflicting_with_option_model_id_is_refused(aws, capsys, tmp_path) -> None:
    props = tmp_path / "p.properties"
    props.write_text("option.model_id=s3://other/model\n")
    code, _, err = run(capsys, *create_args("clash", props, "--model-s3", "s3://models/smol"))
    assert code == 2 and "option.model_id" in err and "Traceback" not in err


def test_switch_is_blue_green_and_deletes_the_old_config_and_model(aws, capsys, props,
                                                                  model_dir, tmp_path) -> None:
    assert run(capsys, *create_args("live", props, "--model-dir", str(model_dir)))[0] == 0
    sm, s3 = aws["sagemaker"], aws["s3"]
    old_config = sm.describe_endpoint(EndpointName="live")["EndpointConfigName"]
    old_model = sm.describe_model(ModelName=old_config)
    new_props = tmp_path / "continuous.properties"
    new_props.write_text(CONTINUOUS)
    code, out, err = run(capsys, "switch", "--name", "live", "--properties", str(new_props),
                         "--startup-timeout", "1800")
    assert code == 0, err
    assert "deleted the old" in out
    new_config = sm.describe_endpoint(EndpointName="live")["EndpointConfigName"]
    assert new_config != old_config
    assert names(sm, "live") == ([new_config], [new_config])  # old config and model are gone
    [variant] = sm.describe_endpoint_config(EndpointConfigName=new_config)["ProductionVariants"]
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1800
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 900  # kept from the old config
    model = sm.describe_model(ModelName=variant["ModelName"])
    container, old_container = model["PrimaryContainer"], old_model["PrimaryContainer"]
    assert container["ModelDataSource"] == old_container["ModelDataSource"]  # same weights
    assert container["Image"] == IMAGE and model["ExecutionRoleArn"] == ROLE
    release = new_config.removeprefix("live-")
    path = f"/opt/ml/model/serving.properties.d/{release}.properties"
    assert container["Environment"] == {"BATCHYARD_PROPERTIES": path}
    uri = container["ModelDataSource"]["S3DataSource"]["S3Uri"]
    prefix = uri.removeprefix(f"s3://{DEFAULT_BUCKET}/")
    key = f"{prefix}serving.properties.d/{release}.properties"
    assert s3.get_object(Bucket=DEFAULT_BUCKET, Key=key)["Body"].read().decode() == CONTINUOUS


def test_failed_switch_keeps_the_old_config_and_model(aws, capsys, props, tmp_path) -> None:
    assert run(capsys, *create_args("steady", props))[0] == 0
    sm = aws["sagemaker"]
    before = names(sm, "steady")
    SIM["update_fail"]["steady"] = "The primary container did not pass the ping health check."
    code, _, err = run(capsys, "switch", "--name", "steady", "--properties", str(props))
    assert code == 2 and "ping health check" in err and "kept endpoint config" in err
    assert names(sm, "steady") == before  # the new model and config were rolled back


def test_autoscale_registers_target_tracking(aws, capsys, props) -> None:
    assert run(capsys, *create_args("scaled", props))[0] == 0
    code, out, err = run(capsys, "autoscale", "--name", "scaled", "--min", "1", "--max", "4",
                         "--target", "120", "--scale-in-cooldown", "600")
    assert code == 0, err
    assert "1..4 instances" in out
    client = aws["application-autoscaling"]
    rid = "endpoint/scaled/variant/AllTraffic"
    [target] = client.describe_scalable_targets(ServiceNamespace="sagemaker",
                                                ResourceIds=[rid])["ScalableTargets"]
    assert target["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert (target["MinCapacity"], target["MaxCapacity"]) == (1, 4)
    [policy] = client.describe_scaling_policies(ServiceNamespace="sagemaker",
                                                ResourceId=rid)["ScalingPolicies"]
    config = policy["TargetTrackingScalingPolicyConfiguration"]
    assert policy["PolicyType"] == "TargetTrackingScaling" and config["TargetValue"] == 120.0
    assert config["PredefinedMetricSpecification"] == {
        "PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"}
    assert (config["ScaleInCooldown"], config["ScaleOutCooldown"]) == (600, 60)
    code, _, err = run(capsys, "autoscale", "--name", "scaled", "--min", "3", "--max", "2",
                       "--target", "5")
    assert code == 2 and "min <= max" in err


def test_delete_removes_everything_and_is_idempotent(aws, capsys, props, model_dir,
                                                     tmp_path) -> None:
    assert run(capsys, *create_args("gone", props, "--model-dir", str(model_dir)))[0] == 0
    assert run(capsys, *create_args("gone-too", props))[0] == 0  # a neighbour, kept
    other = tmp_path / "other.properties"
    other.write_text(CONTINUOUS)
    assert run(capsys, "switch", "--name", "gone", "--properties", str(other))[0] == 0
    assert run(capsys, "autoscale", "--name", "gone", "--min", "1", "--max", "2",
               "--target", "10")[0] == 0
    sm, s3, scaling = aws["sagemaker"], aws["s3"], aws["application-autoscaling"]
    code, out, err = run(capsys, "delete", "--name", "gone")
    assert code == 0, err
    assert "endpoint gone" in out and "autoscaling" in out and "kept S3 artifacts" in out
    with pytest.raises(ClientError):
        sm.describe_endpoint(EndpointName="gone")
    assert names(sm, "gone") == ([], [])
    assert not scaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    assert not scaling.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    assert sm.describe_endpoint(EndpointName="gone-too")["EndpointStatus"] == "InService"
    assert len(names(sm, "gone-too")[0]) == 1
    code, out, err = run(capsys, "delete", "--name", "gone")
    assert code == 0 and "nothing to delete" in out, err
    assert keys(s3, DEFAULT_BUCKET, "batchyard/gone/")  # kept unless asked
    code, out, _ = run(capsys, "delete", "--name", "gone", "--purge-artifacts",
                       "--bucket", DEFAULT_BUCKET)
    assert code == 0 and "S3 objects" in out
    assert keys(s3, DEFAULT_BUCKET, "batchyard/gone/") == []
    assert keys(s3, DEFAULT_BUCKET, "batchyard/gone-too/")


def test_wait_timeout_leaves_the_endpoint_and_says_so(aws, capsys, props) -> None:
    SIM["pending"]["slowpoke"] = 1000
    code, _, err = run(capsys, *create_args("slowpoke", props, "--wait-timeout", "0"))
    assert code == 2 and "still Creating" in err
    assert "batchyard deploy delete --name slowpoke" in err
    assert aws["sagemaker"].describe_endpoint(EndpointName="slowpoke")  # left as it is


def test_switch_needs_an_endpoint(aws, capsys, props) -> None:
    code, _, err = run(capsys, "switch", "--name", "nowhere", "--properties", str(props))
    assert code == 2 and "no endpoint nowhere" in err


def test_name_clash_points_to_switch_or_delete(aws, capsys, props) -> None:
    assert run(capsys, *create_args("twice", props))[0] == 0
    code, _, err = run(capsys, *create_args("twice", props))
    assert code == 2 and "already exists" in err and "switch" in err and "delete" in err
    assert len(names(aws["sagemaker"], "twice")[0]) == 1


def test_missing_bucket_is_one_line_and_creates_nothing(aws, capsys, props) -> None:
    code, out, err = run(capsys, *create_args("nobucket", props, "--bucket", "no-such-bucket"))
    assert code == 2 and "no-such-bucket: no such S3 bucket" in err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert names(aws["sagemaker"], "nobucket") == ([], [])


def test_pickle_checkpoints_are_refused(aws, capsys, props, model_dir) -> None:
    (model_dir / "pytorch_model.bin").write_bytes(b"pickle")
    code, _, err = run(capsys, *create_args("pickled", props, "--model-dir", str(model_dir)))
    assert code == 2 and "pickle" in err and "pytorch_model.bin" in err
    assert "Buckets" not in aws["s3"].list_buckets() or not aws["s3"].list_buckets()["Buckets"]


@pytest.mark.parametrize("option, value", [("--startup-timeout", "59"),
                                           ("--download-timeout", "3601")])
def test_timeouts_outside_60_to_3600_are_refused(aws, capsys, props, option, value) -> None:
    code, _, err = run(capsys, *create_args("slow", props, option, value))
    assert code == 2 and f"{option} {value}: must be 60..3600" in err
    assert names(aws["sagemaker"], "slow") == ([], [])


@pytest.mark.parametrize("flag, value, message", [
    ("--role", "batchyard-sagemaker", "is not an IAM role ARN"),
    ("--role", f"arn:aws:iam::{ACCOUNT}:role/missing", "no such IAM role"),
    ("--image", "batchyard:latest", "is not an ECR image URI"),
    ("--image", f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/batchyard:v9", "not in ECR"),
    ("--image", f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com/batchyard:latest",
     "in eu-west-1 but"),
])
def test_bad_roles_and_images_are_refused(aws, capsys, props, flag, value, message) -> None:
    args = create_args("refused", props)
    args[args.index(flag) + 1] = value
    code, _, err = run(capsys, *args)
    assert code == 2 and message in err


def test_failed_endpoint_prints_the_reason_and_rolls_back(aws, capsys, props, model_dir) -> None:
    SIM["fail"]["broken"] = "Failed to pull the image: CannotPullContainerError"
    code, _, err = run(capsys, *create_args("broken", props, "--model-dir", str(model_dir)))
    assert code == 2 and "CannotPullContainerError" in err and "rolled back" in err
    sm = aws["sagemaker"]
    with pytest.raises(ClientError):
        sm.describe_endpoint(EndpointName="broken")
    assert names(sm, "broken") == ([], [])
    assert keys(aws["s3"], DEFAULT_BUCKET) == []


@pytest.mark.filterwarnings("ignore:Exception\\(_Denied\\)")  # moto: not a modeled error
def test_access_denied_midway_rolls_back_and_names_the_permission(aws, capsys, props) -> None:
    SIM["deny"].add("denied")
    code, _, err = run(capsys, *create_args("denied", props))
    [line] = [line for line in err.splitlines() if line.startswith("batchyard deploy: error:")]
    assert "permission denied" in line and "CreateEndpointConfig" in line
    assert "rolled back" in line and "Traceback" not in err
    assert names(aws["sagemaker"], "denied") == ([], [])
    assert keys(aws["s3"], DEFAULT_BUCKET) == []


def test_translate_access_denied_is_one_line() -> None:
    err = ClientError({"Error": {"Code": "AccessDenied", "Message": "not\nallowed"}}, "PutObject")
    message = str(translate(err, "uploading"))
    assert "\n" not in message and message.startswith("permission denied while uploading")


def test_invoke_through_sagemaker_runtime(aws, capsys, moto_url) -> None:
    answer = {"Body": json.dumps({"generated_text": " Paris."}), "ContentType":
              "application/json", "InvokedProductionVariant": "AllTraffic",
              "CustomAttributes": ""}
    requests.post(f"{moto_url}/moto-api/static/sagemaker/endpoint-results",
                  json={"results": [answer]}, timeout=10)
    code, out, err = run(capsys, "invoke", "--name", "any", "--prompt", "Capital of France?",
                         "--parameters", '{"max_new_tokens": 8}')
    assert code == 0 and out == " Paris.\n", err
    code, _, err = run(capsys, "invoke", "--name", "any", "--prompt", "x", "--parameters", "[1]")
    assert code == 2 and "JSON object" in err


LINES = [{"token": {"id": 1, "text": " Größe", "log_prob": -0.1}},
         {"token": {"id": 2, "text": " 東京", "log_prob": -0.2}},
         {"token": {"id": 3, "text": " 🙂", "log_prob": -0.3}, "generated_text": " Größe 東京 🙂",
          "details": {"finish_reason": "eos_token", "generated_tokens": 3, "inputs": 2}}]
STREAM = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in LINES)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(STREAM)])
def test_splitter_handles_chunks_that_cut_lines_and_characters(size) -> None:
    splitter = JsonLinesSplitter()
    got = [obj for i in range(0, len(STREAM), size) for obj in splitter.feed(STREAM[i:i + size])]
    assert got + splitter.close() == LINES
    texts: list[str] = []
    last = print_tokens(({"PayloadPart": {"Bytes": STREAM[i:i + size]}}
                         for i in range(0, len(STREAM), size)), texts.append)
    assert "".join(texts) == " Größe 東京 🙂" and last["details"]["finish_reason"] == "eos_token"


def test_splitter_takes_a_last_line_without_newline() -> None:
    splitter = JsonLinesSplitter()
    assert splitter.feed(b'{"token": {"text": "a"}}\n{"token": {"te') == [{"token": {"text": "a"}}]
    assert splitter.feed(b'xt": "b"}}') == []
    assert splitter.close() == [{"token": {"text": "b"}}]


def _event(payload: bytes) -> bytes:
    """One application/vnd.amazon.eventstream message carrying a PayloadPart."""
    headers = b""
    for name, value in ((":event-type", "PayloadPart"), (":message-type", "event"),
                        (":content-type", "application/octet-stream")):
        headers += bytes([len(name)]) + name.encode() + b"\x07"
        headers += struct.pack(">H", len(value)) + value.encode()
    prelude = struct.pack(">II", 16 + len(headers) + len(payload), len(headers))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + headers + payload
    return message + struct.pack(">I", zlib.crc32(message))


class _StreamingContainer(BaseHTTPRequestHandler):
    """The SageMaker runtime path of a local container, answering with cut event chunks."""

    requests: list[tuple[str, dict[str, Any], str | None]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body, self.headers.get("Authorization")))
        if self.path.endswith("/invocations"):  # the container said 400: SageMaker's ModelError
            error = json.dumps({"Message": "Received client error (400) from primary",
                                "OriginalStatusCode": 400, "OriginalMessage": json.dumps(
                                    {"code": 400, "type": "BadRequest",
                                     "message": "max_new_tokens must be <= 4096"})}).encode()
            self.send_response(424)
            self.send_header("x-amzn-ErrorType", "ModelError")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)
            return
        data = b"".join(_event(STREAM[i:i + 5]) for i in range(0, len(STREAM), 5))
        self.send_response(200)
        self.send_header("Content-Type", "application/vnd.amazon.eventstream")
        self.send_header("X-Amzn-SageMaker-Content-Type", "application/jsonlines")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def container_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key)  # a local container needs no AWS account: unsigned requests
    _StreamingContainer.requests.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StreamingContainer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_invoke_stream_against_a_local_container(capsys, container_url) -> None:
    code, out, err = run(capsys, "invoke", "--name", "local", "--prompt", "Hi", "--stream",
                         "--endpoint-url", container_url)
    assert code == 0, err
    assert out == " Größe 東京 🙂\n" and "finish_reason=eos_token" in err
    [(path, body, authorization)] = _StreamingContainer.requests
    assert path == "/endpoints/local/invocations-response-stream"
    assert body == {"inputs": "Hi", "stream": True} and authorization is None


def test_container_errors_are_one_line(capsys, container_url) -> None:
    code, out, err = run(capsys, "invoke", "--name", "local", "--prompt", "Hi",
                         "--endpoint-url", container_url)
    assert code == 2 and out == ""
    assert "the container answered 400" in err and "max_new_tokens must be <= 4096" in err
    assert len(err.strip().splitlines()) == 1


def test_batchyard_deploy_dispatch(capsys) -> None:
    assert batchyard_main(["deploy", "delete", "--name", "never-made", "--poll-interval", "0"]) == 0
    assert "nothing to delete" in capsys.readouterr().out
