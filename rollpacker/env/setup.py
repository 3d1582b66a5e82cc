"""How rank 0 starts each episode and reaches its environment: :class:`Environments`, built once per run.

Every response is an episode. With an environment (``env.factory`` or ``env.tools``), an episode's
prompt is its environment's reset, encoded with its tools, and its calls go to the environment
workers; without one, it is the row's prompt and nothing is called. The exchange builds each
round's runner over :meth:`Environments.maker` and carries its calls (:meth:`Environments.send`)
and their replies (:meth:`Environments.poll`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rollpacker.data.chat import TemplateRefused
from rollpacker.env.config import EnvConfig
from rollpacker.env.contract import EnvCall, EnvError, EnvReply
from rollpacker.env.episode import Bridge, Episode
from rollpacker.env.info import TOOL_INFO
from rollpacker.env.workers import EnvPool, EnvSpec
from rollpacker.errors import UserError
from rollpacker.workers import PoolError

logger = logging.getLogger(__name__)

SAID_CALLS = 8
"""Tool calls a step needs before :meth:`Environments.check_tool_calls` reads all of them failing as broken."""

ENV_IDLE_WAIT = 0.005
"""Seconds :meth:`Environments.poll` waits for a reply when only environments are working."""


@dataclass(kw_only=True)
class Environments:
    """The run's episodes: how one starts, and its environment's workers (none without environment)."""

    cfg: EnvConfig
    pool: EnvPool | None
    """The environment workers; None without environment."""
    bridge: Bridge | None
    """The tokenizer's :class:`~rollpacker.env.render.ChatBridge`; None without environment."""
    encode: Callable[[Any, list[dict] | None], list[int]]
    """An episode's prompt (a string or chat messages) and its tools' schemas -> its token ids."""
    seed: int
    max_new_tokens: int
    """Per turn (``rollout.max_new_tokens``); also the episode's model tokens unless ``env.max_tokens``."""
    max_context: int
    """The tokens an episode may reach: the engines' context length, or their KV cache if smaller (a later turn
    the cache cannot hold was an engine's ValueError that ended the run)."""
    warmed: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Episode -> (row, reset seed) of each environment opened ahead (:meth:`warm`) that no round opened yet."""
    held: dict[str, EnvReply] = dataclasses.field(default_factory=dict)
    """The replies of the environments opened ahead, until a round opens them."""
    claimed: list[EnvReply] = dataclasses.field(default_factory=list)
    """Held replies of the environments a round has since opened: the next poll gives them."""
    warm_opens: int = 0
    """Opens answered by an environment opened ahead, since :meth:`take_metrics`."""
    parser_checked: bool = False
    """``env.tool_parser`` was checked against the chat template (:meth:`check_tool_parser`)."""
    tools_said: bool = False
    """:meth:`check_tool_calls` said that every call of a step failed."""
    close_errors: int = 0
    """Closes that failed since :meth:`take_metrics` (:meth:`_closed`)."""
    close_said: bool = False
    templated: bool = False
    """String prompts need no check (:meth:`check_string_prompt`): ``model.chat_template`` renders them as a user
    turn, or the model is a shipped toy one, trained on prompts as they are."""
    user_turn_end: str | None = None
    """How the chat template ends a user turn, once rendered."""

    def __post_init__(self) -> None:
        if self.cfg.tools:  # the calls of env.tools are read by env.tool_parser
            self.check_tool_parser()

    def check_tool_parser(self) -> None:
        """Once a run, as soon as an episode has tools (``env.tools``', or its reset's: a TRL environment's
        methods): refuse an ``env.tool_parser`` that cannot read the calls the chat template writes."""
        if self.bridge is not None and not self.parser_checked:
            self.parser_checked = True
            self.bridge.check_tool_parser(self.cfg.tool_parser)

    @classmethod
    def none(cls, max_new_tokens: int, *, seed: int = 0, max_context: int = 1 << 62) -> Environments:
        """Responses without environment: each the one-turn episode of its row's prompt."""
        return cls(cfg=EnvConfig(), pool=None, bridge=None, encode=None, seed=seed, max_new_tokens=max_new_tokens,
                   max_context=max_context)

    @property
    def enabled(self) -> bool:
        """Episodes talk to an environment (``env.factory`` or ``env.tools``)."""
        return self.cfg.enabled

    def maker(self, rows: Sequence[Any], own: Callable[[Any], list[int]]) -> Callable[[str, int, Any], Episode]:
        """``make(key, row, reset)`` for a round's runner over the data ``rows``: episode ``key`` of
        ``rows[row]`` from its environment's reset ``(prompt or None, info)``; with no prompt or tools
        from it (or no reset), its prompt is the row's own, ``own(row)``, encoded once per round."""
        cache: dict[int, list[int]] = {}

        def make(key: str, row: int, reset: tuple[Any, dict] | None) -> Episode:
            prompt, info = reset or (None, {})
            if info.get("tools"):
                self.check_tool_parser()
            elif reset is not None:  # a string prompt is rendered only with tools; None: no environment, or one that
                self.check_string_prompt(prompt, rows[row])  # never opened (an episode failed at once, never rendered)
            if prompt is None and not info.get("tools"):
                if row not in cache:
                    cache[row] = own(rows[row])
                ids = cache[row]
            else:
                try:
                    ids = self.encode(rows[row]["prompt"] if prompt is None else prompt, info.get("tools"))
                except TemplateRefused as e:  # the environment's prompt: its episode fails, as its reset would
                    raise EnvError(f"{EnvSpec.from_config(self.cfg).name}: episode {key!r} (row {rows[row]['id']!r})"
                                   f": {'its reset prompt' if prompt is not None else 'its prompt with the tools'}"
                                   f": {e}") from None
            return self.episode(key, rows[row], ids, prompt, info.get("tools"))

        return make

    def episode(self, key: str, row: dict, ids: list[int], prompt: Any = None, tools: list[dict] | None = None
                ) -> Episode:
        """Episode ``key`` of ``row`` whose prompt is ``ids`` (encoded from ``prompt``, its reset's, or None: the
        row's own, with ``tools``' schemas). An :class:`EnvError` if it is empty or leaves no token for the first
        turn."""
        if not ids:
            raise EnvError(f"{EnvSpec.from_config(self.cfg).name}: episode {key!r} (row {row['id']!r}): its reset "
                           f"prompt {prompt!r} encodes to no token: the model needs a prompt to answer")
        if len(ids) >= self.max_context:
            raise EnvError(f"{EnvSpec.from_config(self.cfg).name}: episode {key!r} (row {row['id']!r}): its reset "
                           f"prompt is {len(ids)} tokens and the context length is {self.max_context} (the engine's, "
                           "or its KV cache's if smaller): no token is left for the first turn; raise "
                           "--engine.max-model-len (or --engine.kv-memory-mb) or shorten the environment's prompt")
        turns = self.cfg.max_turns if self.enabled else 1
        return Episode(key, ids, self.bridge, seed=self.seed, max_turns=turns,
                       max_tokens=self.cfg.max_tokens or self.max_new_tokens, max_new_tokens=self.max_new_tokens,
                       max_context=self.max_context, info_keys=TOOL_INFO if self.cfg.tools else (), prompt=prompt,
                       tools=tools)

    def warm(self, plan: Callable[[], list[EnvCall]], rows: Sequence[dict]) -> None:
        """With ``env.warm``: open the environments of ``plan()`` now (the next round's first episodes, while this
        step trains), so their resets run ahead; a round's open of one is then answered by its reply. Those
        opened ahead before and never opened by a round are closed."""
        if not self.cfg.warm:  # (the config refuses env.warm without an environment)
            return
        opens = plan()
        for key in self.warmed:
            self.pool.close_episode(key)
        self.warmed, self.held = {}, {}
        for call in opens:
            self.pool.open_episode(call.key, rows[call.row], call.seed)
            self.warmed[call.key] = (call.row, call.seed)

    def check_prompts(self, rows: Sequence[dict]) -> None:
        """Without an environment, refuse a row whose prompt's messages are all empty (only a reset fills one in)."""
        from rollpacker.data.dataset import DatasetError

        if not self.enabled and (row := next((r for r in rows if isinstance(r["prompt"], list) and not any(
                (m.get("content") or "").strip() or m.get("tool_calls") for m in r["prompt"])), None)):
            raise DatasetError(f"data row {row['id']!r}: every message of its prompt is empty, and no environment's "
                               "reset writes one (env.factory): give the question")

    def check_string_prompt(self, prompt: Any, row: Any) -> None:
        """Refuse an episode's prompt (its reset's, or None: its row's) that is a plain string tokenized as it is
        (no ``model.chat_template``, no tools: env.tools render every prompt through it) unless it ends as the chat
        template ends a user turn (rendered already, as the toy tasks' rows): its observations go through the
        template, so its first turn would follow a bare question."""
        if self.templated or self.bridge is None or self.cfg.tools:
            return
        prompt = row["prompt"] if prompt is None else prompt  # its reset's, else the row's own
        if not isinstance(prompt, str):
            return
        if self.user_turn_end is None:
            marker = "\x00"
            try:
                self.user_turn_end = self.bridge.render([{"role": "user", "content": marker}],
                                                        generation=True).rpartition(marker)[2]
            except Exception:  # noqa: BLE001  (a template that refuses a bare user turn: its own errors say why)
                self.user_turn_end = ""
        end = self.user_turn_end
        if end.strip() and not prompt.endswith(end):
            raise UserError(f"data row {row['id']!r}: its episode's prompt is a plain string, tokenized as it is, but "
                            f"the environment's observations go through the chat template, which ends a user turn "
                            f"with {end!r}: set --model.chat-template to render string prompts as a user turn, or "
                            "give prompts as chat messages")

    def check_tool_calls(self, outputs: Sequence[Any], step: int) -> None:
        """Say once a run, loudly, when every one of a step's tool calls (at least :data:`SAID_CALLS`) failed, with
        what most of them answered: a broken tool (or a parser that misreads every call) would train the model,
        all night, not to call it."""
        calls = sum(o.info.get("tool_calls", 0) for o in outputs)
        failed = sum(o.info.get("tool_errors", 0) for o in outputs)
        if self.tools_said or calls < SAID_CALLS or failed < calls:
            return
        self.tools_said = True
        answers = collections.Counter(str(m.get("content"))[:200] for o in outputs for m in o.messages or ()
                                      if m.get("role") == "tool")
        logger.warning("step %d: every one of its %d tool calls failed (env/info/tool_errors), most answered %r: "
                       "check the tools (a tool that always raises) and --env.tool-parser; said once a run", step,
                       int(calls), answers.most_common(1)[0][0] if answers else "")

    def take_metrics(self) -> dict[str, float]:
        """Since last called: ``env/close_errors`` (with an environment), with ``env.warm`` ``env/warm_opens``, the
        opens answered by environments opened ahead, and with ``env.template_breaks count`` ``env/template_breaks``."""
        (opens, self.warm_opens), (closes, self.close_errors) = (self.warm_opens, 0), (self.close_errors, 0)
        return ({"env/close_errors": float(closes)} if self.enabled else {}) | (
            {"env/warm_opens": opens} if self.cfg.warm else {}) | (
            {"env/template_breaks": float(self.bridge.take_breaks())}
            if self.bridge is not None and self.cfg.template_breaks == "count" else {})

    def send(self, calls: list[EnvCall], rows: Sequence[dict], tag: str = "") -> None:
        """Hand ``calls`` to the workers, in order, their episodes named ``TAG + key`` (the held-out
        rounds' episodes share a step's ids with the training round's, not their names)."""
        for call in calls:
            key = tag + call.key
            if call.kind == "open" and key in self.warmed:  # opened ahead: its reply is the open's
                if self.warmed.pop(key) != (call.row, call.seed):
                    raise RuntimeError(f"episode {key!r} opens row {call.row} with reset seed {call.seed}, but its "
                                       "environment was opened ahead for another: env.warm planned the round wrong")
                self.warm_opens += 1
                if key in self.held:
                    self.claimed.append(self.held.pop(key))
            elif call.kind == "open":
                self.pool.open_episode(key, rows[call.row], call.seed)
            elif call.kind == "step":
                self.pool.step_episode(key, call.action)
            elif call.kind == "finish":
                self.pool.finish_episode(key)
            else:
                self.pool.close_episode(key)

    def poll(self, tag: str = "", idle: bool = False) -> list[EnvReply]:
        """The workers' replies ready now for the episodes sent with ``tag`` (named by their keys again);
        those of the others (a close after the rounds they served) are dropped. ``idle``: nothing ran at
        the engines, so wait a little (``ENV_IDLE_WAIT``) for a reply rather than poll them again at once."""
        if self.pool is None:
            return []
        if idle:
            self.pool.wait(ENV_IDLE_WAIT)
        out, replies, self.claimed = [], self.claimed + self.pool.poll(), []
        self._closed(replies)
        for reply in replies:
            if reply.key in self.warmed:  # opened ahead, no round's yet
                self.held[reply.key] = reply
            elif isinstance(reply.key, str) and reply.key.startswith(tag) and (tag or "/" not in reply.key):
                out.append(dataclasses.replace(reply, key=reply.key[len(tag):]))
        return out

    def close(self) -> None:
        """Let the closes sent run (a short wait), then stop the workers."""
        if self.pool is None:
            return
        try:
            self._closed(self.pool.drain(timeout=self.cfg.timeout))
        except (TimeoutError, PoolError):  # a pool that failed (said already, as the run stops) runs no close
            pass
        self.pool.close()

    def _closed(self, replies: list[EnvReply]) -> None:
        """Count the closes among ``replies`` that failed (``env/close_errors``), and say the first of the run: its
        episode was over, but a sandbox or container it started may be left running."""
        for reply in replies:
            if reply.kind == "close" and reply.error:
                self.close_errors += 1
                if not self.close_said:
                    self.close_said = True
                    logger.warning("an environment's close() failed (env/close_errors counts them; said once a run): "
                                   "%s", reply.error)
