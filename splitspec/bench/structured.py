"""`splitspec bench structured`: structured outputs through the real `openai` client, speculation off against the
server's default side by side (greedy), on held-out schemas made here (``schemas``: seeded, none from a training
set): how many answers are valid for their schema, whether speculation changed any, the speed ratio, and the
grammar's mask time per verify pass against the target's step. The same through gRPC (``run_grpc``). Then the
neighbours (``neighbours``): plain streams beside one constrained stream, against the same streams beside one plain
stream (and one plain stream with k = 3 drafts), through gRPC.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

SUBJECTS = ["book", "movie", "city", "recipe", "laptop", "employee", "planet", "song", "hotel", "car", "bird",
            "museum", "team", "course", "painting", "restaurant", "river", "app", "game", "flower", "train", "coffee",
            "bridge", "language", "festival"]
STRINGS = ["name", "title", "author", "country", "color", "owner", "category", "summary", "origin", "brand"]
INTEGERS = ["year", "pages", "rating", "count", "age", "length", "price", "rank", "floors", "seats"]
ENUMS = {"status": ["active", "retired", "planned"], "size": ["small", "medium", "large"],
         "level": ["low", "mid", "high"], "kind": ["classic", "modern", "other"]}


def schemas(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """``n`` (prompt, schema) pairs: an object about a subject with 2-5 typed fields (strings, bounded integers,
    booleans, enums, arrays of strings, a nested object), some required, some without additional properties."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        props, fields = {}, []
        for name in rng.sample(STRINGS, rng.randint(1, 2)):
            props[name] = {"type": "string", "maxLength": rng.choice([20, 40, 60])}
        for name in rng.sample(INTEGERS, rng.randint(0, 2)):
            props[name] = {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 5000])}
        if rng.random() < 0.4:
            name = rng.choice(list(ENUMS))
            props[name] = {"enum": ENUMS[name]}
        if rng.random() < 0.3:
            props["available"] = {"type": "boolean"}
        if rng.random() < 0.3:
            props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1,
                             "maxItems": 3}
        if rng.random() < 0.2:
            props["place"] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                              "required": ["city"], "additionalProperties": False}
        fields = list(props)
        schema = {"type": "object", "properties": props, "required": rng.sample(fields, max(1, len(fields) - 1))}
        if rng.random() < 0.7:
            schema["additionalProperties"] = False
        out.append((f"Describe a {subject} as JSON with the fields {', '.join(fields)}.", schema))
    return out


def schema_valid(text: str, schema: dict) -> bool:
    """``text`` is JSON that ``schema`` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(base_url: str, model: str, *, n: int, max_tokens: int, tokenizer_dir: str) -> dict:
    import openai

    policies = {"off": {"mode": "off"}, "server default": {"mode": "default"}}
    pairs = schemas(n)
    rows = []
    seconds = {p: 0.0 for p in policies}
    tokens = {p: 0 for p in policies}
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        for i, (prompt, schema) in enumerate(pairs):
            row = {"schema": i, "answers": {}}
            for name in (list(policies) if i % 2 == 0 else list(policies)[::-1]):  # alternate who goes first
                start = time.perf_counter()
                answer = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
                    response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
                    extra_body={"speculation": policies[name]})
                seconds[name] += time.perf_counter() - start
                tokens[name] += answer.usage.completion_tokens
                text = answer.choices[0].message.content
                row["answers"][name] = {"text": text, "finish_reason": answer.choices[0].finish_reason,
                                        "valid": schema_valid(text, schema), "tokens": answer.usage.completion_tokens,
                                        "speculation_stats": answer.model_extra.get("speculation_stats")}
            row["identical"] = len({a["text"] for a in row["answers"].values()}) == 1
            rows.append(row)
            print(f"schema {i}: " + ", ".join(f"{p} {'valid' if a['valid'] else 'INVALID'} ({a['finish_reason']}, "
                                             f"{a['tokens']} tokens)" for p, a in row["answers"].items())
                  + ("" if row["identical"] else "  ANSWERS DIFFER"), flush=True)
    tok_s = {p: tokens[p] / seconds[p] for p in policies}
    masks = mask_cost([schema for _, schema in pairs], [r["answers"]["off"]["text"] for r in rows], tokenizer_dir)
    return {
        "schemas": n, "max_tokens": max_tokens,
        "valid": {p: sum(r["answers"][p]["valid"] for r in rows) for p in policies},
        "cut_by_max_tokens": {p: sum(r["answers"][p]["finish_reason"] == "length" for r in rows) for p in policies},
        "identical": sum(r["identical"] for r in rows),
        "tok_s": {p: round(v, 2) for p, v in tok_s.items()},
        "speedup_server_default": round(tok_s["server default"] / tok_s["off"], 3),
        "mask_ms_per_pass_k3": masks,
        "step_ms_off": round(1000 / tok_s["off"], 2),  # (an upper bound on a target step: off's time per token)
        "rows": rows,
    }


def run_grpc(client, *, n: int, max_tokens: int) -> dict:
    """The same schemas through gRPC (``json_schema``, greedy), speculation off against the server default side by
    side: valid answers, answers identical to the openai client's, and the speed ratio."""
    policies = {"off": False, "server default": None}  # (SpecDecodeClient's speculate)
    seconds = {p: 0.0 for p in policies}
    tokens = {p: 0 for p in policies}
    valid = {p: 0 for p in policies}
    texts = []
    for i, (prompt, schema) in enumerate(schemas(n)):
        answers = {}
        for name in (list(policies) if i % 2 == 0 else list(policies)[::-1]):  # alternate who goes first
            start = time.perf_counter()
            response = client.generate(messages=[("user", prompt)], max_new_tokens=max_tokens,
                                       json_schema=json.dumps(schema), speculate=policies[name])
            seconds[name] += time.perf_counter() - start
            tokens[name] += response.usage.completion_tokens
            answers[name] = response.text
            valid[name] += schema_valid(response.text, schema)
        texts.append(answers)
    tok_s = {p: tokens[p] / seconds[p] for p in policies}
    return {"valid": valid, "identical": sum(len(set(a.values())) == 1 for a in texts),
            "tok_s": {p: round(v, 2) for p, v in tok_s.items()},
            "speedup_server_default": round(tok_s["server default"] / tok_s["off"], 3), "texts": texts}


def mask_cost(json_schemas: list[dict], answers: list[str], tokenizer_dir: str) -> dict:
    """The grammar's time for one verify pass's masks (``tree_masks`` over a chain of 3) along each answer, in this
    process: median and p99 ms over every position of every answer."""
    from transformers import AutoTokenizer

    from services.errors import GrammarStateError
    from services.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    times = []
    for schema, answer in zip(json_schemas, answers, strict=True):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        state = compiler.json_schema(schema).start()
        for t in range(len(ids) - 3):
            start = time.perf_counter()
            state.tree_masks(ids[t : t + 3], [0, 1, 2])
            times.append(time.perf_counter() - start)
            try:
                state.advance(ids[t])
            except GrammarStateError:  # (the text re-tokenized otherwise than it was generated)
                break
    times.sort()
    return {"median": round(statistics.median(times) * 1000, 3), "p99": round(times[int(0.99 * (len(times) - 1))] * 1000, 3),
            "passes": len(times)}


# the neighbours' fourth stream, as long as the constrained answer: plain (the server default: the gate serves it
# without a drafter, as its drafts do not pay), constrained by the schema (the server default), and plain with k = 3
# EAGLE drafts at every step (a request whose drafts fill its passes: the load a speculating request brings)
NEIGHBOURS = {"plain": {}, "constrained": {}, "speculating": dict(speculate=True, drafter="eagle", num_draft_tokens=3)}


def neighbours(client, prompts: list[str], schema: dict, *, plain: int = 3, requests: int = 12, rounds: int = 4,
               max_new_tokens: int = 48, speculation_off: bool = False) -> dict:
    """``plain`` closed-loop streams (the server default, greedy) while one more stream loops beside them, of each
    kind in ``NEIGHBOURS`` in turn (ABC CBA, ``rounds`` times: a drift of the machine's speed weighs on every kind
    alike): the plain streams' time per output token (p50, ms) beside each, and its ratio to the plain neighbour's
    (``slowdown``: constrained / plain, > 1 is what a constrained request costs its neighbours beyond the load of a
    request served without drafts; ``speculating``: the same for a plain request with k = 3 drafts). Each neighbour's
    work (requests, tokens, verify steps, draft tokens) is reported beside. ``speculation_off``: every neighbour
    without drafts, so that they do the same work (one token a step, as many steps): what being constrained costs."""
    from splitspec.bench import load

    tpot: dict[str, list[float]] = {kind: [] for kind in NEIGHBOURS}
    work = {kind: dict(requests=0, tokens=0, steps=0, drafted=0, seconds=0.0) for kind in tpot}
    question = [("user", "Describe a book as JSON.")]
    # the plain neighbours answer as many tokens as the constrained one (greedy: the same answer each time), so that
    # they start requests (prefills) as often where they go as fast
    length = len(client.generate(messages=question, max_new_tokens=max_new_tokens, json_schema=json.dumps(schema)).token_ids)
    segments = []  # (kind, p50 ms) in the order run
    for round_ in range(rounds):
        for kind in list(NEIGHBOURS)[:: 1 if round_ % 2 == 0 else -1]:
            done = threading.Event()
            asks = (dict(json_schema=json.dumps(schema), max_new_tokens=max_new_tokens) if kind == "constrained"
                    else dict(max_new_tokens=length)) | NEIGHBOURS[kind]
            if speculation_off:
                asks["speculate"] = False

            def neighbour(asks=asks, done=done, mine=work[kind]):
                while not done.is_set():
                    for chunk in client.stream(messages=question, **asks):
                        if chunk.HasField("usage"):
                            stats = chunk.speculation_stats
                            mine["requests"] += 1
                            mine["tokens"] += chunk.usage.completion_tokens
                            mine["steps"] += stats.steps
                            mine["drafted"] += stats.drafted

            thread = threading.Thread(target=neighbour, daemon=True)
            thread.start()
            outcomes, seconds = load.closed_loop(client, prompts, {}, concurrency=plain, num_requests=requests,
                                                 max_new_tokens=max_new_tokens)
            done.set()
            thread.join()
            work[kind]["seconds"] += seconds
            these = [t for o in outcomes if o.status == "OK" and (t := load.tpot_s(o)) is not None]
            tpot[kind] += these
            segments.append((kind, round(statistics.median(these) * 1000, 2)))
    p50 = {kind: statistics.median(values) * 1000 for kind, values in tpot.items()}
    return {"plain_streams": plain, "requests_per_round": requests, "rounds": rounds,
            "speculation_off": speculation_off,
            "tpot_p50_ms": {k: round(v, 2) for k, v in p50.items()},
            "slowdown": round(p50["constrained"] / p50["plain"], 3),
            "speculating": round(p50["speculating"] / p50["plain"], 3),
            "segments": segments,
            "neighbour": {kind: {**w, "seconds": round(w["seconds"], 1)} for kind, w in work.items()}}
