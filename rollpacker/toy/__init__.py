"""The embedded default's toy task in one place: the task (:mod:`~rollpacker.toy.task`), the shipped
model and its builder (:mod:`~rollpacker.toy.model`, the weights in ``weights/``), a random-weight
model for benchmarks (:mod:`~rollpacker.toy.random_model`) and the task as an environment
(:mod:`~rollpacker.toy.env`). Its reward is the built-in ``toy`` (:mod:`rollpacker.reward.rules`)."""
