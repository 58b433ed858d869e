"""Registering LoRA adapters at run time: DJL Serving's adapter management API (also the form
SageMaker's adapter inference components call: POST /adapters, DELETE /adapters/{name}) and
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter. The folder a client names is
confined (handler/model_source/adapters.py) before the engine reads it.

Statuses: LMI/SageMaker answer 400 (LoRA off, a missing or invalid parameter), 404 (unknown
model or adapter), 409 (the name is taken) and 424 (the adapter itself is refused, with the
engine's reason); vLLM answers 400 for all of those but the unknown adapter (404)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from flask import Flask, Response, request

from engine import AdapterError, AdapterNotFound, EngineDeadError
from handler.http.schemas import HTTPError, bad_request
from handler.http.state import ServerState
from handler.model_source.adapters import (
    AdapterPathError,
    BadCheckpoint,
    allowed_roots,
    check_name,
    confined_folder,
)

ALIAS = "X-Amzn-SageMaker-Adapter-Alias"  # SageMaker's name for the adapter in messages
_TRUE = {"true", "1", "yes"}


def add_adapter_routes(app: Flask, state: ServerState) -> None:
    pins: dict[str, bool] = {}  # DJL's `pin`: reported back (every adapter stays read here)

    @app.get("/adapters")
    @app.get("/models/<model>/adapters")
    def list_adapters(model: str | None = None):
        _engine(state, model)
        listed = [{"name": n, "src": src, "pin": pins.get(n, False)} for n, src in
                  state.engine.adapters()]
        start, limit = _int_arg("next_page_token", 0), _int_arg("limit", 100)
        page: dict = {"adapters": listed[start:start + limit]}
        if start + limit < len(listed):
            page["nextPageToken"] = str(start + limit)
        return _json(page)

    @app.post("/adapters")
    @app.post("/models/<model>/adapters")
    def register(model: str | None = None):
        _engine(state, model)
        name = _checked(lambda: check_name(_param("name")), lmi=True)
        src = _param("src")
        if state.engine.has_adapter(name):
            raise HTTPError(409, "Conflict", f"Adapter {name} is already registered")
        _add(state, name, src, lmi=True)
        pins[name] = _param("pin", "false").lower() in _TRUE
        return _json({"status": f"Adapter {_alias(name)} registered"})

    @app.get("/adapters/<name>")
    @app.get("/models/<model>/adapters/<name>")
    def describe(name: str, model: str | None = None):
        found = _registered(state, model, name)
        return _json([{"name": name, "src": found[name], "pin": pins.get(name, False)}])

    @app.post("/adapters/<name>/update")
    @app.post("/models/<model>/adapters/<name>/update")
    def update(name: str, model: str | None = None):
        found = _registered(state, model, name)
        src = _param("src", "")
        if src and _checked(lambda: confined_folder(src, _roots(state)), True) != found[name]:
            _remove(state, name)  # new weights under the old name: a new registration
            try:
                _add(state, name, src, lmi=True)
            except HTTPError:  # refused: the old weights serve on
                state.engine.add_adapter(name, found[name])
                raise
        if request.args.get("pin") is not None:
            pins[name] = request.args["pin"].lower() in _TRUE
        return _json({"status": f"Adapter {_alias(name)} updated"})

    @app.delete("/adapters/<name>")
    @app.delete("/models/<model>/adapters/<name>")
    def unregister(name: str, model: str | None = None):
        _engine(state, model)
        _remove(state, name)
        pins.pop(name, None)
        return _json({"status": f"Adapter {_alias(name)} unregistered"})

    @app.post("/v1/load_lora_adapter")
    def vllm_load():
        _engine(state, None, lmi=False)
        body = _json_body()
        name, src = body.get("lora_name"), body.get("lora_path")
        if not name or not src:
            raise bad_request("both lora_name and lora_path must be provided.")
        name = _checked(lambda: check_name(name), lmi=False)
        if state.engine.has_adapter(name):
            raise bad_request(f"The lora adapter '{name}' has already been loaded.")
        _add(state, name, src, lmi=False)
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def vllm_unload():
        _engine(state, None, lmi=False)
        name = _json_body().get("lora_name")
        if not name or not isinstance(name, str):
            raise bad_request("lora_name must be provided.")
        _remove(state, name, lmi=False)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")


def _engine(state: ServerState, model: str | None, lmi: bool = True) -> None:
    """503 until loaded; 404 for another model's name; 400 with LoRA off (DJL's message)."""
    if not state.ready():
        raise HTTPError(503, "ServiceUnavailable", f"not ready: model is {state.status}")
    if model is not None and model not in (state.model_name, state.config.model_id):
        raise HTTPError(404, "ModelNotFound", f"Model {model[:128]} not found")
    if state.runner is not None or not state.engine.lora_enabled:
        raise bad_request("LoRA is not enabled." if lmi else
                          "LoRA is not enabled (option.enable_lora=true).")


def _add(state: ServerState, name: str, src: str, *, lmi: bool) -> None:
    folder = _checked(lambda: confined_folder(src, _roots(state)), lmi)
    try:
        state.engine.add_adapter(name, folder)
    except AdapterError as err:  # the engine's reason: rank, modules, shapes, DoRA...
        raise HTTPError(424 if lmi else 400, "AdapterError" if lmi else "BadRequest",
                        str(err)) from err
    except RuntimeError as err:
        if isinstance(err, EngineDeadError):
            raise HTTPError(503, "ServiceUnavailable", "the engine is not running") from err
        if not state.engine.lora_enabled:
            raise bad_request("LoRA is not enabled.") from err
        raise HTTPError(424 if lmi else 400, "AdapterError" if lmi else "BadRequest",
                        f"adapter {name!r} could not be loaded") from err


def _remove(state: ServerState, name: str, lmi: bool = True) -> None:
    try:
        state.engine.remove_adapter(name)
    except AdapterNotFound as err:
        raise _not_found(name, lmi) from err
    except EngineDeadError as err:
        raise HTTPError(503, "ServiceUnavailable", "the engine is not running") from err


def _checked(call: Callable[[], str], lmi: bool) -> str:
    """A path or name refused before the engine: 400; a folder with no safetensors
    checkpoint is a bad adapter: 424 on LMI's routes."""
    try:
        return call()
    except BadCheckpoint as err:
        raise HTTPError(424 if lmi else 400, "AdapterError" if lmi else "BadRequest",
                        str(err)) from err
    except AdapterPathError as err:
        raise bad_request(str(err)) from err


def _roots(state: ServerState) -> list[Path]:
    return allowed_roots(Path(state.config.engine.model))


def _registered(state: ServerState, model: str | None, name: str) -> dict[str, str]:
    """name -> folder of the registered adapters; 404 unless `name` is one of them."""
    _engine(state, model)
    found = dict(state.engine.adapters())
    if name not in found:
        raise _not_found(name)
    return found


def _not_found(name: str, lmi: bool = True) -> HTTPError:
    shown = name[:128]
    return HTTPError(404, "NotFound", f"The adapter {shown} was not found" if lmi else
                     f"The lora adapter '{shown}' cannot be found.")


def _param(name: str, default: str | None = None) -> str:
    """A query parameter (DJL), else the JSON body's field (SageMaker's library); 400 if a
    required one is missing."""
    value = request.args.get(name)
    if value is None and request.is_json:
        value = (request.get_json(silent=True) or {}).get(name)
    if value is None or value == "":
        if default is not None:
            return default
        raise bad_request(f"Parameter {name} is required.")
    if not isinstance(value, str):
        raise bad_request(f"Parameter {name} must be a string.")
    return value


def _int_arg(name: str, default: int) -> int:
    value = request.args.get(name, "")
    if not value:
        return default
    if not value.isdigit():
        raise bad_request(f"Parameter {name} must be a non-negative integer.")
    return int(value)


def _alias(name: str) -> str:
    return request.headers.get(ALIAS) or name


def _json_body() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _json(payload: object) -> Response:
    return Response(json.dumps(payload), status=200, mimetype="application/json")


def _text(message: str) -> Response:
    return Response(message, status=200, mimetype="text/plain")
