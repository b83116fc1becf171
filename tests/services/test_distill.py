"""distill.py: the template recipe keeps its cache key; the self-instruct data changes it."""

import hashlib
import json

from services.training import distill


def test_template_recipe_keeps_its_data_key():
    """Adding the data source did not invalidate caches of the shipped recipe."""
    cfg = distill.DistillConfig()
    old = hashlib.sha256(json.dumps((cfg.seed, cfg.num_prompts, cfg.max_new_tokens, cfg.teacher_top_k)).encode()).hexdigest()[:12]
    assert cfg.data_key() == old


def test_selfinstruct_data_has_its_own_key():
    """Self-instruct data (and each shard prefix of it) is keyed apart from the templates."""
    keys = {distill.DistillConfig(data=distill.SELFINSTRUCT_DATA, max_shards=n).data_key() for n in (None, 4, 8)}
    assert len(keys) == 3 and distill.DistillConfig().data_key() not in keys
