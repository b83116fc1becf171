"""A drafter kind made for the tests, as a user would add one: this module and its one registry line.

It proposes the last token again, k times (one-hot q: exact for sampled requests too). Served by naming this
module in ``models.drafter_modules`` (tests/serving/test_colocated.py).
"""

from services.drafters import DraftProposal, DrafterKind, register

REPEAT_DRAFTER = "repeat"


class RepeatSession:
    def __init__(self, prompt_ids):
        self.tokens, self.proposal = list(prompt_ids), []

    @property
    def nbytes(self) -> int:
        return 8 * len(self.tokens)

    def propose_steps(self, k, forced=(), width=1):
        last = (list(forced) or self.tokens)[-1]
        self.proposal = list(forced) + [last] * k
        return DraftProposal([last] * k, None)
        yield  # (no model pass to batch: a generator that returns at once)

    def pre_draft_steps(self, k, forced, guesses):
        self.proposal = list(forced)
        return DraftProposal([], None)  # (no guesses: no pre-drafted block)
        yield

    def accept(self, n_matches, next_token, features=None):
        self.tokens += self.proposal[:n_matches] + [int(next_token)]
        self.proposal = []


register(DrafterKind(REPEAT_DRAFTER, lambda engine, ids, params, features: RepeatSession(ids)))
