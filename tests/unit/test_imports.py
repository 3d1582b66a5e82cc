"""Importing what a setting names (``rollpacker.imports``): the user's files, each its own module, and their
``warm_up()``."""

from __future__ import annotations

import pickle

from rollpacker.imports import USER_PREFIX, import_path, warm_up


def test_files_of_one_name_or_with_a_dot_in_it_are_each_a_module_whose_classes_pickle(tmp_path):
    """``envs/task.py`` and ``tools/task.py`` were one module, the second replacing the first, so the first's
    classes no longer pickled (a copy of an environment for the reward functions: every open failed); and
    ``inc.v2.py`` was module ``..._inc.v2``, which pickling looks up as a package."""
    paths = [tmp_path / "envs" / "task.py", tmp_path / "tools" / "task.py", tmp_path / "inc.v2.py"]
    for i, path in enumerate(paths):
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"class Env:\n    made_by = {i}\n")
    modules = [import_path(str(path), USER_PREFIX) for path in paths]
    assert len({m.__name__ for m in modules}) == 3 and "." not in modules[2].__name__
    for i, module in enumerate(modules):
        assert pickle.loads(pickle.dumps(module.Env)) is module.Env and module.Env.made_by == i
    assert import_path(str(paths[0]), USER_PREFIX) is modules[0]  # once per process


def test_a_classs_own_warm_up_method_is_its_instances_and_a_classmethod_the_factorys(tmp_path):
    """An environment class with a ``warm_up(self)`` of its own was called on the class as the worker started:
    a TypeError ("missing 1 required positional argument: 'self'") that stopped the run."""
    (tmp_path / "envs.py").write_text(
        "class Own:\n    def warm_up(self):\n        raise RuntimeError('called on the class')\n\n"
        "class Loads:\n    warmed = False\n\n    @classmethod\n    def warm_up(cls):\n        cls.warmed = True\n")
    assert warm_up(f"{tmp_path / 'envs.py'}:Own", "env.factory", mapping=True) == ""
    assert warm_up(f"{tmp_path / 'envs.py'}:Loads", "env.factory", mapping=True) == ""
    assert import_path(str(tmp_path / "envs.py"), USER_PREFIX).Loads.warmed
