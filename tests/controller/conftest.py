"""A run in one process, without Ray: the real loop, algorithm, rollout manager, rewards,
filters and torch trainer on a tiny model; only the engines and the actor transport are fakes.

* :class:`FakeEngine` has the face of :class:`loongsage_core.engine_client.EngineClient` (the
  ``/generate`` call and the control calls). It answers each sample with a response text chosen
  by a ``responder`` (correct or wrong answers to the prompt it recognises), tokenised with the
  real tokenizer, with log-probs of its own (so the engine and the trainer disagree, as a
  different inference stack would), and records every control call in a shared event list.
* Trainer ranks are real :class:`loongsage_core.controller.actors.ModelActor` objects behind
  :class:`loongsage_core.controller.remote.LocalActor` (in-process calls with Ray's face); so are
  the critic rank and the teacher actor when the job has them.
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from loongsage_core.config import apply_override, structure_job
from loongsage_core.controller.actors import ModelActor
from loongsage_core.controller.colocation import PhaseSwitch
from loongsage_core.controller.placement import Actors
from loongsage_core.controller.remote import LocalActor
from loongsage_core.controller.rollout import RolloutManager
from loongsage_core.engine_client import GenerationResult
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "data" / "tokenizer"

TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": True}


def base_job() -> dict[str, Any]:
    """The job table of the controller tests: one arithmetic source, 2 prompts x 4 samples."""
    return {
        "plugins": {"enable": ["torch", "rl", "rewards", "agents", "distill", "schedulers"]},
        "model": {"tokenizer": str(TOKENIZER), "config": dict(TINY)},
        "train": {"lr": 1e-3, "total_steps": 2, "mini_batch_size": 8, "micro_batch_size": 4},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 32,
                    "max_context_length": 256},
        "placement": {"colocate": False},
        "run": {"seed": 3, "checkpoint_every": 0, "save_hf_at_end": False},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean"},
        "loggers": [],
        "data": [{"name": "add", "generator": "arithmetic", "generator_args": {"num_samples": 32},
                  "reward": ["exact_match"]}],
    }


def arithmetic_responder(prompt_text: str, sample: int) -> tuple[str, str]:
    """Even samples answer ``What is a + b?`` correctly, odd ones wrongly; ``(text, finish_reason)``."""
    m = re.search(r"What is ([-+ 0-9]+)\?", prompt_text)
    value = eval(m.group(1)) if m else 0  # noqa: S307 - digits and +/- from our own generator
    return (f"The answer is {value if sample % 2 == 0 else value + 1 + sample}", "stop")


def sample_of(rid: str) -> int:
    """The sample index in a request id: the fast path's ``step:index:j``, or the router's
    ``{trajectory id step-index-j}-{attempt}-{turn}-...``."""
    return int(rid.rsplit(":", 1)[-1]) if ":" in rid else int(rid.split("-")[2])


class FakeEngine:
    """An engine client answering from ``responder``; control calls go to ``events``."""

    def __init__(self, tokenizer: Any, events: list[str], responder: Callable[[str, int], tuple[str, str]],
                 name: str = "engine0") -> None:
        self.tokenizer = tokenizer
        self.events = events
        self.responder = responder
        self.name = name
        self.version = 0
        self.requests = 0
        self.priorities: list[int | None] = []  # the ``priority`` of each generate call

    async def generate(self, input_ids: Any, sampling_params: Any, *, return_logprob: bool = True,
                       rids: Any = None, priority: int | None = None, **_: Any) -> list[GenerationResult]:
        # the rollout's fast path sends a batch of prompts, the router one prompt (a list of ids)
        prompts = [list(input_ids)] if input_ids and isinstance(input_ids[0], int) else [list(p) for p in input_ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.priorities.append(priority)
        out = []
        for i, (tokens, p) in enumerate(zip(prompts, params)):
            self.requests += 1
            seed = int(p.get("sampling_seed", p.get("seed", 0)))
            sample = sample_of(str(rids[i])) if rids else i
            text, finish = self.responder(self.tokenizer.decode(tokens), sample)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            rng = random.Random(seed)
            # around log(1/512), what the untrained tiny model gives, off by up to +-0.2
            logprobs = [-6.24 + 0.4 * (rng.random() - 0.5) for _ in ids]
            out.append(GenerationResult(rid=str(rids[i]) if rids else str(i), output_ids=ids, logprobs=logprobs,
                                        finish_reason=finish, finish_detail={}, weight_version=self.version,
                                        weight_versions=[self.version] * len(ids), prompt_tokens=len(tokens),
                                        cached_tokens=0, text=text, meta_info={}))
        await asyncio.sleep(0)
        return out

    async def generate_stream(self, input_ids: Any, sampling_params: Any, *, rid: str, return_logprob: bool = True,
                              **_: Any) -> Any:
        """A streamed generation (agents that stream their turns): the whole answer as one chunk."""
        (result,) = await self.generate(input_ids, sampling_params, return_logprob=return_logprob, rids=[rid])
        yield result

    async def model_info(self, timeout: Any = None) -> dict[str, Any]:
        return {"max_context_length": 1 << 20}  # the router asks; the fake has no limit of its own

    server_info = model_info

    async def abort(self, rid: str, timeout: Any = None) -> None:
        self.events.append(f"{self.name}.abort:{rid}")

    async def pause(self, mode: str = "abort") -> None:
        self.events.append(f"{self.name}.pause:{mode}")

    async def resume(self) -> None:
        self.events.append(f"{self.name}.resume")

    async def release_memory_occupation(self, tags: Any = None) -> None:
        self.events.append(f"{self.name}.release:{','.join(tags or [])}")

    async def resume_memory_occupation(self, tags: Any = None) -> None:
        self.events.append(f"{self.name}.resume_memory:{','.join(tags or [])}")

    async def aclose(self) -> None:
        self.events.append(f"{self.name}.close")


class RecordingTrainer(ModelActor):
    """A real trainer rank that also notes the calls whose order the tests check."""

    events: list[str]

    def offload(self) -> None:
        self.events.append("trainer.offload")
        super().offload()

    def onload(self) -> None:
        self.events.append("trainer.onload")
        super().onload()

    def train_mini_batch(self, batch: Any, norm: Any) -> dict[str, float]:
        self.events.append("trainer.train")
        self.norms.append(norm)
        return super().train_mini_batch(batch, norm)

    def push_weights(self, version: int, targets: Any) -> dict[str, float]:
        self.events.append(f"trainer.push:{version}")
        return super().push_weights(version, [])  # nowhere to send: the engines are fakes


def make_job(overrides: dict[str, Any] | None = None, dotted: tuple[str, ...] = ()) -> Any:
    raw = base_job()
    for section, table in (overrides or {}).items():
        if isinstance(table, dict) and isinstance(raw.get(section), dict):
            raw[section].update(table)
        else:
            raw[section] = table
    for item in dotted:
        apply_override(raw, item)
    return structure_job(raw, source="<controller test>")


def build_controller(tmp_path: Path, overrides: dict[str, Any] | None = None, *, dotted: tuple[str, ...] = (),
                     responder: Callable[[str, int], tuple[str, str]] = arithmetic_responder) -> Any:
    """The job's loop (sync, or async with ``async.enable``) over a started run (``loop.run``)
    whose engines are fakes; the loop also carries ``events``, ``trainer`` and ``engine``."""
    from loongsage_core.controller.run import make_loop
    from loongsage_core.controller.runtime import Run

    job = make_job(overrides, dotted)
    run = Run(resolve_job(job), tmp_path / "run")
    loop = make_loop(run)
    run.output_dir.mkdir(parents=True, exist_ok=True)
    events: list[str] = []
    trainer = RecordingTrainer(job, 0, 1, None, run.needs_reference)
    trainer.start("127.0.0.1", 0)  # one rank: no group to join
    trainer.events = events
    trainer.norms = []
    run.actors = Actors(trainers=[LocalActor(trainer)], engine_actors=[], engine_urls=["http://fake-engine"],
                        colocated=job.placement.colocate, dp_ranks=[0], dp_size=1)
    run.rollout = RolloutManager(job, run.host, run.tokenizer, ["http://fake-engine"])
    engine = FakeEngine(run.tokenizer, events, responder)
    run.rollout.clients = [engine]
    run.rollout.generate_clients = [engine]
    start_router = run.rollout.start_router

    def start_router_on_the_fake() -> str:  # agents other than the fast path's talk to the router
        url = start_router()
        run.rollout.router.engines._clients["http://fake-engine"] = engine
        return url

    run.rollout.start_router = start_router_on_the_fake
    if run.evaluator is not None:
        run.evaluator.register(run.rollout)
    run.phases = PhaseSwitch(job, run.actors.trainers, run.rollout.clients, run.loop)
    from loongsage_core.controller.teacher_actor import Teachers

    run.teachers = Teachers.local(job, run.host)  # the teacher actor's code, in this process
    if run.needs_critic:
        from loongsage_core.controller.critic import Critic, CriticActor

        critic = CriticActor(job, 0, 1)
        critic.start("127.0.0.1", 0)  # one rank: no group to join
        run.critic = Critic(job, [LocalActor(critic)])
    loop.events = events
    loop.trainer = trainer
    loop.engine = engine
    return loop


@pytest.fixture
def controller_factory(tmp_path: Path):
    """``make(overrides, dotted=..., responder=...)`` -> a loop over its run; closed after the test."""
    made: list[Any] = []

    def make(overrides: dict[str, Any] | None = None, **kw: Any) -> Any:
        c = build_controller(tmp_path / f"c{len(made)}", overrides, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.run.actors = c.run.critic = None  # in-process: nothing to kill
        c.run.close()
