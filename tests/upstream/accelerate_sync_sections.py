"""accelerate's test_sync.py sections that its main() runs only on GPUs, called one by one on CPU ranks."""

import itertools

from accelerate import Accelerator
from accelerate.test_utils.scripts import test_sync


def main() -> None:
    accelerator = Accelerator()
    for split, dispatch, each in itertools.product([True, False], repeat=3):
        test_sync.test_gradient_accumulation(split, dispatch, each)
        if split or dispatch or each:
            test_sync.test_gradient_accumulation_with_opt_and_scheduler(split, dispatch, each)
    accelerator.print("all GPU-gated sections passed")
    accelerator.state.destroy_process_group()


if __name__ == "__main__":
    main()
