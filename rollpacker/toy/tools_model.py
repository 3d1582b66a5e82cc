"""The toy tools model (``model.path = toy-tools``): the toy model's tiny Qwen2, fine-tuned to use a calculator.

Same architecture and byte-level tokenizer as :mod:`rollpacker.toy.model` (0.76M parameters, 3 MB),
with a chat template that renders ``tools`` as one short line, ``tool`` messages (``R: ...``) and
assistant ``tool_calls`` (Hermes ``<tool_call>`` JSON, as the model writes them).

Supervised fine-tuning runs on episodes of :mod:`rollpacker.toy.tools`, tokenized exactly as a run's
(the chat bridge and ``ToolEnv`` themselves). Its behaviour is a deliberate mix (:class:`SFTConfig`):
mostly answer directly, call on 30% of hard and 10% of easy problems, now and then write a call that
fails. So the shipped model, greedy, answers in its head and gets the hard problems wrong: held-out
success about 0.5, where calling on hard problems gives about 0.95. That is the room RL has.

``python -m rollpacker.toy.tools_model build`` regenerates it deterministically (about 9 minutes on
one core); ``eval`` reports, per kind of problem, success, tool calls and failed calls. The full
mix and why: ``docs/results.md`` ("A toy agent learns to use a tool").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollpacker.data.chat import encode
from rollpacker.data.dataset import DataConfig, toy_rows
from rollpacker.env import contract
from rollpacker.env.episode import Episode, StepEnv, TurnRequest
from rollpacker.env.render import ChatBridge
from rollpacker.env.tools import ToolEnv, schemas
from rollpacker.model import CausalAttention, ModelArgs, Transformer, load_model, save_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import TorchEngine
from rollpacker.toy import tools as toy_tools
from rollpacker.toy.model import (
    build_tokenizer,
    model_config,
    refuse_out,
    save_tokenizer,
    shipped_or_built,
    single_thread,
)
from rollpacker.train.trainer import warmup_cosine

logger = logging.getLogger(__name__)

MODEL_DIR = Path(__file__).parent / "tools_weights"
TOOLS = {"calculator": toy_tools.calculator}
CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'Tools:' }}{% for t in tools %}{% set f = t.function if t.function is defined else t %}"
    "{{ ' ' + f.name + '(' }}{% if f.parameters is defined and f.parameters.properties is defined %}"
    "{% for name, p in f.parameters.properties.items() %}{{ (', ' if not loop.first else '') + name }}"
    "{% if p.type is defined %}{{ ': ' + p.type }}{% endif %}{% endfor %}{% endif %}{{ ')' }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{{ 'Q: ' + m.content + '\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ 'A:' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}"
    "{{ ' <tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{ '}</tool_call>' }}{% endfor %}"
    "{{- '\\n' }}{% elif m.role == 'tool' %}{{ 'R: ' + m.content + '\\n' }}"
    "{%- else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)
"""The toy template's turns (``Q: ...``, ``A:...``), a ``Tools:`` line first when there are tools,
tool results as ``R: ...`` lines. It is prefix-preserving: an observation renders after the turns
before it without changing them."""
EVAL_NUM = 512
"""Held-out problems of ``eval`` (the preset evaluates the first 256 of them)."""
MAX_TURNS = 3
"""Model turns of an episode in ``eval``, as ``configs/toy-tools.toml``'s ``env.max_turns``."""
MAX_NEW_TOKENS = 96
"""Tokens of one turn in ``eval``, as the preset's ``rollout.max_new_tokens`` (a call is about 85)."""


@dataclass(kw_only=True)
class SFTConfig:
    num_steps: int = 3000
    """Optimizer steps."""
    batch_tokens: int = 2048
    """Tokens (prompts, turns and observations) packed into one step's batch."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine decay to 10% at num_steps)."""
    warmup_steps: int = 50
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the initialization and of the training episodes."""
    tools_frac: float = 0.85
    """Share of episodes whose prompt has the tools line (the others are answered directly)."""
    hard_call_frac: float = 0.3
    """Share of hard problems' episodes with tools that call the calculator; the others answer directly."""
    easy_call_frac: float = 0.1
    """The same for easy problems: a weak sense of when the tool helps, which RL sharpens."""
    malformed_frac: float = 0.25
    """Share of first calls that fail: malformed JSON or a wrong argument name."""
    retry_frac: float = 0.3
    """After a failed call: share that call again, well formed (the others answer directly)."""
    practice_frac: float = 0.3
    """Share of episodes with tools that call without training the choice to call (practice of calls and results)."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_tokens", "warmup_steps", "lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sft.{name} must be positive, got {getattr(self, name)}")
        for name in ("tools_frac", "hard_call_frac", "easy_call_frac", "malformed_frac", "retry_frac",
                     "practice_frac"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"sft.{name} must be in [0, 1], got {getattr(self, name)}")


def build_tools_tokenizer() -> PreTrainedTokenizerFast:
    """The toy model's tokenizer with :data:`CHAT_TEMPLATE`."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def call_text(expression: str, name: str = "calculator", argument: str = "expression") -> str:
    """A model turn that calls ``name`` with ``{argument: expression}``, Hermes style."""
    return f' <tool_call>{json.dumps({"name": name, "arguments": {argument: expression}})}</tool_call>'


def malformed_call(rng: random.Random, expression: str) -> str:
    """A call that fails: its JSON cut short or unquoted, or a wrong argument name."""
    good = call_text(expression)
    return rng.choice([
        good.replace("}}</tool_call>", "}</tool_call>"),  # a brace short: not JSON
        good.replace(f'"{expression}"', expression),  # the expression unquoted: not JSON
        call_text(expression, argument="expr"),  # the call raises TypeError
    ])


CHOICE_TOKENS = 2
"""A first turn's tokens that say whether it calls: " <" (a call) or " #" (an answer)."""


def answer_text(answer: str) -> str:
    return f" #### {answer}"


def sft_actions(rng: random.Random, problem: dict, cfg: SFTConfig) -> tuple[bool, list[str], bool]:
    """An episode of ``problem`` in the SFT mix: whether its prompt has tools, the model's turns (the
    tool's replies come from the real ToolEnv; a turn after a tool result answers with it), and whether
    the first turn's choice, to call or to answer (its first :data:`CHOICE_TOKENS` tokens), is trained.
    A practice episode calls without training that choice: it teaches calls and their results without
    making the model call more often than ``hard_call_frac`` and ``easy_call_frac`` say."""
    expression, answer = problem["prompt"], problem["answer"]
    if rng.random() >= cfg.tools_frac:
        return False, [answer_text(answer)], True
    practice = rng.random() < cfg.practice_frac
    call_frac = cfg.hard_call_frac if problem["data_source"] == "hard" else cfg.easy_call_frac
    if not practice and rng.random() >= call_frac:
        return True, [answer_text(answer)], True
    if rng.random() >= cfg.malformed_frac:
        return True, [call_text(expression), answer_text(answer)], not practice
    if rng.random() < cfg.retry_frac:
        return True, [malformed_call(rng, expression), call_text(expression), answer_text(answer)], not practice
    return True, [malformed_call(rng, expression), answer_text(answer)], not practice


class EpisodeTokens:
    """Token sequences of toy tool episodes, as a run makes them: the prompt through the chat
    template (with the tools' schemas), each model turn's text with EOS, each tool reply as the
    template's delta (:class:`ChatBridge`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer, self.bridge = tokenizer, ChatBridge(tokenizer)
        self.schemas = schemas(TOOLS)

    def prompt_ids(self, expression: str, with_tools: bool = True) -> list[int]:
        """As the controller encodes a row's string prompt for an episode with tools (without: as a
        chat prompt, ``model.chat_template``)."""
        if with_tools:
            return encode(self.tokenizer, expression, tools=self.schemas)
        return encode(self.tokenizer, expression, chat_template=True)

    def episode(self, expression: str, with_tools: bool, actions: list[str]) -> tuple[list[int], list[bool]]:
        """The episode's tokens and which of them the model wrote (trained)."""
        env = ToolEnv(TOOLS)
        ids = self.prompt_ids(expression, with_tools)
        mask = [False] * len(ids)
        for action in actions:
            turn = self.tokenizer.encode(action) + [self.tokenizer.eos_token_id]
            ids += turn
            mask += [True] * len(turn)
            step = contract.step(env, action)
            if step.terminated:
                break
            obs = self.bridge.observation_ids(step.observation, turn)
            ids += obs
            mask += [False] * len(obs)
        return ids, mask


def sft_batch(rng: random.Random, episodes: EpisodeTokens, cfg: SFTConfig
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Fresh episodes packed up to ``batch_tokens``: tokens, positions and targets (the next token
    where the model wrote it, -100 elsewhere), all [T], and the sequence lengths."""
    tokens: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    seq_lens: list[int] = []
    while True:
        problem = toy_tools.make_problem(rng)
        with_tools, actions, choice = sft_actions(rng, problem, cfg)
        ids, mask = episodes.episode(problem["prompt"], with_tools, actions)
        if not choice:
            first = mask.index(True)
            mask[first:first + CHOICE_TOKENS] = [False] * CHOICE_TOKENS
        if seq_lens and len(tokens) + len(ids) > cfg.batch_tokens:
            break
        tokens += ids
        positions += range(len(ids))
        targets += [t if m else -100 for t, m in zip(ids[1:], mask[1:])] + [-100]
        seq_lens.append(len(ids))
    return torch.tensor(tokens), torch.tensor(positions), torch.tensor(targets), seq_lens


def train(model: Transformer, tokenizer: PreTrainedTokenizerFast, cfg: SFTConfig) -> None:
    """Supervised fine-tuning on the mix's episodes, loss on the model's tokens only."""
    rng, episodes = random.Random(cfg.seed), EpisodeTokens(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: warmup_cosine(step, cfg.warmup_steps, cfg.num_steps, 0.1))
    start = time.perf_counter()
    for step in range(cfg.num_steps):
        tokens, positions, targets, seq_lens = sft_batch(rng, episodes, cfg)
        logits = model.logits(model(tokens, positions, CausalAttention(seq_lens)))
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == cfg.num_steps - 1:
            logger.info("step %d/%d loss %.4f (%.0fs)", step + 1, cfg.num_steps, loss.item(),
                        time.perf_counter() - start)


def build(out: Path, cfg: SFTConfig | None = None) -> None:
    """Make the toy tools model from scratch and write it (weights, config, tokenizer) to ``out``."""
    cfg = cfg or SFTConfig()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tools_tokenizer()
    model = Transformer(ModelArgs.from_hf(model_config(tokenizer)))
    model.init_weights()
    with single_thread():
        train(model, tokenizer, cfg)
    save_model(model, out)
    save_tokenizer(tokenizer, out)


def run_episodes(engine, tokenizer, rows: list[dict], *, temperature: float = 0.0, seed: int = 0,
                 with_tools: bool = True) -> list[dict]:
    """Episodes of ``rows`` through ``engine`` and an in-process :class:`ToolEnv`, all turns of a round
    batched: per row, its kind, ``success`` (1.0 or 0.0), ``tool_calls``, ``tool_errors``, ``turns``
    and the ``messages``."""
    episodes = EpisodeTokens(tokenizer)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature)
    live: dict[str, tuple[Episode, ToolEnv, dict]] = {}
    todo: list[TurnRequest] = []
    for i, row in enumerate(rows):
        episode = Episode(str(i), episodes.prompt_ids(row["prompt"], with_tools), episodes.bridge, seed=seed,
                          max_turns=MAX_TURNS, max_tokens=MAX_TURNS * MAX_NEW_TOKENS, max_new_tokens=MAX_NEW_TOKENS,
                          max_context=1024)
        env = ToolEnv(TOOLS)
        contract.reset(env, seed=seed, row=row, max_turns=MAX_TURNS)  # as a run's: the last turn's calls are not run
        live[episode.id] = (episode, env, {"tool_calls": 0, "tool_errors": 0})
        todo.append(episode.next_turn())
    while todo:
        outs = generate(engine, [Request(id=t.id, prompt_ids=t.prompt_ids, params=dataclasses.replace(
            params, max_new_tokens=t.max_new_tokens, seed=t.seed)) for t in todo])
        todo = []
        for out in outs.values():
            episode, env, counts = live[out.id.rpartition("#")[0]]
            what = episode.on_turn(out.token_ids, out.logprobs, out.finish_reason)
            if isinstance(what, StepEnv):
                step = contract.step(env, what.action)
                for key in counts:
                    counts[key] += step.info.get(key, 0)
                what = episode.on_step(step)
            if isinstance(what, TurnRequest):
                todo.append(what)
    results = []
    for i, row in enumerate(rows):
        episode, _, counts = live[str(i)]
        success = toy_tools.correct([episode.messages], [row["answer"]])[0] if episode.done.reason == "terminated" \
            else 0.0
        results.append({"kind": row["data_source"], "success": success, **counts, "turns": episode.num_turns,
                        "messages": episode.messages})
    return results


def summarize(results: list[dict]) -> list[tuple[str, int, float, float, float]]:
    """Per kind, then overall: ``(kind, episodes, success, share that called the tool, share with a failed call)``."""
    out = []
    for kind in (*toy_tools.KINDS, "all"):
        picked = [r for r in results if kind in ("all", r["kind"])]
        n = max(1, len(picked))
        out.append((kind, len(picked), sum(r["success"] for r in picked) / n,
                    sum(r["tool_calls"] > 0 for r in picked) / n, sum(r["tool_errors"] > 0 for r in picked) / n))
    return out


def evaluate(path: Path, num: int = EVAL_NUM, temperature: float = 0.0, seed: int = 0,
             with_tools: bool = True, held_out: bool = True) -> list[tuple[str, int, float, float, float]]:
    """:func:`summarize` of ``num`` held-out episodes (the preset's held-out problems, ``data.toy_seed`` 0; of
    the training part: not ``held_out``)."""
    engine = TorchEngine(load_model(path), EngineConfig())  # first: a directory that is no model says so
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = toy_rows(DataConfig(toy_task="tools"), num, toy_tools.EVAL_SEED, held_out=held_out)
    with single_thread():
        return summarize(run_episodes(engine, tokenizer, rows, temperature=temperature, seed=seed,
                                      with_tools=with_tools))


def model_dir() -> Path:
    """The shipped toy tools model (or one built once into the cache: :func:`shipped_or_built`)."""
    return shipped_or_built(MODEL_DIR, "toy_tools_model", build)


def build_cmd(out: Path = MODEL_DIR, sft: SFTConfig = SFTConfig()) -> None:
    """Regenerate the toy tools model (deterministic) and write it to ``out``.

    Args:
        out: Directory to write the model to.
        sft: Fine-tuning settings and the behaviour mix.
    """
    refuse_out(out, "rollpacker.toy.tools_model build")
    start = time.perf_counter()
    build(out, sft)
    logger.info("wrote %s in %.0fs", out, time.perf_counter() - start)


def eval_cmd(path: Path | None = None, num: int = EVAL_NUM, temperature: float = 0.0, seed: int = 0,
             no_tools: bool = False, training_part: bool = False) -> None:
    """Report the model's held-out success and tool use per kind of problem, as episodes with the calculator.

    Args:
        path: Model directory; default: the shipped toy tools model.
        num: Number of held-out problems (half easy, half hard).
        temperature: Sampling temperature (0: greedy).
        seed: Seed of the sampling.
        no_tools: Prompts without the tools line.
        training_part: Problems of the part training draws instead (the shipped model's SFT drew both parts).
    """
    if num < 1:
        sys.exit(f"rollpacker.toy.tools_model eval: --num must be positive, got {num}")
    start = time.perf_counter()
    try:
        report = evaluate(path or model_dir(), num, temperature, seed, not no_tools, not training_part)
    except (ValueError, OSError) as e:  # a directory that is no model: its message names the fix
        sys.exit(f"rollpacker.toy.tools_model eval: {e}")
    print(f"{'kind':>6} {'episodes':>9} {'success':>8} {'called':>7} {'failed call':>12}")
    for kind, n, success, called, failed in report:
        print(f"{kind:>6} {n:>9} {success:>8.3f} {called:>7.3f} {failed:>12.3f}")
    logger.info("evaluated in %.0fs", time.perf_counter() - start)


if __name__ == "__main__":
    import tyro

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tyro.extras.subcommand_cli_from_dict({"build": build_cmd, "eval": eval_cmd})
