"""``python -m rollpacker.bench.spec_job [rollpacker.run flags]``: ``rollpacker.run`` that also writes,
on rank 0, every round's responses and speculation counters to ``RUN_DIR/spec_rounds.jsonl``.

``bench spec`` launches its jobs with it to compare the tokens of two runs response by response. It
is the benchmark's instrument (it wraps :meth:`~rollpacker.exchange.ExchangeRound.finish`), not a
setting of the product.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

RECORD = "spec_rounds.jsonl"


def main(argv: list[str]) -> None:
    from rollpacker import exchange, run

    run_dir = Path(argv[argv.index("--run-dir") + 1])
    finish = exchange.ExchangeRound.finish

    def recording_finish(self):
        result = finish(self)
        outputs = [*self.round.state.outputs, *(o for r in self.final for o in r.aborted)]
        record = {"step": self.step, "kind": result.kind, "spec": dataclasses.asdict(result.spec),
                  "outputs": [[o.id, o.prompt_ids, o.token_ids, o.finish_reason] for o in outputs]}
        with open(run_dir / RECORD, "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    exchange.ExchangeRound.finish = recording_finish
    run.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
