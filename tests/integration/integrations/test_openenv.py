"""OpenEnv's own rollout loops on Sandman sandboxes, against a real stack.

The pinned ``openenv`` package drives every episode: ``CollectRunner`` and
``build_harness_rollout_func`` create a session per rollout, run
``MCPHarnessAdapter``'s tool loop and close the session. The model is OpenEnv's
``OpenAIClient`` talking to a scripted chat-completions server on 127.0.0.1
(stdlib, written here): deterministic, no network model.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from openenv.core.harness import (
    MCPHarnessAdapter,
    ModelStepResult,
    build_harness_rollout_func,
)
from openenv.core.harness.collect import CollectRunner, RolloutSerializer, build_model_step
from openenv.core.llm_client import LLMResponse, OpenAIClient, ToolCall

from broker.client import SandboxClient
from broker.errors import ExecError, SandboxLost
from broker.integrations.openenv import SandboxTask, SandmanSession, SandmanSessionFactory
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.names import Queue, Task
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
TASK = SandboxTask(
    prompt="add() in /workspace/calc.py is wrong: fix it, then submit.",
    files={"/workspace/calc.py": "def add(a, b):\n    return a - b\n"},
    check="cd /workspace && python3 -c 'import calc; assert calc.add(2, 3) == 5'",
)
FIX = "sed -i 's/a - b/a + b/' /workspace/calc.py"


class ScriptedChat:
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1 answering, in order,
    the replies it was given; it keeps each request body to show what the model saw."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        chat = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                chat.requests.append(body)
                message = chat.replies.pop(0)
                reason = "tool_calls" if message.get("tool_calls") else "stop"
                data = json.dumps(
                    {
                        "id": f"chatcmpl-{len(chat.requests)}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": reason, "message": message}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def call(name: str, **arguments: str) -> dict[str, Any]:
    """An assistant message calling one tool."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    ident = f"call_{secrets.token_hex(4)}"
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": ident, "type": "function", "function": function}],
    }


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class RecordingFactory(SandmanSessionFactory):
    """The factory under test, keeping each session it made (the test reads their ids)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[SandmanSession] = []

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> SandmanSession:
        session = super().create(task, seed=seed, episode_id=episode_id)
        self.made.append(session)
        return session


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"openenv-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name)
    return name


@pytest.fixture
def factory(stack: Settings, job: str) -> Iterator[RecordingFactory]:
    client = SandboxClient(stack.redis_url)
    try:
        yield RecordingFactory(client, image=IMAGE, job=job, timeout=60, command_timeout=60)
    finally:
        client.close()


def _all_released(sessions: Any, ids: list[str]) -> bool:
    with sessions() as session:
        rows = [session.get(Sandbox, i) for i in ids]
        return all(row is not None and row.state == State.DELETED for row in rows)


def _live_of_job(sessions: Any, job: str) -> list[str]:
    with sessions() as session:
        rows = session.query(Sandbox).filter(Sandbox.job == job).all()
        return [row.id for row in rows if row.state != State.DELETED]


def _runner(factory: SandmanSessionFactory, tmp_path: Path, n: int) -> CollectRunner:
    return CollectRunner(
        session_factory=factory,
        harness_adapter=MCPHarnessAdapter(),
        serializer=RolloutSerializer(tmp_path / "out"),
        tasks=[TASK] * n,
    )


def _records(tmp_path: Path) -> dict[str, dict[str, Any]]:
    lines = (tmp_path / "out").glob("*.jsonl")
    records = [json.loads(x) for path in lines for x in path.read_text().splitlines() if x]
    return {r["episode_id"]: r for r in records}


def test_collect_runner_rewards_the_fix_inside_the_sandbox(
    factory: RecordingFactory, sessions: Any, tmp_path: Path
) -> None:
    chat = ScriptedChat(
        [
            # Episode 0 fixes the bug through bash and submits: reward 1.
            call("bash", command=f"cd /workspace && {FIX} && cat calc.py"),
            call("submit"),
            # Episode 1 reads a missing file (a tool error it sees), reads the file, gives
            # up without fixing: reward 0. Its sandbox is its own (the fix is not there).
            call("read_file", path="/workspace/missing.py"),
            call("read_file", path="/workspace/calc.py"),
            say("I cannot fix this."),
        ]
    )
    try:
        model = OpenAIClient(chat.url, None, model="scripted")
        result = _runner(factory, tmp_path, 2).run(
            model_step=build_model_step(model), num_episodes=2, resume=False
        )
    finally:
        chat.close()
    assert (result.num_collected, result.num_failed) == (2, 0)
    records = _records(tmp_path)
    assert records["ep-000000"]["reward"] == 1.0
    assert records["ep-000001"]["reward"] == 0.0
    # What the model saw came from the sandboxes.
    first_tool = [m for m in chat.requests[1]["messages"] if m["role"] == "tool"]
    assert "return a + b" in first_tool[0]["content"]
    seen = [m["content"] for m in chat.requests[4]["messages"] if m["role"] == "tool"]
    assert seen[0].startswith("error:") and "missing.py" in seen[0]
    assert "return a - b" in seen[1]
    ids = [s.sandbox.id for s in factory.made]
    assert len(set(ids)) == 2
    wait_until(lambda: _all_released(sessions, ids), 60, 0.2, "both sandboxes released")


def test_a_lost_sandbox_masks_the_episode_instead_of_scoring_it(
    factory: RecordingFactory, sessions: Any, tmp_path: Path
) -> None:
    """execd is killed under episode 0 (a real infrastructure failure): SandboxLost leaves
    the session, so CollectRunner counts the episode failed and writes no record (OpenEnv's
    masking); episode 1 goes on and is scored."""
    chat = ScriptedChat(
        [
            call("bash", command="kill -9 $PPID"),  # the session's parent is execd
            call(
                "write_file",
                path="/workspace/calc.py",
                content="def add(a, b):\n    return a + b\n",
            ),
            call("submit"),
        ]
    )
    try:
        model = OpenAIClient(chat.url, None, model="scripted")
        result = _runner(factory, tmp_path, 2).run(
            model_step=build_model_step(model), num_episodes=2, resume=False
        )
    finally:
        chat.close()
    assert (result.num_collected, result.num_failed) == (1, 1)
    assert set(_records(tmp_path)) == {"ep-000001"}
    assert _records(tmp_path)["ep-000001"]["reward"] == 1.0
    ids = [s.sandbox.id for s in factory.made]
    wait_until(lambda: _all_released(sessions, ids), 60, 0.2, "both sandboxes released")

    # The same failure under TRL's rollout function is raised, never turned into a reward.
    chat = ScriptedChat([call("bash", command="kill -9 $PPID")])
    try:
        rollout = build_harness_rollout_func(
            session_factory=factory,
            harness_adapter=MCPHarnessAdapter(),
            model_step_builder=lambda trainer, session: build_model_step(
                OpenAIClient(chat.url, None, model="scripted")
            ),
        )
        with pytest.raises(SandboxLost):
            rollout([TASK], None)
    finally:
        chat.close()
    lost = factory.made[-1].sandbox.id
    wait_until(lambda: _all_released(sessions, [lost]), 60, 0.2, "the lost sandbox released")


def test_the_sandbox_is_released_when_the_rollout_raises(
    factory: RecordingFactory, sessions: Any, job: str, tmp_path: Path
) -> None:
    def crashing(error: BaseException) -> Any:
        """A policy that makes one tool call, then raises ``error``."""
        calls = iter(
            [LLMResponse(content="", tool_calls=[ToolCall("c1", "bash", {"command": "true"})])]
        )

        def step(messages: Any, tools: Any, sampling: Any) -> ModelStepResult:
            response = next(calls, None)
            if response is None:
                raise error
            return ModelStepResult(response=response)

        return step

    # An exception in TRL's rollout function: re-raised after close().
    rollout = build_harness_rollout_func(
        session_factory=factory,
        harness_adapter=MCPHarnessAdapter(),
        model_step_builder=lambda trainer, session: crashing(RuntimeError("policy crashed")),
    )
    with pytest.raises(RuntimeError, match="policy crashed"):
        rollout([TASK], None)
    # Ctrl-C in CollectRunner: KeyboardInterrupt goes through its finally.
    with pytest.raises(KeyboardInterrupt):
        _runner(factory, tmp_path, 1).run(
            model_step=crashing(KeyboardInterrupt()), num_episodes=1, resume=False
        )
    ids = [s.sandbox.id for s in factory.made]
    assert len(ids) == 2
    wait_until(lambda: _all_released(sessions, ids), 60, 0.2, "both sandboxes released")

    # A create that fails after the acquire (a task file execd refuses) releases too.
    with pytest.raises(ExecError):
        factory.create({"prompt": "p", "check": "true", "files": {"relative.txt": "x"}})
    assert len(factory.made) == 2
    wait_until(lambda: not _live_of_job(sessions, job), 60, 0.2, "no live sandbox of the job")


HARNESS = """
import pathlib, sys, time
from openenv.core.harness import MCPHarnessAdapter, ModelStepResult
from openenv.core.harness.collect import CollectRunner, RolloutSerializer
from openenv.core.llm_client import LLMResponse, ToolCall
from broker.client import SandboxClient
from broker.integrations.openenv import SandboxTask, SandmanSessionFactory

redis_url, job, image, marker, out = sys.argv[1:]

class Factory(SandmanSessionFactory):
    def create(self, task, seed=None, episode_id=None):
        self.current = super().create(task, seed=seed, episode_id=episode_id)
        return self.current

factory = Factory(SandboxClient(redis_url), image=image, job=job, timeout=60)

def step(messages, tools, sampling):
    if any(m["role"] == "tool" for m in messages):  # mid-episode: say so, then hang
        pathlib.Path(marker + ".tmp").write_text(factory.current.sandbox.id)
        pathlib.Path(marker + ".tmp").rename(marker)
        time.sleep(3600)
    call = ToolCall("c1", "bash", {"command": "echo held"})
    return ModelStepResult(response=LLMResponse(content="", tool_calls=[call]))

CollectRunner(
    session_factory=factory, harness_adapter=MCPHarnessAdapter(),
    serializer=RolloutSerializer(out), tasks=[SandboxTask(prompt="p", check="true")],
).run(model_step=step, num_episodes=1)
"""


def test_the_gc_reclaims_the_sandbox_of_a_killed_harness(
    stack: Settings, sessions: Any, tmp_path: Path
) -> None:
    """SIGKILL runs no finally: the sandbox a killed OpenEnv process held is left to its
    lease (3 s here, no more heartbeats) and the GC deletes it."""
    job = f"openenv-kill-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, job, lease_s=3.0)
    marker = tmp_path / "sandbox-id"
    argv = [sys.executable, "-c", HARNESS, stack.redis_url, job, IMAGE, str(marker)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.Popen(
        [*argv, str(tmp_path / "out")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_until(lambda: marker.exists() or proc.poll() is not None, 120, 0.2, "mid-episode")
        assert marker.exists(), proc.communicate()[1].decode()[-3000:]
        sandbox_id = marker.read_text()
        with sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            assert row is not None and row.state == State.READY
    finally:
        proc.kill()
        proc.communicate()
    client = SandboxClient(stack.redis_url)
    try:

        def reclaimed() -> bool:
            client.send(Task.GC, [], Queue.POOL)
            return _all_released(sessions, [sandbox_id])

        wait_until(reclaimed, 120, 1.0, "the GC to delete the killed harness's sandbox")
    finally:
        client.close()


def test_tool_contract(factory: RecordingFactory, sessions: Any) -> None:
    """What the agent gets back for each tool, including its own mistakes."""
    with factory.create(TASK) as session:
        assert session.initial_messages() == [{"role": "user", "content": TASK.prompt}]
        assert [t.name for t in session.list_tools()] == [
            "bash",
            "read_file",
            "write_file",
            "submit",
        ]
        first = session.call_tool("bash", {"command": "cd /workspace && export A=1; false"})
        assert first.data["exit_code"] == 1 and not first.done
        second = session.call_tool("bash", {"command": "pwd; echo $A; echo e >&2"})
        assert second.data == {"exit_code": 0, "output": "/workspace\n1\ne\n"}
        session.command_timeout = 1.0
        slow = session.call_tool("bash", {"command": "sleep 60"})
        assert slow.metadata["timed_out"] and "[timed out" in slow.data["output"]
        wrote = session.call_tool("write_file", {"path": "/workspace/n/x.txt", "content": "hé"})
        assert wrote.data == "wrote 3 bytes to /workspace/n/x.txt"
        assert session.call_tool("read_file", {"path": "/workspace/n/x.txt"}).data == "hé"
        refused = session.call_tool("write_file", {"path": "/workspace", "content": "x"})
        assert refused.error is not None and refused.data.startswith("error:")
        with pytest.raises(KeyError):
            session.call_tool("rm_rf", {})
        with pytest.raises(ValueError):
            session.call_tool("bash", {})
        assert session.call_tool("submit", {}).done
        assert session.verify([]).env_reward == 0.0  # the bug is still there
    ids = [s.sandbox.id for s in factory.made]
    wait_until(lambda: _all_released(sessions, ids), 60, 0.2, "the sandbox released")
