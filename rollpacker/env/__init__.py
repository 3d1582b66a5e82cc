"""Episodes: multi-turn conversations with an environment, tool calls, token in and token out.

- :mod:`~rollpacker.env.contract`: the environment contract, gymnasium's API over text
  (``env.factory``), and its checks;
- :mod:`~rollpacker.env.episode`: one episode as a pure state machine (tokens, loss mask,
  log-probs, step rewards; what to run next);
- :mod:`~rollpacker.env.render`: observations as chat-template deltas (token in, token out);
- :mod:`~rollpacker.env.tools`: tools as Python functions, the environment that runs them, the ``python`` tool;
- :mod:`~rollpacker.env.parsers`: tool calls read from a turn, one parser per model family's format;
- :mod:`~rollpacker.env.workers`: environments in killable worker processes;
- :mod:`~rollpacker.toy.env`: the built-in toy environment; adapters for existing libraries:
  :mod:`~rollpacker.env.trl` (TRL's ``environment_factory`` classes, chosen by their shape),
  :mod:`~rollpacker.env.verifiers`, :mod:`~rollpacker.env.skyrl_gym`.

Nothing here imports torch. ``docs/environments.md`` is the user's guide.
"""
