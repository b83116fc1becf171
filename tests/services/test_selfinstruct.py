"""Self-instruct data: recorded features equal a teacher-forced pass; distill format; instruction parsing."""

import pytest
import torch
from transformers import LlamaForCausalLM

from services.models.tiny import TINY_EOS, tiny_config
from services.training import selfinstruct as si


class _Tok:
    pad_token_id = 0


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(4)).eval()


def test_recorded_features_match_teacher_forced_pass(tiny_target):
    """Hooks during batched, left-padded generate record what one teacher-forced pass computes."""
    cfg = si.DataConfig(feature_layers=(0, 1, 2), teacher_top_k=4, max_new_tokens=12)
    prompts = [[1, 5, 9, 17, 4], [1, 44, 8]]
    rows = si.answer_batch(tiny_target, _Tok(), prompts, cfg)
    for prompt, row in zip(prompts, rows):
        assert row["ids"][: len(prompt)].tolist() == prompt
        n = len(row["ids"])
        with torch.no_grad():
            out = tiny_target(input_ids=row["ids"][None].long(), output_hidden_states=True)
        hs = out.hidden_states
        assert row["final"].shape == (n - 1, 64)
        torch.testing.assert_close(row["final"].float(), hs[-1][0, :-1], atol=0.05, rtol=0.02)
        fused = torch.cat([hs[i + 1] for i in cfg.feature_layers], dim=-1)[0, :-1]
        torch.testing.assert_close(row["fused"].float(), fused, atol=0.05, rtol=0.02)
        # greedy: the teacher's top-1 at each answer position is the answer token
        assert row["top_idx"][:, 0].tolist() == row["ids"][len(prompt):].tolist()
        answer = row["ids"][len(prompt):].tolist()
        assert TINY_EOS not in answer[:-1]


def test_distill_format_masks_answer_positions(tiny_target):
    """to_distill_data marks exactly the positions that predict an answer token."""
    cfg = si.DataConfig(feature_layers=(0, 1, 2), teacher_top_k=4, max_new_tokens=6)
    rows = si.answer_batch(tiny_target, _Tok(), [[1, 5, 9]], cfg)
    data = si.to_distill_data(rows)
    n, p = len(rows[0]["ids"]), rows[0]["prompt_len"]
    assert data["masks"][0].nonzero().squeeze(-1).tolist() == list(range(p - 1, n - 1))
    assert data["top_idx"][0].shape == (n - p, 4)


@pytest.mark.parametrize("text,expected", [
    ('A person might ask: "Can you help me write a function that reverses a list?', "Can you help me write a function that reverses a list?"),
    ("What are good exercises for lower back pain?\nMore text", "What are good exercises for lower back pain?"),
    ("Here's an example question to help you get started:", None),
    ("Short?", None),
])
def test_clean_instruction(text, expected):
    """Self-instructed requests: a quoted request wins, else the first line; chatter is dropped."""
    assert si._clean_instruction(text) == expected
