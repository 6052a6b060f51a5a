"""`cache_salt` (vLLM's request field) and the `X-Cache-Salt` header a gateway sets: the tenant a prompt's
cached state belongs to. The salt starts the prefix cache's key chain (service/prefix_cache/keys.py
`chain_start`), so prompts under different salts never share a kept state, an in-flight prefill (n /
best_of forks, identical requests) or a cached_tokens report: a caller cannot learn from the cache whether
a caller of another salt sent a document.

Both may be given: the key then starts from the two together, so a client cannot leave the tenant its
gateway put it in by sending a field of its own, only split that tenant further. A salt is 1 to
MAX_SALT_CHARS characters of [A-Za-z0-9._:/+=@-] (what a tenant id, a UUID or a base64 token is made of);
anything else is refused naming the field or the header."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from service.errors import ValidationFailed
from service.jobs import GenerationSpec
from service.prefix_cache.keys import MAX_SALT_CHARS

HEADER = "x-cache-salt"
PATTERN = r"^[A-Za-z0-9._:/+=@-]+$"
_SALT = re.compile(PATTERN)

DESCRIPTION = (f"Extension (vLLM's): the prefix-cache isolation key, 1 to {MAX_SALT_CHARS} characters of "
               "[A-Za-z0-9._:/+=@-]. Requests reuse each other's cached prompt states, in-flight prefills and "
               "cached_tokens reports only when their salts (this field and the X-Cache-Salt header together) "
               "are equal.")


def cache_salt_field() -> Any:
    """The request field, as each generation route declares it."""
    return Field(None, min_length=1, max_length=MAX_SALT_CHARS, pattern=PATTERN, description=DESCRIPTION)


def request_salt(headers: Mapping[str, str], field: str | None, tenant: str | None = None) -> str | None:
    """The salt a request's prompts are keyed under: its caller's tenant (`tenant`: set when the server holds
    keys and cache_salt_per_key is on, service/api_keys.py), the header's and the field's, those given
    together, or None; ValidationFailed naming the header when it is malformed (the field is checked by its
    model)."""
    header = headers.get(HEADER)
    if header is not None and (not 1 <= len(header) <= MAX_SALT_CHARS or not _SALT.match(header)):
        raise ValidationFailed(f"the {HEADER} header must be 1 to {MAX_SALT_CHARS} characters of "
                               "[A-Za-z0-9._:/+=@-]", param=HEADER)
    if header is None and field is None:
        salt = None
    elif field is None:
        salt = f"h:{header}"
    elif header is None:
        salt = f"f:{field}"
    else:
        salt = "hf:" + json.dumps([header, field])
    # the tenant is added by the server after authentication: no header or field can leave or name it
    return salt if tenant is None else "t:" + json.dumps([tenant, salt])


def tenant_salt(request: Any) -> str | None:
    """The caller's tenant when its key names one (ApiKeyMiddleware) and cache_salt_per_key is on, else None."""
    tenant = getattr(request.state, "tenant", None)
    return tenant if tenant is not None and request.app.state.service.settings.cache_salt_per_key else None


def salted(specs: list[GenerationSpec], salt: str | None) -> list[GenerationSpec]:
    return specs if salt is None else [dataclasses.replace(spec, cache_salt=salt) for spec in specs]
