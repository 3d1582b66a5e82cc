"""Rewards: the reward functions (built-ins and the user's own, TRL's or verl's calling convention),
the scheduler that scores each response as it finishes, the pool of killable worker processes
that runs them, the code sandbox, and the LLM judge's config (the judge itself,
:mod:`rollpacker.reward.judge`, imports torch)."""

from rollpacker.reward.config import JudgeConfig, RewardConfig
from rollpacker.reward.functions import Ref, RewardFunctionError
from rollpacker.reward.rules import RewardError, math_reward, toy_reward
from rollpacker.reward.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from rollpacker.reward.workers import RewardPool, Scored

__all__ = [
    "JudgeConfig", "Ref", "RewardConfig", "RewardError", "RewardFunctionError", "RewardPool", "Sandbox",
    "SandboxConfig", "SandboxUnavailable", "Scored", "math_reward", "toy_reward",
]
