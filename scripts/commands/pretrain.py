"""`posfreq pretrain`: check the run, launch Fabric's processes, run the Trainer (train/run/trainer.py), report errors.

Run ``posfreq pretrain --config configs/pretrain_2k.yaml [--section.key value ...]``
(``--help`` lists every key). One code path on CPU (gloo) and GPU (NCCL): Fabric's
`ModelParallelStrategy` with FSDP2 (train/run/parallel.py).

Signals, requeue and exit codes: train/run/control.py. Errors a user can fix (config, checkpoint,
a run directory locked by another job, a non-finite loss) print ``error: ...`` naming the key or
file and the fix, and exit 1; after a non-finite loss the fix is the exact command that continues
with a lower LR (``--resume-override "{optim.lr: ...}"``).
"""

from __future__ import annotations

import sys

from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.data.tokens.shard_files import DamagedShard
from posfreq.train.run import config as run_config
from posfreq.train.run.config import ConfigError, parse_args
from posfreq.train.run.pretrain import RunStopped, continue_command, train
from posfreq.train.run.trainer import NonFiniteLoss
from posfreq.train.run_lock import RunLockError


def build_parser():
    """`posfreq pretrain`'s parser: the run config's (a --config YAML plus one flag per TrainConfig field)."""
    return run_config.build_parser()


def main(argv: list[str] | None = None) -> int:
    """The command line: run `train`, printing `error: ...` (exit 1) for a config, checkpoint or lock error, or a
    non-finite loss (with the command that continues the run at a lower LR)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        train(parse_args(argv))
        return 0
    except RunStopped as stop:
        return stop.exit_code
    except (ConfigError, CheckpointError, RunLockError, DamagedShard) as err:
        sys.exit(f"error: {err}")
    except NonFiniteLoss as err:
        sys.exit(f"error: {err} Command: {continue_command(argv, err.lower_lr)}")
    except KeyboardInterrupt:
        print(
            "interrupted by a second Ctrl-C: nothing saved since the last checkpoint; continue with --resume auto",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
