"""Reward functions: ``(response, answer) -> float``, looked up by name."""

from rollpacker.reward.rules import REWARDS, RewardError, get_reward, math_reward, toy_reward

__all__ = ["REWARDS", "RewardError", "get_reward", "math_reward", "toy_reward"]
