"""Structured output's request fields, in every client's spelling, and what they ask for.

OpenAI's `response_format` (`json_object`, `json_schema`; `text` asks for nothing), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` on `/v1/completions` and `/v1/chat/completions`
(`OpenAIStructured`, a base both request models share); TGI's `parameters.grammar` (`json`, `regex`,
`json_schema`) on the native routes (`TGIGrammar`). Each becomes a `ConstraintSource`, which the route
compiles (service/api/routes/structured.py) before the request is turned into specs; a request may ask
for one constraint at most."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from service.api.protocol.common import RequestModel
from service.errors import ValidationFailed
from service.jobs import OutputConstraint
from service.text.structured import ConstraintSource

# An output schema as a JSON object, or its JSON text (vLLM takes both).
SchemaValue = dict[str, Any] | str


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema` (OpenAI)."""

    name: str | None = Field(None, description="The schema's name (not used).")
    description: str | None = Field(None, description="What the output is for (not used).")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON schema the output must match.")
    strict: bool | None = Field(None, description="Accepted; the output always matches the schema exactly.")


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: unconstrained; json_object: any JSON object; json_schema: JSON matching `json_schema`.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type json_schema, and only with it")
        return self


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one of its fields."""

    json_: SchemaValue | None = Field(None, alias="json", description="A JSON schema (object or JSON text).")
    regex: str | None = Field(None, description="A regular expression (Rust regex syntax) the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect) or a GBNF one.")
    json_object: bool | None = Field(None, description="true: any JSON object.")

    def source(self, field: str) -> ConstraintSource | None:
        asked = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if name == "json" else name) not in (None, False)]
        if len(asked) > 1:
            raise ValidationFailed(f"{field} takes one of json, regex, choice, grammar or json_object; got "
                                   f"{', '.join(asked)}", param=field)
        if not asked:
            return None
        name = asked[0]
        if name == "json":
            return ConstraintSource.schema(self.json_, f"{field}.json")
        if name == "json_object":
            return ConstraintSource("json_object", "", f"{field}.json_object")
        if self.regex is not None:
            return _source("regex", self.regex, f"{field}.regex")
        if self.choice is not None:
            return _source("choice", self.choice, f"{field}.choice")
        assert self.grammar is not None
        return _source("grammar", self.grammar, f"{field}.grammar")


def _source(kind: Literal["regex", "choice", "grammar"], value: str | list[str], field: str) -> ConstraintSource:
    if kind == "choice":
        assert isinstance(value, list)
        if not value:
            raise ValidationFailed(f"{field} must hold at least one string", param=field)
        return ConstraintSource("choice", json.dumps(value, ensure_ascii=False), field)
    assert isinstance(value, str)
    if not value:
        raise ValidationFailed(f"{field} must not be empty", param=field)
    return ConstraintSource(kind, value, field)


class Constrained(RequestModel):
    """What the route's compile step sets: the compiled constraint the request's specs carry."""

    _compiled: OutputConstraint | None = PrivateAttr(default=None)

    @property
    def compiled_constraint(self) -> OutputConstraint | None:
        return self._compiled

    @compiled_constraint.setter
    def compiled_constraint(self, value: OutputConstraint | None) -> None:
        self._compiled = value

    def constraint_source(self) -> ConstraintSource | None:
        raise NotImplementedError


class OpenAIStructured(Constrained):
    """The structured-output fields of /v1/completions and /v1/chat/completions."""

    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: {type: json_object} any JSON object; {type: json_schema, json_schema: "
        "{name, schema}} JSON matching the schema; {type: text} unconstrained.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object.")
    guided_json: SchemaValue | None = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="vLLM's older name of structured_outputs.grammar.")

    def constraint_source(self) -> ConstraintSource | None:
        """The one constraint the request asks for, or None; two fields that both ask are refused."""
        found: list[ConstraintSource] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            found.append(ConstraintSource("json_object", "", "response_format"))
        elif self.response_format is not None and self.response_format.json_schema is not None:
            found.append(ConstraintSource.schema(self.response_format.json_schema.json_schema,
                                                 "response_format.json_schema.schema"))
        if self.structured_outputs is not None:
            source = self.structured_outputs.source("structured_outputs")
            if source is not None:
                found.append(source)
        if self.guided_json is not None:
            found.append(ConstraintSource.schema(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            found.append(_source("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(_source("choice", self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(_source("grammar", self.guided_grammar, "guided_grammar"))
        if len(found) > 1:
            raise ValidationFailed(f"ask for one structured output at most; got {found[0].field} and "
                                   f"{found[1].field}", param=found[1].field)
        return found[0] if found else None


# The fields OpenAIStructured adds, which /v1/chat/completions passes on to /v1/completions as they are.
OPENAI_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                            "guided_grammar")


class TGIGrammar(RequestModel):
    """TGI's `parameters.grammar`."""

    type: Literal["json", "json_object", "regex", "json_schema"] = Field(
        description="json (json_object: its alias): `value` is a JSON schema; regex: `value` is a regular "
        "expression; json_schema: `value` is {name, schema}.")
    value: dict[str, Any] | str = Field(description="The schema, the regular expression, or {name, schema}.")

    def source(self, field: str) -> ConstraintSource:
        if self.type in ("json", "json_object"):
            return ConstraintSource.schema(self.value, f"{field}.value")
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise ValidationFailed(f"{field}.value must be a string for type regex", param=f"{field}.value")
            return _source("regex", self.value, f"{field}.value")
        if not isinstance(self.value, dict) or not isinstance(self.value.get("schema"), dict) \
                or set(self.value) - {"name", "schema"}:
            raise ValidationFailed(f"{field}.value must be {{name, schema}} (schema a JSON object) for type "
                                   "json_schema", param=f"{field}.value")
        return ConstraintSource.schema(self.value["schema"], f"{field}.value.schema")
