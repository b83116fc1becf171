"""Grammars (services.grammar): masks allow exactly the tokens that continue a valid document, rollback and tree masks
equal the sequential masks, bad schemas raise InvalidGrammarError with the reason, json_object takes any object."""

import json
import os

import pytest
import torch

from services.errors import GrammarStateError, InvalidGrammarError, InvalidRequestError
from services.grammar import GrammarCompiler, mask_logits, pack_bitmask, unpack_bitmask
from services.loading import describe
from services.models import default_pair
from services.tree import side_tree

PADDING = 64  # logits wider than the tokenizer (as padded embeddings are): these ids must never be allowed
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"], "additionalProperties": False}
# Schemas with a few documents each, written as json.dumps writes them: the language is finite, so the allowed
# next tokens can be checked against every vocab entry.
FINITE = [
    ({"enum": ["red", "green", "blue", "gr"]}, ['"red"', '"green"', '"blue"', '"gr"']),
    ({"type": "boolean"}, ["true", "false"]),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 12]}}, "required": ["ok", "n"],
      "additionalProperties": False},
     ['{"ok": true, "n": 1}', '{"ok": false, "n": 1}', '{"ok": true, "n": 12}', '{"ok": false, "n": 12}']),
]


@pytest.fixture(scope="module")
def model_info():
    return describe(default_pair.prepare_target())


@pytest.fixture(scope="module")
def compiler(model_info):
    return GrammarCompiler(model_info.tokenizer, vocab_size=model_info.vocab_size + PADDING,
                           eos_token_ids=sorted(model_info.eos_token_ids))


@pytest.fixture(scope="module")
def pieces(model_info):
    """Each id's text, for the real tokens (special ones are never part of a document)."""
    tok = model_info.tokenizer
    special = set(tok.all_special_ids)
    return {i: tok.decode([i]) for i in range(len(tok)) if i not in special}


def encode(compiler, model_info, text: str) -> list[int]:
    return model_info.tokenizer.encode(text, add_special_tokens=False)


def expected_allowed(compiler, model_info, pieces, docs: list[str], prefix: str) -> set[int]:
    """Ids whose text extends ``prefix`` towards some document, EOS ids where ``prefix`` is a document; where the
    documents force the next bytes and these take several tokens, the first of them only (llguidance's forced
    tokens)."""
    forced = encode(compiler, model_info, os.path.commonprefix([d[len(prefix):] for d in docs if d.startswith(prefix)]))
    if len(forced) > 1:  # a forced token that more forced tokens follow (one alone might still grow)
        return {forced[0]}
    allowed = {i for i, piece in pieces.items() if piece and any(d.startswith(prefix + piece) for d in docs)}
    return allowed | (set(compiler.eos_token_ids) if prefix in docs else set())


def ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


@pytest.mark.parametrize("schema,docs", FINITE)
def test_masks_allow_exactly_the_valid_continuations(compiler, model_info, pieces, schema, docs):
    """Along each document's tokens, the mask is exactly the tokens that continue some document (forced bytes: their
    first token; EOS at the end), never a padding id."""
    grammar = compiler.json_schema(schema)
    for doc in docs:
        state, prefix = grammar.start(), ""
        for token in encode(compiler, model_info, doc) + [compiler.eos_token_ids[0]]:
            allowed = state.allowed()
            assert allowed.shape == (compiler.vocab_size,)
            assert not allowed[len(model_info.tokenizer):].any()
            assert ids(allowed) == expected_allowed(compiler, model_info, pieces, docs, prefix), (doc, prefix)
            state.advance(token)
            prefix += pieces.get(token, "")
        assert state.is_terminated() and state.is_accepting()
        assert ids(state.allowed()) == set(compiler.eos_token_ids)


def test_rollback_restores_the_mask(compiler, model_info):
    """At every position of a document: take k tokens, roll back k, and the mask and counts are the ones before."""
    tokens = encode(compiler, model_info, json.dumps({"name": "Ada \u00e9", "age": 36, "tags": ["b", "a"]}))
    tokens.append(compiler.eos_token_ids[0])
    state = compiler.json_schema(PERSON).start()
    for i in range(len(tokens)):
        before, n_before = state.bitmask(), state.n_tokens
        for k in (1, 3, 5):
            ahead = tokens[i:i + k]
            state.advance_many(ahead)
            state.rollback(len(ahead))
            assert torch.equal(state.bitmask(), before) and state.n_tokens == n_before
        state.advance(tokens[i])
    assert state.is_terminated()
    state.rollback(state.n_tokens)
    assert torch.equal(state.bitmask(), compiler.json_schema(PERSON).start().bitmask())


def sequential_masks(grammar, prefix, tokens, parents) -> torch.Tensor:
    """Each row's mask from a fresh state advanced over ``prefix`` and then the row's path (the definition)."""
    rows = []
    for row in range(1 + len(tokens)):
        path = []
        while row:
            path.append(tokens[row - 1])
            row = parents[row - 1]
        state = grammar.start()
        state.advance_many(prefix + path[::-1])
        rows.append(state.bitmask())
    return torch.stack(rows)  # [1 + n, words]


def trie(token_lists: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, end rows) of the trie of several token sequences, breadth first (parents first)."""
    children: dict[tuple[int, int], int] = {}
    tokens, parents, ends = [], [], [0] * len(token_lists)
    frontier = [(n, 0, seq) for n, seq in enumerate(token_lists)]
    while frontier:
        nxt = []
        for n, row, seq in frontier:
            if not seq:
                ends[n] = row
                continue
            if (row, seq[0]) not in children:
                tokens.append(seq[0])
                parents.append(row)
                children[(row, seq[0])] = len(tokens)
            nxt.append((n, children[(row, seq[0])], seq[1:]))
        frontier = nxt
    return tokens, parents, ends


def test_tree_masks_of_a_trie_equal_sequential_masks(compiler, model_info):
    """A tree of four documents' continuations (and an EOS node) gets, row by row, the masks of each node's path
    decoded alone; the state is unchanged afterwards."""
    grammar = compiler.json_schema(PERSON)
    docs = [{"name": "Al", "age": 3}, {"name": "Al", "age": 30, "tags": []}, {"name": "Bea", "age": 7},
            {"name": "Al", "age": 3, "tags": ["a"]}]
    tokenized = [encode(compiler, model_info, json.dumps(d)) for d in docs]
    prefix = tokenized[0][:3]  # '{"name": ' as the documents' own tokens
    assert all(t[:3] == prefix for t in tokenized)
    tokens, parents, ends = trie([t[3:] for t in tokenized])
    tokens.append(compiler.eos_token_ids[0])
    parents.append(ends[0])
    state = grammar.start()
    state.advance_many(prefix)
    before = state.bitmask()
    masks = state.tree_masks(tokens, parents)
    assert masks.shape == (1 + len(tokens), compiler.words)
    assert torch.equal(masks, sequential_masks(grammar, prefix, tokens, parents))
    assert ids(unpack_bitmask(masks[-1], compiler.vocab_size)) == set(compiler.eos_token_ids)
    assert torch.equal(state.bitmask(), before) and state.n_tokens == len(prefix)


def test_tree_masks_of_the_side_tree_layout(compiler, model_info):
    """services.tree's layout (a chain of k, then width - 1 side nodes under each chain row), inside a string where
    every row has alternatives: tree masks equal sequential masks."""
    grammar = compiler.json_schema(PERSON)
    prefix = encode(compiler, model_info, '{"name": "')
    chain = encode(compiler, model_info, 'Ada Lovelace Byron')[:3]
    k, width = len(chain), 3
    state = grammar.start()
    state.advance_many(prefix)
    chain_masks = state.tree_masks(chain, list(range(k)))
    sides = []
    for depth in range(k):
        others = sorted(ids(unpack_bitmask(chain_masks[depth], compiler.vocab_size)) - {chain[depth]})
        sides += others[: width - 1]
    parents = side_tree(k, width)
    assert len(parents) == k + len(sides)
    masks = state.tree_masks(chain + sides, parents)
    assert torch.equal(masks, sequential_masks(grammar, prefix, chain + sides, parents))
    assert state.n_tokens == len(prefix)


def test_forbidden_tokens_raise_and_leave_the_state(compiler, model_info):
    """A token the grammar forbids raises GrammarStateError in advance (in a tree it is a dead node: the test
    below); the state is as before."""
    state = compiler.json_schema(PERSON).start()
    state.advance_many(encode(compiler, model_info, '{"name": "x", "age": '))
    before, n = state.bitmask(), state.n_tokens
    letter = encode(compiler, model_info, "q")[0]
    for bad in (letter, compiler.eos_token_ids[0], compiler.vocab_size - 1):
        assert not state.accepts(bad)
        with pytest.raises(GrammarStateError):
            state.advance(bad)
    digit = encode(compiler, model_info, "4")[0]
    masks = state.tree_masks([digit, letter], [0, 1])
    assert torch.equal(masks[2], masks[1])  # the forbidden node keeps its parent's mask
    with pytest.raises(GrammarStateError):
        state.rollback(n + 1)
    assert torch.equal(state.bitmask(), before) and state.n_tokens == n


@pytest.mark.parametrize("schema,reason", [
    ("{oops", "not JSON"),
    ("[1, 2]", "object or a boolean"),
    ({"type": "strin"}, "strin"),
    ({"properties": {"a": {"$ref": "#/definitions/missing"}}}, "missing"),
    ({"type": "string", "format": "byte"}, "format"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
])
def test_bad_schemas_raise_with_the_reason(compiler, schema, reason):
    """A schema that cannot be compiled raises InvalidGrammarError (an InvalidRequestError: 400) naming the cause."""
    with pytest.raises(InvalidGrammarError) as err:
        compiler.json_schema(schema)
    assert isinstance(err.value, InvalidRequestError) and reason in str(err.value)


@pytest.mark.parametrize("doc", [
    {}, {"a": 1}, {"nested": {"list": [1, -2.5e3, "s", None, True, False, {"x": []}]}},
    {"unicode": "caf\u00e9 \u4e2d\u6587", "escapes": "tab\t quote\" slash\\ newline\n"},
])
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_json_object_takes_any_object(compiler, model_info, doc, ensure_ascii):
    """json_object's grammar takes any JSON object as json.dumps writes it, and ends there."""
    state = compiler.json_object().start()
    state.advance_many(encode(compiler, model_info, json.dumps(doc, ensure_ascii=ensure_ascii)))
    assert state.is_accepting() and state.is_terminated()
    state.advance(compiler.eos_token_ids[0])


@pytest.mark.parametrize("text", ["[1]", '"x"', "3", "null"])
def test_json_object_refuses_other_values(compiler, model_info, text):
    """json_object's first token must open an object."""
    state = compiler.json_object().start()
    assert not state.accepts(encode(compiler, model_info, text)[0])


def test_compiled_grammars_are_cached_by_schema_text(compiler):
    """The same schema text gives the same compiled grammar; a dict is cached as its json.dumps text."""
    assert compiler.json_schema(PERSON) is compiler.json_schema(json.dumps(PERSON))
    assert compiler.json_object() is compiler.json_object()


def test_mask_logits_and_bitmask_packing(compiler, model_info):
    """mask_logits puts -inf exactly where the mask forbids; pack and unpack are inverses."""
    state = compiler.json_schema(PERSON).start()
    state.advance_many(encode(compiler, model_info, '{"name": "x", "age": '))
    allowed = state.allowed()  # [V]
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), compiler.vocab_size), allowed)
    logits = torch.randn(2, compiler.vocab_size)  # [2, V]
    masked = mask_logits(logits, allowed.expand(2, -1))
    assert torch.equal(masked.isfinite(), allowed.expand(2, -1))
    assert torch.equal(masked[allowed.expand(2, -1)], logits[allowed.expand(2, -1)])


def test_a_forbidden_draft_node_and_its_subtree_get_their_parents_mask(compiler, model_info):
    """A drafter kind that does not mask may propose a forbidden token: its row (and its children's) gets the
    parent's mask (finite logits, p = 0 at the forbidden token, so no verdict accepts it); the other rows are the
    sequential masks, and the state is unchanged."""
    grammar = compiler.json_schema(PERSON)
    prefix = encode(compiler, model_info, '{"name": "')
    chain = encode(compiler, model_info, 'Ada Lovelace Byron')[:2]
    state = grammar.start()
    state.advance_many(prefix)
    row1 = unpack_bitmask(state.tree_masks(chain, [0, 1])[1], compiler.vocab_size)
    forbidden = next(t for t in range(compiler.vocab_size) if not row1[t])
    # chain[0] (allowed), then a forbidden child of it, a child of that, and an allowed sibling chain[1]
    tokens, parents = [chain[0], forbidden, chain[1], chain[1]], [0, 1, 2, 1]
    masks = state.tree_masks(tokens, parents)
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    good = [0, 1, 4]
    want = sequential_masks(grammar, prefix, [chain[0], chain[1], chain[1], chain[1]], [0, 1, 2, 1])
    assert torch.equal(masks[good], want[good])
    assert state.n_tokens == len(prefix)


@pytest.mark.parametrize("extra,others_allowed", [({}, False), ({"additionalProperties": True}, True),
                                                  ({"additionalProperties": {"type": "integer"}}, True)])
def test_objects_take_other_keys_only_where_the_schema_says_so(compiler, model_info, extra, others_allowed):
    """An object schema that lists properties and says nothing of other names takes no other key (xgrammar's strict
    mode, vLLM's and SGLang's default: a small model would invent keys until max_tokens); one that says so does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]} | extra
    state = compiler.json_schema(schema).start()
    state.advance_many(encode(compiler, model_info, '{"a": 1'))
    assert state.accepts(encode(compiler, model_info, ",")[0]) == others_allowed
    assert state.accepts(encode(compiler, model_info, "}")[0])


def test_closed_objects_leave_open_what_another_schema_may_extend():
    from services.grammar import closed_objects

    nested = {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {}}}}}
    assert closed_objects(nested) == {"type": "object", "additionalProperties": False, "properties": {
        "p": {"type": "object", "properties": {"q": {}}, "additionalProperties": False}}}
    named = {"properties": {"properties": {"type": "string"}}}  # a property named "properties" is no keyword
    assert closed_objects(named) == named | {"additionalProperties": False}
    model = {"$defs": {"A": {"properties": {"a": {}}}}, "properties": {"x": {"$ref": "#/$defs/A"}}}  # pydantic's
    assert closed_objects(model)["$defs"]["A"]["additionalProperties"] is False
    union = {"$defs": {"A": {"properties": {"a": {}}}}, "anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}
    assert closed_objects(union)["$defs"]["A"]["additionalProperties"] is False
    unchanged = [
        {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},  # {"a", "b"} is valid
        {"$defs": {"A": {"properties": {"a": {}}}}, "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {}}}]},
        {"$defs": {"A": {"properties": {"a": {}}}}, "$ref": "#/$defs/A", "properties": {"b": {}}},
        {"properties": {"p": {"properties": {"q": {}}}}, "allOf": [{"$ref": "#/properties/p"}]},
        {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]},
        {"patternProperties": {"^x-": {}}, "anyOf": [{"properties": {"a": {}}, "required": ["a"]}]},
        {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # asks for a name it does not list
        {"type": "object", "properties": {"a": {}}, "minProperties": 2},
        {"type": "object"}, True,
    ]
    for schema in unchanged:
        assert closed_objects(schema) == schema, schema


def test_a_schema_nested_too_deeply_is_refused(compiler):
    with pytest.raises(InvalidGrammarError, match="nests too deeply"):
        compiler.json_schema('{"items": ' * 5000 + "{}" + "}" * 5000)
