"""option.model_id=s3://bucket/prefix against a real S3 API (moto's server on loopback): the
download, its cache, refused keys and pickle-only prefixes, and a real server that downloads in
the background while /ping answers 503."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from pathlib import Path

import boto3
import pytest
import requests
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer

from handler.cli import resolve_config
from handler.model_source.s3 import COMPLETE_MARKER, describe_error, download_model, s3_cache_dir
from handler.model_source.s3_layout import S3ModelError, parse_s3_uri
from handler.model_source.store import resolve_model_dir
from tests.models_fixtures import build_tiny_model
from tests.server_harness import first_answer, running_server, wait_for_ping

BUCKET = "batchyard-models"
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing", "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
            "AWS_EC2_METADATA_DISABLED": "true"}
PAGED = "option.rolling_batch=auto\noption.num_kv_blocks=40\noption.max_model_len=128\n"


class MotoS3:
    """moto's S3 on loopback; counts the requests it serves and can hold them back."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        self.requests: list[tuple[str, str]] = []
        self.held = 0
        self.gate = threading.Event()
        self.gate.set()
        wsgi = self.server._server  # werkzeug's server; wrap its app to observe each request
        app = wsgi.app

        def observed(environ, start_response):
            self.requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"]))
            self.held += 1
            self.gate.wait(30)
            self.held -= 1
            return app(environ, start_response)

        wsgi.app = observed
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing")
        self.client.create_bucket(Bucket=BUCKET)

    def upload(self, folder: Path, prefix: str, extra: dict[str, bytes] | None = None) -> str:
        for path in folder.iterdir():
            self.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}",
                                   Body=path.read_bytes())
        for key, body in (extra or {}).items():
            self.client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=body)
        return f"s3://{BUCKET}/{prefix}"

    def delete_prefix(self, prefix: str) -> None:
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")
        for obj in listed.get("Contents", []):
            self.client.delete_object(Bucket=BUCKET, Key=obj["Key"])


@pytest.fixture(scope="module")
def s3():
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAKE_AWS.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL",
                     "AWS_ENDPOINT_URL_S3", "BATCHYARD_AWS_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        moto = MotoS3()
        yield moto
        moto.gate.set()
        moto.server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("s3-tiny"))


def env_for(s3: MotoS3) -> dict[str, str]:
    return {"BATCHYARD_AWS_ENDPOINT_URL": s3.url, "AWS_REGION": "us-east-1"}


def test_download_skips_what_is_not_served_and_reuses_the_cache(s3, tiny_model, tmp_path,
                                                                 caplog) -> None:
    uri = s3.upload(tiny_model, "unit/llama", extra={
        "README.md": b"# card", "pytorch_model.bin": b"pickle", "serving.properties": b"x=1",
        "original/consolidated.00.pth": b"pickle", "chat_template.jinja": b"{{ x }}",
        "sub/": b""})
    caplog.set_level("INFO", logger="handler.model_source")
    path = download_model(uri, tmp_path, env_for(s3))
    assert path == s3_cache_dir(uri, tmp_path) == s3_cache_dir(uri + "/", tmp_path)
    assert path.parent.parent == tmp_path / "s3" and path.name == "llama"
    wanted = {p.name for p in tiny_model.iterdir()} | {"chat_template.jinja", COMPLETE_MARKER}
    assert {p.name for p in path.iterdir()} == wanted
    assert not list(path.parent.glob(".partial-*"))
    for skipped in ("README.md", "pytorch_model.bin (pickle checkpoint", "serving.properties",
                    "original/consolidated.00.pth (in a subfolder"):
        assert f"skipping unit/llama/{skipped}" in caplog.text
    assert "downloaded" in caplog.text

    s3.delete_prefix("unit/llama")  # the second start must not need S3 at all
    served = len(s3.requests)
    assert download_model(uri, tmp_path, env_for(s3)) == path
    assert len(s3.requests) == served


@pytest.mark.parametrize(("key", "why"), [
    ("../evil.json", "'..' component"),
    ("a/../../x", "'..' component"),
    ("a/../config.json", "'..' component"),
    ("a\\..\\evil.json", "backslash"),
    ("/abs.json", "absolute path"),
    ("./config.json", "both name the file config.json"),
])
def test_keys_that_could_escape_the_folder_refuse_the_model(s3, tiny_model, tmp_path, key,
                                                             why) -> None:
    prefix = f"traversal/{abs(hash(key))}"
    uri = s3.upload(tiny_model, prefix, extra={key: b"{}"})
    with pytest.raises(S3ModelError, match=why) as raised:
        download_model(uri, tmp_path, env_for(s3))
    assert repr(f"{prefix}/{key}") in str(raised.value) and uri in str(raised.value)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "s3").exists()


def test_pickle_only_prefix_is_refused_with_the_reason(s3, tiny_model, tmp_path) -> None:
    for name in ("config.json", "tokenizer.json"):
        s3.client.put_object(Bucket=BUCKET, Key=f"pickled/{name}",
                             Body=(tiny_model / name).read_bytes())
    s3.client.put_object(Bucket=BUCKET, Key="pickled/pytorch_model.bin", Body=b"pickle")
    with pytest.raises(S3ModelError, match=r"pytorch_model\.bin.*arbitrary code.*safetensors"):
        download_model(f"s3://{BUCKET}/pickled", tmp_path, env_for(s3))


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://no-such-bucket-here/model", "bucket no-such-bucket-here does not exist"),
    (f"s3://{BUCKET}/nothing/here", f"no objects under s3://{BUCKET}/nothing/here"),
])
def test_missing_bucket_or_prefix_is_one_clear_line(s3, tmp_path, uri, message) -> None:
    with pytest.raises(S3ModelError, match=message) as raised:
        download_model(uri, tmp_path, env_for(s3))
    assert uri in str(raised.value) and "\n" not in str(raised.value)


def test_access_denied_names_the_permissions() -> None:
    uri = parse_s3_uri("s3://bkt/some/model/")
    err = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                       "ResponseMetadata": {"HTTPStatusCode": 403}}, "ListObjectsV2")
    line = describe_error(err, uri)
    assert "access denied" in line and "arn:aws:s3:::bkt/some/model/*" in line


@pytest.mark.parametrize("uri", ["s3://", "s3:///model", "s3://a/model", "s3://bad bucket/x"])
def test_malformed_uris_are_configuration_errors(uri) -> None:
    with pytest.raises(ValueError, match="expected s3://bucket/prefix"):
        parse_s3_uri(uri)


def test_resolve_config_defers_the_download_and_the_architecture(s3, tiny_model,
                                                                  tmp_path) -> None:
    uri = s3.upload(tiny_model, "resolve/llama")
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id={uri}\n{PAGED}")
    args = argparse.Namespace(properties=props, model_dir=None)
    environ = {**env_for(s3), "BATCHYARD_CACHE_DIR": str(tmp_path / "cache")}
    served = len(s3.requests)
    config, prepare = resolve_config(args, environ)
    assert len(s3.requests) == served, "start-up must not touch the network"
    assert config.engine.model == str(s3_cache_dir(uri, tmp_path / "cache"))
    assert config.engine.batching == "paged" and "after the download" in config.strategy_reason
    assert prepare() == Path(config.engine.model)
    again, prepare_again = resolve_config(args, environ)  # cached: read like a local folder
    assert prepare_again is None and again.engine.batching == "paged"


@contextlib.contextmanager
def held(s3: MotoS3):
    s3.gate.clear()
    try:
        yield
    finally:
        s3.gate.set()


@pytest.mark.slow
def test_server_downloads_in_the_background_then_serves(s3, tiny_model, tmp_path) -> None:
    uri = s3.upload(tiny_model, "e2e/llama")
    env = {**FAKE_AWS, **env_for(s3), "BATCHYARD_CACHE_DIR": str(tmp_path / "cache")}
    with held(s3), running_server(tmp_path, None, f"option.model_id={uri}\n{PAGED}", env,
                                  wait_ready=False) as srv:
        ping = first_answer(f"{srv.url}/ping", timeout=60)
        assert ping.status_code == 503
        end = time.monotonic() + 30
        while s3.held == 0 and time.monotonic() < end:  # the loader is waiting on S3 ...
            time.sleep(0.05)
        assert s3.held > 0 and requests.get(f"{srv.url}/ping", timeout=2).status_code == 503
        s3.gate.set()  # ... and /ping turns 200 once the download and the load are done
        wait_for_ping(srv, 60)
        body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 4, "ignore_eos": True}}
        answer = requests.post(f"{srv.url}/invocations", json=body, timeout=60)
        assert answer.status_code == 200 and "generated_text" in answer.json()
        assert "after the download" in srv.log() and "downloaded" in srv.log()


@pytest.mark.slow
def test_hf_model_id_env_with_boto3s_own_endpoint_variable(s3, tiny_model, tmp_path) -> None:
    uri = s3.upload(tiny_model, "e2e-env/tiny")
    env = {**FAKE_AWS, "AWS_ENDPOINT_URL_S3": s3.url, "HF_MODEL_ID": uri,
           "BATCHYARD_CACHE_DIR": str(tmp_path / "cache")}
    with running_server(tmp_path, None, "option.max_model_len=128\n", env, timeout=60) as srv:
        body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 3}}
        assert requests.post(f"{srv.url}/invocations", json=body, timeout=60).status_code == 200
    assert (s3_cache_dir(uri, tmp_path / "cache") / COMPLETE_MARKER).is_file()


@pytest.mark.slow
def test_failed_download_stops_the_server_with_a_clear_line(s3, tmp_path) -> None:
    uri = "s3://no-such-bucket-here/model"
    env = {**FAKE_AWS, **env_for(s3), "BATCHYARD_CACHE_DIR": str(tmp_path / "cache")}
    with running_server(tmp_path, None, f"option.model_id={uri}\n", env,
                        wait_ready=False) as srv:
        assert srv.process.wait(timeout=60) != 0
        assert f"cannot list {uri}: bucket no-such-bucket-here does not exist" in srv.log()


def test_an_unwritable_cache_is_one_clear_line(s3, tiny_model, tmp_path) -> None:
    uri = s3.upload(tiny_model, "unwritable/llama")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(S3ModelError, match=r"cannot download .*\(BATCHYARD_CACHE_DIR must name"):
        download_model(uri, blocker, env_for(s3))


def test_model_store_resolves_an_s3_id_to_its_cache_folder_without_network(s3, tmp_path) -> None:
    served = len(s3.requests)
    got = resolve_model_dir(None, f"s3://{BUCKET}/some/prefix/", tmp_path, fetch=False)
    assert got == tmp_path / "s3" / got.parent.name / "prefix" and len(got.parent.name) == 16
    assert len(s3.requests) == served and not got.exists()


def test_auto_strategy_is_paged_whatever_the_downloaded_architecture(s3, tiny_model,
                                                                    tmp_path) -> None:
    """option.rolling_batch=auto does not wait for config.json: every architecture runs paged
    (natively or through the transformers fallback)."""
    config = json.loads((tiny_model / "config.json").read_text())
    uri = s3.upload(tiny_model, "foreign/gpt2", extra={
        "config.json": json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}).encode()})
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id={uri}\n{PAGED}")
    environ = {**env_for(s3), "BATCHYARD_CACHE_DIR": str(tmp_path / "cache")}
    config, prepare = resolve_config(argparse.Namespace(properties=props, model_dir=None),
                                     environ)
    assert config.engine.batching == "paged"
    path = prepare()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
