"""Rewards: rule-based functions ``(response, answer) -> float`` looked up by name, the code
sandbox, the pool of worker processes that scores samples asynchronously, and the LLM judge's
config (the judge itself, :mod:`rollpacker.reward.judge`, imports torch)."""

from rollpacker.reward.config import JudgeConfig, RewardConfig
from rollpacker.reward.rules import REWARDS, RewardError, get_reward, math_reward, toy_reward
from rollpacker.reward.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from rollpacker.reward.workers import RewardPool, Scored

__all__ = [
    "JudgeConfig", "REWARDS", "RewardConfig", "RewardError", "RewardPool", "Sandbox", "SandboxConfig",
    "SandboxUnavailable", "Scored", "get_reward", "math_reward", "toy_reward",
]
