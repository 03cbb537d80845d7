"""Train several recipes one after another in one process group (as torchrun's worker, or alone).

The reference runs (and the resumes of test_resume.py) differ only in settings; making them in one
process group per world size saves the start-up (imports, DeepSpeed set-up) of each, which
dominates these tiny runs.
Usage: multi_run.py RECIPE ROOT NAME=override,override ... (each run goes to ROOT/NAME).
"""

import gc
import logging
import sys

from baton.train.distributed import init_distributed
from baton.train.recipe import load_config
from baton.train.trainer import train


def main(recipe: str, root: str, specs: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # as `baton` logs
    init_distributed(need_group=True)  # one group for all runs, as DeepSpeed needs
    for spec in specs:
        name, _, overrides = spec.partition("=")
        train(load_config(recipe, [f"out_dir={root}/{name}", *filter(None, overrides.split(","))]))
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
