"""env=dataset: bring your own task — prompts from a jsonl/parquet file, rewards from your function.

    slurmrl env=dataset env.path=/data/train.jsonl env.answer_key=answer \\
        env.reward_fn=my_package.rewards:score env.eval_fraction=0.1 orchestrator.eval_every_steps=10

Each record becomes one single-turn task: the user message is ``record[env.prompt_key]`` or
``env.prompt_template.format(**record)``, after an optional ``env.system_prompt``. Tokens:
the model's own tokenizer and chat template when the model is pretrained (``model.pretrained``),
else the byte-level template of envs/chat.py (``BOS USER <utf-8 bytes> EOT ASSISTANT``; needs
``model.vocab_size`` >= 264; the answer ends at EOT). The completion is decoded to text and
scored by ``env.reward_fn`` (workers/orchestrator/rewards: a function or dict of functions,
sync or async, under ``env.reward_timeout_s``; failures score 0 and are counted in
``reward_failures``, never crash the run).

Data order and resume (envs/data.py): seeded shuffled epochs (``env.num_epochs``, 0 = forever);
a task's id is its position ``"<epoch>:<index>:<row>"``, which the orchestrator's ledger records
per group. A restarted orchestrator replays as many draws as the ledger counts, lands on the
same position (and warns when a replayed id differs: the data changed), so nothing is skipped or
repeated; ``orchestrator_state.json`` also keeps the position (``env_state``) after each batch.

Eval split: ``env.eval_path`` (its own file) or ``env.eval_fraction`` (held out by ``env.seed``);
:meth:`DatasetEnv.eval_tasks` gives its first records in file order (the orchestrator's
``eval_every_steps`` / ``eval_num_samples``).

The plan (:func:`check`) reads the whole dataset on the login node (a missing file, an empty
one, a row without a needed key: refused naming file and line) and imports the reward module
there (rewards/__init__.py: that is the user's code, run with the user's rights).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from workers.common.config import EnvConfig
from workers.common.config.ranges import TEXT, between, ge, gt, limits
from workers.common.config.ranges import check_fields
from workers.common.logs import get_logger
from workers.common.registry import ENVS
from workers.orchestrator.envs import data
from workers.orchestrator.envs.base import EpisodeLimits, Env, StepResult
from workers.orchestrator.envs.chat import VOCAB_SIZE, ChatTemplate
from workers.orchestrator.envs.spec import EnvSpec, check_latency
from workers.orchestrator.rewards import TIMED_OUT, RewardRunner, load_reward

LOGGED_FAILURES, LOG_EVERY_FAILURE = 20, 100
#: Tokens of the byte template around the user message's text: BOS USER <text> EOT ASSISTANT.
BYTE_OVERHEAD = 4


@dataclasses.dataclass(kw_only=True)
class DatasetConfig(EnvConfig):
    name: str = "dataset"
    """Task name."""
    path: str = ""
    """Training data: an absolute path to a .jsonl file, a .parquet file (needs pyarrow) or a directory of them."""
    prompt_key: str = "prompt"
    """Field holding the user message (unused when ``prompt_template`` is set)."""
    prompt_template: str = ""
    """A ``str.format`` template over the record's fields (``"Solve: {question}"``); "" uses ``prompt_key``."""
    answer_key: str = "answer"
    """Field holding the reference answer, passed to the reward as ``sample["answer"]``; "" for none."""
    system_prompt: str = ""
    """System message before every prompt ("" for none)."""
    max_new_tokens: int = 64
    """Generation budget of one answer."""
    num_epochs: int = 0
    """Passes over the training data; 0 = as many as the run needs."""
    shuffle: bool = True
    """Shuffle each epoch (seeded by ``seed`` and the epoch); false keeps file order."""
    eval_path: str = ""
    """Eval data (same format and keys); "" for none or for ``eval_fraction``."""
    eval_fraction: float = 0.0
    """Fraction of ``path`` held out for eval (seeded by ``seed``); 0 for none."""
    reward_fn: str = "exact_match"
    """``module.path:name`` of a function (prompt, completion, sample) -> float, or a dict of such
    functions; or a built-in: exact_match, math_equal, code_tests."""
    reward_timeout_s: float = 10.0
    """Deadline of one reward call; past it the sample scores 0 and counts as a reward failure."""


limits(DatasetConfig, path=TEXT, prompt_key=TEXT, prompt_template=TEXT, answer_key=TEXT, system_prompt=TEXT,
       max_new_tokens=gt(0), num_epochs=ge(0), eval_path=TEXT, eval_fraction=between(0, 1, hi_open=True),
       reward_fn=TEXT, reward_timeout_s=gt(0))


def needed_fields(e: DatasetConfig) -> dict[str, str]:
    """Record field -> the config key that needs it."""
    need = ({f: "env.prompt_template" for f in data.template_fields(e.prompt_template)} if e.prompt_template
            else {e.prompt_key: "env.prompt_key"})
    if e.answer_key:
        need[e.answer_key] = "env.answer_key"
    if e.reward_fn == "code_tests":
        need["tests"] = "env.reward_fn=code_tests"
    return need


def load_splits(e: DatasetConfig) -> tuple[list[data.Record], list[data.Record]]:
    """(train, eval) records, every needed field checked; ValueError naming file, line and key."""
    if not e.prompt_template and not e.prompt_key:
        raise ValueError("set env.prompt_key (the field holding the prompt) or env.prompt_template")
    if e.eval_path and e.eval_fraction > 0:
        raise ValueError(f"set env.eval_path({e.eval_path!r}) or env.eval_fraction({e.eval_fraction}), not both")
    need = needed_fields(e)
    train = data.load_records(e.path, key="env.path")
    data.check_keys(train, need)
    if e.eval_path:
        evals = data.load_records(e.eval_path, key="env.eval_path")
        data.check_keys(evals, need)
        return train, evals
    return data.split(train, fraction=e.eval_fraction, seed=e.seed)


def uses_tokenizer(m: Any) -> bool:
    """The model brings a tokenizer (``model.pretrained``, or tokenizer files in ``model.path``): env=dataset
    uses it and its chat template; otherwise text is tokenised byte-level (envs/chat.py)."""
    if getattr(m, "pretrained", ""):
        return True
    if getattr(m, "path", ""):
        from workers.models.hf_dir import has_tokenizer

        return has_tokenizer(m.path)
    return False


def vocabulary_problem(m: Any) -> Optional[str]:
    """Why a model without a tokenizer cannot read byte-level text, with the fix that works for where
    its vocabulary comes from (a checkpoint's config.json cannot be overridden: model_path.py)."""
    if uses_tokenizer(m) or m.vocab_size >= VOCAB_SIZE:
        return None
    if getattr(m, "path", ""):
        return (f"model.path={m.path} has no tokenizer files, so env=dataset tokenises text byte-level "
                f"({VOCAB_SIZE} ids: envs/chat.py), but its config.json says vocab_size {m.vocab_size}; "
                f"model.vocab_size cannot override a checkpoint. Fix: add tokenizer files (tokenizer.json with a "
                f"chat template, what AutoTokenizer.save_pretrained writes) to {m.path}, or rebuild the "
                f"checkpoint with vocab_size >= {VOCAB_SIZE}")
    return (f"env=dataset tokenises text byte-level for a model without a tokenizer ({VOCAB_SIZE} ids: "
            f"envs/chat.py), but model.vocab_size is {m.vocab_size}. Fix: model.vocab_size={VOCAB_SIZE}, or a "
            f"model with a tokenizer (model=smollm2_135m, or model.path=DIR with tokenizer files)")


def context_fix(m: Any) -> str:
    """How to make room in the context: a checkpoint's max_position_embeddings is its config.json's."""
    if getattr(m, "path", ""):
        return (f"model.max_position_embeddings({m.max_position_embeddings}) comes from {m.path}/config.json "
                f"and cannot be overridden: lower env.max_new_tokens or shorten the prompts")
    return "raise model.max_position_embeddings or lower env.max_new_tokens"


def problems(run_cfg: Any) -> list[str]:
    """Every problem of model + env + data together (not one at a time), each with its fix."""
    e, m, o = run_cfg.env, run_cfg.model, run_cfg.orchestrator
    out: list[str] = []

    def attempt(fn, *args) -> Any:
        try:
            return fn(*args)
        except ValueError as err:
            out.append(str(err))
            return None

    attempt(check_fields, e, "env")
    attempt(check_latency, e)
    vocab = vocabulary_problem(m)
    if vocab:
        out.append(vocab)
    if e.max_new_tokens >= m.max_position_embeddings:
        out.append(f"env.max_new_tokens({e.max_new_tokens}) must be < model.max_position_embeddings"
                   f"({m.max_position_embeddings}): the prompt needs room too; {context_fix(m)}")
    if e.reward_fn in ("exact_match", "math_equal") and not e.answer_key:
        out.append(f"env.reward_fn={e.reward_fn} compares with the reference answer: set env.answer_key")
    splits = attempt(load_splits, e)
    attempt(load_reward, e.reward_fn)
    if splits is None:
        return out
    train, evals = splits
    if not uses_tokenizer(m) and not vocab:  # byte-level: lengths are known here; a tokenizer is the env's
        system = len(e.system_prompt.encode()) + 2 if e.system_prompt else 0  # USER <bytes> EOT
        room = m.max_position_embeddings - e.max_new_tokens - BYTE_OVERHEAD - system
        long = [(r, n) for r in train + evals
                if (n := len(data.prompt_text(r, prompt_key=e.prompt_key, template=e.prompt_template).encode())) > room]
        if long:
            r, n = max(long, key=lambda x: x[1])
            out.append(f"{len(long)} prompt(s) do not fit: the longest, {r.where}, is {n} bytes, more than the {room} "
                       f"that fit model.max_position_embeddings({m.max_position_embeddings}) with "
                       f"env.max_new_tokens({e.max_new_tokens}) (byte-level tokens); {context_fix(m)}")
    need = run_cfg.trainer.num_steps * o.num_prompts_per_step
    if e.num_epochs and len(train) * e.num_epochs < need:
        out.append(f"env.num_epochs({e.num_epochs}) x {len(train)} training records < {need} prompts the run "
                   f"trains on (trainer.num_steps({run_cfg.trainer.num_steps}) x orchestrator."
                   f"num_prompts_per_step({o.num_prompts_per_step})); raise env.num_epochs or set it to 0")
    if getattr(o, "eval_every_steps", 0) > 0 and not evals:
        out.append("orchestrator.eval_every_steps > 0 needs an eval split: set env.eval_path or env.eval_fraction")
    return out


def check(run_cfg: Any) -> None:
    """Fields, tokenizer (or byte vocabulary), data, reward import, prompt lengths, epochs, eval split:
    every problem found, in one ValueError (one per line when there are several)."""
    found = problems(run_cfg)
    if len(found) == 1:
        raise ValueError(found[0])
    if found:
        raise ValueError(f"env=dataset with model {run_cfg.model.name}: {len(found)} problems\n"
                         + "\n".join(f"  - {p}" for p in found))


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: str
    """``"<epoch>:<index>:<row>"`` (training) or ``"eval:<row>"``: the ledger records it."""
    record: data.Record
    prompt: str
    sample: dict
    """What the reward sees: the record's fields, plus ``answer`` = the ``env.answer_key`` field."""


class DatasetEnv(Env):
    """Single-turn env over records; an episode is one answer scored by the user's reward."""

    name = "dataset"

    def __init__(self, cfg: DatasetConfig, *, seed: int, model=None, tokenizer=None):
        self.cfg = cfg
        self.log = get_logger("orchestrator", 0)
        self.train, self.evals = load_splits(cfg)
        self.order = data.DataOrder(len(self.train), seed=seed * 1_000_003 + cfg.seed, shuffle=cfg.shuffle,
                                    num_epochs=cfg.num_epochs)
        self.runner = RewardRunner(load_reward(cfg.reward_fn), timeout_s=cfg.reward_timeout_s)
        self.max_new_tokens = cfg.max_new_tokens
        self.limits = EpisodeLimits.single_turn(cfg.max_new_tokens)
        self.max_prompt_tokens = (model.max_position_embeddings - cfg.max_new_tokens) if model is not None else None
        self.tokenizer, self.template = tokenizer, None
        if tokenizer is None and model is not None and uses_tokenizer(model):
            from workers.models.pretrained import load_tokenizer, require_prepared, tokenizer_dir  # transformers

            self.tokenizer = load_tokenizer(require_prepared(model) if model.pretrained else tokenizer_dir(model))
        if self.tokenizer is None:
            self.template = ChatTemplate()
            self.stop_token_ids = self.template.stop_token_ids
        else:
            self.stop_token_ids = (int(self.tokenizer.eos_token_id),)
        self.num_skipped = 0
        self.num_failures = 0
        self.first_failure: Optional[str] = None
        """The first reward failure's line (a run stopped by orchestrator.max_failed_reward_steps names it)."""

    # ---- text <-> tokens ------------------------------------------------------------------
    def messages(self, prompt: str) -> list[dict]:
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def prompt_ids(self, task: Task) -> list[int]:
        if self.template is not None:
            return self.template.prompt_ids(self.messages(task.prompt))
        ids = self.tokenizer.apply_chat_template(self.messages(task.prompt), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def text(self, ids) -> str:
        if self.template is not None:
            return self.template.turn_text(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- tasks ---------------------------------------------------------------------------
    def _task(self, task_id: str, record: data.Record) -> Task:
        sample = dict(record.fields)
        if self.cfg.answer_key:
            sample["answer"] = record.fields[self.cfg.answer_key]
        return Task(task_id, record, data.prompt_text(record, prompt_key=self.cfg.prompt_key,
                                                      template=self.cfg.prompt_template), sample)

    def sample_task(self) -> Task:
        """The next record in the seeded order. A prompt longer than the model's context (only a
        pretrained tokenizer can tell; the plan checked byte-level ones) is skipped and counted."""
        for _ in range(len(self.train)):
            epoch, index, row = self.order.next()
            task = self._task(f"{epoch}:{index}:{row}", self.train[row])
            if self.max_prompt_tokens is None or self.template is not None or \
                    len(self.prompt_ids(task)) <= self.max_prompt_tokens:
                return task
            self.num_skipped += 1
            self.log.warning("%s: prompt longer than %d tokens; skipped", task.record.where, self.max_prompt_tokens)
        raise ValueError(f"env.path={self.cfg.path!r}: no prompt fits model.max_position_embeddings minus "
                         f"env.max_new_tokens ({self.max_prompt_tokens} tokens)")

    def eval_tasks(self, n: int) -> list[Task]:
        """The first ``n`` eval records, in file order (the same ones at every evaluation)."""
        return [self._task(f"eval:{i}", r) for i, r in enumerate(self.evals[:n])]

    def session(self, task: Task, episode_id: str) -> "DatasetSession":
        return DatasetSession(self, task)

    def log_failure(self, line: str) -> None:
        """Log reward failures: the first LOGGED_FAILURES, then one in LOG_EVERY_FAILURE (all are counted
        in the metrics' reward_failures; a reward failing on every sample must not flood the log)."""
        self.num_failures += 1
        self.first_failure = self.first_failure or line
        n = self.num_failures
        if n <= LOGGED_FAILURES or n % LOG_EVERY_FAILURE == 0:
            more = "" if n < LOGGED_FAILURES else f" ({n} reward failures so far; logging one in {LOG_EVERY_FAILURE})"
            self.log.warning("%s%s", line, more)

    def state(self) -> dict:
        return {**self.order.state(), "draws_over_num_epochs": self.order.draws_over,
                "prompts_skipped_too_long": self.num_skipped}

    def metrics(self) -> dict:
        return {f"data/{k}": v for k, v in self.state().items()}


class DatasetSession:
    """Prompt = the task's chat prompt; the first step decodes the answer and scores it."""

    def __init__(self, env: DatasetEnv, task: Task):
        self.env, self.task = env, task
        self.metrics: dict[str, Any] = {}
        self.completion: Optional[str] = None

    async def reset(self) -> list[int]:
        return self.env.prompt_ids(self.task)

    async def step(self, turn_ids: list[int]) -> StepResult:
        self.completion = self.env.text(turn_ids).strip()
        score = await self.env.runner.score(self.task.prompt, self.completion, self.task.sample)
        for why in score.failures:
            self.env.log_failure(f"reward failed for {self.task.record.where} ({self.task.task_id}): {why}")
        self.metrics = {"reward_failures": len(score.failures), "reward_calls": len(self.env.runner.reward.functions),
                        "reward_timeouts": sum(TIMED_OUT in why for why in score.failures),
                        **{f"reward/{k}": v for k, v in score.parts.items()}}
        return StepResult(observation_ids=[], reward=score.total, done=True)

    async def final_reward(self) -> float:
        return 0.0  # no answer was scored (the request was aborted)

    async def close(self) -> None:
        pass


ENVS.register(EnvSpec(name="dataset", config=DatasetConfig, check=check, eval_split=True,
                      make=lambda cfg, *, seed, model=None: DatasetEnv(cfg, seed=seed, model=model),
                      summary="your own prompts (jsonl/parquet) scored by your reward function (module:function)"))
