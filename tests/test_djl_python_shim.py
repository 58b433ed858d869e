"""The djl_python stand-in behaves as DJL documents it, never shadows a real install, and a
handler's Output is split per request as DJL Serving checks it. No server, no torch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from handler.config.lmi_options import LmiOptions
from handler.lmi.entry_point import EntryPointError, load_module
from handler.lmi.rows import split_rows
from handler.lmi.runner import HandlerRunner
from handler.lmi.shim import COMPAT_DIR, ensure_djl_python, is_stand_in

djl = ensure_djl_python()
from djl_python import Input, Output, PairList  # noqa: E402  (importable only after the shim)
from djl_python.encode_decode import decode, encode  # noqa: E402


def request(body: bytes, **properties: str) -> Input:
    inputs = Input()
    inputs.properties.update(properties)
    inputs.content.add("data", body)
    return inputs


def test_stand_in_is_used_only_without_a_real_package() -> None:
    assert is_stand_in(djl)
    site = [i for i, p in enumerate(sys.path) if p.endswith("site-packages")]
    assert sys.path.index(str(COMPAT_DIR)) > max(site)  # appended: installed packages win


def test_a_real_djl_python_wins(tmp_path: Path) -> None:
    real = tmp_path / "site" / "djl_python"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from handler.lmi.shim import ensure_djl_python, is_stand_in;"
            "m = ensure_djl_python(); print(getattr(m, 'REAL', False), is_stand_in(m))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.split() == ["True", "False"]


def test_input_properties_and_content() -> None:
    inputs = request(b'{"inputs": "hi"}', **{"Content-Type": "application/json"})
    inputs.content.add("extra", b"x")
    assert inputs.get_property("content-type") == "application/json"  # any case
    assert inputs.contains_key("data") and not inputs.contains_key("nope")
    assert inputs.get_as_json() == {"inputs": "hi"} and inputs.get_as_bytes("extra") == b"x"
    assert inputs.get_data() == {"inputs": "hi"}
    with pytest.raises(KeyError):
        inputs.get_as_bytes("nope")
    empty = Input()
    empty.content.add("data", b"")  # an empty body is not stored, as in DJL
    assert empty.is_empty() and empty.get_as_bytes() is None and not empty.is_batch()


def test_batches_split_with_either_separator() -> None:
    inputs = Input()
    inputs.properties.update({"batch_size": "2", "batch_000.content-type": "text/plain",
                              "batch_001_content-type": "application/json"})
    inputs.content.add("batch_000.data", b"a")
    inputs.content.add("batch_001_data", b'"b"')
    first, second = inputs.get_batches()
    assert inputs.is_batch() and inputs.get_batch_size() == 2
    assert first.get_as_string() == "a" and second.get_data() == "b"
    assert second.get_property("Content-Type") == "application/json"


def test_output_add_encodes_and_keys_batch_rows() -> None:
    out = Output().add("text").add(b"raw", key="k").add({"a": 1}, batch_index=3)
    assert out.content.get_values() == [b"text", b"raw", b'{"a":1}']
    assert out.content.get_keys() == [None, "k", "batch_3."]
    err = Output().error("boom")
    assert (err.code, err.get_property("Content-Type")) == (424, "application/json")
    assert b'"error":"boom"' in err.content.value_at(0)
    assert Output().set_code(201).set_message("made").add_property("X", "1").code == 201
    stream = Output().add_stream_content(iter([1]), output_formatter=str)
    assert stream.stream_content_formatter is str
    assert Output._default_stream_output_formatter(["a"]) == b'{"outputs": ["a"]}\n'


def test_encode_decode_follow_content_type() -> None:
    assert decode(request(b"hello"), "text/plain") == {"inputs": ["hello"]}
    assert decode(request(b'{"inputs": "x"}'), "application/json") == {"inputs": "x"}
    assert decode(Input(), None) == {"inputs": ""}
    assert decode(request(b"inputs\nrow1\nrow2\n"), "text/csv") == {"inputs": ["row1", "row2"]}
    out = Output()
    encode(out, {"ok": True}, "application/json")
    assert out.get_property("content-type") == "application/json"
    pair = PairList(keys=["a"], values=[b"1"])
    assert pair.get("a") == b"1" and pair.size() == 1


def test_rows_split_as_djl_checks_them() -> None:
    batched = Output().add("x", batch_index=0).add("y", batch_index=1).add_property("H", "v")
    rows = split_rows(batched, 2)
    assert [r.items for r in rows] == [[(None, b"x")], [(None, b"y")]]
    assert rows[1].properties == {"H": "v"}
    assert all(r.code == 418 for r in split_rows(Output().set_code(418), 3))
    assert split_rows(None, 2)[0].empty
    assert split_rows(Output().add("only one"), 2)[0].error is not None
    assert "not an Output" in str(split_rows("a string", 1)[0].error)


def test_runner_groups_requests_into_one_batched_call() -> None:
    sizes: list[int] = []

    def handle(inputs: Input) -> Output:
        batch = inputs.get_batches()
        sizes.append(len(batch))
        out = Output()
        for i, item in enumerate(batch):
            out.add(item.get_as_string().upper(), batch_index=i)
        return out

    runner = HandlerRunner(handle, Input, batch_size=3, max_batch_delay_s=0.5)
    runner.start()
    answers: dict[int, bytes] = {}

    def call(i: int) -> None:
        row = runner.call({"n": str(i)}, [("data", f"r{i}".encode())], timeout=10)
        answers[i] = row.items[0][1]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert answers == {0: b"R0", 1: b"R1", 2: b"R2"} and sizes == [3]


def test_runner_survives_a_raising_handler() -> None:
    def handle(inputs: Input):
        raise SystemExit("a handler calling exit must not end the worker")

    runner = HandlerRunner(handle, Input)
    runner.start()
    assert isinstance(runner.call({}, [("data", b"x")], timeout=5).error, SystemExit)
    assert runner.alive()


def test_entry_point_resolution(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("def handle(inputs):\n    return None\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "serve.py").write_text("def predict(inputs):\n    return None\n")
    assert load_module(LmiOptions(), tmp_path).handle(None) is None
    assert hasattr(load_module(LmiOptions(entry_point="pkg/serve.py"), tmp_path), "predict")
    assert hasattr(load_module(LmiOptions(entry_point="pkg.serve"), tmp_path), "predict")
    assert load_module(LmiOptions(entry_point="djl_python.huggingface"), tmp_path) is None
    with pytest.raises(EntryPointError, match="no such file"):
        load_module(LmiOptions(entry_point="../outside.py"), tmp_path)
    with pytest.raises(EntryPointError, match="cannot import"):
        load_module(LmiOptions(entry_point="no_such_module_anywhere"), tmp_path)
