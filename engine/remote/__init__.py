"""Models served by an OpenAI-compatible server (SGLang, vLLM, llama-server, `expertdesk serve`).

`RemoteService` has the EngineService interface and events, so every front end drives a
server model as it drives a local one; `BackendRouter` picks local or remote by the
model ref; `endpoint` names servers and explains failures; `metrics` reads /metrics.
"""

from engine.remote.endpoint import (
    ConnectionReport,
    EndpointProblem,
    ModelCard,
    check_connection,
    endpoint_ref,
    is_endpoint_ref,
    normalize_base_url,
    parse_endpoint_ref,
)

__all__ = [
    "ConnectionReport", "EndpointProblem", "ModelCard", "check_connection", "endpoint_ref", "is_endpoint_ref",
    "normalize_base_url", "parse_endpoint_ref",
]
