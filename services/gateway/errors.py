"""OpenAI-shaped API errors, and what each ``RequestFailed`` reason becomes over HTTP.

Every error answer is ``{"error": {"message", "type", "param", "code"}}``; ``param`` names the request
field at fault (also named in ``message``) or is null.
"""

from __future__ import annotations

from shared.messages.events import FailureReason, RequestFailed

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT = "rate_limit_error"

# Internal names in a scheduler's failure detail -> the API field a client sets, in search order.
_DETAIL_FIELDS: tuple[tuple[str, str], ...] = (
    ("min_threshold", "min_threshold"),
    ("max_threshold", "min_threshold"),
    ("gen_length", "max_tokens"),
    ("max_tokens", "max_tokens"),
    ("block_length", "block_length"),
    ("cache_mode", "cache"),
    ("slo_ms", "slo_ms"),
    ("prompt", "prompt"),
    ("model", "model"),
    ("seed", "seed"),
    ("priority", "priority"),
)


class ApiError(Exception):
    """An HTTP error answer in OpenAI's shape."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = INVALID_REQUEST, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    """A 400 naming ``param`` (the message is prefixed with it when it does not already say it)."""
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return ApiError(400, message, param, code)


def detail_param(detail: str, fallback: str | None = None) -> str | None:
    """The API field a failure detail talks about, where one can be found."""
    for internal, field in _DETAIL_FIELDS:
        if internal in detail:
            return field
    return fallback


def failure_error(event: RequestFailed, retry_after_s: int) -> ApiError:
    """The HTTP answer for a request that ended with ``event``; the message carries the request id."""
    reason = FailureReason(event.reason)
    message = f"request {event.request_id} failed: {reason.name.lower()}"
    if event.detail:
        message += f" ({event.detail})"
    retry = {"Retry-After": str(retry_after_s)}
    if reason is FailureReason.FLOOR_UNSATISFIABLE:
        param = detail_param(event.detail, "min_threshold")
        return ApiError(400, f"{param}: {message}", param, "floor_unsatisfiable")
    if reason is FailureReason.INVALID:
        param = detail_param(event.detail)
        return ApiError(400, f"{param}: {message}" if param else message, param, "invalid_request")
    if reason is FailureReason.DEADLINE_INFEASIBLE:
        return ApiError(429, f"slo_ms: {message}; the cluster cannot meet the SLO now", "slo_ms",
                        "deadline_infeasible", RATE_LIMIT, retry)
    if reason is FailureReason.NO_INSTANCE:
        return ApiError(503, f"{message}; no model instance can take it now", None, "no_instance", SERVER_ERROR,
                        retry)
    if reason is FailureReason.CANCELLED:
        return ApiError(409, message, None, "cancelled")
    return ApiError(500, message, None, reason.name.lower(), SERVER_ERROR)
