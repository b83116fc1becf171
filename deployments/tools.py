"""Tool calls in the chat API, translated: ``tools`` and the history's tool calls and results into the prompt, a
forced tool choice into the JSON schema that constrains the answer, and an answer back into ``tool_calls``. Pure
translation, no Ray and no HTTP.

Two ways into the prompt (``ToolFormat``, one per server, from the target's chat template):

- **the model's own template**, where it renders tools (Qwen2.5, Hermes, Llama 3.1, ...) and its answers' format has
  a parser (deployments.tool_parsers; or ``models.tool_call_parser`` names one): the messages go to the template as
  structured messages (an assistant's ``tool_calls``, ``tool`` messages) with ``tools=`` the signatures
  (``render_prompt``), as transformers' ``apply_chat_template`` takes them;
- else **the documented prompt format** (docs/api.md), the Hermes / Qwen2.5 one rendered as ordinary messages so
  that it works under any chat template, the default pair's included (its template has no tool format): the tools'
  signatures go into the system message, inside ``<tools></tools>``, with the instruction to answer a call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an assistant message's ``tool_calls`` become such
  blocks after its text; a ``tool`` message (a call's result) becomes a user message
  ``<tool_response>...</tool_response>`` (``render_messages``).

``tool_choice``: ``none`` leaves the tools out of the prompt; ``auto`` (the default with tools) lets the model
answer in text or in calls, parsed from its answer by the format's parser (a call that is not a valid call of a
known function stays text); ``required`` and a named function constrain the answer to JSON calls
(``forced_schema``): an array of one or more calls of the tools (one call if ``parallel_tool_calls`` is false), or
one call of the named function, its arguments valid for the function's ``parameters``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from deployments.tool_parsers import HERMES, PARSERS, ToolCall, ToolParser, call_of, detect
from services.errors import InvalidRequestError

logger = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the OpenAI API's function names
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
class ToolPlan:
    """What a request's tools ask of the answer: the functions, a forced schema or none, and how calls are read."""

    functions: tuple[Function, ...] = ()
    choice: str = "none"  # none | auto | required | a function's name (forced)
    parallel: bool = True
    forced: dict | None = None  # the JSON schema the answer must follow (required / named), None: free text
    parser: ToolParser = field(default=HERMES, compare=False)  # the server's (ToolFormat): how an auto answer is read

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


def plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
         parser: ToolParser = HERMES) -> ToolPlan:
    """The request's tool plan (its auto answers read by ``parser``); InvalidRequestError naming what is wrong."""
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
    return ToolPlan(functions, choice, parallel, forced, parser)


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
    name, arguments = _call_parts(call, i)
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _call_parts(call: Any, i: int) -> tuple[str, Any]:
    """(name, arguments parsed) of a history message's tool call."""
    try:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        return function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"messages[{i}].tool_calls: expected {{\"function\": {{\"name\", \"arguments\": "
                                  f"JSON}}}} ({exc})") from None


def parse_answer(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a finished answer. Forced: the answer is the schema's JSON (one call, or an array
    of calls). Auto: the calls the plan's parser finds (valid calls of known functions), taken out of the content;
    anything else stays text."""
    names = {f.name for f in tool_plan.functions}
    if tool_plan.forced is not None:
        try:
            value = json.loads(text)
        except ValueError:
            return text, []  # (cut short by max_tokens: the client gets the text and finish_reason "length")
        calls = [call_of(item, names) for item in (value if isinstance(value, list) else [value])]
        return ("", calls) if calls and all(calls) else (text, [])
    if not tool_plan.active:
        return text, []
    return tool_plan.parser.parse(text, names)


class StreamedAnswer:
    """A streamed answer's deltas under a tool plan: text is passed on until a call may begin (auto: where the plan's
    parser says) — from there it is held back and parsed when the answer ends — and a forced answer is held back
    whole. ``feed`` gives the content to send now; ``finish`` the rest and the calls."""

    def __init__(self, tool_plan: ToolPlan):
        self.plan, self.text, self.sent = tool_plan, "", 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.forced is not None:
            return ""
        if not self.plan.active:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        hold = self.plan.parser.hold_from(self.text, self.sent)
        out, self.sent = self.text[self.sent : hold], max(self.sent, hold)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the answer has ended."""
        return parse_answer(self.text[self.sent :], self.plan)


# -- the model's own template ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """How a server puts tools into prompts and reads calls from answers: through the target's own chat template
    (``in_template``) or the documented prompt format, and the parser of its answers."""

    parser: ToolParser = HERMES
    in_template: bool = False


def server_format(chat_template: str | dict | None, parser: str = "auto") -> ToolFormat:
    """The format for a target whose tokenizer has ``chat_template`` (a dict: named templates, the ``tool_use`` one
    preferred, as transformers picks it when tools are given). ``parser``: ``auto`` uses the template where it
    renders tools in a format ``tool_parsers.detect`` knows, else the documented prompt format; a registered
    parser's name uses the template with that parser (where the template renders tools)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    template = chat_template if isinstance(chat_template, str) else ""
    if parser != "auto":
        if parser not in PARSERS:
            raise ValueError(f"models.tool_call_parser {parser!r} is none of {['auto', *PARSERS]}")
        if "tools" not in template:  # (the documented prompt format asks for <tool_call> blocks: hermes reads them)
            raise ValueError(f"models.tool_call_parser is {parser!r}, but the chat template renders no tools: give "
                             "one that does (models.chat_template), or leave the parser auto")
        return ToolFormat(PARSERS[parser], in_template=True)
    found = detect(template)
    if found is None and "tools" in template:
        logger.warning("the chat template renders tools in a format splitspec does not know: tools use the documented "
                       "prompt format (set models.tool_call_parser to use the template with a parser)")
    return ToolFormat(found, in_template=True) if found is not None else ToolFormat()


def uses_template(tool_format: ToolFormat, messages: list[dict], tool_plan: ToolPlan) -> bool:
    """A chat that goes through the model's own tool template: the server's format has one, and the request has
    tools or a history of calls."""
    return tool_format.in_template and (tool_plan.active or any(
        m.get("role") == "tool" or m.get("tool_calls") for m in messages))


def template_messages(messages: list[dict], tool_plan: ToolPlan) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as transformers' ``apply_chat_template`` takes them: an assistant's ``tool_calls`` with
    their arguments as objects, ``tool`` messages with the call they answer; the tools' signatures (None: no
    tools in the prompt)."""
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")
        item = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [_template_call(call, i) for call in message["tool_calls"]]
        if role == "tool" and message.get("tool_call_id"):
            item["tool_call_id"] = message["tool_call_id"]
        out.append(item)
    return out, ([f.signature() for f in tool_plan.functions] if tool_plan.active else None)


def _template_call(call: Any, i: int) -> dict:
    name, arguments = _call_parts(call, i)
    return {"id": call.get("id") or "", "type": "function", "function": {"name": name, "arguments": arguments}}


def render_prompt(tokenizer, messages: list[dict], tool_plan: ToolPlan) -> str:
    """The prompt text of a chat through the model's own template, with its generation prompt: tokenised as the raw
    prompt is (the tokenizer's defaults), so a BOS the template writes is left out where the tokenizer adds one."""
    chat, signatures = template_messages(messages, tool_plan)
    try:
        text = tokenizer.apply_chat_template(chat, tools=signatures, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template's own check (e.g. roles must alternate): the caller's to fix
        raise InvalidRequestError(f"the chat template refused the messages: {exc}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos) :]
    return text
