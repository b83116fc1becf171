"""Structured outputs under speculation (services.constraint): greedy answers equal constrained decoding without
speculation, token for token, for every drafter kind (chains, trees, pre-drafts); no drafter proposes a token the
grammar forbids; sampled tokens follow the masked target distribution (chi-square); answers are schema-valid JSON."""

import json

import jsonschema
import pytest
import torch

from services.constraint import FEW_ALLOWED, Constraint, Grammars, masked_argmax
from services.draft import DraftEngine
from services.eagle_draft import installed_head
from services.errors import InvalidGrammarError
from services.grammar import JSON_OBJECT_SCHEMA, unpack_bitmask
from services.loading import load_causal_lm
from services.loop import generate
from services.models import eagle
from services.models.tiny import random_pair
from services.prefill import PrefillEngine
from services.sampling import SamplingParams, logits_to_probs
from services.tree import chain_parents
from services.verify import VerifyEngine
from tests.services.test_eagle_drafter import first_verified
from tests.services.test_sampling import assert_follows

NEW_TOKENS = 48
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    json.loads(JSON_OBJECT_SCHEMA),
]
QUESTIONS = ["Give a person's name and age as JSON.", "Pick a color and say if it is ok, as JSON.",
             "List three small numbers as a JSON array.", "Reply with the JSON object {\"ok\": true}."]
# (drafter, k, tree width, pre-drafting)
DRAFTS = [("model", 3, 1, False), ("model", 3, 3, False), ("eagle", 3, 1, False), ("eagle", 3, 3, False),
          ("hybrid", 3, 3, False), ("prompt_lookup", 3, 1, False), ("eagle", 2, 1, True), ("model", 2, 1, True)]
DRAWS = 800


class CheckingVerify(VerifyEngine):
    """The real verifier, asserting first that every draft token it gets is one its row's grammar mask allows."""

    checked = 0

    def verify_batch(self, calls):
        for call in calls:
            grammar = self.sessions.get(call.request_id).grammar
            if grammar is None or not call.draft_token_ids:
                continue
            parents = list(call.tree_parents or chain_parents(len(call.draft_token_ids)))
            allowed = unpack_bitmask(grammar.tree_masks(call.draft_token_ids, parents), grammar.compiler.vocab_size)
            for token, parent in zip(call.draft_token_ids, parents):
                assert allowed[parent, token], f"draft token {token} is forbidden after row {parent}"
            self.checked += len(call.draft_token_ids)
        return super().verify_batch(calls)


def chat(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def constrained(schema, **kwargs) -> SamplingParams:
    return SamplingParams(constraint=Constraint(json.dumps(schema)), **kwargs)


@pytest.fixture(scope="module")
def engines(default_pair):
    target, draft = default_pair
    return (PrefillEngine(target), DraftEngine(draft, eagle_head=installed_head(draft, target)), CheckingVerify(target))


@pytest.fixture(scope="module")
def references(default_pair, engines):
    """Per schema: the constrained answer without speculation (the same loop, no drafts)."""
    target, _ = default_pair
    prefill, _, verify = engines
    return [generate(prefill, None, verify, chat(target.tokenizer, q), max_new_tokens=NEW_TOKENS, num_draft_tokens=1,
                     params=constrained(s)) for s, q in zip(SCHEMAS, QUESTIONS)]


@pytest.mark.slow
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_answers_are_schema_valid_json(default_pair, references, schema):
    """Constrained greedy answers of the default target end (EOS) and parse as JSON valid under the schema."""
    tokenizer = default_pair[0].tokenizer
    result = references[schema]
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(result.token_ids, skip_special_tokens=True)), SCHEMAS[schema])


@pytest.mark.slow
@pytest.mark.parametrize("drafter,k,width,overlap", DRAFTS)
def test_greedy_with_speculation_equals_speculation_off(default_pair, engines, references, drafter, k, width, overlap):
    """Every drafter kind, chains, trees and pre-drafts: the constrained answers are the same, token for token, and
    every draft token the verifier got was allowed by its row's grammar."""
    target, _ = default_pair
    prefill, draft, verify = engines
    before, accepted = verify.checked, 0
    for schema, question, reference in zip(SCHEMAS, QUESTIONS, references):
        result = generate(prefill, draft, verify, chat(target.tokenizer, question), max_new_tokens=NEW_TOKENS,
                          num_draft_tokens=k, params=constrained(schema), drafter=drafter, tree_width=width,
                          overlap=overlap)
        assert result.token_ids == reference.token_ids, json.dumps(schema)
        accepted += result.stats.accepted
    assert verify.checked > before and (accepted > 0 or drafter == "prompt_lookup")


@pytest.mark.slow
def test_steps_that_draft_nothing_verify_the_tokens_the_grammar_forces(default_pair, engines, references):
    """Every step at k = 0 (the policy overloaded): each verifies the tokens the grammar forces after the answer so
    far (the keys, quotes and separators of a JSON object), with no drafter call, and the answers are the same."""
    from services.policy import AdaptiveK, CostModel

    target, _ = default_pair
    prefill, draft, verify = engines
    jumped = 0
    for schema, question, reference in zip(SCHEMAS, QUESTIONS, references):
        policy = AdaptiveK(CostModel(), load=lambda: 2, max_load=1)  # overloaded: k = 0 at every step
        result = generate(prefill, draft, verify, chat(target.tokenizer, question), max_new_tokens=NEW_TOKENS,
                          num_draft_tokens=3, params=constrained(schema), drafter="eagle", policy=policy)
        assert result.token_ids == reference.token_ids, json.dumps(schema)
        assert policy.counts.reached == []  # the drafter drafted nothing
        jumped += result.stats.accepted
    assert jumped >= 10  # (schema 0 alone forces `{"name": "`, `", "age": `)


def test_a_step_that_drafts_nothing_verifies_the_forced_tokens():
    """With no drafter (drafting off) the loop follows the grammar along the emitted tokens and puts the tokens it
    forces in the step's verify block, one-hot: after `{"` under a schema of one required key, the key, `":` and the
    usual token of the forced ` "` (` "book` would be allowed too)."""
    from transformers import AutoTokenizer

    from services.grammar import GrammarCompiler
    from services.loop import Results, SpeculativeLoop
    from services.models import default_pair as dp
    from services.verify import VerifyResult

    tokenizer = AutoTokenizer.from_pretrained(dp.target_dir())
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"category": {"type": "string"}}, "required": ["category"],
              "additionalProperties": False}
    state = compiler.json_schema(schema).start()
    first = state.forced()  # `{"`
    loop = SpeculativeLoop(first, max_new_tokens=32, eos={tokenizer.eos_token_id}, num_draft_tokens=3, drafting=False,
                           grammar=compiler.json_schema(schema).start())
    assert loop.advance().token_ids == [first]
    calls = loop.advance()
    assert calls.propose is None and calls.verify.probs is None and calls.verify.parents is None
    assert tokenizer.decode([first, *calls.verify.draft_ids]) == '{"category": "'
    run, bonus = calls.verify.draft_ids, tokenizer.encode("Books", add_special_tokens=False)[0]
    step = loop.advance(Results(verdict=VerifyResult([*run, bonus], len(run), [True] * len(run))))
    assert step.token_ids == [*run, bonus] and step.n_drafted == step.n_matches == len(run)
    assert loop.advance().verify.draft_ids == []  # inside the string value the grammar forces nothing


@pytest.fixture(scope="module")
def random_engines(tmp_path_factory, default_pair):
    """A small random pair with the default target's tokenizer, and a random EAGLE head over the whole vocabulary:
    their distributions spread over all of it, so unmasked drafts would be forbidden almost always."""
    from services.models import default_pair as dp

    target_dir, draft_dir = random_pair(tmp_path_factory.mktemp("pair"), dp.target_dir(), "small")
    target, draft = load_causal_lm(target_dir), load_causal_lm(draft_dir)
    torch.manual_seed(3)
    kept = torch.arange(target.vocab_size)
    head = eagle.EagleHead(target.model, eagle.EagleConfig(draft_vocab=len(kept)), kept, target.config.hidden_size).eval()
    return target, PrefillEngine(target), DraftEngine(draft, eagle_head=head), CheckingVerify(target)


@pytest.mark.parametrize("drafter", ["model", "eagle", "hybrid"])
def test_sampled_drafts_are_always_allowed(random_engines, drafter):
    """Sampled at temperature 1 from random models, every draft token (q masked along its path) is allowed."""
    _, prefill, draft, verify = random_engines
    before = verify.checked
    for seed in range(3):
        generate(prefill, draft, verify, [1, 2, 3, 4], max_new_tokens=24, num_draft_tokens=3, drafter=drafter,
                 params=constrained(SCHEMAS[0], temperature=1.0, seed=seed))
    assert verify.checked > before


def assert_allowed_path(state, tokens: list[int]) -> None:
    """Each of ``tokens`` is in the grammar's mask after the ones before it (the state is the same afterwards)."""
    state = state.fork()
    for token in tokens:
        assert state.allowed()[token], f"token {token} of {tokens} is forbidden"
        state.advance(token)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_pre_drafted_blocks_are_allowed(random_engines, drafter):
    """Pre-drafting after a block: each branch's guess and block are allowed after the block's accepted prefix."""
    _, prefill, draft, _ = random_engines
    params = constrained(SCHEMAS[0], temperature=1.0, seed=5)
    prompt = [1, 2, 3, 4]
    result = prefill.prefill(prompt, params, features=True)
    state = Grammars.of(prefill.target).start(params.constraint)
    state.advance(result.first_token)
    for session in ("block", "pre"):  # (a block to pre-draft after, from a session of its own)
        draft.start(session, prompt, params, drafter, result.features)
        draft.accept(session, 0, result.first_token)
    block = draft.propose("block", 3).token_ids
    assert_allowed_path(state, block)
    branches = draft.propose("pre", 3, forced=block, guesses=3).branches
    draft.close("block")
    draft.close("pre")
    assert branches
    for branch in branches:
        assert_allowed_path(state, block[: branch.n_matches] + [branch.next_token] + branch.token_ids)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_sampled_tokens_follow_the_masked_target(random_engines, drafter):
    """With the first token fixed, the first verified token follows the target's p masked by the grammar
    (chi-square), drafts from the drafter's masked q."""
    target, prefill, draft, verify = random_engines
    schema = {"type": "integer"}
    prompt, first = [1, 2, 3, 4], target.tokenizer.encode("4", add_special_tokens=False)[0]
    params = constrained(schema, temperature=1.0)
    result = prefill.prefill(prompt, params, features=True)
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + [first]])).logits[0, -1:].float()  # [1, V]
    state = Grammars.of(target).start(params.constraint)
    state.advance(first)
    p = logits_to_probs(logits.masked_fill(~state.allowed(), float("-inf")), params)[0]  # [V]
    counts = first_verified(draft, verify, result, prompt, first, drafter,
                            lambda seed: constrained(schema, temperature=1.0, seed=seed), target.vocab_size, DRAWS)
    assert_follows(counts, p)


@pytest.mark.parametrize("schema,reason", [("nope", "not JSON"), ('{"not": {"type": "string"}}', "not"),
                                           ('{"type": "string", "format": "weird"}', "Unknown format: weird")])
def test_a_bad_schema_is_refused_with_the_reason(random_engines, schema, reason):
    _, prefill, _, _ = random_engines
    with pytest.raises(InvalidGrammarError, match=reason):
        prefill.prefill([1, 2, 3], SamplingParams(constraint=Constraint(schema)))


@pytest.mark.parametrize("params", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_a_forbidden_draft_is_rejected_not_an_error(default_pair, params):
    """A drafter kind that does not mask (a custom one) may propose what the grammar forbids: the verifier rejects
    it (its masked p is 0) and emits what the grammar allows, as with no draft at all."""
    target, _ = default_pair
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    request = constrained(SCHEMAS[0], **params)
    prompt = chat(target.tokenizer, QUESTIONS[0])
    handoff = prefill.prefill(prompt, request)
    forbidden = min(target.eos_token_ids)  # (the document has not begun: EOS is not allowed)
    verdicts = []
    for name, draft in (("forbidden", [forbidden, forbidden]), ("none", [])):
        verify.open(name, handoff.payload, handoff.first_token, request)
        try:
            verdicts.append(verify.verify(name, draft))
        finally:
            verify.close(name)
    assert verdicts[0].n_matches == 0 and verdicts[0].token_ids == verdicts[1].token_ids


def test_masked_argmax_is_the_argmax_of_the_masked_logits(default_pair):
    """A constrained greedy row takes the argmax screen (services.constraint.masked_argmax): where the grammar allows
    the row's argmax it is kept, elsewhere the row's own logits are masked (a few allowed ids: theirs alone, the same
    bits); either way the id is the argmax of the masked logits, as from the full logits (rows whose argmax is
    forbidden included)."""
    target, _ = default_pair
    runner = VerifyEngine(target).runner
    assert runner.screens_masked_rows  # (the compact forward: the default pair's)
    prompt = torch.tensor(chat(target.tokenizer, QUESTIONS[0]))
    features = runner.forward(prompt, runner.new_cache(), return_features=True)[1][-8:]  # [8, hidden]
    logits = runner.head_logits(features)  # [8, V]
    ids = runner.argmax(features)
    assert torch.equal(ids, logits.argmax(-1))
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(logits.shape, generator=generator) < 0.5  # [8, V]
    # rows 5 and 7: a few ids (at a JSON object's punctuation: their logits alone); row 3: one id
    for row, few in ((3, 1), (5, 3), (7, FEW_ALLOWED)):
        allowed[row] = False
        allowed[row, torch.randperm(logits.shape[1], generator=generator)[:few]] = True
    allowed[torch.arange(8), ids] = torch.arange(8) % 2 == 0  # odd rows: the argmax is forbidden
    got = masked_argmax(ids, allowed, features, runner)
    assert torch.equal(got, logits.masked_fill(~allowed, float("-inf")).argmax(-1))
    assert not torch.equal(got, ids)  # (the forbidden rows took another id)
    some = torch.randperm(logits.shape[1], generator=generator)[:100].sort().values
    assert torch.equal(runner.head_logits_at(features, some), logits[:, some])  # (the same bits)


@pytest.mark.parametrize("drafter", ["model", "eagle", "hybrid", "prompt_lookup"])
@pytest.mark.parametrize("params", [{}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "sampled"])
def test_the_tokens_the_grammar_forces_follow_the_chain_and_are_accepted(default_pair, engines, drafter, params):
    """After ``{"`` the schema forces ``name": "``: a proposal of one token (the drafter's own) goes on with the tokens
    the grammar forces after it, free (jump_forward): each the only one its mask allows, which the verifier accepts,
    greedy and sampled (the masked target is certain of each; their q is one-hot), then ` "`, the usual token of the
    forced bytes that ` "Jo` could cover too (a one-hot draft like the others, not certain)."""
    target, _ = default_pair
    prefill, draft, verify = engines
    prompt, params = chat(target.tokenizer, QUESTIONS[0]), constrained(SCHEMAS[0], **params)
    prefilled = prefill.prefill(prompt, params, features=True)
    first = prefilled.first_token
    verify.open("j", prefilled.payload, first, params, features=True)
    draft.start("j", prompt, params, drafter, prefilled.features)
    draft.accept("j", 0, first)
    proposal = draft.propose("j", 1, jump=8)
    state = Grammars.of(target).start(params.constraint)
    state.advance(first)
    chain = len(proposal.token_ids) - proposal.jumped  # the drafter's own: at most 1 (prompt lookup: none)
    state.advance_many(proposal.token_ids[:chain])
    for token in proposal.token_ids[chain:-1]:  # each the one token the grammar allows after the ones before
        assert state.forced() == token
        state.advance(token)
    assert state.forced() is None and state.forced_bytes_tokens() == proposal.token_ids[-1:]
    assert proposal.jumped >= 2 and chain <= 1
    assert target.tokenizer.decode([first, *proposal.token_ids]) == '{"name": "'
    if proposal.probs is not None:  # a sampled chain's q: one-hot rows for the forced tokens
        assert proposal.probs.shape[0] == len(proposal.token_ids)
        assert torch.equal(proposal.probs[chain:].argmax(-1), torch.tensor(proposal.token_ids[chain:]))
        assert torch.equal(proposal.probs[chain:].sum(-1), torch.ones(proposal.jumped))
    verdict = verify.verify("j", proposal.token_ids, proposal.probs)
    assert verdict.n_matches >= len(proposal.token_ids) - 1  # every position but the last is forced: accepted
    draft.accept("j", verdict.n_matches, verdict.token_ids[-1], verdict.features)
    verify.close("j")
    draft.close("j")


class FreeGrammar:
    """A grammar state that allows every token and forces none (the loop's view of one)."""

    ended = False

    def advance(self, token: int) -> None:
        pass

    def rollback(self, n: int) -> None:
        pass

    def forced(self) -> None:
        return None


@pytest.mark.parametrize("constrained", [False, True])
def test_only_a_constrained_request_asks_for_the_grammar_s_tokens(constrained):
    """The loop asks the drafter for jump-forward tokens (and books verify rows for them) only where a grammar can
    force any, never past max_new_tokens (side nodes counted); a tree that would not fit steps as a chain."""
    from services.loop import MAX_JUMP, SpeculativeLoop
    from services.tree import tree_rows

    for max_new_tokens, width in ((64, 1), (64, 3), (6, 1), (6, 3)):
        loop = SpeculativeLoop(5, max_new_tokens=max_new_tokens, eos={0}, num_draft_tokens=3, drafting=True,
                               tree_width=width, grammar=FreeGrammar() if constrained else None)
        assert loop.advance().token_ids == [5]  # the first token
        propose, remaining = loop.advance().propose, max_new_tokens - 1
        fits = width if tree_rows(3, width) <= remaining else 1
        assert propose.k == 3 and propose.width == fits
        assert propose.jump == (min(MAX_JUMP, remaining - tree_rows(3, fits)) if constrained else 0)
        assert tree_rows(3, fits) - 1 + propose.jump <= remaining - 1  # drafts and jump, then the step's own token
