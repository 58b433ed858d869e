"""TGI-shaped responses (option.tgi_compat=true or option.output_formatter=tgi), as LMI >= 0.28
writes them: a JSON list of {generated_text, details}; tokens carry `logprob` and `special`;
streams are SSE lines of {index, token, generated_text, details}."""

from __future__ import annotations

from engine import TokenEvent


def tgi_token(token: dict) -> dict:
    """LMI token {id, text, log_prob} → TGI token {id, text, logprob, special}."""
    return {"id": token["id"], "text": token["text"], "logprob": token.get("log_prob"),
            "special": False}


def tgi_result(result: dict, seed: int | None) -> dict:
    """One LMI generation dict in TGI's shape."""
    details = result.get("details")
    if details is None:
        return result
    out = {"finish_reason": details["finish_reason"],
           "generated_tokens": details["generated_tokens"], "seed": seed}
    for key in ("prefill", "tokens"):
        if key in details:
            out[key] = [tgi_token(t) for t in details[key]]
    if "top_tokens" in details:
        out["top_tokens"] = [[tgi_token(t) for t in row] for row in details["top_tokens"]]
    return {**result, "details": out}


def tgi_stream_line(line: dict, event: TokenEvent, index: int, seed: int | None) -> dict:
    """One LMI stream line → TGI's StreamResponse (generated_text and details on the last)."""
    token = line.get("token") or {"id": None, "text": "", "log_prob": None}
    out: dict = {"index": index, "token": tgi_token(token),
                 "generated_text": line.get("generated_text"), "details": None}
    if "top_tokens" in line:
        out["top_tokens"] = [tgi_token(t) for t in line["top_tokens"]]
    if event.finished and "details" in line:
        out["details"] = {"finish_reason": event.finish_reason,
                          "generated_tokens": event.num_output_tokens, "seed": seed,
                          "input_length": event.num_prompt_tokens}
    return out
