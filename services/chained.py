"""A drafter next to its target: proposals and the verification of their drafts in one engine call.

Where the drafter runs on the verifier's own device and thread (a verify replica that
drafts locally, speculation.drafting; as vLLM runs an EAGLE head beside its target), a
speculative step need not be two engine calls — propose, hand the drafts back, verify.
``run_chained`` takes a pass's calls, plain verify calls and ``ChainedCall``s alike:
it drafts for every chained one in one batched draft pass, then verifies every call
in one batched target pass, each chained call against the drafts just proposed for it
(``SpeculativeLoop(chained=True)`` asks for such rounds). A proposal that fails fails
alone: its session's step verifies no drafts, and its result carries the error.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.draft import DraftEngine, DraftProposal, ProposeCall
from services.tree import tree_rows
from services.verify import VerifyCall, VerifyEngine, VerifyResult


@dataclass(frozen=True)
class ChainedCall:
    """One session's proposal and the verification of its drafts."""

    propose: ProposeCall
    verify_rows: int = 0  # the most rows its drafts take in the target pass (its kind's ``verify_rows``); 0: a tree's

    @property
    def request_id(self) -> str:
        return self.propose.request_id

    @property
    def rows(self) -> int:
        """Rows it adds to the target pass at most: its pending token and its drafts (a tree's included)."""
        return self.verify_rows or tree_rows(self.propose.k, self.propose.width) + self.propose.jump


@dataclass(frozen=True)
class ChainedResult:
    proposal: DraftProposal | Exception  # an exception: the draft failed, and no draft was verified
    verdict: VerifyResult | Exception
    propose_s: float  # seconds of the draft pass and of the target pass the call took part in
    verify_s: float


def run_chained(drafts: DraftEngine, verifier: VerifyEngine,
                calls: Sequence[VerifyCall | ChainedCall]) -> list[VerifyResult | ChainedResult | Exception]:
    """One draft pass over the chained calls' proposals, then one target pass over every call (see the module
    docstring); a result or an exception per call, in order."""
    chained = [i for i, call in enumerate(calls) if isinstance(call, ChainedCall)]
    start = time.perf_counter()
    proposals = drafts.propose_batch([calls[i].propose for i in chained]) if chained else []
    propose_s = time.perf_counter() - start
    verify_calls = list(calls)
    for i, proposal in zip(chained, proposals):
        drafted = not isinstance(proposal, Exception)
        verify_calls[i] = VerifyCall(calls[i].request_id, list(proposal.token_ids) if drafted else [],
                                     proposal.probs if drafted else None,
                                     tree_parents=tuple(proposal.parents) if drafted and proposal.parents else None)
    start = time.perf_counter()
    verdicts = verifier.verify_batch(verify_calls)
    verify_s = time.perf_counter() - start
    results: list = list(verdicts)
    for i, proposal in zip(chained, proposals):
        results[i] = ChainedResult(proposal, verdicts[i], propose_s, verify_s)
    return results
