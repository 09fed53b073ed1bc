"""A real ``inspect_ai.eval()`` on the ``sandman`` provider (found through its entry point):
the solver writes a file in the sandbox, the scorer reads it back; and a sandbox lost
mid-sample is an error Inspect retries (``retry_on_error``), never a score.
"""

from __future__ import annotations

import gc
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import Model, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, generate, solver
from inspect_ai.util import sandbox

from broker.integrations.inspectai import SandmanSandboxConfig
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
    # inspect-ai 0.3.285 passes tenacity's deprecated `initial` (its own code, not ours).
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
    # eval() leaves an anyio stream unclosed even with Inspect's own "local" sandbox.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
IMAGE = TASK_IMAGE


@pytest.fixture(autouse=True)
def _collect_what_eval_left() -> Iterator[None]:
    """Collect Inspect's unclosed stream here, under this module's warning filter: left to
    a later collection, its ResourceWarning would fail whichever test runs then."""
    yield
    gc.collect()


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"inspect-eval-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name)
    return name


def mockllm() -> Model:
    """Inspect's mockllm/model, answering with its usage already set: mockllm otherwise
    counts tokens with tiktoken, which downloads its encoding (no network here)."""

    def output(*_: Any) -> ModelOutput:
        reply = ModelOutput.from_content(model="mockllm", content=f"answer-{secrets.token_hex(4)}")
        reply.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return reply

    return get_model("mockllm/model", custom_outputs=output)


@solver
def write_answer() -> Any:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        env = sandbox()
        await env.write_file("answer.txt", state.output.completion)
        result = await env.exec(["sh", "-c", "wc -c < answer.txt; id -u"], input="")
        state.metadata["exec"] = result.stdout
        return state

    return solve


@solver
def lose_the_sandbox_once(attempts: list[int]) -> Any:
    """The first attempt kills its sandbox's execd from inside (the exec never answers)."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        attempts.append(1)
        if len(attempts) == 1:
            await sandbox().exec(["sh", "-c", "kill -9 $PPID; sleep 5"])
        return state

    return solve


@scorer(metrics=[accuracy()])
def answer_file() -> Any:
    async def score(state: TaskState, target: Target) -> Score:
        written = await sandbox().read_file("answer.txt")
        ok = written == state.output.completion and bool(written)
        return Score(value=CORRECT if ok else INCORRECT, answer=written)

    return score


def _sandbox_rows(sessions: Any, job: str) -> list[Sandbox]:
    with sessions() as session:
        return list(session.query(Sandbox).filter(Sandbox.job == job))


def _all_deleted(sessions: Any, job: str, n: int) -> bool:
    rows = _sandbox_rows(sessions, job)
    return len(rows) == n and all(r.state == State.DELETED for r in rows)


def test_eval_with_mockllm_scores_a_file_the_solver_wrote(
    stack: Settings, job: str, sessions: Any, tmp_path: Path
) -> None:
    config = SandmanSandboxConfig(image=IMAGE, job=job, redis_url=stack.redis_url)
    task = Task(
        dataset=[Sample(input="Say something.", target="x"), Sample(input="Again.", target="x")],
        solver=[generate(), write_answer()],
        scorer=answer_file(),
        sandbox=("sandman", config),
    )
    [log] = eval(task, model=mockllm(), log_dir=str(tmp_path), display="none")
    assert log.status == "success", log.error
    assert log.samples is not None and len(log.samples) == 2
    for sample in log.samples:
        assert sample.error is None
        assert sample.scores is not None
        score = sample.scores["answer_file"]
        assert score.value == CORRECT and score.answer == sample.output.completion
        assert sample.metadata["exec"].splitlines()[0] == str(len(sample.output.completion))
    assert log.results is not None and log.results.scores[0].metrics["accuracy"].value == 1.0
    wait_until(lambda: _all_deleted(sessions, job, 2), 60, 0.2, "both sandboxes released")


def test_a_lost_sandbox_is_a_retried_error_not_a_score(
    stack: Settings, job: str, sessions: Any, tmp_path: Path
) -> None:
    config = SandmanSandboxConfig(image=IMAGE, job=job, redis_url=stack.redis_url)
    attempts: list[int] = []
    task = Task(
        dataset=[Sample(input="Say something.", target="x")],
        solver=[generate(), lose_the_sandbox_once(attempts), write_answer()],
        scorer=answer_file(),
        sandbox=("sandman", config),
    )
    [log] = eval(task, model=mockllm(), log_dir=str(tmp_path), display="none", retry_on_error=1)
    assert log.status == "success", log.error
    assert log.samples is not None
    [sample] = log.samples
    assert len(attempts) == 2
    assert sample.error_retries is not None and len(sample.error_retries) == 1
    assert "SandmanInfrastructureError" in sample.error_retries[0].message + str(
        sample.error_retries[0].traceback
    )
    assert sample.scores is not None and sample.scores["answer_file"].value == CORRECT
    # The lost sandbox and the retry's were both released.
    wait_until(lambda: _all_deleted(sessions, job, 2), 60, 0.2, "both sandboxes released")
