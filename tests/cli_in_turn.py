"""Run several `latentloop` command lines one after another in this process (one torchrun job for
many trainings: each process imports torch once instead of once per command). Used as a torchrun
script by the contract suite:

    torchrun ... tests/cli_in_turn.py COMMANDS.json RESULTS.json

COMMANDS.json maps a name to an argv (`latentloop.cli.main` with argv). The job's process group is
joined once, before the first command, and every command uses it: a command that left it (as one
does at its end) and the next that joined it again would rendezvous on the same store keys, and a
peer can read the previous group's address there and wait forever (seen). Each command still ends
with a barrier. Every process prints "=== NAME ===" before each command; rank 0 writes {name: exit
code} to RESULTS.json after each one. The first command that fails ends the job (its peers may be
waiting for it in a collective)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

import latentloop.distributed
from latentloop.cli import main

MARKER = "=== {} ==="


def _barrier_only() -> bool:
    dist.barrier()
    return False  # the group stays up for the next command


def run_in_turn(commands: dict[str, list[str]], results: Path) -> int:
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    latentloop.distributed.destroy_distributed = _barrier_only
    codes = {}
    for name, argv in commands.items():
        print(MARKER.format(name), flush=True)
        codes[name] = main(argv)
        if os.environ.get("RANK", "0") == "0":
            results.write_text(json.dumps(codes))
        if codes[name] != 0:
            return codes[name]
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_in_turn(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
