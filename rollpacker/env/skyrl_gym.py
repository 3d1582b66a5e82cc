"""SkyRL-gym text environments through the contract: ``--env.factory rollpacker.env.skyrl_gym:make_env``.

A SkyRL environment is made by id at ``reset``, with the dataset row and ``env.max_turns`` as its
``extras`` and its ``env_config`` an OmegaConf config (``skyrl_gym.make(id, env_config=...,
extras=row | {"max_turns": ...})``), as SkyRL's generator makes it. Its API maps onto gymnasium's
over text:

- ``init(prompt) -> (messages, metadata)`` is ``reset``: the row's prompt (chat messages; a string
  is one user turn) goes in, the messages it returns are the episode's prompt;
- ``step(action) -> {observations, reward, done, metadata}`` is ``step``: ``done`` is
  ``terminated``, the observations are appended, the reward is the step's; the step's info holds how
  much each number of ``get_metrics()`` changed since the step before, so an episode's summed info is
  its last ``get_metrics()`` whatever ended it, as SkyRL's generator reads them after its loop (logged
  as ``env/info/K``, a mean per episode: SkyRL's default aggregation);
- ``close()`` is ``close``.

:func:`make_env` takes the id from the row's ``env_class`` column (SkyRL's dataset layout). A row
without ``reward_spec`` (or with None) gets ``{"method": "rule", "ground_truth": row["answer"]}`` (a number as a
string), and one without ``extra_info`` an empty one, so rows of rollpacker's layout run too. For another id or
``env_config``, write a factory: ``def make_env(row): return SkyRLEnv("gsm8k_multi_turn", row)``.
"""

from __future__ import annotations

import math

from rollpacker.env.contract import number


class SkyRLEnv:
    """The SkyRL-gym environment ``env_id`` for one episode on ``row`` (see the module docstring)."""

    def __init__(self, env_id: str, row: dict, env_config: dict | None = None):
        self.env_id, self.row, self.env_config = env_id, row, env_config or {}
        self.env = None
        self._metrics: dict[str, float] = {}
        """The numbers of ``get_metrics()`` as of the last step."""

    def reset(self, *, seed: int, options: dict):
        import skyrl_gym
        from omegaconf import OmegaConf

        row = self.row
        answer = row.get("answer")  # as SkyRL's datasets hold it, a string: its rule rewards compare strings
        answer = str(answer) if isinstance(answer, (int, float)) and not isinstance(answer, bool) else answer
        extras = {"reward_spec": {"method": "rule", "ground_truth": answer}, "extra_info": {},
                  **{k: v for k, v in row.items() if v is not None}}  # a column other rows have: None here
        if options.get("max_turns"):  # SkyRL's generator gives its own; its environments' defaults differ (2 to 10)
            extras["max_turns"] = options["max_turns"]
        self.env = skyrl_gym.make(self.env_id, env_config=OmegaConf.create(self.env_config), extras=extras)
        prompt = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        messages, metadata = self.env.init(prompt)
        return messages, dict(metadata or {})

    def step(self, action: str):
        out = self.env.step(action)
        info = dict(out.get("metadata") or {}) | self._metrics_change()
        return out["observations"], out["reward"], bool(out["done"]), False, info

    def _metrics_change(self) -> dict[str, float]:
        """Each number of ``get_metrics()`` less its value at the last step (one no longer a number: 0 now), so the
        steps' sum is the latest, whichever step is the last."""
        now = {k: v for k, v in ((k, number(v)) for k, v in self.env.get_metrics().items())
               if v is not None and math.isfinite(v)}
        change = {k: now.get(k, 0.0) - self._metrics.get(k, 0.0) for k in now.keys() | self._metrics.keys()}
        self._metrics = now
        return change

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def make_env(row: dict) -> SkyRLEnv:
    """The environment the row's ``env_class`` names."""
    if not row.get("env_class"):
        raise ValueError(f"row {row.get('id')!r} has no env_class column naming its SkyRL-gym environment "
                         "(or write a factory that names one: SkyRLEnv('gsm8k_multi_turn', row))")
    return SkyRLEnv(row["env_class"], row)
