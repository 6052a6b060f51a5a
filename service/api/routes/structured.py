"""Structured output's step in a generation route: the request's constraint compiled (off the event loop and the
model worker, within the server's time limit: service/text/structured/grammars.py) before its specs are made,
which then carry it. Counted in reformer_structured_requests_total by kind."""

from __future__ import annotations

from service.api.protocol.structured import Constrained
from service.api.state import ServiceState
from service.errors import Unavailable, ValidationFailed


async def compile_constraint(state: ServiceState, body: Constrained, *, ignore_eos: bool) -> None:
    """Compile the constraint `body` asks for, if any, and set it on the body for its specs; a constraint the
    engine refuses is a ValidationFailed naming the field and the construct."""
    source = body.constraint_source()
    if source is None:
        return
    if ignore_eos:
        # a constrained generation ends when its structure is complete: there is nothing to generate past it
        raise ValidationFailed(f"ignore_eos cannot be combined with structured output ({source.field})",
                               param="ignore_eos")
    if state.grammars is None:
        raise Unavailable("the model is loading")
    body.compiled_constraint = await state.grammars.compile(source)
    state.metrics.structured.requests.labels(source.kind).inc()
