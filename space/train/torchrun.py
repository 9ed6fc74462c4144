"""``python -m space.train.torchrun ARGS``: torchrun (``torch.distributed.run``) as
``run_sft_multi_node.sh`` calls it, ending a failed run with one line.

The failing worker prints its own error first (``space-train: error: ...``); torchrun then adds a
30-line traceback and report of the same failure. Here a worker's failure ends with
``run_sft_multi_node.sh: training failed: rank R exited N (its output is above)`` and this exit
code N (128 + the signal for a killed worker), and a rendezvous that fails (a node that never
came: ``RendezvousError`` under ``--standalone``, the TCP store's ``DistNetworkError`` /
``DistStoreError`` under the multi-node launch's static rendezvous) with one line and exit 1.
Every other error keeps torchrun's own output.
"""
from __future__ import annotations

import logging
import sys

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import parse_args, run

PROG = "run_sft_multi_node.sh"


class _NoFailureLine(logging.Filter):
    """Drop torchrun's ``failed (exitcode: N) local_rank: ...`` log line: the one-line summary
    below says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; returns the exit code (0 when every worker succeeded)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureLine())
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            print(f"{PROG}: training failed: rank {rank} was killed by {failure.signal_name()} "
                  "(its output is above)", file=sys.stderr)
            return 128 - failure.exitcode
        print(f"{PROG}: training failed: rank {rank} exited {failure.exitcode} (its output is above)",
              file=sys.stderr)
        return failure.exitcode
    except (RendezvousError, DistError) as e:  # DistError: the static rendezvous's TCP store timed out
        print(f"{PROG}: the nodes did not meet: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
