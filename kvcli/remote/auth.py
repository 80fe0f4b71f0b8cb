"""The API key a client of another server sends (kvcli serve --api-key, vLLM's and llama-server's
--api-key all take it as a Bearer token), and what to say when the server refuses.
"""

from __future__ import annotations


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header of a server started with an API key (kvcli serve --api-key, vLLM's,
    llama-server's); none without one."""
    return {} if not api_key else {"Authorization": f"Bearer {api_key}"}


def refused_key(status: int, api_key: str | None) -> str:
    """What to say when the server answers 401 / 403."""
    if status not in (401, 403):
        return ""
    return (" (the server wants an API key: --api-key KEY or KVCLI_API_KEY)" if not api_key
            else " (the server refused the API key given)")
