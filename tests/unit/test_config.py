"""Presets, flags and config errors: all before torch is imported."""

from __future__ import annotations

import pytest

from rollpacker.config import CONFIGS_DIR, load_preset, parse
from rollpacker.schedule.tail import TailConfig

PRESETS = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def test_presets_exist():
    assert {"toy-cpu", "qwen2.5-7b-8k", "qwen2.5-14b-16k", "qwen2.5-32b-32k"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    config = parse(["--preset", name])  # through the real CLI, as `rollpacker.run --preset NAME` reads it
    assert config == load_preset(name)
    if name.startswith("qwen2.5"):
        assert (config.rollout.num_prompts, config.rollout.group_size) == (128, 8)
        config.check_world(config.rollout.tp * 2)


def test_one_set_of_defaults_a_bare_config_is_the_default_job():
    from rollpacker.config import Config

    assert parse([]) == load_preset("toy-cpu") == Config()


def test_flags_override_the_preset():
    config = parse(["--preset", "qwen2.5-7b-8k", "--rollout.num-prompts", "64", "--train.lr", "2e-6"])
    assert config.rollout.num_prompts == 64 and config.train.lr == 2e-6
    assert config.rollout.max_new_tokens == 8192


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(SystemExit):
        parse(["--rollout.group-size", "0"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlrr = 1.0\n")
    with pytest.raises(ValueError, match="bad.toml.*'lrr'"):
        load_preset(str(bad))
    with pytest.raises(FileNotFoundError, match="known presets"):
        load_preset("no-such-preset")
    with pytest.raises(ValueError, match="rollout.tp=2 does not divide the world size 3"):
        parse(["--rollout.tp", "2"]).check_world(3)
    with pytest.raises(ValueError, match=r"rollout.num_prompts x rollout.group_size = 3 x 3"):
        parse(["--rollout.num-prompts", "3", "--rollout.group-size", "3"]).check_world(2)


def test_choice_fields_are_typed_and_refuse_unknown_values_by_name(capsys):
    with pytest.raises(SystemExit, match="schedule:tial: no such policy"):
        parse(["schedule:tial"])
    with pytest.raises(SystemExit):
        parse(["--train.off-policy", "maybe"])
    assert parse(["schedule:tail", "--stream.criterion", "kv"]).stream.criterion == "kv"


def test_the_policy_is_a_tagged_union_of_its_own_settings(tmp_path):
    tail = parse(["--seed", "3", "schedule:tail", "--schedule.eta-prompts", "1.5", "--num-steps", "4"])
    assert (tail.policy, tail.schedule, tail.seed, tail.num_steps) == ("tail", TailConfig(eta_prompts=1.5), 3, 4)
    assert parse(["schedule:sorted-partial", "--train.off-policy", "tis"]).policy == "sorted_partial"
    with pytest.raises(SystemExit, match=r"schedule.eta_prompts does not apply to policy sync \(it is a setting "
                                         r"of tail\)"):
        parse(["--schedule.eta-prompts", "1.5"])  # the preset's policy is sync
    preset = tmp_path / "tail.toml"
    preset.write_text('[schedule]\npolicy = "tail"\neta_responses = 2.0\n')
    assert parse(["--preset", str(preset), "--schedule.eta-prompts", "1.5"]).schedule == TailConfig(
        eta_prompts=1.5, eta_responses=2.0)  # a --schedule flag alone applies to the preset's policy
    preset.write_text('[schedule]\npolicy = "sorted"\neta_prompts = 2.0\n')
    with pytest.raises(ValueError, match="schedule.eta_prompts does not apply to policy sorted"):
        load_preset(str(preset))
    preset.write_text('policy = "tail"\n')
    with pytest.raises(ValueError, match="tail.toml: unknown setting 'policy'"):
        load_preset(str(preset))


def test_engine_rules_ask_the_engine_registry():
    from rollpacker.choices import choices
    from rollpacker.config import Config
    from rollpacker.plan.config import PlanConfig
    from rollpacker.rollout import ENGINES
    from rollpacker.rollout.config import EngineConfig

    assert set(choices(EngineConfig)["kind"]) == {"auto", *ENGINES}
    assert ENGINES["torch"].supports_tp_switch and ENGINES["vllm"].needs_world_groups
    Config(engine=EngineConfig(kind="auto"), plan=PlanConfig(enabled=True))  # auto picks one the planner can switch
    for kind, engine in ENGINES.items():
        if engine.supports_tp_switch:
            Config(engine=EngineConfig(kind=kind), plan=PlanConfig(enabled=True))
        else:
            with pytest.raises(ValueError, match=f"plan.enabled with engine.kind='{kind}': a TP switch"):
                Config(engine=EngineConfig(kind=kind), plan=PlanConfig(enabled=True))


def test_choice_fields_are_checked_once_on_every_path(tmp_path):
    """A Literal field is refused by the same check from a preset, from Python and (tyro first) from a flag."""
    from rollpacker.config import Config
    from rollpacker.train.config import TrainConfig

    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\noff_policy = "maybe"\n')
    with pytest.raises(ValueError, match="bad.toml: train.off_policy must be one of none, is, tis, got 'maybe'"):
        load_preset(str(bad))
    with pytest.raises(ValueError, match="train.off_policy must be one of none, is, tis, got 'maybe'"):
        Config(train=TrainConfig(off_policy="maybe"))
    with pytest.raises(SystemExit):
        parse(["--train.off-policy", "maybe"])
