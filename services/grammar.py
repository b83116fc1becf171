"""Structured outputs: a JSON schema (or any JSON object) compiled to a token grammar, and a per-request state.

The engine is llguidance (github.com/guidance-ai/llguidance; chosen in
docs/journal/2026-12-06-grammars.md): a schema compiles in milliseconds, the
mask after each token is an Earley parse over a token trie, and the matcher
rolls back any number of tokens, which is what a draft path or tree needs.

Speculation stays exact when both distributions are masked by the same state:
at each row of a draft path or tree, the target's p and the drafter's q are
masked by the grammar state after that row's path (``GrammarState.tree_masks``),
so rejection sampling runs on the masked distributions, greedy output equals
constrained decoding without speculation, and the drafter, sampling from its
masked q, never proposes a token the grammar forbids.

Masks are bitmasks, one bit per vocab id in int32 words (bit ``i % 32`` of word
``i // 32``), as llguidance fills them. Where the grammar forces the next bytes
(``{"name": `` after ``{``), llguidance's mask holds only the first token of
their canonical tokenization, not every token that spells a prefix of them: a
deterministic function of the path, so target and drafter still see the same
mask at each row (docs/fast_forward.md in llguidance). ``unpack_bitmask`` turns them into
bools and ``mask_logits`` sets the forbidden logits to -inf. Ids at or past the
tokenizer's size (the model's logits may be wider) are always forbidden.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from services.errors import GrammarStateError, InvalidGrammarError

# How JSON is written: json.dumps's separators and no other whitespace (free whitespace lets a small model emit
# newlines forever; any layout keeps speculation exact), and \uXXXX escapes of any character, as json.dumps
# writes non-ASCII text by default (llguidance allows only control characters' escapes otherwise).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "json_allow_general_unicode_escapes": True}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
# Subschema keywords (JSON Schema 2020-12 and draft 7), by what they hold: one schema, a list, or a name -> schema map.
_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems", "contains",
        "not", "if", "then", "else", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
CACHE_SIZE = 64  # compiled schemas kept per compiler (a compile is milliseconds; a cached one is a copy)
BITS = 32  # vocab ids per bitmask word (int32)


def bitmask_words(vocab_size: int) -> int:
    """Int32 words of a bitmask over ``vocab_size`` ids."""
    return (vocab_size + BITS - 1) // BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bools [..., vocab_size] (True = allowed) from a bitmask [..., words] int32."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [..., words, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with -inf where ``allowed`` [..., V] (bool) is False; a new tensor. Apply it before the
    temperature and top-k/top-p warps, to the target's and the drafter's logits alike."""
    return logits.masked_fill(~allowed, float("-inf"))


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that lists ``properties`` and says
    nothing of other names (xgrammar's strict mode, the default of vLLM and SGLang): JSON Schema lets such an object
    take any other key, and a small model writes invented keys until max_tokens. The answers stay valid for the
    schema as given; a schema that wants other keys says so (``additionalProperties`` or ``patternProperties``).
    Left open, where other names may be meant: an object whose ``required`` or ``minProperties`` asks for more than
    it lists; one beside ``$ref`` or a combinator; a member of ``allOf``, or of ``anyOf`` / ``oneOf`` under a schema
    that has names of its own; whatever a ``$ref`` in such a place points to. A new object."""
    if not isinstance(schema, dict):
        return schema
    return _close(schema, "#", _open_refs(schema), True)


def _close(schema, pointer: str, open_refs: set[str], close: bool):
    if not isinstance(schema, dict):
        return schema
    out, close = dict(schema), close and pointer not in open_refs
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], f"{pointer}/{_escape(key)}", open_refs, True)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, f"{pointer}/{key}/{i}", open_refs, not _members_open(out, key))
                        for i, s in enumerate(out[key])]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, f"{pointer}/{key}/{_escape(name)}", open_refs, True)
                        for name, s in out[key].items()}
    props = out.get("properties")
    if close and isinstance(props, dict) and not any(k in out for k in (*_OPENERS, *_COMBINED)):
        required = out.get("required") if isinstance(out.get("required"), list) else []
        wants_more = set(required) - set(props) or out.get("minProperties", 0) > len(props)
        if not wants_more:
            out["additionalProperties"] = False
    return out


_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")  # what says "other names too"
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")
_ANNOTATIONS = {"$ref", "title", "description", "$comment", "default", "examples", "deprecated"}


def _members_open(schema: dict, key: str) -> bool:
    """Whether the members of ``schema[key]`` stay open: ``allOf``'s always (a sibling may list the rest), ``anyOf``
    / ``oneOf``'s when ``schema`` admits names of its own (``properties``, or an opener that is not false)."""
    if key == "allOf":
        return True
    names_of_its_own = "properties" in schema or any(k in schema and schema[k] is not False for k in _OPENERS)
    return key in ("anyOf", "oneOf") and names_of_its_own


def _open_refs(schema) -> set[str]:
    """The JSON pointers (``#/...``) of the schemas a ``$ref`` in an open place names (where ``_close`` leaves an
    object open: beside other keywords, a member of ``allOf``, of ``anyOf`` / ``oneOf`` under names of its own)."""
    found: set[str] = set()

    def walk(node, open_member: bool):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and (open_member or set(node) - _ANNOTATIONS):
                found.add(ref.rstrip("/") or "#")
            for key, value in node.items():
                if key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
                    for member in value:
                        walk(member, _members_open(node, key))
                else:
                    walk(value, False)
        elif isinstance(node, list):
            for item in node:
                walk(item, False)

    walk(schema, False)
    return found


def _escape(name: str) -> str:  # a JSON pointer's reference token (RFC 6901)
    return name.replace("~", "~0").replace("/", "~1")


class Grammar:
    """A compiled grammar at its start state, bound to one tokenizer; ``start()`` makes a request's state."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, source: str):
        self._matcher, self.compiler, self.source = matcher, compiler, source

    def start(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self.compiler)


class GrammarCompiler:
    """Compiles JSON schemas for one model's tokenizer; compiled grammars are cached by schema text (thread-safe).

    ``vocab_size`` is the model's logits width (may exceed the tokenizer's; the extra ids are never allowed);
    ``eos_token_ids`` are the ids that end a request: allowed once the JSON is complete.
    """

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int]):
        if not eos_token_ids:
            raise ValueError("a grammar needs the model's EOS ids (the grammar's end)")
        self.vocab_size, self.eos_token_ids = vocab_size, sorted(set(eos_token_ids))
        self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self._real = torch.zeros(vocab_size, dtype=torch.bool)  # [V] ids the tokenizer has
        self._real[: min(len(tokenizer), vocab_size)] = True
        self._real_words = pack_bitmask(self._real)  # [words]
        self._eos_words = pack_bitmask(torch.isin(torch.arange(vocab_size), torch.tensor(self.eos_token_ids)))
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def json_schema(self, schema: str | dict) -> Grammar:
        """The grammar of JSON documents valid under ``schema`` (text or dict); InvalidGrammarError says why not."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        with self._lock:
            if (hit := self._cache.get(text)) is not None:
                self._cache.move_to_end(text)
                return hit
        grammar = Grammar(self._compile(text), self, text)
        with self._lock:
            self._cache[text] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {type: json_object}``)."""
        return self.json_schema(JSON_OBJECT_SCHEMA)

    def _compile(self, text: str) -> llguidance.LLMatcher:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidGrammarError(f"the JSON schema is not JSON: {exc}") from None
        except RecursionError:
            raise InvalidGrammarError("the JSON schema nests too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammarError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), overrides=JSON_LAYOUT)
        except ValueError as exc:
            raise InvalidGrammarError(f"invalid JSON schema: {exc}") from None
        matcher = llguidance.LLMatcher(self._lltok, source, log_level=0)  # validates; never raises (see is_error)
        if matcher.is_error():
            raise InvalidGrammarError(f"unsupported JSON schema: {matcher.get_error()}")
        return matcher


class GrammarState:
    """One request's place in its grammar: the mask of allowed next tokens, advance, roll back, fork.

    An EOS id is taken only where the JSON is complete, and ends the state (``is_terminated``); a terminated state
    allows only EOS ids, so a row past the end still has a finite distribution.
    """

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler):
        self._matcher, self.compiler = matcher, compiler
        self._eos_at: int | None = None  # tokens consumed when an EOS id was taken (the matcher does not count it)
        self.n_tokens = 0  # tokens advanced over (EOS included), the limit of rollback

    def fill_bitmask(self, out: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``out[row]``; out is [rows, words] int32, contiguous, on CPU.
        llguidance releases the GIL while it computes, so another thread can run this beside a model pass."""
        if self._eos_at is not None:
            out[row] = self.compiler._eos_words
            return
        words = out[row]  # (llguidance.torch.fill_next_token_bitmask's call: that module imports torch's compiler, 1 s)
        if not (out.dtype == torch.int32 and out.is_cpu and words.is_contiguous()):
            raise ValueError("a grammar bitmask is int32, on the CPU, its rows contiguous")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        out[row] &= self.compiler._real_words

    def bitmask(self) -> torch.Tensor:
        """The allowed next tokens as a bitmask [words] int32."""
        out = torch.empty(1, self.compiler.words, dtype=torch.int32)  # [1, words]
        self.fill_bitmask(out)
        return out[0]

    def allowed(self) -> torch.Tensor:
        """The allowed next tokens as bools [vocab_size]."""
        return unpack_bitmask(self.bitmask(), self.compiler.vocab_size)

    def forced(self) -> int | None:
        """The one token the grammar allows next, where it allows exactly one (bytes the grammar forces: the mask then
        holds only their canonical first token); None where it allows several, or none."""
        if self._eos_at is not None:
            return None
        bitmask = self.bitmask()  # [words]
        words = torch.nonzero(bitmask).flatten()
        if words.numel() != 1:
            return None
        word = int(bitmask[words[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit
            return None
        return int(words[0]) * BITS + word.bit_length() - 1

    def forced_bytes_tokens(self) -> list[int]:
        """Where the grammar forces bytes yet allows several tokens (their own token and tokens that go on past them,
        as ` "` and ` "book` before a string's value), those bytes as the tokenizer writes them: the model's usual
        tokens there, a good draft but no certainty ([] where nothing is forced)."""
        if self._eos_at is not None:
            return []
        forced = self._matcher.compute_ff_bytes()
        return list(self.compiler._lltok.tokenize_bytes(forced)) if forced else []

    def accepts(self, token: int) -> bool:
        """Whether the mask allows ``token`` next (what the target and the drafter may sample)."""
        if not 0 <= token < self.compiler.vocab_size:
            return False
        return bool((int(self.bitmask()[token // BITS]) >> (token % BITS)) & 1)

    def advance(self, token: int) -> None:
        """Take ``token``: any token of the grammar's language, a superset of the mask where the grammar forces
        bytes (the mask then holds only their first canonical token). GrammarStateError if the grammar forbids it
        (the state is then unchanged): tokens come from masked distributions, so a forbidden one is a bug upstream."""
        if not self._grammatical(token):
            raise GrammarStateError(f"the grammar forbids token {token} after {self.n_tokens} tokens")
        if token in self.compiler.eos_token_ids:
            self._eos_at = self.n_tokens
        elif not self._matcher.consume_token(token):
            raise GrammarStateError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        self.n_tokens += 1

    def _grammatical(self, token: int) -> bool:
        if self._eos_at is not None or not 0 <= token < self.compiler.vocab_size or not self.compiler._real[token]:
            return False
        if token in self.compiler.eos_token_ids:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def advance_many(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.advance(token)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` advances (a rejected draft suffix)."""
        if not 0 <= n <= self.n_tokens:
            raise GrammarStateError(f"cannot roll back {n} of {self.n_tokens} tokens")
        if n == 0:
            return
        if self._eos_at is not None:  # the EOS is always the last token taken
            self._eos_at, self.n_tokens, n = None, self.n_tokens - 1, n - 1
        if n and not self._matcher.rollback(n):
            raise GrammarStateError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")
        self.n_tokens -= n

    def is_accepting(self) -> bool:
        """The tokens so far are a complete document (an EOS id may come next)."""
        return self._eos_at is not None or self._matcher.is_accepting()

    @property
    def ended(self) -> bool:
        """An EOS id was taken: no token at all may be advanced over now (a drafter stops its path here)."""
        return self._eos_at is not None

    def is_terminated(self) -> bool:
        """Nothing but the end may follow: an EOS id was taken, or the document is complete and admits no more."""
        return self._eos_at is not None or self._matcher.is_stopped()

    def fork(self) -> GrammarState:
        """An independent copy (same grammar, same place)."""
        twin = GrammarState(self._matcher.deep_copy(), self.compiler)
        twin._eos_at, twin.n_tokens = self._eos_at, self.n_tokens
        return twin

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int],
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Bitmasks [1 + n, words] of a draft tree of n nodes: row 0 is this state's mask, row i the mask after the
        path to node i - 1 (its ancestors' tokens, then its own). ``tokens[i]`` is node i's token and
        ``parents[i]`` its parent's row (0 = this state), parents before children (services.tree's layout).
        Row r masks the logits that row r scores (the next token after its path), the target's and the drafter's.
        A node whose token its parent's mask forbids (a drafter kind that does not mask) gets its parent's mask, and
        so do its descendants: the target's masked p is 0 there, so no verdict accepts them. The state is the same
        afterwards."""
        if len(tokens) != len(parents):
            raise GrammarStateError(f"{len(tokens)} tree tokens but {len(parents)} parents")
        out = torch.empty(1 + len(tokens), self.compiler.words, dtype=torch.int32) if out is None else out
        self.fill_bitmask(out, 0)
        path: list[int] = []  # rows advanced over, from row 0 down
        dead: set[int] = set()  # rows whose path holds a forbidden token
        try:
            for i, (token, parent) in enumerate(zip(tokens, parents)):
                if not 0 <= parent <= i:
                    raise GrammarStateError(f"tree node {i}'s parent is row {parent}; a parent precedes its child")
                if parent in dead or not _allows(out[parent], token, self.compiler.vocab_size):
                    dead.add(i + 1)
                    out[i + 1] = out[parent]
                    continue
                wanted = _ancestors(parents, parent)  # rows from row 0 to the parent, row 0 excluded
                keep = _common_prefix(path, wanted)
                self.rollback(len(path) - keep)
                del path[keep:]
                for row in wanted[keep:]:
                    self.advance(tokens[row - 1])
                    path.append(row)
                self.advance(token)
                path.append(i + 1)
                self.fill_bitmask(out, i + 1)
        finally:
            self.rollback(len(path))
        return out


def _allows(bitmask: torch.Tensor, token: int, vocab_size: int) -> bool:  # bitmask: [words]
    return 0 <= token < vocab_size and bool((int(bitmask[token // BITS]) >> (token % BITS)) & 1)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """A bitmask [words] int32 from bools [V] (the inverse of ``unpack_bitmask``)."""
    words = bitmask_words(allowed.shape[-1])
    bits = torch.zeros(words * BITS, dtype=torch.int64)  # [words * 32]
    bits[: allowed.shape[-1]] = allowed.long()
    weights = torch.ones(BITS, dtype=torch.int64) << torch.arange(BITS)  # [32]
    packed = (bits.view(words, BITS) * weights).sum(-1)  # [words] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _ancestors(parents: Sequence[int], row: int) -> list[int]:
    """Rows from the root's child down to ``row`` (empty for row 0)."""
    path = []
    while row:
        path.append(row)
        row = parents[row - 1]
    return path[::-1]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
