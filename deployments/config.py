"""The application's typed config: what `serve run` / `serve deploy` pass to ``deployments.app:build_app``.

A plain dict (from YAML) is validated here once; every field has a
description, cross-field checks live in one validator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services import drafters
from services.loading import DTYPES
from services.policy import DEFAULT_EXPLORE_EVERY, DEFAULT_MAX_DRAFT_TOKENS
from services.tree import MAX_TREE_WIDTH
from services.validation import MAX_DRAFT_TOKENS, MIN_DRAFT_TOKENS

STAGES = ("prefill", "draft", "verify")
INGRESS = "ingress"
STAGE_LABEL = "splitspec.io/accelerator"  # node label key of the example cluster layout
DEFAULT_APP_NAME = "splitspec"


# Rows one pass of a stage takes. Prefill is compute-bound: a pass of one or two prompts keeps every first token
# early, and a larger batch saves little (8 prompts of 40 tokens: 1.0 s in one pass, 1.4 s one by one) while it
# holds back every first token to the last (splitspec bench load, c=8: TTFT p50 2.4 s with 512 rows, 0.6 s with 64).
# Draft calls are k rows, verify calls k + 1.
DEFAULT_BATCH_ROWS = {"prefill": 64, "draft": 32, "verify": 32}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Placement(_Strict):
    """Where a stage's replicas may run: node labels and/or custom resources (both optional)."""

    label_selector: dict[str, str] = Field(
        default_factory=dict, description="Ray node label selector, e.g. {'splitspec.io/accelerator': 'verify'}"
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources each replica requires, e.g. {'splitspec_verify': 1}"
    )
    num_cpus: float = Field(0.0, ge=0, description="logical CPUs reserved per replica (threads sets real use)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (Ray hands each replica its own through CUDA_VISIBLE_DEVICES)")
    cpus: list[int] = Field(
        default_factory=list, description="CPU set of each replica's process (Linux CPU ids, e.g. [1]): every thread of "
        "it runs only there, on a CPU-only machine what 'a device of its own' means (verify alone on a core: no other "
        "process preempts its passes). Checked against the node's CPUs when the replica starts; empty = wherever the "
        "OS schedules it",
    )

    @field_validator("cpus")
    @classmethod
    def _distinct_cpus(cls, cpus: list[int]) -> list[int]:
        if any(c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
            raise ValueError(f"cpus must be distinct CPU ids >= 0, got {cpus}")
        return sorted(cpus)


class StageConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="replicas of this stage")
    threads: int = Field(1, ge=1, description="torch intra-op threads per replica")
    max_ongoing_requests: int = Field(
        64, ge=1, description="concurrent calls a replica accepts (more than the ingress runs: closes are in flight too)"
    )
    max_batch_rows: int = Field(
        0, ge=0, description="rows (tokens) one batched pass takes from concurrent requests' calls; "
        f"0 = the stage's default: {DEFAULT_BATCH_ROWS}",
    )
    engine_nice: int | None = Field(
        None, ge=-20, le=19, description="niceness of the replica's engine thread (the one that runs its passes); "
        "empty = as Ray starts workers (15, below Ray's own threads at 0). 0 for verify: more throughput at high concurrency, later first tokens and a longer "
        "inter-token tail at moderate load (README, 'Under load'). Below 15 needs CAP_SYS_NICE or RLIMIT_NICE: "
        "without, the replica logs why and goes on",
    )
    saturated_nice: int | None = Field(
        0, ge=-20, le=19, description="niceness of the engine thread while the replica is saturated (its passes take "
        "saturated_calls calls or more; back to engine_nice below half as many): the bottleneck of every stream in "
        "the pass preempted by nothing at nice 0 (README, 'Under load'). Empty = no change by load",
    )
    saturated_calls: int = Field(16, ge=1, description="calls (sessions) in one pass from which the replica counts as "
                                 "saturated (saturated_nice)")
    placement: Placement = Field(default_factory=Placement, description="hardware pinning of this stage")
    device: str = Field("cpu", description="where the stage's model and KV live: cpu or cuda (needs placement.num_gpus > 0)")
    dtype: str = Field("", description="weights dtype of this stage (float32, bfloat16, float16); empty = models.dtype")
    kv_capacity: int = Field(
        0, ge=0, description="verify only: the longest sequence (prompt and answer) a session holds; 0 = the target's "
        "context. Where the verifier runs transformers' forward (every GPU stage) each session holds a static KV "
        "buffer of this many positions and every pass attends over all of them (services.batch_invariant): lower "
        "it for long-context models to save memory and attention time",
    )
    pass_slots: int = Field(
        0, ge=0, le=64, description="verify only, where the verifier runs transformers' forward (GPU stages): sessions "
        "one pass takes; every pass has this many slots of 17 rows (empty ones padded), so that a session's logits "
        "do not depend on who shares its pass (services.batch_invariant). 0 = 8 on cuda, 1 on the CPU",
    )


class SpeculationDefaults(_Strict):
    enabled: bool = Field(True, description="speculate unless a request turns it off")
    drafting: Literal["auto", "local", "remote"] = Field(
        "auto", description="where a speculating request's drafter runs. local: in its verify replica, on the target's "
        "device and engine thread (the draft pass right before the verify pass, no hop); remote: in the draft stage, "
        "asked by the verify replica directly, drafting the next block while this one is verified (pre-drafting). "
        "auto: remote where the draft stage has a device of its own (its placement differs from verify's: another "
        "label, a GPU of its own, another device or a disjoint CPU set), else local",
    )
    tree_width: int = Field(
        3, ge=1, le=MAX_TREE_WIDTH, description="candidates per draft position for greedy requests: > 1 drafts a tree, "
        "the chain and the drafter's next most likely tokens at its first depth, verified in one pass (services.tree; "
        "exact for greedy decoding, sampled requests draft chains)",
    )
    num_draft_tokens: int = Field(
        0, ge=0, le=MAX_DRAFT_TOKENS,
        description="default k; 0 = adaptive: k picked per step (0 included) from measured acceptance and costs",
    )
    max_draft_tokens: int = Field(
        DEFAULT_MAX_DRAFT_TOKENS, ge=MIN_DRAFT_TOKENS, le=MAX_DRAFT_TOKENS, description="largest k the adaptive policy takes"
    )
    seeded_draft_tokens: int = Field(
        2, ge=0, le=MAX_DRAFT_TOKENS,
        description="k of a seeded sampled request under the adaptive default: pinned, so that the seed reproduces the "
        "answer (an adaptive k decides which random draws are made); 0 = such requests run without speculation",
    )
    drafter: str = Field(
        "", description="default drafter kind (services.drafters: model, eagle, prompt_lookup, hybrid, or one of "
        "models.drafter_modules); empty = hybrid when the drafter folder has an EAGLE head, else model"
    )
    overlap: bool | None = Field(
        None, description="pre-draft: the drafter drafts beyond the block the verifier is checking (services.loop); "
        "only where drafting is remote (a local drafter shares the verifier's engine thread). Empty = on where "
        "drafting is remote",
    )
    explore_every: int = Field(
        DEFAULT_EXPLORE_EVERY, ge=1, description="adaptive requests start without a drafter where speculation has not "
        "paid on earlier ones; every this many of them speculate anyway, to keep the estimates fresh (1 = always speculate)",
    )
    off_above_concurrency: int = Field(
        2, ge=0, description="adaptive k drafts nothing while a verify replica holds more sessions than this "
        "(the verifier batches their tokens instead), and an adaptive request that starts then opens no draft "
        "session; 0 = no limit. A request that pins k keeps it",
    )


class Auth(_Strict):
    token_sha256: str = Field(
        "", pattern=r"^([0-9a-f]{64})?$",
        description="hex SHA-256 of the bearer token every call must carry (`splitspec serve` sets it from "
        "SPLITSPEC_AUTH_TOKEN or --auth-token-file; deployments.auth); empty = no authentication",
    )


class Limits(_Strict):
    max_new_tokens: int = Field(512, ge=1, description="largest max_new_tokens a request may ask for")
    max_prompt_chars: int = Field(
        65536, ge=1, description="characters of a request's prompt, or of all its chat messages together; a longer one "
        "is INVALID_ARGUMENT before any tokenising (the model's context bounds the tokens)",
    )
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="bytes of an HTTP request body (the OpenAI API); a larger one is refused with "
        "413 before it is read whole (gRPC messages: 4 MiB, gRPC's own limit, RESOURCE_EXHAUSTED)",
    )
    max_messages: int = Field(256, ge=1, description="chat messages one request may carry")
    max_stop_chars: int = Field(256, ge=1, description="characters of one stop sequence (at most 8 of them)")
    default_max_new_tokens: int = Field(128, ge=1, description="max_new_tokens when a request leaves it unset")
    max_sessions: int = Field(64, ge=1, description="open sessions per draft / verify replica")
    max_kv_bytes: int = Field(4 * 2**30, ge=1, description="KV bytes per draft / verify replica")
    max_ongoing_requests: int = Field(32, ge=1, description="requests the ingress runs at once (per replica); the verify pass batches them all")
    max_queued_requests: int = Field(32, ge=0, description="requests waiting beyond that; more get RESOURCE_EXHAUSTED")
    prefill_chunk_tokens: int = Field(
        256, ge=1, description="a longer prompt is prefilled in chunks of this many tokens, each in a pass shared with "
        "other prompts, so that it does not stall their first token",
    )
    prefix_cache_bytes: int = Field(
        64 * 2**20, ge=0, description="host memory per prefill replica for recent prompts' KV, reused by prompts that "
        "start with the same tokens (a chat template's system turn, an agent's shared context); 0 turns it off",
    )
    local_prefill_tokens: int = Field(
        2, ge=0, description="a prompt whose prefix-cache hit leaves at most this many positions (the same prompt again: "
        "one) has them computed by its verify replica, as rows of a batched verify pass, instead of a prefill pass that "
        "reads every weight for them (conditional disaggregation, as Dynamo prefills short prompts on the decode "
        "worker); the answer is a full prefill's up to float rounding (in bfloat16 a near-tie can move: README, "
        "'On GPU nodes'). 0 = every prompt on the prefill stage",
    )
    stage_timeout_s: float = Field(120.0, gt=0, description="one stage call; slower means UNAVAILABLE")
    request_timeout_s: float = Field(600.0, gt=0, description="a whole request; longer means DEADLINE_EXCEEDED")
    session_idle_s: float = Field(
        660.0, gt=0, description="a draft / verify session without a call for longer is closed (its request is gone, e.g. "
                                 "with a lost ingress replica); must exceed request_timeout_s"
    )


class Faults(_Strict):
    """Test only: deterministic fault injection (tests/serving/test_faults.py). Leave off in production."""

    enabled: bool = Field(False, description="stage replicas take arm_fault() calls: a later call exits the replica "
                                             "process or holds until released (never set this in production)")


def _generation_tag():
    """transformers' ``{% generation %}`` block (it marks the assistant's tokens), as a parse-only Jinja extension."""
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


class Models(_Strict):
    target: str = Field("", description="target model folder (HF format); empty = the prepared default pair")
    draft: str = Field("", description="draft model folder sharing the target's tokenizer; empty = default pair")
    dtype: str = Field("float32", description="weights dtype: float32, bfloat16 or float16")
    served_name: str = Field("", description="the model id of the OpenAI-compatible API; empty = the target folder's name")
    draft_weights: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="how a drafter loaded in float32 on the CPU keeps its matmul weights (the draft model's "
        "and the EAGLE head's): bfloat16 halves the bytes each draft step streams (products and sums stay float32); "
        "lossless either way, the verifier accepts by the drafter's own q",
    )
    draft_vocab_size: int | None = Field(
        None, ge=0, description="ids the drafter's LM head keeps (FR-Spec, services.draft_vocab; the EAGLE head's too): "
        "the N most frequent of the drafter folder's draft_vocab.json; empty = its default (8192 for the default "
        "pair), 0 = every id (an EAGLE head: the ids it was trained on)",
    )
    drafter_modules: list[str] = Field(
        default_factory=list, description="Python modules that register more drafter kinds (services.drafters."
        "register), imported by every replica, e.g. ['mypackage.drafters']",
    )
    chat_template: str = Field(
        "", description="a Jinja chat template replacing the target tokenizer's (as vLLM's --chat-template): the "
        "template, or a file holding it (read when the config is loaded, so the text travels with the config to every "
        "node); empty = the tokenizer's own",
    )
    tool_call_parser: str = Field(
        "auto", description="how the model writes tool calls (deployments.tool_parsers: hermes, llama3_json): auto = "
        "the chat template's own tool format where it renders tools in one splitspec knows, else the documented "
        "prompt format (docs/api.md, \"Tool calls\"); a parser's name = the template with that parser",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str) -> str:
        """A file's template is read; the text must parse as Jinja."""
        if value and "{" not in value:
            path = Path(value).expanduser()
            if not path.is_file():
                raise ValueError(f"chat_template {value!r} is neither a Jinja template nor a file")
            value = path.read_text(encoding="utf-8")
        if value:
            import jinja2

            try:
                jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _generation_tag()]).parse(value)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat_template is no valid Jinja: {exc.message} (line {exc.lineno})") from None
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        from deployments.tool_parsers import PARSERS

        if value != "auto" and value not in PARSERS:
            raise ValueError(f"tool_call_parser must be auto or one of {list(PARSERS)}, got {value!r}")
        return value


class Stages(_Strict):
    prefill: StageConfig = Field(default_factory=StageConfig)
    draft: StageConfig = Field(default_factory=StageConfig)
    verify: StageConfig = Field(default_factory=StageConfig)


class AppConfig(_Strict):
    """splitspec's Ray Serve application."""

    models: Models = Field(default_factory=Models)
    speculation: SpeculationDefaults = Field(default_factory=SpeculationDefaults)
    limits: Limits = Field(default_factory=Limits)
    auth: Auth = Field(default_factory=Auth)
    stages: Stages = Field(default_factory=Stages)
    faults: Faults = Field(default_factory=Faults)
    ingress_replicas: int = Field(1, ge=1, description="replicas of the ingress (the loop runs there)")
    ingress_placement: Placement = Field(default_factory=Placement, description="where the ingress may run (default: anywhere)")
    stage_access_log: bool = Field(
        False, description="Serve's access log line for every stage call: one per verify / propose call, hundreds a "
        "second under load (on 2 cores they cost a quarter of the throughput at 8 streams); the ingress logs every "
        "request either way",
    )
    replica_one_loop: bool = Field(
        True, description="run each replica's methods, and the router of the handles it calls, on the replica's own "
        "event loop (Serve's RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 in "
        "the replicas' environment): every streamed token then crosses two threads fewer in the verify replica and "
        "the ingress (splitspec's methods never block that loop: engine work runs on each replica's engine thread, "
        "tokenizing on the ingress's pool). false: Serve's default, a thread and a loop of their own",
    )
    direct_ingress: bool | None = Field(
        None, description="the ingress replica serves the gRPC and HTTP ports itself (Serve's direct ingress, "
        "RAY_SERVE_ENABLE_DIRECT_INGRESS in its environment), so a token reaches the client without Serve's proxy: "
        "one process and one object-store hop fewer a token. Needs a Serve controller started for it, which hands out "
        "the ports (splitspec.cluster.start_serve(direct_ingress=True)), one application and one ingress replica a "
        "node. Empty: on where `splitspec serve` starts its own cluster with one ingress replica, off on a cluster "
        "given by --address and under `serve run` / `serve deploy`; false: always through Serve's proxy",
    )
    placement_timeout_s: float = Field(30.0, gt=0, description="how long a stage may stay unplaced before it is reported")
    graceful_shutdown_timeout_s: float = Field(
        10.0, ge=0, description="on stop, how long a replica lets its in-flight requests finish before it is killed"
    )

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        try:
            drafters.load_modules(self.models.drafter_modules)
        except ImportError as exc:
            raise ValueError(f"models.drafter_modules: {exc}") from exc
        if self.speculation.drafter and self.speculation.drafter not in drafters.kinds():
            raise ValueError(f"speculation.drafter must be one of {sorted(drafters.kinds())}, got "
                             f"{self.speculation.drafter!r}")
        if self.limits.default_max_new_tokens > self.limits.max_new_tokens:
            raise ValueError("limits.default_max_new_tokens must not exceed limits.max_new_tokens")
        if self.limits.session_idle_s <= self.limits.request_timeout_s:
            raise ValueError("limits.session_idle_s must exceed limits.request_timeout_s (a live request's sessions "
                             "would be closed)")
        if self.models.dtype not in DTYPES:
            raise ValueError(f"models.dtype must be float32, bfloat16 or float16, got {self.models.dtype!r}")
        for name in STAGES:
            stage = self.stage(name)
            if stage.dtype and stage.dtype not in DTYPES:
                raise ValueError(f"stages.{name}.dtype must be float32, bfloat16 or float16, got {stage.dtype!r}")
            kind, _, index = stage.device.partition(":")
            if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
                raise ValueError(f"stages.{name}.device must be cpu, cuda or cuda:N, got {stage.device!r}")
            if kind == "cuda" and stage.placement.num_gpus <= 0:
                raise ValueError(f"stages.{name}.device is {stage.device!r}: set stages.{name}.placement.num_gpus "
                                 "(e.g. 1) so that Ray gives its replicas a GPU")
            for option in ("kv_capacity", "pass_slots"):
                if getattr(stage, option) and name != "verify":
                    raise ValueError(f"stages.{name}.{option}: only the verify stage holds sessions' KV (set "
                                     f"stages.verify.{option})")
        if self.stage_dtype("prefill") != self.stage_dtype("verify"):
            raise ValueError(f"stages.prefill and stages.verify must use one dtype (the KV passes between them), got "
                             f"{self.stage_dtype('prefill')!r} and {self.stage_dtype('verify')!r}")
        return self

    def context_limit(self, target_context: int) -> int:
        """The longest sequence a request may reach: the target's context, or the verifier's ``kv_capacity``."""
        capacity = self.stages.verify.kv_capacity
        return min(target_context, capacity) if capacity else target_context

    def stage_dtype(self, name: str) -> str:
        """The weights dtype a stage loads its model in."""
        return self.stage(name).dtype or self.models.dtype

    def stage(self, name: str) -> StageConfig:
        return getattr(self.stages, name)

    def batch_rows(self, name: str) -> int:
        """Rows one batched pass of the stage takes."""
        return self.stage(name).max_batch_rows or DEFAULT_BATCH_ROWS[name]

    def remote_drafting(self) -> bool:
        """Whether speculating requests draft in the draft stage (speculation.drafting; auto: where its placement
        gives it a device of its own, ``own_device``)."""
        if self.speculation.drafting != "auto":
            return self.speculation.drafting == "remote"
        return own_device(self.stages.draft, self.stages.verify)

    def deployed_stages(self) -> tuple[str, ...]:
        """The stages the application deploys: the draft stage only where requests draft remotely."""
        return tuple(s for s in STAGES if s != "draft" or self.remote_drafting())

    def placement(self, name: str) -> Placement:
        """Placement of a stage or of the ingress."""
        return self.ingress_placement if name == INGRESS else self.stage(name).placement


def own_device(draft: StageConfig, verify: StageConfig) -> bool:
    """Whether the draft stage's replicas run on hardware verify's do not: nodes of another label, a GPU of their
    own, another device kind, or a CPU set disjoint from verify's. (Custom resources alone say nothing of the
    hardware: a local cluster pins every stage by one on a single node.)"""
    d, v = draft.placement, verify.placement
    return bool(
        (d.label_selector and d.label_selector != v.label_selector)
        or d.num_gpus >= 1
        or draft.device.partition(":")[0] != verify.device.partition(":")[0]
        or (d.cpus and v.cpus and not set(d.cpus) & set(v.cpus))
    )


def local_placement(stage: str) -> Placement:
    """One machine: each stage (and the ingress) needs its own custom resource, which `splitspec serve` gives the node."""
    return Placement(resources={resource_name(stage): 0.01})


def labelled_placement(stage: str) -> Placement:
    """A labelled cluster: each stage runs only on nodes labelled ``splitspec.io/accelerator=<stage>``."""
    return Placement(label_selector={STAGE_LABEL: stage})


def resource_name(stage: str) -> str:
    return f"splitspec_{stage}"
