"""Tool calls in the chat API, translated: ``tools`` and the history's tool calls and results into plain chat
messages, a forced tool choice into the JSON schema that constrains the answer, and an answer back into
``tool_calls``. Pure translation, no Ray and no HTTP.

The prompt format (documented in docs/api.md) is the Hermes / Qwen2.5 one, rendered as ordinary messages so that
it works under any chat template, the default pair's included (its template has no tool format):

- the tools' signatures go into the system message, inside ``<tools></tools>``, with the instruction to answer a
  call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant message's ``tool_calls`` become such blocks after its text;
- a ``tool`` message (a call's result) becomes a user message ``<tool_response>...</tool_response>``.

``tool_choice``: ``none`` leaves the tools out of the prompt; ``auto`` (the default with tools) lets the model
answer in text or in ``<tool_call>`` blocks, parsed from its answer (``parse_answer``; a block that is not a valid
call stays text); ``required`` and a named function constrain the answer to JSON calls (``forced_schema``): an
array of one or more calls of the tools (one call if ``parallel_tool_calls`` is false), or one call of the named
function, its arguments valid for the function's ``parameters``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidRequestError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the OpenAI API's function names
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict  # a JSON schema of the arguments (an object)

    def signature(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the answer: its prompt's system block, and a forced schema or none."""

    functions: tuple[Function, ...] = ()
    choice: str = "none"  # none | auto | required | a function's name (forced)
    parallel: bool = True
    forced: dict | None = None  # the JSON schema the answer must follow (required / named), None: free text

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.functions)


def parse_functions(tools: list[Any] | None) -> tuple[Function, ...]:
    """``tools`` of a chat body: each ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    functions = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        spec = tool["function"]
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        parameters = spec.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise InvalidRequestError(f"tools[{i}].function.description must be a string")
        functions.append(Function(name, description, parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: function names must be unique, got {names}")
    return tuple(functions)


def plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The request's tool plan; InvalidRequestError naming what is wrong."""
    functions = parse_functions(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        choice = "auto" if functions else "none"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        choice = tool_choice["function"]["name"]
        if choice not in {f.name for f in functions}:
            raise InvalidRequestError(f"tool_choice names function {choice!r}, which is not in tools")
    else:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}')
    if choice in ("auto", "required") and not functions and tool_choice is not None:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools")
    forced = None if choice in ("none", "auto") else forced_schema(functions, choice, parallel)
    return ToolPlan(functions, choice, parallel, forced)


def call_schema(function: Function) -> dict:
    """One call of ``function`` as JSON: its name, and arguments valid for its parameters."""
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_schema(functions: tuple[Function, ...], choice: str, parallel: bool) -> dict:
    """The answer's schema where a call is forced: one call of the named function; or (``required``) an array of one
    or more calls of any of the tools, exactly one if not ``parallel``."""
    if choice != "required":
        return call_schema(next(f for f in functions if f.name == choice))
    one = {"anyOf": [call_schema(f) for f in functions]} if len(functions) > 1 else call_schema(functions[0])
    return {"type": "array", "items": one, "minItems": 1} | ({} if parallel else {"maxItems": 1})


def render_messages(messages: list[dict], tool_plan: ToolPlan) -> list[tuple[str, str]]:
    """Chat messages (OpenAI dicts, tool calls and results included) as (role, content) pairs of system / user /
    assistant turns in the documented prompt format."""
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
        if role == "tool":
            out.append(("user", f"<tool_response>\n{content}\n</tool_response>"))
        elif role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call, i) for call in message["tool_calls"]]
            out.append(("assistant", "\n".join(([content] if content else []) + blocks)))
        else:
            out.append((role, content))
    if tool_plan.active:
        system = SYSTEM.format(tools="\n".join(json.dumps(f.signature()) for f in tool_plan.functions))
        if out and out[0][0] in ("system", "developer"):
            out[0] = (out[0][0], f"{out[0][1]}\n\n{system}" if out[0][1] else system)
        else:
            out.insert(0, ("system", system))
    return out


def _call_block(call: Any, i: int) -> str:
    try:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        return f'<tool_call>\n{json.dumps({"name": function["name"], "arguments": arguments})}\n</tool_call>'
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"messages[{i}].tool_calls: expected {{\"function\": {{\"name\", \"arguments\": "
                                  f"JSON}}}} ({exc})") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(item: Any, names: set[str]) -> ToolCall | None:
    """A parsed ``{"name": ..., "arguments": {...}}`` of a known function, or None."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(new_call_id(), item["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def parse_answer(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a finished answer. Forced: the answer is the schema's JSON (one call, or an array
    of calls). Auto: each ``<tool_call>`` block that holds a valid call of a known function is a call, taken out of
    the content; anything else stays text."""
    names = {f.name for f in tool_plan.functions}
    if tool_plan.forced is not None:
        try:
            value = json.loads(text)
        except ValueError:
            return text, []  # (cut short by max_tokens: the client gets the text and finish_reason "length")
        calls = [_call(item, names) for item in (value if isinstance(value, list) else [value])]
        return ("", calls) if calls and all(calls) else (text, [])
    if not tool_plan.active:
        return text, []
    calls, kept, at = [], [], 0
    for match in CALL_BLOCK.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is not None:
            kept.append(text[at : match.start()])
            at = match.end()
            calls.append(call)
    kept.append(text[at:])
    return ("".join(kept).strip() if calls else text), calls


class StreamedAnswer:
    """A streamed answer's deltas under a tool plan: text is passed on until a ``<tool_call>`` may begin (auto) —
    from there it is held back and parsed when the answer ends — and a forced answer is held back whole. ``feed``
    gives the content to send now; ``finish`` the rest and the calls."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan, self.text, self.sent = tool_plan, "", 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.forced is not None:
            return ""
        if not self.plan.active:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        hold = self.text.find(OPEN_TAG, self.sent)
        if hold < 0:  # hold back a tail that may begin the tag
            hold = next((i for i in range(max(self.sent, len(self.text) - len(OPEN_TAG) + 1), len(self.text))
                         if OPEN_TAG.startswith(self.text[i:])), len(self.text))
        out, self.sent = self.text[self.sent : hold], max(self.sent, hold)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the answer has ended."""
        return parse_answer(self.text[self.sent :], self.plan)
