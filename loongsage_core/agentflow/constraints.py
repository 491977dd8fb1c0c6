"""What a turn's request forces the model to write, as a grammar the engine decodes under.

Three request features constrain a turn (the real APIs honour them, and agent frameworks depend
on it: structured output parsers, loops that must get a tool call):

* ``tool_choice`` ``"required"``: the answer is one or more tool calls (any offered function);
* ``tool_choice`` naming a function: the answer is one call of that function;
* ``response_format`` ``json_object`` / ``json_schema`` (Responses ``text.format``, Anthropic
  ``output_config.format``): the answer is JSON (following the schema). With tools offered and
  ``tool_choice`` ``"auto"`` the answer may instead be tool calls.

How the model writes a tool call depends on its chat template; the ``tool_call_parser``
middleware knows (the ``ConstrainsToolCalls`` capability), and a forced call without such a
middleware is a 400. The JSON the grammar allows is compact, with the separators the chat
templates' ``tojson`` writes (``", "``, ``": "``), so a call re-rendered in the next turn's prompt
has the text the model wrote.

:func:`turn_constraint` returns the engine's constraint (SGLang's ``json_schema`` or ``ebnf``
sampling parameter) and the compiled grammar the record keeps, so a trainer can score the turn's
tokens under the same restriction (:class:`~loongsage_hookspecs.GrammarSpan`).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import attrs

from loongsage_hookspecs import ConstrainsToolCalls

from ..grammar import GrammarError, TokenGrammar, compile_grammar
from .errors import bad_request
from .openai_api import ChatRequest

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: no free white space, ``json.dumps``' separators."""


@attrs.frozen
class TurnConstraint:
    """One turn's constraint: what the engine is sent and the grammar the record keeps."""

    kind: str
    """The engine's sampling parameter: ``json_schema`` or ``ebnf`` (a Lark grammar)."""
    text: str
    """Its value."""
    grammar: str
    """The compiled grammar (llguidance's serialized form), as the engine compiles ``text``."""

    def sampling_params(self, resumed_tokens: int = 0) -> dict[str, Any]:
        """The engine's sampling parameters for this constraint; ``resumed_tokens``: how many of the
        prompt's last tokens the turn generated under it before (a call resumed after an abort)."""
        params: dict[str, Any] = {self.kind: self.text}
        if resumed_tokens:
            params["custom_params"] = {"grammar_offset": resumed_tokens}
        return params


def _compact(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": COMPACT_JSON}


def answer_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an answer must follow under ``response_format`` (chat spelling), or ``None``."""
    if not response_format or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    schema = response_format["json_schema"].get("schema")
    return dict(schema) if isinstance(schema, Mapping) and schema else {"type": "object"}


def call_schema(tool: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` (a chat-completions tool)."""
    fn = tool["function"]
    params = fn.get("parameters")
    arguments = dict(params) if isinstance(params, Mapping) and params else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False}


def _syntax(middlewares: Sequence[Any], body: dict[str, Any]) -> tuple[str, str, str, str] | None:
    for mw in middlewares:
        if isinstance(mw, ConstrainsToolCalls):
            syntax = mw.tool_call_syntax(body)
            if syntax is not None:
                return syntax
    return None


def _calls_rule(tools: Sequence[Mapping[str, Any]], syntax: tuple[str, str, str, str], tg: TokenGrammar,
                several: bool) -> str:
    begin, end, separator, arguments_key = syntax
    schemas = [call_schema(t, arguments_key) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = f"{tg.literal(begin)} %json {json.dumps(_compact(schema))} {tg.literal(end)}".strip()
    if not several or not separator:  # one call (a named function, or a syntax without a separator)
        return f"calls: {call}\n"
    return f"calls: call ({tg.literal(separator)} call)*\ncall: {call}\n"


def turn_constraint(req: ChatRequest, body: dict[str, Any], middlewares: Sequence[Any],
                    tg: TokenGrammar) -> TurnConstraint | None:
    """The constraint of ``req`` (``body``: the chat request the middleware saw), or ``None`` when
    the turn is free; a 400 when it cannot be built (no middleware that knows the call syntax, a
    schema the grammar engine cannot follow)."""
    choice = req.tool_choice
    forced = choice == "required" or isinstance(choice, Mapping)
    schema = answer_schema(req.response_format)
    if not forced and schema is None:
        return None
    tools = req.offered_tools or []
    syntax = _syntax(middlewares, body) if tools else None
    if forced and syntax is None:
        raise bad_request(f"tool_choice {json.dumps(choice)} needs a router middleware that knows how the model "
                          "writes a tool call (e.g. tool_call_parser) to force one", param="tool_choice",
                          code="unsupported_value")
    try:
        if forced:
            assert syntax is not None
            if isinstance(choice, Mapping):
                name = choice["function"]["name"]
                tools = [t for t in tools if t["function"]["name"] == name]
            lark = "start: calls\n" + _calls_rule(tools, syntax, tg, several=not isinstance(choice, Mapping))
            kind, text = "ebnf", lark
        elif syntax is None:  # structured output alone
            assert schema is not None
            kind, text = "json_schema", json.dumps(_compact(schema))
        else:  # structured output, or the offered tools' calls
            answer = f"answer: %json {json.dumps(_compact(schema or {}))}\n"
            kind, text = "ebnf", "start: answer | calls\n" + answer + _calls_rule(tools, syntax, tg, several=True)
        grammar = compile_grammar(kind, text)
        tg.check(grammar)
    except GrammarError as exc:
        param = "tools" if forced else "response_format"
        raise bad_request(f"the constraint of this request cannot be decoded: {exc}", param=param,
                          code="invalid_value") from None
    return TurnConstraint(kind=kind, text=text, grammar=grammar)
