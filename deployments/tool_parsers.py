"""How a model writes tool calls in its answer: one parser per format, in one registry (``PARSERS``, ``register``),
chosen by the target's chat template (``detect``) or by ``models.tool_call_parser``. Pure text, no Ray and no HTTP.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the answer, text
  around them (Hermes 2 / 3, Qwen2.5, Qwen3, and splitspec's documented prompt format, deployments.tools);
- ``llama3_json``: the whole answer is one call, or several separated by ``;``, each ``{"name": ..., "parameters":
  {...}}`` (``"arguments"`` also read), optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3's JSON tool
  calling).

Only a valid call of a known function is a call; anything else stays text (auto tool choice: the model may answer
in prose).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


class ToolParser(Protocol):
    name: str
    markers: tuple[str, ...]  # text in a chat template that shows its model writes calls this way (``detect``)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished answer: the calls taken out of the text; (text, []) where there is none."""

    def hold_from(self, text: str, sent: int) -> int:
        """Where a streamed answer's text (``sent`` characters of it passed on) is held back from, as the start of
        a call may be there: ``len(text)`` holds nothing."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_of(item: Any, names: set[str], keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A parsed ``{"name": ..., <key>: {...}}`` of a known function (its arguments an object, or JSON text of one),
    or None."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = next((item[k] for k in keys if k in item), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(new_call_id(), item["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


class HermesParser:
    name = "hermes"
    markers = ("<tool_call>",)
    OPEN = "<tool_call>"
    # a block, or the answer's last one where it ended before the closing tag (EOS right after the JSON)
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        calls, kept, at = [], [], 0
        for match in self.BLOCK.finditer(text):
            try:
                call = call_of(json.loads(match.group(1)), names)
            except ValueError:
                call = None
            if call is not None:
                kept.append(text[at : match.start()])
                at = match.end()
                calls.append(call)
        kept.append(text[at:])
        return ("".join(kept).strip() if calls else text), calls

    def hold_from(self, text: str, sent: int) -> int:
        hold = text.find(self.OPEN, sent)
        if hold >= 0:
            return hold
        # a tail that may begin the tag
        return next((i for i in range(max(sent, len(text) - len(self.OPEN) + 1), len(text))
                     if self.OPEN.startswith(text[i:])), len(text))


class Llama3JsonParser:
    name = "llama3_json"
    # (Meta's templates for 3.1 and 3.2 write the format out: 'Respond in the format {"name": function name,
    # "parameters": dictionary of argument name and its value}')
    markers = ("<|python_tag|>", '"parameters": dictionary of argument name')
    TAG = "<|python_tag|>"

    def parse(self, text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                item, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = call_of(item, names, keys=("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return "", calls

    def hold_from(self, text: str, sent: int) -> int:
        if sent:  # the answer began as text: it is no call
            return len(text)
        head = text.lstrip()
        may_be_call = not head or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head)
        return 0 if may_be_call else len(text)


PARSERS: dict[str, ToolParser] = {}


def register(parser: ToolParser) -> ToolParser:
    """Add a format (a model family's way of writing calls); ``models.tool_call_parser`` names it."""
    PARSERS[parser.name] = parser
    return parser


HERMES = register(HermesParser())
register(Llama3JsonParser())


def detect(template: str) -> ToolParser | None:
    """The parser of the calls a chat template's model writes, by the markers in its tool section; None when the
    template renders no tools or shows no known format."""
    if "tools" not in template:
        return None
    return next((p for p in PARSERS.values() if any(m in template for m in p.markers)), None)
