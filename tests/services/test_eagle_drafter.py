"""The EAGLE drafter in the engine (tiny pair, random head): greedy identical to the target alone, sampled
output follows the target exactly, q lives on the kept ids, and misuse gets clear errors."""

import pytest
import torch

from services import eagle_draft
from services.draft import DraftEngine
from services.draft_vocab import DraftVocab
from services.errors import InvalidRequestError
from services.loop import generate
from services.models import eagle
from services.models.tiny import TINY_VOCAB_SIZE
from services.prefill import PrefillEngine
from services.sampling import SamplingParams, logits_to_probs
from services.verify import VerifyEngine
from tests.conftest import greedy_reference
from tests.services.test_engine import NEW_TOKENS, PROMPTS
from tests.services.test_sampling import assert_follows

KEPT = 64  # ids the head keeps, of the tiny vocabulary's 96
DRAWS = 3000


def random_head(target) -> eagle.EagleHead:
    """A random (untrained) EAGLE head over a pruned vocabulary of the tiny target."""
    torch.manual_seed(3)
    kept = torch.sort(torch.randperm(TINY_VOCAB_SIZE)[:KEPT]).values
    head = eagle.EagleHead(target.model, eagle.EagleConfig(draft_vocab=KEPT), kept, target.config.hidden_size)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


@pytest.fixture(scope="module")
def engines(tiny):
    """Prefill, a draft engine offering a random (untrained) EAGLE head over a pruned vocabulary, and verify."""
    target, draft = tiny
    return PrefillEngine(target), DraftEngine(draft, eagle_head=random_head(target)), VerifyEngine(target)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target_alone(tiny, engines, k):
    target, _ = tiny
    prefill, draft, verify = engines
    accepted = 0
    for prompt in PROMPTS:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter="eagle")
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
        accepted += result.stats.accepted
    assert accepted > 0, "no draft was accepted: the multi-row feature path was not exercised"


@pytest.mark.parametrize("k,guesses", [(1, 1), (1, 3), (3, 3)])
def test_greedy_with_pre_drafting_equals_target_alone(tiny, engines, k, guesses):
    """Pre-drafting: the head chains through the block under verification on its own features, then drafts on."""
    target, _ = tiny
    prefill, draft, verify = engines
    hits = 0
    for prompt in PROMPTS:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                          params=SamplingParams(), drafter="eagle", overlap=True, guesses=guesses)
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
        hits += result.stats.pre_draft_hits
    assert hits > 0, "no pre-drafted block was used"


def test_forced_tokens_continue_the_chain(engines):
    prefill, draft, _ = engines
    prompt, params = [1, 5, 7, 9], SamplingParams()
    result = prefill.prefill(prompt, params, features=True)
    for sid in ("whole", "forced"):
        draft.start(sid, prompt, params, "eagle", result.features)
        draft.accept(sid, 0, result.first_token)
    whole = draft.propose("whole", 5).token_ids
    assert draft.propose("forced", 3, forced=whole[:2]).token_ids == whole[2:]
    branches = draft.propose("forced", 2, forced=whole[:2], guesses=3).branches
    assert (branches[0].n_matches, branches[0].next_token, branches[0].token_ids) == (2, whole[2], whole[3:5])
    assert [b.n_matches for b in branches] == [2, 2, 2, 0, 0]
    for sid in ("whole", "forced"):
        draft.close(sid)


def test_the_head_reads_the_last_window_of_a_long_prompt(tiny, engines, monkeypatch):
    """A prompt longer than the head's window: the head reads its last PROMPT_WINDOW positions only (it drafts what a
    session over that tail drafts), and greedy output is still the target alone's."""
    target, _ = tiny
    prefill, draft, verify = engines
    monkeypatch.setattr(eagle_draft, "PROMPT_WINDOW", 3)
    prompt, params = [1, 40, 41, 42, 43, 44, 45, 46], SamplingParams()
    result = prefill.prefill(prompt, params, features=True)
    draft.start("long", prompt, params, "eagle", result.features)
    draft.start("tail", prompt[-3:], params, "eagle", result.features[-3:])
    for sid in ("long", "tail"):
        draft.accept(sid, 0, result.first_token)
    long = draft.propose("long", 3)
    assert long.token_ids == draft.propose("tail", 3).token_ids
    draft.accept("long", 1, 7, features=torch.zeros(2, target.config.hidden_size))  # positions after the window read on
    assert len(draft.propose("long", 2).token_ids) == 2
    for sid in ("long", "tail"):
        draft.close(sid)
    accepted = 0
    for prompt in PROMPTS:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=3,
                          params=params, drafter="eagle")
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
        accepted += result.stats.accepted
    assert accepted > 0


def test_sampled_tokens_follow_the_target(tiny, engines):
    """With the first token fixed, the first verified token is distributed as the target's p (chi-square)."""
    target, _ = tiny
    prefill, draft, verify = engines
    prompt, first = [1, 40, 41, 42, 43], 44
    params = SamplingParams(temperature=1.0)
    result = prefill.prefill(prompt, params, features=True)
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + [first]])).logits[0, -1:]
    p = logits_to_probs(logits.float(), params)[0]  # [vocab_size]
    counts = first_verified(draft, verify, result, prompt, first, "eagle",
                            lambda seed: SamplingParams(temperature=1.0, seed=seed), TINY_VOCAB_SIZE)
    assert_follows(counts, p)


def first_verified(draft, verify, prefilled, prompt: list[int], first: int, drafter: str, params_of,
                   vocab_size: int, draws: int = DRAWS) -> torch.Tensor:  # -> [vocab_size] counts
    """How often each token is the first a verify pass emits after ``first`` (a k = 2 proposal of ``drafter``),
    over ``draws`` requests seeded 0 .. draws - 1 (``params_of(seed)``), from one prefill's KV and features."""
    counts = torch.zeros(vocab_size)
    for seed in range(draws):
        seeded = params_of(seed)
        verify.open("r", prefilled.payload, first, seeded, features=True)
        draft.start("r", prompt, seeded, drafter, prefilled.features)
        draft.accept("r", 0, first)
        proposal = draft.propose("r", 2)
        counts[verify.verify("r", proposal.token_ids, proposal.probs).token_ids[0]] += 1
        verify.close("r")
        draft.close("r")
    return counts


def assert_q_lives_on(kept: torch.Tensor, prefill: PrefillEngine, draft: DraftEngine) -> None:
    """A sampled EAGLE proposal's q: a distribution over the whole vocabulary, zero outside ``kept``."""
    prompt, params = [1, 5, 7, 9], SamplingParams(temperature=0.8, seed=1)
    result = prefill.prefill(prompt, params, features=True)
    draft.start("q", prompt, params, "eagle", result.features)
    draft.accept("q", 0, result.first_token)
    proposal = draft.propose("q", 4)
    draft.close("q")
    outside = torch.ones(TINY_VOCAB_SIZE, dtype=torch.bool)
    outside[kept] = False
    assert proposal.probs.shape == (4, TINY_VOCAB_SIZE)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(4))
    assert proposal.probs[:, outside].sum() == 0
    assert all(proposal.probs[j, x] > 0 for j, x in enumerate(proposal.token_ids))


def test_q_lives_on_the_kept_ids(engines):
    prefill, draft, _ = engines
    assert_q_lives_on(draft.eagle_head.kept_ids, prefill, draft)


def test_a_draft_vocabulary_prunes_the_heads_lm_head_too(tiny):
    """A draft vocabulary (services.draft_vocab) prunes an EAGLE head as well: it keeps as many of its own ids, those
    the vocabulary ranks highest; its LM head shrinks to them, q lives on them, and greedy output is still the
    target's. The head the engine was given is unchanged (another engine may share it), and a full vocabulary keeps
    it whole."""
    target, draft_model = tiny
    head = random_head(target)
    ranked = tuple(torch.randperm(TINY_VOCAB_SIZE, generator=torch.Generator().manual_seed(5)).tolist())
    draft = DraftEngine(draft_model, eagle_head=head, vocab=DraftVocab(ranked, 48))
    own = set(head.kept_ids.tolist())
    kept = torch.tensor(sorted([i for i in ranked if i in own][:48]))
    pruned = draft.eagle_head
    assert torch.equal(pruned.kept_ids, kept)
    assert [int(pruned.remap[i]) for i in kept] == list(range(len(kept)))
    assert eagle.HeadLinears.of(pruned).lm_head.out_features == len(kept)
    assert len(head.kept_ids) == KEPT and pruned.fc is head.fc  # the given head as it was; the weights shared
    assert DraftEngine(draft_model, eagle_head=head, vocab=DraftVocab(ranked, 48), draft_vocab_size=0).eagle_head is head
    prefill, verify = PrefillEngine(target), VerifyEngine(target)
    for prompt in PROMPTS:
        result = generate(prefill, draft, verify, prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=3,
                          params=SamplingParams(), drafter="eagle")
        assert result.token_ids == greedy_reference(target.model, prompt, NEW_TOKENS), f"prompt {prompt}"
    assert_q_lives_on(kept, prefill, draft)


def test_misuse_gets_clear_errors(tiny, engines):
    target, draft_model = tiny
    prefill, draft, _ = engines
    prompt, params = [1, 5, 7], SamplingParams()
    with pytest.raises(InvalidRequestError, match="prompt's target features"):
        draft.start("e", prompt, params, "eagle")
    with pytest.raises(InvalidRequestError, match="unknown drafter 'eagle'"):
        DraftEngine(draft_model).start("e", prompt, params, "eagle")
    wrong = torch.zeros(len(prompt) + 1, target.config.hidden_size)
    with pytest.raises(InvalidRequestError, match="prompt features have shape"):
        draft.start("e", prompt, params, "eagle", wrong)
    draft.start("e", prompt, params, "eagle", prefill.prefill(prompt, params, features=True).features)
    with pytest.raises(InvalidRequestError, match="accept a verdict"):
        draft.propose("e", 2)
    draft.close("e")


def test_a_head_for_another_target_is_refused(tiny, tmp_path):
    """The installed report names the target; loading the head for another target fails with that reason."""
    import json

    from services.training.eagle_recipe import save_head

    target, _ = tiny
    head = eagle.EagleHead(target.model, eagle.EagleConfig(draft_vocab=KEPT), torch.arange(KEPT), target.config.hidden_size)
    path = save_head(head, {}, "tiny-head", folder=tmp_path)
    (tmp_path / eagle_draft.HEAD_REPORT).write_text(json.dumps({"target": "0123456789abcdef"}))
    path.rename(tmp_path / eagle_draft.HEAD_FILE)
    assert eagle_draft.find(tmp_path) == tmp_path / eagle_draft.HEAD_FILE
    with pytest.raises(ValueError, match="was trained for target"):
        eagle_draft.load(tmp_path / eagle_draft.HEAD_FILE, target)
    (tmp_path / eagle_draft.HEAD_REPORT).write_text(json.dumps({"target": eagle_draft.target_identity(target.config)}))
    assert eagle_draft.load(tmp_path / eagle_draft.HEAD_FILE, target).kept_ids.tolist() == list(range(KEPT))
